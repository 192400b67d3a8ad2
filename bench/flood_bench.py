"""Same-user floods against a CPU target server: control latency while queued requests drain, and
the memory a flood of large frames leaves behind.

    python bench/flood_bench.py                              # 50 x 2,000 status requests, 12 x 8 s of frames
    python bench/flood_bench.py --repo /path/to/checkout     # another checkout's target server, same floods

A peer pings the server every 0.3 s throughout (what a connected trainer rank sends), so "quiet"
never means silence. Phases:

1. requests: tests/flood.py queues --requests status requests on each of --connections connections;
   while they drain, a probe asks `status` every 0.1 s on a fresh connection (as `dfpipe ctl
   target status` does, 5 s timeout): latency p50/p90/p99/max and timeouts.
2. frames: --frame-connections connections send frames just under service.max_message_bytes for
   --frame-seconds; RssAnon over the idle size at its peak, when the flood ends, QUIET_S + 0.5 s
   later (the documented give-back) and 20 s later (`--frame-connections 100`: issue 47, item 7).
3. hellos: --hello-threads threads, each on its own connection, re-send one HELLO of --hello-bytes
   (a `have` set of every other seq: the largest kind of message a trainer sends) as fast as their
   queues take it, for --hello-seconds; a probe asks `status` every 0.1 s meanwhile (5 s timeout):
   latency p50/p90/max and timeouts.

    python bench/flood_bench.py --phases frames --frame-connections 100
    python bench/flood_bench.py --phases hellos --hello-threads 10 --hello-seconds 60

Prints one JSON object; exit status 1 when the server did not stop cleanly (exit status 0).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.soak import write_config  # noqa: E402
from common.channel import QUIET_S, DealerChannel, RequestTimeout, request  # noqa: E402
from common.protocol import Control, Hello, Ping, new_session_secret, next_rid  # noqa: E402
from common.seqset import SeqSet  # noqa: E402
from dfpipe.ctl import try_status  # noqa: E402

MB = 1 << 20
FLOODER = os.path.join(REPO, "tests", "flood.py")


def rss_anon(pid: int) -> int:
    """The process's anonymous resident memory (/proc/PID/status RssAnon): what a flood could grow.
    The ring's shared-memory pages (RssShmem) fill as the worker publishes and are not a peer's doing."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no RssAnon in /proc/{pid}/status")


def settled_rss(pid: int, seconds: float = 3.0) -> int:
    """RssAnon once it stopped moving (within 4 MB over `seconds`)."""
    last = rss_anon(pid)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(seconds)
        now = rss_anon(pid)
        if abs(now - last) < 4 * MB:
            return now
        last = now
    return last


class Pinger(threading.Thread):
    """A trainer rank's share of the traffic: a PING every 0.3 s, answers read."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(name="pinger", daemon=True)
        self.endpoint = endpoint
        self.halt = threading.Event()

    def run(self) -> None:
        chan = DealerChannel(self.endpoint)
        try:
            while not self.halt.is_set():
                chan.send(Ping(rid=next_rid(), t=time.time()))
                chan.poll(0.3)
        finally:
            chan.close()


def probe_s(endpoint: str, timeout_s: float = 5.0) -> float:
    """Seconds one status request took on a fresh connection; inf when it was not answered in time."""
    t0 = time.monotonic()
    try:
        request(endpoint, Control(rid=next_rid(), cmd="status", args={}), timeout_s=timeout_s, retries=0)
    except RequestTimeout:
        return float("inf")
    return time.monotonic() - t0


def probe_while(endpoint: str, busy: Callable[[], bool], every_s: float, quantiles: dict[str, float]) -> dict[str, Any]:
    """A status probe (probe_s) every `every_s` while busy(): probes, timeouts, the answers' latency quantiles."""
    latencies = []
    while busy():
        latencies.append(probe_s(endpoint))
        time.sleep(every_s)
    answered = sorted(s for s in latencies if s != float("inf"))
    return {"probes": len(latencies), "timeouts": len(latencies) - len(answered),
            **{f"probe_{name}_s": round(answered[min(len(answered) - 1, int(q * len(answered)))], 3) if answered
               else None for name, q in quantiles.items()}}


def request_flood(endpoint: str, connections: int, requests: int, every_s: float = 0.1) -> dict[str, Any]:
    """Queue `requests` status requests on each of `connections` connections; probe while they drain."""
    flooder = subprocess.Popen([sys.executable, FLOODER, endpoint, str(connections), "--requests", str(requests)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    probes = probe_while(endpoint, lambda: flooder.poll() is None, every_s,
                         {"p50": 0.5, "p90": 0.9, "p99": 0.99, "max": 1.0})
    sent = json.loads(flooder.communicate()[0])
    return {"requests": sent["frames"], "answered": sent["answers"], "drain_s": sent["seconds"],
            "per_request_ms": round(1000 * sent["seconds"] / max(1, sent["answers"]), 3), **probes}


def frame_flood(pid: int, endpoint: str, connections: int, size: int, seconds: float) -> dict[str, Any]:
    """Frames of `size` bytes from `connections` connections for `seconds`; RssAnon over idle (MB)."""
    idle = settled_rss(pid)
    flooder = subprocess.Popen([sys.executable, FLOODER, endpoint, str(connections), str(size)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    peak, deadline = idle, time.monotonic() + seconds
    while time.monotonic() < deadline:
        peak = max(peak, rss_anon(pid))
        time.sleep(0.1)
    sent = json.loads(flooder.communicate(timeout=60)[0])   # closing its stdin stops it
    ended = time.monotonic()
    over = {"at_end": rss_anon(pid)}
    for name, at in ((f"after_{QUIET_S + 0.5:g}s", QUIET_S + 0.5), ("after_20s", 20.0)):
        time.sleep(max(0.0, ended + at - time.monotonic()))
        over[name] = rss_anon(pid)
    return {"sent_mb": round(sent["bytes"] / MB), "idle_mb": round(idle / MB), "peak_mb": round((peak - idle) / MB),
            **{f"{k}_mb": round((v - idle) / MB) for k, v in over.items()}}


def big_hello(size: int) -> bytes:
    """One encoded HELLO of about `size` bytes: a `have` set of every other seq (~7 bytes a range)."""
    ranges = max(1, size // 7)
    while True:
        frame = Hello(rid=next_rid(), job="hello-flood", secret=new_session_secret(), rank=0, world=1,
                      pid=os.getpid(), start_time=0, have=SeqSet(range(0, 2 * ranges, 2)), epochs=1, credit=2,
                      heldout=False).encode()
        if len(frame) >= size or ranges > size:
            return frame
        ranges += max(1, (size - len(frame)) // 7)


def hello_flood(endpoint: str, threads: int, size: int, seconds: float, every_s: float = 0.1) -> dict[str, Any]:
    """`threads` connections re-sending one `size`-byte HELLO each for `seconds`; a status probe every 0.1 s."""
    halt, sent = threading.Event(), [0] * threads
    frame = big_hello(size)

    def spam(i: int) -> None:
        chan = DealerChannel(endpoint, hwm=4)
        try:
            while not halt.is_set():
                if chan.socket.poll(100, zmq.POLLOUT):
                    chan.socket.send(frame, zmq.NOBLOCK)
                    sent[i] += 1
                chan.poll(0)   # read (and drop) the answers
        finally:
            chan.close()

    workers = [threading.Thread(target=spam, args=(i,), daemon=True) for i in range(threads)]
    for w in workers:
        w.start()
    deadline = time.monotonic() + seconds
    try:
        probes = probe_while(endpoint, lambda: time.monotonic() < deadline, every_s,
                             {"p50": 0.5, "p90": 0.9, "max": 1.0})
    finally:
        halt.set()
        for w in workers:
            w.join(10)
    return {"hello_bytes": len(frame), "hellos_sent": sum(sent), **probes}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repo", default=REPO, help="checkout whose `python -m dfpipe target-server` runs")
    p.add_argument("--connections", type=int, default=50)
    p.add_argument("--requests", type=int, default=2000, help="status requests queued per connection")
    p.add_argument("--frame-connections", type=int, default=12)
    p.add_argument("--frame-seconds", type=float, default=8.0)
    p.add_argument("--hello-threads", type=int, default=10)
    p.add_argument("--hello-bytes", type=int, default=143_000)
    p.add_argument("--hello-seconds", type=float, default=60.0)
    p.add_argument("--phases", default="requests,frames",
                   help="comma-separated, in this order: requests, frames, hellos (default: requests,frames)")
    args = p.parse_args(argv)
    workdir = tempfile.mkdtemp(prefix="dfflood-", dir="/tmp")
    config, cfg = write_config(workdir, samples=40, cache_dir=os.path.join(REPO, ".cache", "dfpipe-tests"), seed=0)
    endpoint = cfg["service"]["target_endpoint"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": args.repo}
    with open(os.path.join(workdir, "target.log"), "wb") as log:
        target = subprocess.Popen([sys.executable, "-m", "dfpipe", "target-server", "-c", config], cwd=args.repo,
                                  env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    pinger = Pinger(endpoint)
    try:
        deadline = time.monotonic() + 300
        while not ((s := try_status(endpoint)) and s.get("state") == "serving"):
            if target.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the target server did not start: see {workdir}/target.log")
            time.sleep(0.5)
        pinger.start()
        phases = set(args.phases.split(","))
        out: dict[str, Any] = {"repo": args.repo}
        if "requests" in phases:
            out["requests"] = request_flood(endpoint, args.connections, args.requests)
        if "frames" in phases:
            out["frames"] = frame_flood(target.pid, endpoint, args.frame_connections, (1 << 20) - 64,
                                        args.frame_seconds)
        if "hellos" in phases:
            out["hellos"] = hello_flood(endpoint, args.hello_threads, args.hello_bytes, args.hello_seconds)
            out["hellos"]["status_after"] = {k: v for k, v in (try_status(endpoint) or {}).items()
                                             if k in ("receive", "bad_messages", "refused")}
    finally:
        pinger.halt.set()
        if target.poll() is None:
            target.send_signal(signal.SIGTERM)
        try:
            target.wait(120)
        except subprocess.TimeoutExpired:
            target.kill()
    out["exit_status"] = target.wait()
    print(json.dumps(out))
    return 0 if out["exit_status"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
