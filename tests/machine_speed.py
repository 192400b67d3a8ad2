"""How much slower than the reference machine this one runs the tests now, and wall-clock limits
scaled by it.

Every wall-clock limit in the tests (pytest-timeout's, a subprocess wait, a bench part's budget)
is there only to turn a hang into a failure. Set at >= 3x what the test needs on a quiet 2-core
machine, it still fails on a slower or busier one (one run of `make test` beside other work at a
load of 5-19 lost five tests to their limits, none of them broken). So each limit is written for
the reference machine and multiplied by `slowness()`: a fixed CPU workload of the kind the tests
run (small torch ops with autograd, and plain Python), timed once per session in conftest and
divided by its time on the reference machine (never below 1: a faster machine keeps the limits).
The conftest measures it in the first pytest process and hands it to xdist workers and every
subprocess through $DFPIPE_TEST_SLOWNESS; setting that variable by hand overrides the measurement.
"""
from __future__ import annotations

import os
import statistics
import time

ENV = "DFPIPE_TEST_SLOWNESS"
# median of `_workload()` on the reference: the project's 2-core CPU machine, quiet, one thread
REFERENCE_S = 0.11
ROUNDS = 5


def _workload() -> None:
    import torch

    x = torch.randn(64, 128)
    w = torch.randn(128, 128, requires_grad=True)
    for _ in range(300):
        (x @ w).tanh().square().mean().backward()
    acc = 0
    for i in range(300_000):   # interpreter-bound, like the tests' Python between torch calls
        acc += i * i % 7


def measure() -> float:
    """The median wall time of ROUNDS runs of the workload over its reference time, >= 1."""
    _workload()   # warm-up: first-call allocations and dispatch caches
    times = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        _workload()
        times.append(time.perf_counter() - t0)
    return max(1.0, statistics.median(times) / REFERENCE_S)


def slowness() -> float:
    """This session's factor: $DFPIPE_TEST_SLOWNESS once conftest has set it, else measured now."""
    if ENV not in os.environ:
        os.environ[ENV] = f"{measure():.2f}"
    value = float(os.environ[ENV])
    if not value > 0:
        raise ValueError(f"${ENV} must be a positive number, not {os.environ[ENV]!r}")
    return value


def scaled(seconds: float) -> float:
    """A wall-clock limit set for the reference machine, stretched to this one's speed now."""
    return seconds * slowness()
