"""Per-stage timers and a Prometheus endpoint that exports a service's status snapshot.

Both services keep their live numbers in one status dict (what `dfpipe ctl ... status` returns);
the Prometheus endpoint flattens that same dict, so the two views can never disagree.
"""
from __future__ import annotations

import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger(__name__)


class StageTimes:
    """Seconds and counts per named stage (data, forward, copy, publish_wait, ring_full_wait, ...)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds: dict[str, float] = {}
        self._counts: dict[str, int] = {}

    def add(self, stage: str, seconds: float) -> None:
        with self._lock:
            self._seconds[stage] = self._seconds.get(stage, 0.0) + seconds
            self._counts[stage] = self._counts.get(stage, 0) + 1

    @contextmanager
    def time(self, stage: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(stage, time.perf_counter() - t0)

    def snapshot(self) -> dict[str, dict[str, float]]:
        with self._lock:
            return {k: {"seconds": round(v, 6), "count": self._counts[k],
                        "mean_ms": round(1000 * v / max(1, self._counts[k]), 3)}
                    for k, v in self._seconds.items()}


RATE_WINDOW_S = 30.0   # long enough to hold several steps of a slow trainer (a few seconds each on a CPU)


class TokenRate:
    """A service's tokens per second over its last RATE_WINDOW_S seconds: the one rate it reports
    (its status, the trainer's metrics records), which `dfpipe top`, `ctl`, the demo's summary
    and its plot all show. A rate between two looks of a viewer would read 0 whenever no step or
    batch ended in between.

    `mark(now, total)` records the running token count (the trainer at each step's end, the
    target server as it polls). The rate is over whole marks: from the newest mark at least
    RATE_WINDOW_S old (or the first) to the newest; none for RATE_WINDOW_S means 0."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self._lock = threading.Lock()    # marked by one thread, read by the control thread
        self._marks: deque[tuple[float, float]] = deque()

    def mark(self, now: float, total: float) -> None:
        with self._lock:
            if self._marks and total < self._marks[-1][1]:
                self._marks.clear()      # the count went back (a new accounting): start over
            self._marks.append((now, total))
            while len(self._marks) > 2 and self._marks[1][0] <= now - self.window_s:
                self._marks.popleft()

    def per_s(self, now: float) -> float | None:
        """Tokens per second (to 2 decimals, as the status shows it); None before two marks."""
        rate = self.exact_per_s(now)
        return None if rate is None else round(rate, 2)

    def exact_per_s(self, now: float) -> float | None:
        """`per_s` unrounded: for a time left from a slow count (0.034 batches/s is not 0.03)."""
        with self._lock:
            if len(self._marks) < 2:
                return None
            (t0, c0), (t1, c1) = self._marks[0], self._marks[-1]
        if now - t1 > self.window_s:
            return 0.0
        return (c1 - c0) / (t1 - t0) if t1 > t0 else None


def time_left_s(done: float, total: float, per_s: float | None) -> float | None:
    """Seconds until `done` reaches `total` at `per_s` (a TokenRate of the same count); None while
    the rate is unknown or nil: no estimate rather than an infinite one."""
    if not per_s or per_s <= 0:
        return None
    return max(0.0, (total - done) / per_s)


def human_duration(seconds: float) -> str:
    """A duration as people read it: 42s, 3m05s, 1h02m, 2d03h."""
    s = max(0, int(round(seconds)))
    minutes, secs = divmod(s, 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


LOG_LINE_EVERY_S = 30.0   # a progress line this often when stderr is not a terminal


class ProgressLines:
    """Progress for a log: `dfpipe regenerate: 1,200/5,000 rows (24.0%), 3m10s left` on stderr every
    LOG_LINE_EVERY_S, the time left from the rate of the last RATE_WINDOW_S (tqdm's bar redraws one
    line in place, which a log file cannot show)."""

    def __init__(self, what: str, unit: str, total: int, done: int = 0) -> None:
        self.what, self.unit, self.total, self.done = what, unit, total, done
        self.rate = TokenRate()          # of `unit`s, not tokens: the same windowed count
        self.last = time.monotonic()
        self.rate.mark(self.last, done)

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        self.rate.mark(now, self.done)
        if now - self.last >= LOG_LINE_EVERY_S:
            self.last = now
            left = time_left_s(self.done, self.total, self.rate.exact_per_s(now))
            print(f"{self.what}: {self.done:,}/{self.total:,} {self.unit} ({self.done / max(1, self.total):.1%})"
                  + ("" if left is None else f", {human_duration(left)} left"), file=sys.stderr, flush=True)


def flatten(prefix: str, value: Any, out: dict[str, float] | None = None) -> dict[str, float]:
    """Numeric leaves of a nested status dict as `prefix_a_b` -> float (bools as 0/1)."""
    out = {} if out is None else out
    if isinstance(value, (int, float)):   # bool is an int
        out[prefix] = float(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            flatten(f"{prefix}_{k}", v, out)
    return out


def start_metrics_server(port: int, namespace: str, snapshot: Callable[[], dict[str, Any]]) -> bool:
    """Serve `snapshot()` as Prometheus gauges on `port` (0: disabled). Returns whether it started."""
    if not port:
        return False
    from prometheus_client import start_http_server
    from prometheus_client.core import GaugeMetricFamily
    from prometheus_client.registry import CollectorRegistry

    class _Collector:
        def collect(self):  # noqa: ANN202 - prometheus_client protocol
            try:
                values = flatten(namespace, snapshot())
            except Exception:  # a status bug must not take the endpoint (or the service) down
                log.exception("metrics snapshot failed")
                values = {}
            for name, v in sorted(values.items()):
                safe = "".join(c if c.isalnum() or c == "_" else "_" for c in name)
                yield GaugeMetricFamily(safe, f"dfpipe status field {name}", value=v)

    registry = CollectorRegistry()
    registry.register(_Collector())
    try:
        start_http_server(port, registry=registry)
    except OSError as e:
        log.error("metrics endpoint on port %d not started: %s", port, e)
        return False
    log.info("Prometheus metrics on :%d/metrics", port)
    return True
