"""A local peer that floods a service's endpoint.

    python tests/flood.py ENDPOINT CONNECTIONS BYTES              # frames of BYTES bytes
    python tests/flood.py ENDPOINT CONNECTIONS --requests N       # N queued status requests each

Frames: opens CONNECTIONS DEALER sockets to ENDPOINT and sends frames of BYTES bytes (not a
protocol message: what a buggy or hostile peer would send) round-robin, as fast as its queues take
them, until stdin closes or SIGTERM; then prints `{"frames": N, "bytes": M}` on stdout.

Requests: every connection queues N `status` control requests at once (its send queue holds them
all: what a script looping over `dfpipe ctl` without waiting would do, on many connections), then
reads the answers until every request is answered, no answer came for --idle seconds (the service
dropped the rest), stdin closes or SIGTERM; then prints `{"frames", "bytes", "answers", "seconds"}`
(seconds: from the first request sent to the last answer read)."""
from __future__ import annotations

import argparse
import json
import select
import signal
import sys
import time
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script: the repo's common/
from common.protocol import Control, next_rid  # noqa: E402


def _stopped(stop: list[int]) -> bool:
    return bool(stop) or bool(select.select([sys.stdin], [], [], 0)[0])


def flood_frames(socks: list[zmq.Socket], size: int, stop: list[int]) -> dict[str, int]:
    frame = b"\xc6" + (size - 5).to_bytes(4, "big") + bytes(size - 5)   # a msgpack bin32 of size - 5 bytes
    writable = zmq.Poller()
    for s in socks:
        writable.register(s, zmq.POLLOUT)
    frames = 0
    while not _stopped(stop):
        sent = 0
        for s in socks:
            try:
                s.send(frame, zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                pass
        frames += sent
        if not sent:
            writable.poll(10)   # every queue full: wait for room instead of spinning
    return {"frames": frames, "bytes": frames * size}


def flood_requests(socks: list[zmq.Socket], requests: int, idle_s: float, stop: list[int]) -> dict[str, float]:
    frame = Control(rid=next_rid(), cmd="status", args={}).encode()   # one rid: answers are counted, not matched
    t0 = time.monotonic()
    for s in socks:
        for _ in range(requests):
            s.send(frame)   # never blocks: SNDHWM holds them all
    readable = zmq.Poller()
    for s in socks:
        readable.register(s, zmq.POLLIN)
    answers, last = 0, time.monotonic()
    while answers < requests * len(socks) and time.monotonic() - last < idle_s and not _stopped(stop):
        for s, _ in readable.poll(100):
            while True:
                try:
                    s.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                answers += 1
                last = time.monotonic()
    return {"frames": requests * len(socks), "bytes": requests * len(socks) * len(frame), "answers": answers,
            "seconds": round(last - t0, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("endpoint")
    p.add_argument("connections", type=int)
    p.add_argument("bytes", type=int, nargs="?", default=0, help="frame size (frames mode)")
    p.add_argument("--requests", type=int, default=0, help="status requests queued per connection")
    p.add_argument("--idle", type=float, default=10.0, help="requests mode: stop after this long without an answer")
    args = p.parse_args()
    if (args.bytes > 0) == (args.requests > 0):
        p.error("give either BYTES or --requests N")
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    ctx = zmq.Context()
    socks = []
    for _ in range(args.connections):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, max(4, args.requests))
        s.setsockopt(zmq.RCVHWM, 0)   # requests mode: read every answer, never make the service drop one
        s.connect(args.endpoint)
        socks.append(s)
    if args.requests:
        out = flood_requests(socks, args.requests, args.idle, stop)
    else:
        out = flood_frames(socks, args.bytes, stop)
    for s in socks:
        s.close()
    ctx.term()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
