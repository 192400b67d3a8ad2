"""Drive the real `target_server.worker.TargetWorker` over chosen seqs, with an in-process consumer.

This is the server's production path (CUDA: forward -> staging buffer -> publisher thread ->
copy stream -> registered slot -> event -> publish), minus ZeroMQ: the consumer here scans the
ring's headers itself, hands each READY slot to `on_slot`, acks it at once and wakes the producer.
It scans when a publisher reports a publish, as the server's announcer is woken; a real trainer is
another process, so a consumer that polled here would take the GIL from the worker's launch loop
(the `poll_interval_s` variant measures that).

    seqs -> Dispatcher -> TargetWorker thread(s) -> ring slot READY -> consumer (this thread)
                                                                          on_slot(view); ack; wake
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from common.config import Config, validate
from common.metrics import StageTimes
from common.ring import ConsumerRing, SlotView
from target_server.delivery import Dispatcher
from target_server.worker import TargetWorker

CONSUMER_EPOCH = 1


@dataclass
class WorkerRun:
    """What one worker run produced; `publishes[i]` = (perf_counter, batches, tokens) after publish i+1."""

    publishes: list[tuple[float, int, int]] = field(default_factory=list)
    quarantined: list[tuple[int, str]] = field(default_factory=list)
    received: int = 0
    invalid_after_read: int = 0
    stages: dict[str, Any] = field(default_factory=dict)

    def tokens_per_s(self, skip: int) -> float:
        """Real tokens per second between publish `skip` and the last one (steady state)."""
        if len(self.publishes) <= skip + 1:
            raise ValueError(f"need more than {skip + 1} publishes to time, got {len(self.publishes)}")
        t0, _, tok0 = self.publishes[skip]
        t1, _, tok1 = self.publishes[-1]
        return (tok1 - tok0) / (t1 - t0)


def worker_config(token_budget: int, max_len: int, ring_name: str, shm_dir: str, slots: int,
                  cuda_register: str, audit_every: int) -> Config:
    cfg = Config()
    cfg.data.token_budget, cfg.data.max_len = token_budget, max_len
    cfg.ring.name, cfg.ring.shm_dir, cfg.ring.slots, cfg.ring.cuda_register = ring_name, shm_dir, slots, cuda_register
    cfg.target.warmup = False          # the runner handed in is already warm
    cfg.target.audit_every = audit_every
    return validate(cfg)


def run_workers(runners: list[Any], cfg: Config, dataset: Any, packer: Any, seqs: list[int],
                on_slot: Callable[[SlotView], None] | None = None,
                patch: Callable[[TargetWorker], None] | None = None, timeout_s: float = 300.0,
                poll_interval_s: float | None = None) -> WorkerRun:
    """Serve `seqs` through one TargetWorker per runner (one ring each, one shared dispatcher: the
    server's shape); every published slot goes through on_slot, then is acked. `patch` may alter
    each worker before it starts (a diagnostic variant); `poll_interval_s`: scan that often instead
    of on each publish. Raises a worker's own error if one fails, TimeoutError if the seqs are not
    all published or quarantined in time."""
    run = WorkerRun()
    dispatcher = Dispatcher()
    dispatcher.reset(list(seqs))
    workers: list[TargetWorker] = []
    lock = threading.Lock()
    published = threading.Event()

    def on_publish() -> None:  # a publisher thread, after each publish (and once on failure)
        published.set()
        with lock:
            batches = sum(w.batches for w in workers)
            if batches > (run.publishes[-1][1] if run.publishes else 0):
                run.publishes.append((time.perf_counter(), batches, sum(w.tokens for w in workers)))

    stages = StageTimes()
    for i, runner in enumerate(runners):
        worker = TargetWorker(i, str(runner.device), cfg, lambda _device, r=runner: r, dataset, packer, dispatcher,
                              on_publish, lambda seq, why: run.quarantined.append((seq, why)), stages)
        if patch is not None:
            patch(worker)
        workers.append(worker)
    for worker in workers:
        worker.start()
    consumers: list[ConsumerRing] = []
    try:
        for worker in workers:
            if not worker.ready.wait(timeout_s) or worker.error is not None:
                raise RuntimeError(f"target worker did not start: {worker.error!r}") from worker.error
            worker.ring.set_consumer_epoch(CONSUMER_EPOCH)
            # reads headers and bytes only
            consumers.append(ConsumerRing.attach(worker.ring.path, cuda_register="off"))
        deadline = time.monotonic() + timeout_s
        while run.received + len(run.quarantined) < len(seqs):
            failed = next((w for w in workers if w.error is not None), None)
            if failed is not None:
                raise RuntimeError(f"target worker {failed.worker} failed: {failed.error!r}") from failed.error
            if time.monotonic() > deadline:
                raise TimeoutError(f"{run.received} of {len(seqs)} seqs published within {timeout_s}s "
                                   f"({len(run.quarantined)} quarantined)")
            if poll_interval_s is None:
                published.wait(0.1)   # the timeout only bounds how late a failure or the deadline is seen
                published.clear()     # before the scan: a publish during it sets the event again
            for worker, consumer in zip(workers, consumers):
                infos = worker.ring.ready()
                for info in infos:
                    view = consumer.read(info.index, info.pub_seq)
                    if on_slot is not None:
                        on_slot(view)
                    if not view.still_valid():
                        run.invalid_after_read += 1
                    del view  # no slot tensor may outlive the ack
                    consumer.ack(info.index, info.pub_seq, CONSUMER_EPOCH)
                    run.received += 1
                if infos:
                    worker.ring.wake()
            if poll_interval_s is not None:
                time.sleep(poll_interval_s)
    finally:
        for worker in workers:
            worker.stop()
        dispatcher.stop()
        for worker in workers:
            worker.join(timeout=60)
        for consumer in consumers:
            consumer.close()
        for worker in workers:
            worker.close()
        run.stages = stages.snapshot()
    return run
