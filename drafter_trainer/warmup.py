"""Compile the drafter's kernels before the first batch, while the start-up waits on other things.

A trainer's first step on CUDA pays for compiling its kernels: flex attention, the compiled
layers and the fused cross-entropy (`drafter.compile`), Triton's autotuning of them, and cuBLAS's
first calls. From the inductor cache that is still seconds; cold it is tens of seconds. Nothing
in that work depends on the target's weights or on real data, only on shapes, so a restarting
trainer does it on random inputs of the training shapes while the target's embedding and head
are read from disk (in another thread) and the target server's WELCOME is on its way. The first
real step then finds every graph compiled.

The shapes are those of a full batch (`data.token_budget` tokens, `drafter.max_anchors` blocks),
then a second, shorter batch of odd length. Every graph is compiled with dynamic shapes, but a
first trace still takes some values as given: Python ints it meets (say, in the flex mask's
closure) become constants until a second value shows up, and inductor may assume a length is a
multiple of 16. Real packed rows have every length up to the budget, so the first real batch
would trigger that one recompile (seen on the H200: one graph more after a single-shape warm-up
with flex attention). The second pass takes it here instead.
"""
from __future__ import annotations

import threading
import time

import torch

from common.batch import PackedBatch
from drafter_trainer.blocks import build_blocks, sample_anchors
from drafter_trainer.loss import cross_entropy_fn
from drafter_trainer.model import DFlashDraftModel


def preload_compiler() -> threading.Thread:
    """Import torch's compiler stack (dynamo, inductor) in a background thread and return it.

    `compile_for` needs those modules, and importing them took 7 s of a restart on the H200
    host; started first thing, the import runs beside the CUDA and process-group set-up, the
    endpoints and the connection instead of after them (Python's per-module import locks make a
    later import in the main thread wait for this one rather than run it twice).
    """
    def load() -> None:
        try:
            import torch._dynamo  # noqa: F401
            import torch._inductor.config  # noqa: F401
        except Exception:  # the main thread's own import reports it, with its traceback
            pass

    thread = threading.Thread(target=load, name="preload-compiler", daemon=True)
    thread.start()
    return thread


WARMUP_DOCS = 4            # documents in the random batch: block masks with several documents
WARMUP_LOSS_ROWS = 64      # rows of the random logits the cross-entropy is compiled on


def random_batch(model: DFlashDraftModel, tokens: int, device: torch.device, hidden_dtype: torch.dtype) -> PackedBatch:
    """`tokens` random tokens in WARMUP_DOCS documents, every token in the loss, random captured
    planes drawn on the device (at 27B widths they are 1.7 GB: a CPU draw would cost seconds)."""
    cfg = model.config
    docs = max(1, min(WARMUP_DOCS, tokens // 2))
    lens = torch.full((docs,), tokens // docs, dtype=torch.int64)
    lens[-1] += tokens - int(lens.sum())
    return PackedBatch(
        hidden=torch.randn(cfg.num_context_layers, tokens, cfg.hidden_size, device=device, dtype=hidden_dtype),
        input_ids=torch.randint(0, cfg.vocab_size, (tokens,), device=device),
        loss_mask=torch.ones(tokens, dtype=torch.int64, device=device),
        position_ids=torch.cat([torch.arange(int(n)) for n in lens]).to(device),
        doc_lens=lens.to(device),
        sample_ids=torch.arange(docs, device=device),
    )


def warm_up_kernels(model: DFlashDraftModel, device: torch.device, compute_dtype: torch.dtype, tokens: int,
                    max_anchors: int, gamma: float) -> float:
    """Warm up on a full batch of `tokens`, then on a shorter one of odd length (see the module
    docstring); returns the seconds both took."""
    t0 = time.perf_counter()
    for length in sorted({tokens, max(2, tokens - tokens // 8) | 1}, reverse=True):
        warm_up_once(model, device, compute_dtype, length, max_anchors, gamma)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def warm_up_once(model: DFlashDraftModel, device: torch.device, compute_dtype: torch.dtype, tokens: int,
                 max_anchors: int, gamma: float) -> None:
    """One forward and backward of everything after the frozen embedding, on random inputs. Needs
    no target head; leaves the weights and their gradients as they were
    (the gradients it makes are dropped), and the optimizer is not involved.

    The random planes are in `compute_dtype`, which is what the target sends by default (bf16 on
    CUDA): compiled graphs are specialised on dtypes, so planes of another dtype would compile again.
    """
    cfg = model.config
    batch = random_batch(model, tokens, device, compute_dtype)
    g = torch.Generator().manual_seed(1)
    anchors = sample_anchors(batch.loss_mask.cpu(), batch.doc_lens.cpu(), max_anchors, g)
    blocks = build_blocks(batch, anchors.to(device), cfg.block_size, cfg.mask_token_id, gamma)
    params = [p for p in model.parameters() if p.requires_grad]
    had_grad = [p.grad for p in params]
    autocast = compute_dtype != torch.float32
    noise = torch.randn(blocks.num_blocks * cfg.block_size, cfg.hidden_size, device=device,
                        dtype=model.fc.weight.dtype)
    with torch.autocast(device.type, dtype=compute_dtype, enabled=autocast):
        out = model.decode_blocks(noise, batch.hidden, blocks)
        loss = out.float().square().mean()
    loss.backward()
    for p, grad in zip(params, had_grad):
        p.grad = grad
    with torch.no_grad(), torch.autocast(device.type, dtype=compute_dtype, enabled=autocast):
        model.decode_blocks(noise, batch.hidden, blocks)   # the held-out eval's graphs (no autograd)
    if model.compiled:   # the loss head's elementwise half: one graph with a gradient, one without
        logits = torch.randn(WARMUP_LOSS_ROWS, cfg.vocab_size, device=device, dtype=compute_dtype)
        labels = torch.randint(0, cfg.vocab_size, (WARMUP_LOSS_ROWS,), device=device)
        weights = torch.rand(WARMUP_LOSS_ROWS, device=device)
        for need_grad in (True, False):
            cross_entropy_fn(True)(logits.clone(), labels, weights, need_grad)
