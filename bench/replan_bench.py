"""What a trainer's HELLO costs the target server: queueing every seq the session still needs.

  python bench/replan_bench.py [--batches-per-epoch 40000,300000] [--epochs 6] [--repeats 3]

For a plan of E epochs of N batches, a third of it already held, a few seqs quarantined, in a
slot or being computed: the time and peak Python memory of the server's replan as shipped
(`Dispatcher.replan` of `DeliveryCore.todo` for a session that said HELLO: pending work as seq
ranges), against the same step with one int per seq in a sorted
deque (dfpipe before commit c5e1bed; kept here, and only here, as the baseline). The replan runs
in the server's loop under the dispatcher's lock: no worker takes work and no message is handled
while it runs.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import tracemalloc
from collections import deque

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from common.protocol import Hello, plan_id  # noqa: E402
from common.seqset import SeqSet  # noqa: E402
from target_server.delivery import TRAIN, DeliveryCore, Dispatcher, EpochPlan, SlotView  # noqa: E402


def per_seq_baseline(plan: EpochPlan, have: SeqSet, quarantined: SeqSet, in_ring: set[int],
                     computing: set[int]) -> deque[int]:
    todo = [s for a, b in have.difference_ranges(0, plan.total) for s in range(a, b)
            if s not in quarantined and s not in in_ring and s not in computing]
    return deque(sorted(todo))


def measure(fn) -> tuple[float, float]:
    tracemalloc.start()
    t0 = time.perf_counter()
    kept = fn()
    seconds = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del kept
    return seconds, peak / 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches-per-epoch", default="40000,300000")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3, help="best of")
    args = p.parse_args()
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    print("| plan (seqs) | to queue | shipped: s, peak MB | one int per seq: s, peak MB | time ratio |")
    print("| --- | --- | --- | --- | --- |")
    for n in (int(x) for x in args.batches_per_epoch.split(",")):
        plan = EpochPlan([n] * args.epochs)
        have = SeqSet.from_ranges([(0, plan.total // 3)])
        quarantined = SeqSet([plan.total // 2, plan.total // 2 + 5])
        in_ring = {plan.total // 3 + i for i in (0, 2, 4)}
        computing = {plan.total // 3 + 1}
        core = DeliveryCore(lambda e, n=n: [n] * e, {"data": "bench", "id": plan_id({"data": "bench"})}, lease_s=60.0, announce_retry_s=1.0)
        core.on_hello(b"rank0", Hello(rid=1, job="bench", secret="ab" * 16, rank=0, world=1, pid=1, start_time=1,
                                      have=have, epochs=args.epochs, credit=4, heldout=False), 0.0, [], [])
        core.quarantined[TRAIN].update(quarantined)
        slots = [SlotView(worker=0, slot=i, pub_seq=i + 1, ready=True, seq=seq) for i, seq in enumerate(in_ring)]
        dispatcher = Dispatcher()

        def shipped() -> int:
            dispatcher.replan(lambda busy: core.todo(TRAIN, busy | computing, slots))
            return dispatcher.pending_count()

        new = min((measure(shipped) for _ in range(args.repeats)), key=lambda r: r[0])
        old = min((measure(lambda: per_seq_baseline(plan, have, quarantined, in_ring, computing))
                   for _ in range(args.repeats)), key=lambda r: r[0])
        queued = dispatcher.pending_count()
        assert queued == len(per_seq_baseline(plan, have, quarantined, in_ring, computing))
        print(f"| {plan.total:,} | {queued:,} | {new[0]:.5f}, {new[1]:.3f} | {old[0]:.3f}, {old[1]:.1f} | "
              f"{old[0] / new[0]:,.0f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
