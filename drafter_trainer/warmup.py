"""Compile the drafter's kernels beside a trainer's first steps: the trainer's one start-up path.

A trainer's first step on CUDA pays for compiling its kernels (flex attention, the compiled layers
of `drafter.compile`, the loss head's Triton kernel, Triton's autotuning, cuBLAS's first calls):
seconds from the inductor cache (dynamo keeps none across processes), tens of seconds cold. None
of it depends on the target's weights or on real data, only on shapes, so `CompileBehind` takes
it off a restart's critical path: the trainer steps eagerly from its first batch while a thread
compiles and warms up the same kernels (`warm_up_kernels`, on random inputs) on a *shadow*
drafter (same shapes, same weight memory), and switches to the compiled step at a step boundary
once they are ready. Compiled code is found by code object and guards, not by module instance, so
the model itself then compiles nothing more. (Compiling before the first step instead took twice
as long to the first step at the 27B shape: docs/benchmarks.md.)

The warm-up runs a full batch (`data.token_budget` tokens, one chunk of blocks), then a shorter
one of odd length: every graph is compiled with dynamic shapes, but a first trace still takes
some values as given (Python ints it meets, say in the flex mask's closure, stay constants until
a second value shows up; inductor may assume a length is a multiple of 16), so the first real
batch, packed rows having every length up to the budget, would recompile once. Here instead.
"""
from __future__ import annotations

import logging
import sys
import threading
import time

import torch
from torch import nn

from common.batch import PackedBatch
from drafter_trainer.blocks import build_blocks, sample_anchors
from drafter_trainer.devices import use_device
from drafter_trainer.loss import auto_blocks_per_chunk, cross_entropy_fn
from drafter_trainer.model import DFlashDraftModel, resolve_attention


WARMUP_DOCS = 4            # documents in the random batch: block masks with several documents
WARMUP_LOSS_ROWS = 64      # rows of the random logits the loss head kernel is first run on
WARMUP_SEED = 1            # the warm-up's own generators: it draws nothing from the training's RNG

log = logging.getLogger("dfpipe.trainer")


def random_batch(model: DFlashDraftModel, tokens: int, device: torch.device, hidden_dtype: torch.dtype,
                 gen: torch.Generator) -> PackedBatch:
    """`tokens` random tokens in WARMUP_DOCS documents, every token in the loss, random captured
    planes drawn on the device (at 27B widths they are 1.7 GB: a CPU draw would cost seconds)."""
    cfg = model.config
    docs = max(1, min(WARMUP_DOCS, tokens // 2))
    lens = torch.full((docs,), tokens // docs, dtype=torch.int64)
    lens[-1] += tokens - int(lens.sum())
    return PackedBatch(
        hidden=torch.randn(cfg.num_context_layers, tokens, cfg.hidden_size, device=device, dtype=hidden_dtype,
                           generator=gen),
        input_ids=torch.randint(0, cfg.vocab_size, (tokens,), device=device, generator=gen),
        loss_mask=torch.ones(tokens, dtype=torch.int64, device=device),
        position_ids=torch.cat([torch.arange(int(n)) for n in lens]).to(device),
        doc_lens=lens.to(device),
        sample_ids=torch.arange(docs, device=device),
        doc_ids=torch.arange(docs, device=device),
    )


def warm_up_kernels(model: DFlashDraftModel, device: torch.device, compute_dtype: torch.dtype, tokens: int,
                    max_anchors: int, gamma: float) -> float:
    """Warm up on a full batch of `tokens`, then on a shorter one of odd length (see the module
    docstring); returns the seconds both took."""
    t0 = time.perf_counter()
    gen = torch.Generator(device).manual_seed(WARMUP_SEED)
    for length in sorted({tokens, max(2, tokens - tokens // 8) | 1}, reverse=True):
        warm_up_once(model, device, compute_dtype, length, max_anchors, gamma, gen)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def warm_up_once(model: DFlashDraftModel, device: torch.device, compute_dtype: torch.dtype, tokens: int,
                 max_anchors: int, gamma: float, gen: torch.Generator) -> None:
    """One forward and backward of everything after the frozen embedding, on random inputs: no
    target head, no optimizer, the weights and their gradients left as they were. The planes are
    in `compute_dtype`, what the target sends by default (bf16 on CUDA): compiled graphs are
    specialised on dtypes, so planes of another dtype would compile again."""
    cfg = model.config
    batch = random_batch(model, tokens, device, compute_dtype, gen)
    anchors = sample_anchors(batch.loss_mask.cpu(), batch.doc_lens.cpu(), max_anchors,
                             torch.Generator().manual_seed(WARMUP_SEED))
    blocks = build_blocks(batch, anchors.to(device), cfg.block_size, cfg.mask_token_id, gamma)
    # one chunk of blocks, as the step runs them (every graph is dynamic in the block count)
    blocks, first, end = blocks.chunks(auto_blocks_per_chunk(cfg.block_size))[0]
    params = [p for p in model.parameters() if p.requires_grad]
    had_grad = [p.grad for p in params]
    autocast = compute_dtype != torch.float32
    noise = torch.randn(blocks.num_blocks * cfg.block_size, cfg.hidden_size, device=device,
                        dtype=model.fc.weight.dtype, generator=gen)

    def decode() -> torch.Tensor:
        kv = model.context_kv(batch.hidden, batch.position_ids)
        return model.decode_blocks(noise, [(k[first:end], v[first:end]) for k, v in kv], blocks)

    with torch.autocast(device.type, dtype=compute_dtype, enabled=autocast):
        loss = decode().float().square().mean()
    loss.backward()
    for p, grad in zip(params, had_grad):
        p.grad = grad
    with torch.no_grad(), torch.autocast(device.type, dtype=compute_dtype, enabled=autocast), model.as_served():
        decode()   # the held-out eval's graphs (no autograd; matmuls as served, Validator.evaluate)
    if device.type == "cuda":   # the loss head's kernel (ce_kernel): its variant with a gradient, and without
        logits = torch.randn(WARMUP_LOSS_ROWS, cfg.vocab_size, device=device, dtype=compute_dtype, generator=gen)
        labels = torch.randint(0, cfg.vocab_size, (WARMUP_LOSS_ROWS,), device=device, generator=gen)
        weights = torch.rand(WARMUP_LOSS_ROWS, device=device, generator=gen)
        with torch.no_grad():      # as in the loss, whose autograd.Function runs its forward so
            for need_grad in (True, False):
                cross_entropy_fn(device)(logits.clone(), labels, weights, need_grad)


# ---- compiling behind the first steps ------------------------------------------------------------

# How much smaller the shadow's warm-up batches are than a training batch. Every graph is traced with
# dynamic shapes, so a quarter-size batch compiles the same graphs as a full one, and its
# activations (a full batch's are ~40 GB at 27B widths) share the GPU with the eager steps and
# the target server.
BEHIND_SHRINK = 4
BEHIND_MIN_TOKENS = 256     # a few flex tiles of context and of block queries even for tiny budgets
BEHIND_MIN_ANCHORS = 16
# While the compile thread runs, the GIL is handed over every 0.1 ms instead of every 5 ms. Every
# torch op of the eager step releases the GIL around its kernel launch and must win it back from a
# thread that traces Python non-stop; at the default interval that cost ~1 ms per op (measured on
# the dev box: 400 small ops 7.6 ms alone, 448 ms beside a busy thread, 16 ms at 0.1 ms).
BEHIND_SWITCH_INTERVAL_S = 1e-4


_handover_lock = threading.Lock()
_handover_users = 0
_handover_default = 0.005


def _quick_gil_handover(on: bool) -> None:
    """BEHIND_SWITCH_INTERVAL_S while any compile thread runs (a rebuilt drafter can briefly have
    two), the interpreter's own interval otherwise."""
    global _handover_users, _handover_default
    with _handover_lock:
        if on and _handover_users == 0:
            _handover_default = sys.getswitchinterval()
            sys.setswitchinterval(BEHIND_SWITCH_INTERVAL_S)
        _handover_users += 1 if on else -1
        if not on and _handover_users == 0:
            sys.setswitchinterval(_handover_default)


def eager_attention(impl: str, device: torch.device, head_dim: int) -> str:
    """The attention path of the eager steps while compiling: on CUDA flex and fa4 are compiled
    kernels (a first call traces and compiles), so those steps take split for flex (the same
    attention, tests compare; on the H200 at the published density an eager step took 7.4 s with
    split, 10.0 s with sdpa's dense mask over every key) and flash for fa4. Flash (CUDA's auto in
    an eager model) runs precompiled kernels and stays (its sliding-window layers run split)."""
    if device.type != "cuda":
        return impl
    resolved = resolve_attention(impl, device.type, head_dim, compiled=False)
    return {"flex": "split", "fa4": "flash"}.get(resolved, impl)


def needs_compiling(model_compile_mode: str, attn: str, device: torch.device, head_dim: int) -> bool:
    """Whether a drafter built with these settings compiles anything on `device` (fa4 and flex
    compile their attention call even in an eager model)."""
    on = model_compile_mode == "on" or (model_compile_mode == "auto" and device.type == "cuda")
    return on or (device.type == "cuda" and resolve_attention(attn, device.type, head_dim, compiled=False) in ("flex", "fa4"))


def shadow_of(model: DFlashDraftModel, attn_impl: str) -> DFlashDraftModel:
    """The same drafter over the same weight memory, to compile and warm up beside training. Built
    on the meta device (it allocates nothing), each trainable weight a new tensor over the model's
    storage, not a view: the optimizer's in-place updates of the model's weights then do not bump
    the shadow's version counters (autograd would refuse its backward: 'modified by an inplace
    operation'). Its gradients are dropped as each is accumulated: they never reach the model's
    `.grad` and never all exist at once. The frozen target head stays empty (the warm-up needs none)."""
    with torch.device("meta"):
        shadow = DFlashDraftModel(model.config, split_fc=model.split_fc, attn_impl=attn_impl)
    shadow.segment_rows, shadow.checkpoint_layers = model.segment_rows, model.checkpoint_layers
    shadow.precision = model.precision
    shadow.train(model.training)
    own = dict(model.named_parameters())
    for name, _ in list(shadow.named_parameters()):
        owner, _, attr = name.rpartition(".")
        source = own[name]
        if name.startswith(DFlashDraftModel.FROZEN_PREFIXES):
            weight = nn.Parameter(torch.empty(0, model.config.hidden_size, device=source.device,
                                              dtype=source.dtype), requires_grad=False)
        else:
            alias = torch.empty(0, device=source.device, dtype=source.dtype)
            alias.set_(source.untyped_storage(), source.storage_offset(), source.shape, source.stride())
            weight = nn.Parameter(alias, requires_grad=source.requires_grad)
            if weight.requires_grad:
                weight.register_post_accumulate_grad_hook(_drop_grad)
        setattr(shadow.get_submodule(owner), attr, weight)
    return shadow


def _drop_grad(p: torch.Tensor) -> None:
    p.grad = None


BEHIND_THREAD = "compile-behind"


def compiling_in_background() -> bool:
    """Whether any CompileBehind thread of this process still runs (a rebuilt drafter's too)."""
    return any(t.name == BEHIND_THREAD and t.is_alive() for t in threading.enumerate())


class CompileBehind:
    """The module docstring's background compile (`start`) and switch (`switch_if_ready`, at step
    boundaries). Until the switch the model is eager, with an attention path that compiles nothing
    (`eager_attention`); the thread compiles a `shadow_of` it with the configured attention and the
    model's own compile options, and warms it up on batches BEHIND_SHRINK times smaller. A failed
    warm-up leaves the model eager (slower, never stopped); one that ran out of GPU memory still
    switches (the step compiles what it lacks). Each rank switches on its own: compiled layers
    match eager up to rounding (tests), so ranks need not switch at the same step."""

    def __init__(self, model: DFlashDraftModel, device: torch.device, compile_mode: str,
                 compute_dtype: torch.dtype, tokens: int, max_anchors: int, gamma: float) -> None:
        self.model, self.device, self.compile_mode = model, device, compile_mode
        self.attn_impl = model.attn_impl
        self.shape = (max(min(tokens, BEHIND_MIN_TOKENS), tokens // BEHIND_SHRINK),
                      max(min(max_anchors, BEHIND_MIN_ANCHORS), max_anchors // BEHIND_SHRINK))
        self.compute_dtype, self.gamma = compute_dtype, gamma
        self.state = "compiling"          # compiling -> compiled | failed (trainer status)
        self.error: str | None = None
        self.out_of_memory = False
        self.seconds: float | None = None   # of the background compile and warm-up
        self._started: float | None = None
        self._done = threading.Event()
        model.attn_impl = eager_attention(self.attn_impl, device, model.config.head_dim)
        self._thread = threading.Thread(target=self._run, name=BEHIND_THREAD, daemon=True)

    def start(self) -> "CompileBehind":
        """Start compiling (once). The trainer starts it when it would otherwise idle (the target
        server still starting, no batch to train) or else after its first step: beside the
        compile thread, eager steps ran 2-4x slower on the H200 (a restart's first step 5.3 s)."""
        if self._started is None:
            self._started = time.perf_counter()
            _quick_gil_handover(True)
            self._thread.start()
        return self

    @property
    def started(self) -> bool:
        return self._started is not None

    def _run(self) -> None:
        try:
            use_device(self.device)
            shadow = shadow_of(self.model, self.attn_impl)
            shadow.compile_for(self.device, self.compile_mode)
            tokens, anchors = self.shape
            warm_up_kernels(shadow, self.device, self.compute_dtype, tokens, anchors, self.gamma)
        except torch.OutOfMemoryError as e:   # the warm-up's activations, not the compile: switch anyway
            self.out_of_memory = True
            self.error = f"{type(e).__name__}: {e}"
        except Exception as e:   # noqa: BLE001 - any other failure leaves the trainer eager, not dead
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.seconds = time.perf_counter() - (self._started or 0.0)
            _quick_gil_handover(False)
            self._done.set()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the background work is over (tests, benchmarks); whether it is."""
        return self._done.wait(timeout)

    def switch_if_ready(self) -> bool:
        """At a step boundary: once the background work is over, compile the model (its graphs are
        in dynamo's cache already) or, after a failure, leave it eager for good. True when done."""
        if not self._done.is_set():
            return False
        if self.error is None or self.out_of_memory:
            self.model.compile_for(self.device, self.compile_mode)
            self.model.attn_impl = self.attn_impl
            self.state = "compiled"
            if self.error is None:
                log.info("compiled kernels ready after %.1fs in the background: the steps run compiled from now on",
                         self.seconds)
            else:
                log.warning("the background warm-up ran out of GPU memory after %.1fs; switching to the compiled "
                            "step anyway (it compiles what the warm-up did not reach): %s", self.seconds, self.error)
        else:
            self.state = "failed"
            log.warning("compiling in the background failed after %.1fs, the drafter stays eager (slower, same "
                        "math): %s", self.seconds, self.error)
        return True
