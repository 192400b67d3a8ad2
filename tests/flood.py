"""A local peer that floods a service's endpoint: `python tests/flood.py ENDPOINT CONNECTIONS BYTES`.

Opens CONNECTIONS DEALER sockets to ENDPOINT and sends frames of BYTES bytes (not a protocol
message: what a buggy or hostile peer would send) round-robin, as fast as its queues take them,
until stdin closes or SIGTERM; then prints `{"frames": N, "bytes": M}` on stdout."""
from __future__ import annotations

import json
import select
import signal
import sys

import zmq


def main() -> None:
    endpoint, connections, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    ctx = zmq.Context()
    socks = []
    for _ in range(connections):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 4)
        s.connect(endpoint)
        socks.append(s)
    frame = b"\xc6" + (size - 5).to_bytes(4, "big") + bytes(size - 5)   # a msgpack bin32 of size - 5 bytes
    writable = zmq.Poller()
    for s in socks:
        writable.register(s, zmq.POLLOUT)
    frames = 0
    while not stop and not select.select([sys.stdin], [], [], 0)[0]:
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
    for s in socks:
        s.close()
    ctx.term()
    print(json.dumps({"frames": frames, "bytes": frames * size}), flush=True)


if __name__ == "__main__":
    main()
