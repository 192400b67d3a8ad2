"""One target worker: a device, its frozen target, its ring. Turns seqs into published slots.

    dispatcher.take() -> seq -> packer + dataset -> packed tokens -> target.capture -> audit
                      -> slot tensors -> publish (READY) -> main thread announces it

A held-out batch (`Work(i, heldout=True)`) takes exactly this path, packed from the held-out data
set, and its slot meta says `"heldout": True` so the server announces it as such.

CPU: the forward writes straight into the slot's `hidden` view (no extra copy).
CUDA: the forward writes into one of two device staging buffers; a publisher thread copies the
planes into the registered slot on its own stream, waits for that copy's event and only then
publishes. The forward stream never waits for the copy, and a staging buffer is reused only after
the copy out of it completed (the race that gave other pipelines NaN losses).

Every published slot's meta carries the payload checksum of each tensor (`common.checksum`): on
CUDA the hidden planes' is computed on the GPU from the staging buffer, on the copy stream, and
read back under the same event wait as the copy; the token tensors' on the CPU from the slot.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from common.batch import TOKEN_TENSORS, slot_tensor_specs
from common.checksum import META_KEY, as_meta, payload_checksums, tensor_checksum
from common.config import ConfigError
from common.metrics import StageTimes
from common.liveness import RoleLock
from common.ring import ProducerRing, RingReplaced, slot_bytes
from common.ring_limits import MAX_SLOT_SIZE

from . import fp8
from .delivery import Dispatcher, Work

log = logging.getLogger(__name__)

# Document length of the warm-up's unpacked audit forward (any length tunes the same kernels).
AUDIT_WARMUP_TOKENS = 128


@dataclass
class AuditResult:
    ok: bool
    reason: str = ""


def audit_hidden(hidden: torch.Tensor, doc_lens: np.ndarray, max_rms: float) -> AuditResult:
    """Cheap checks on every batch: finite, no all-zero token rows, row RMS in range.

    One fp32 norm per row ([k, T] values): a NaN or Inf anywhere in a row makes its norm NaN or
    Inf, so no full-size fp32 copy of the planes is ever made.
    """
    rms = torch.linalg.vector_norm(hidden, dim=-1, dtype=torch.float32) / hidden.shape[-1] ** 0.5  # [k, T]
    if not bool(torch.isfinite(rms).all()):
        return AuditResult(False, "non-finite values in captured hidden states")
    if zero_rows := int((rms == 0).sum()):
        return AuditResult(False, f"{zero_rows} all-zero captured rows")
    if (peak := float(rms.max())) > max_rms:
        return AuditResult(False, f"captured row RMS {peak:.3g} above {max_rms:.3g}")
    return AuditResult(True)


class TargetWorker(threading.Thread):
    """Loads the target on its device, warms it up, then serves seqs until stopped."""

    def __init__(self, worker: int, device: str, cfg, load_runner: Callable[[str], object],
                 dataset, packer, dispatcher: Dispatcher, notify: Callable[[], None],
                 on_quarantine: Callable[[int, str], None], stages: StageTimes,
                 heldout_dataset=None, heldout_packer=None,
                 on_heldout_quarantine: Callable[[int, str], None] | None = None,
                 role: RoleLock | None = None) -> None:
        """role: the producer role of this worker's ring, already taken (ProducerRing.take_role), so
        that a second server is refused before it loads a model; the ring owns it once created."""
        super().__init__(name=f"target-worker-{worker}", daemon=True)
        self.worker = worker
        self.device = device
        self.cfg = cfg
        self._load_runner = load_runner
        self.dataset = dataset
        self.packer = packer
        self.heldout_dataset = heldout_dataset
        self.heldout_packer = heldout_packer
        self.dispatcher = dispatcher
        self.notify = notify
        self.on_quarantine = on_quarantine
        self.on_heldout_quarantine = on_heldout_quarantine
        self.stages = stages
        self.runner = None
        self.ring: ProducerRing | None = None
        # rings replaced while this worker may still write into them (their files were removed):
        # closed by the thread that writes slots, at its next slot
        self.retired: list[ProducerRing] = []
        self.role = role
        self.state = "loading"
        self.error: BaseException | None = None
        self.ready = threading.Event()
        self.model_loads = 0
        self.batches = 0
        self.tokens = 0
        self.heldout_batches = 0                # held-out batches published (not in batches/tokens)
        self._halt = threading.Event()

    # ---- set-up ------------------------------------------------------------------------------
    def slot_size(self) -> int:
        budget = self.cfg.data.token_budget
        specs = slot_tensor_specs(budget, budget, len(self.runner.layer_ids), self.runner.hidden_size,
                                  self.runner.dtype)
        size = slot_bytes(specs)
        if size > MAX_SLOT_SIZE:   # the ring would refuse it; the setting that makes it is the budget
            per_token = size // budget
            raise ConfigError(f"data.token_budget: {budget} tokens need {size} bytes per ring slot with this "
                              f"target ({len(self.runner.layer_ids)} layers x {self.runner.hidden_size} wide), "
                              f"above the ring's limit of {MAX_SLOT_SIZE}: at most about "
                              f"{MAX_SLOT_SIZE // per_token} tokens")
        return size

    def _setup(self) -> None:
        t0 = time.perf_counter()
        log.info("worker %d: loading the target on %s", self.worker, self.device)
        self.runner = self._load_runner(self.device)
        self.model_loads += 1
        self.stages.add("load", time.perf_counter() - t0)
        r = self.cfg.ring
        self.ring = ProducerRing.create(r.shm_dir, r.name, self.worker, r.slots, self.slot_size(),
                                        cuda_register=r.cuda_register, role=self.role)
        self.state = "warming"
        if self.cfg.target.warmup:
            self._warmup()
        self.state = "serving"

    def _warmup(self) -> None:
        """Run the fixed token-budget shape once, before any trainer connects (Triton autotune).

        With the unpacked audit on, also run its reference forward: transformers' own forward
        calls FLA's non-varlen kernels, which tune separately from the packed path's. Left to the
        first audited batch, that tuning (over a minute on a fresh Triton cache) happens while a
        trainer waits, and holds the GPU beside it.
        """
        t0 = time.perf_counter()
        budget = self.cfg.data.token_budget
        doc = min(budget, self.cfg.data.max_len)
        lens = [doc] * (budget // doc) + ([budget % doc] if budget % doc else [])
        doc_lens = torch.tensor(lens, dtype=torch.int32)
        ids = torch.randint(0, self.runner.vocab_size, (budget,), generator=torch.Generator().manual_seed(0))
        pos = torch.cat([torch.arange(n) for n in lens])
        self.runner.capture(ids, pos, doc_lens)
        if self.cfg.target.audit_every:
            n = min(doc, AUDIT_WARMUP_TOKENS)
            for length in (n - 1, n):   # Triton specialises an integer on being divisible by 16: one of each
                if length > 0:
                    self.runner.capture_unpacked(ids[:length])
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)
        self.stages.add("warmup", time.perf_counter() - t0)

    # ---- the loop ----------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self._setup()
            self.ready.set()
            if self.runner.device.type == "cuda":
                self._serve_cuda()
            else:
                self._serve_cpu()
        except BaseException as e:  # the main thread reports it and exits non-zero
            if not isinstance(e, ConfigError):   # a config mistake is the main thread's one line, no traceback
                log.exception("target worker %d failed", self.worker)
            self.error = e
            self.state = "failed"
            self.ready.set()
            self.notify()

    def stop(self) -> None:
        self._halt.set()

    def _next_work(self) -> Work | None:
        with self.stages.time("idle"):
            return self.dispatcher.take(timeout=0.2)

    def _pack(self, work: Work) -> dict[str, np.ndarray]:
        with self.stages.time("data"):
            from .packer import build_packed
            if work.heldout:  # held-out batch i: batch i of the held-out data's epoch 0
                return build_packed(self.heldout_dataset, self.heldout_packer.batch(work.seq))
            return build_packed(self.dataset, self.packer.batch(work.seq))

    def _meta(self, work: Work, arrays: dict[str, np.ndarray], checksums: dict[str, list[int]]) -> dict:
        epoch = 0 if work.heldout else self.packer.locate(work.seq)[0]
        return {"seq": work.seq, "epoch": epoch, "num_tokens": int(arrays["input_ids"].shape[0]),
                "layer_ids": list(self.runner.layer_ids), "worker": self.worker, "heldout": work.heldout,
                META_KEY: checksums}

    def _audit(self, work: Work, hidden: torch.Tensor, arrays: dict[str, np.ndarray]) -> bool:
        with self.stages.time("audit"):
            result = audit_hidden(hidden, arrays["doc_lens"], self.cfg.target.max_hidden_norm)
            every = self.cfg.target.audit_every
            if result.ok and every and self.batches % every == 0:
                result = self._audit_unpacked(hidden, arrays)
        if not result.ok:
            if not work.heldout:
                self.on_quarantine(work.seq, result.reason)
            elif self.on_heldout_quarantine is not None:
                self.on_heldout_quarantine(work.seq, result.reason)
        return result.ok

    def _audit_unpacked(self, hidden: torch.Tensor, arrays: dict[str, np.ndarray]) -> AuditResult:
        """Recompute the last document alone and compare: catches packing leaks at run time."""
        n = int(arrays["doc_lens"][-1])
        ids = torch.from_numpy(arrays["input_ids"][-n:].astype(np.int64))
        alone = self.runner.capture_unpacked(ids).float().cpu()
        packed = hidden[:, -n:].float().cpu()
        err = float((alone - packed).abs().max() / alone.abs().max().clamp_min(1e-6))
        if err > fp8.audit_tolerance(self.cfg.target.audit_tolerance, self.runner.precision):
            return AuditResult(False, f"packed != unpacked recompute (relative error {err:.3g})")
        return AuditResult(True)

    def _write_tokens(self, slot, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """The token tensors into the slot; returns the slot's views of them."""
        views = {}
        for name in TOKEN_TENSORS:
            views[name] = slot.tensor(name, TOKEN_TENSORS[name], tuple(arrays[name].shape))
            views[name].copy_(torch.from_numpy(arrays[name]))
        return views

    def _hidden_view(self, slot, num_tokens: int) -> torch.Tensor:
        k, h = len(self.runner.layer_ids), self.runner.hidden_size
        return slot.tensor("hidden", self.runner.dtype, (k, num_tokens, h))

    def _settle(self, work: Work, num_tokens: int, published: bool) -> None:
        """Hand taken work back to the dispatcher; count and announce it when it reached a slot."""
        if published and work.heldout:
            self.heldout_batches += 1
        elif published:
            self.batches += 1
            self.tokens += num_tokens
        self.dispatcher.done(work)
        if published:
            self.notify()

    def _publish(self, slot, work: Work, arrays: dict[str, np.ndarray], hidden_checksum: list[int]) -> None:
        """Token tensors into the slot, then READY (the hidden planes are already there, and
        `hidden_checksum` is theirs); the meta carries every tensor's payload checksum."""
        tokens = self._write_tokens(slot, arrays)
        with self.stages.time("publish"):
            checksums = {"hidden": hidden_checksum, **as_meta(tokens, payload_checksums(tokens))}
            slot.publish(self._meta(work, arrays, checksums))

    def _serve_cpu(self) -> None:
        while not self._halt.is_set():
            work = self._next_work()
            if work is None:
                continue
            arrays = self._pack(work)
            t = int(arrays["input_ids"].shape[0])
            published = False
            try:
                with self.stages.time("ring_full_wait"):
                    ctx = self._acquire()
                    if ctx is None:
                        break
                with ctx as slot:
                    hidden = self._hidden_view(slot, t)
                    with self.stages.time("forward"):
                        self.runner.capture(torch.from_numpy(arrays["input_ids"]),
                                            torch.from_numpy(arrays["position_ids"]),
                                            torch.from_numpy(arrays["doc_lens"]), out=hidden)
                    if self._audit(work, hidden, arrays):
                        self._publish(slot, work, arrays, tensor_checksum(hidden).tolist())
                        published = True
            except RingReplaced:
                self._dropped(work)
            finally:
                self._settle(work, t, published)

    def _acquire(self):
        """A slot context, waiting through a full ring; None when the worker is stopping."""
        self._close_retired()
        while not self._halt.is_set():
            cm = self.ring.acquire(timeout=0.5)
            try:
                slot = cm.__enter__()
            except (TimeoutError, RingReplaced):
                continue   # full, or replaced meanwhile: `self.ring` is the new one
            return _Entered(cm, slot)
        return None

    def _close_retired(self) -> None:
        while self.retired:
            self.retired.pop().close(unlink=False)   # its file is gone; another user may own its name now

    def _dropped(self, work: Work) -> None:
        what = f"held-out batch {work.seq}" if work.heldout else f"batch seq {work.seq}"
        log.warning("worker %d: %s not published: its ring was replaced meanwhile; it is computed again",
                    self.worker, what)

    def _serve_cuda(self) -> None:
        device = self.runner.device
        k, h, budget = len(self.runner.layer_ids), self.runner.hidden_size, self.cfg.data.token_budget
        staging = [torch.empty(k * budget * h, dtype=self.runner.dtype, device=device) for _ in range(2)]
        free_staging: queue.Queue[int] = queue.Queue()
        for i in range(len(staging)):
            free_staging.put(i)
        queued: queue.Queue = queue.Queue(maxsize=len(staging))
        copy_stream = torch.cuda.Stream(device=device)
        publisher = threading.Thread(target=self._publish_cuda, name=f"publisher-{self.worker}",
                                     args=(queued, staging, free_staging, copy_stream), daemon=True)
        publisher.start()
        try:
            while not self._halt.is_set():
                work = self._next_work()
                if work is None:
                    continue
                arrays = self._pack(work)
                t = int(arrays["input_ids"].shape[0])
                with self.stages.time("staging_wait"):
                    buf = free_staging.get()
                out = staging[buf][: k * t * h].view(k, t, h)
                with self.stages.time("forward_launch"):
                    with torch.cuda.device(device):
                        self.runner.capture(torch.from_numpy(arrays["input_ids"]),
                                            torch.from_numpy(arrays["position_ids"]),
                                            torch.from_numpy(arrays["doc_lens"]), out=out)
                        forward_done = torch.cuda.Event()
                        forward_done.record()
                self._put_alive(queued, (work, arrays, buf, out, forward_done), publisher)
        finally:
            self._put_alive(queued, None, publisher)
            publisher.join(timeout=60)

    def _put_alive(self, queued: queue.Queue, item, publisher: threading.Thread) -> None:
        """Hand work to the publisher; never block on a publisher that has died."""
        while publisher.is_alive():
            try:
                queued.put(item, timeout=0.5)
                return
            except queue.Full:
                continue
        # A publisher that returned because the worker is stopping (it was waiting on a full ring)
        # is a shutdown, not a failure: the batch in hand is simply not published.
        if item is not None and not self._halt.is_set():
            raise RuntimeError(f"publisher of worker {self.worker} died: {self.error!r}")

    def _publish_cuda(self, queued: queue.Queue, staging: list[torch.Tensor], free_staging: queue.Queue,
                      copy_stream: torch.cuda.Stream) -> None:
        while True:
            item = queued.get()
            if item is None:
                return
            work, arrays, buf, out, forward_done = item
            t = out.shape[1]
            published = False
            try:
                # Audit on the copy stream, ordered after this batch's forward only: on the forward
                # stream its host sync would also wait for the next forward.
                with torch.cuda.stream(copy_stream):
                    copy_stream.wait_event(forward_done)
                    ok = self._audit(work, out, arrays)
                if ok:
                    with self.stages.time("ring_full_wait"):
                        ctx = self._acquire()
                    if ctx is None:
                        return
                    with ctx as slot:
                        hidden = self._hidden_view(slot, t)
                        with self.stages.time("copy"):
                            with torch.cuda.stream(copy_stream):  # already ordered after forward_done
                                # the checksum of what is copied, on the GPU; its read-back lands
                                # under the copy's event, so it adds no host sync of its own
                                checksum = tensor_checksum(out).to("cpu", non_blocking=True)
                                hidden.copy_(out, non_blocking=True)
                                copied = torch.cuda.Event()
                                copied.record(copy_stream)
                            copied.synchronize()
                        self._publish(slot, work, arrays, checksum.tolist())
                        published = True
            except RingReplaced:
                self._dropped(work)
            except BaseException as e:
                log.exception("publisher of worker %d failed", self.worker)
                self.error = e
                self._halt.set()
                self.dispatcher.done(work)
                return
            finally:
                free_staging.put(buf)
            self._settle(work, t, published)

    def close(self) -> None:
        self._close_retired()
        if self.ring is not None:
            self.ring.close(unlink=True)
            self.ring = None
        if self.role is not None:
            self.role.release(unlink=True)   # never created a ring (or it already gave the role up)


class _Entered:
    """An already-entered slot context, re-usable in a `with` statement."""

    def __init__(self, cm, slot) -> None:
        self._cm, self._slot = cm, slot

    def __enter__(self):
        return self._slot

    def __exit__(self, *exc) -> bool | None:
        return self._cm.__exit__(*exc)
