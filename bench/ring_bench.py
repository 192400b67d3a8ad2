"""Ring throughput and announce-to-claim latency between two processes.

  python bench/ring_bench.py [--sizes-mib 64,256,512] [--slots 3] [--latency-iters 2000]

Throughput: the producer (this process) copies a private source tensor into a slot and publishes;
a consumer process, told over ZeroMQ PUSH/PULL, copies the slot into its own private tensor and
acks (an ACK message wakes the producer, as in the server). Reported: payload GB/s delivered end
to end, next to a plain single-process copy of the same bytes in the same run (the ratio is the
ring's cost: each byte is copied twice, by two processes that overlap through the slots).
Latency: one small slot at a time; time from the producer's publish() returning to the consumer's
read() returning (both CLOCK_MONOTONIC), p50/p99.
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import msgpack
import numpy as np
import torch
import zmq

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from common.ring import ConsumerRing, ProducerRing, slot_bytes  # noqa: E402

GB = 1e9


def consumer_main(path: str, announce_ep: str, ack_ep: str, max_bytes: int) -> None:
    torch.set_num_threads(1)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(announce_ep)
    push = ctx.socket(zmq.PUSH)
    push.connect(ack_ep)
    ring = ConsumerRing.attach(path, cuda_register="off")
    private = torch.empty(max_bytes, dtype=torch.uint8)
    private.fill_(0)  # touch every page before timing
    latencies: list[int] = []
    while True:
        msg = msgpack.unpackb(pull.recv())
        if msg[0] == "quit":
            break
        index, pub_seq, published_ns, epoch = msg
        view = ring.read(index, pub_seq)
        claimed_ns = time.monotonic_ns()
        src = view.tensors["data"]
        private[:src.numel()].copy_(src)
        if not view.still_valid():
            raise SystemExit("slot changed while copying")
        ring.ack(index, pub_seq, epoch)
        push.send(msgpack.packb([index, pub_seq]))
        latencies.append(claimed_ns - published_ns)
        del view, src
    push.send(msgpack.packb(["latencies", latencies]))
    ring.close()
    ctx.destroy(linger=1000)


class Producer:
    def __init__(self, shm_dir: str, slots: int, max_bytes: int, workdir: str) -> None:
        spec = [("data", torch.uint8, (max_bytes,))]
        self.ring = ProducerRing.create(shm_dir, "dfpipe-ringbench", 0, slots, slot_bytes(spec),
                                        cuda_register="off")
        self.ring.set_consumer_epoch(1)
        self.ctx = zmq.Context()
        self.announce = self.ctx.socket(zmq.PUSH)
        self.announce.bind(f"ipc://{workdir}/announce")
        self.acks = self.ctx.socket(zmq.PULL)
        self.acks.bind(f"ipc://{workdir}/acks")
        self.sent = self.acked = 0
        self.cv = threading.Condition()
        self.latencies: list[int] = []
        self.listener = threading.Thread(target=self._listen, daemon=True)
        self.listener.start()

    def _listen(self) -> None:
        while True:
            msg = msgpack.unpackb(self.acks.recv())
            if msg[0] == "latencies":
                with self.cv:
                    self.latencies = msg[1]
                    self.cv.notify_all()
                return
            self.ring.wake()  # the ACK message is the doorbell; the header is the truth
            with self.cv:
                self.acked += 1
                self.cv.notify_all()

    def send(self, source: torch.Tensor) -> None:
        with self.ring.acquire(timeout=60) as slot:
            slot.tensor("data", torch.uint8, (source.numel(),)).copy_(source)
            slot.publish({"n": source.numel()})
        self.announce.send(msgpack.packb([slot.index, slot.pub_seq, time.monotonic_ns(), 1]))
        self.sent += 1

    def wait_all_acked(self) -> None:
        with self.cv:
            if not self.cv.wait_for(lambda: self.acked >= self.sent, timeout=120):
                raise TimeoutError(f"only {self.acked} of {self.sent} slots acked")


def throughput(prod: Producer, source: torch.Tensor, iters: int) -> float:
    for _ in range(prod.ring.slot_count + 1):  # warm-up: every slot and both private buffers touched
        prod.send(source)
    prod.wait_all_acked()
    t0 = time.perf_counter()
    for _ in range(iters):
        prod.send(source)
    prod.wait_all_acked()
    return source.numel() * iters / (time.perf_counter() - t0) / GB


def memcpy_rate(source: torch.Tensor, iters: int) -> float:
    dst = torch.empty_like(source)
    dst.copy_(source)
    t0 = time.perf_counter()
    for _ in range(iters):
        dst.copy_(source)
    return source.numel() * iters / (time.perf_counter() - t0) / GB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mib", default="64,256,512")
    parser.add_argument("--iters", type=int, default=0, help="slots per size (0: about 4 GiB per size)")
    parser.add_argument("--slots", type=int, default=3)
    parser.add_argument("--latency-iters", type=int, default=2000)
    parser.add_argument("--latency-bytes", type=int, default=4096)
    parser.add_argument("--shm-dir", default="/dev/shm")
    parser.add_argument("--consumer", nargs=4, metavar=("PATH", "ANNOUNCE", "ACK", "MAX_BYTES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.consumer:
        path, announce_ep, ack_ep, max_bytes = args.consumer
        consumer_main(path, announce_ep, ack_ep, int(max_bytes))
        return

    torch.set_num_threads(1)
    sizes = [int(s) << 20 for s in args.sizes_mib.split(",")]
    workdir = tempfile.mkdtemp(prefix="ringbench-")  # ZeroMQ ipc sockets
    prod = Producer(args.shm_dir, args.slots, max(sizes), workdir)
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--consumer", prod.ring.path,
                              f"ipc://{workdir}/announce", f"ipc://{workdir}/acks", str(max(sizes))])
    try:
        print(f"# {time.strftime('%Y-%m-%d %H:%M')} {platform.node()} {os.cpu_count()} CPUs, "
              f"load {os.getloadavg()[0]:.1f}, torch {torch.__version__}, 1 torch thread per process, "
              f"{args.slots} slots")
        print("| payload | ring GB/s | memcpy GB/s | ratio |")
        print("| --- | --- | --- | --- |")
        for size in sizes:
            source = torch.from_numpy(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8))
            iters = args.iters or max(4, (4 << 30) // size)
            ring_rate = throughput(prod, source, iters)
            copy_rate = memcpy_rate(source, iters)
            print(f"| {size >> 20} MiB | {ring_rate:.2f} | {copy_rate:.2f} | {ring_rate / copy_rate:.2f} |", flush=True)
            del source
        small = torch.ones(args.latency_bytes, dtype=torch.uint8)
        for _ in range(args.latency_iters):
            prod.send(small)
            prod.wait_all_acked()
        prod.announce.send(msgpack.packb(["quit"]))
        with prod.cv:
            prod.cv.wait_for(lambda: bool(prod.latencies), timeout=60)
        lat = np.array(prod.latencies[-args.latency_iters:]) / 1e3
        print(f"announce-to-claim latency ({args.latency_bytes} B slots, {args.latency_iters} samples): "
              f"p50 {np.percentile(lat, 50):.0f} us, p99 {np.percentile(lat, 99):.0f} us")
    finally:
        try:
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        prod.ring.close()
        prod.ctx.destroy(linger=0)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
