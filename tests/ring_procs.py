"""Child processes for the ring tests, and a small driver to talk to them line by line.

Run as a script, it is a consumer or a producer that follows the real call sequence and can stop
(and wait to be killed) at a named point:

  consumer SHM_DIR NAME PATH [--stop-at before_claim|mid_read|after_read|before_ack] [--heartbeat]
      holds RoleLock(SHM_DIR, NAME, "consumer") like a trainer; stdin lines "INDEX PUB_SEQ EPOCH CRC"
      announce slots; for each it reads, copies out, checks the crc of the copied bytes, acks and
      prints "A INDEX PUB_SEQ ok|bad|stale" (unless --quiet); "quit" prints "done OK BAD STALE"
      (counts) and exits normally.
  producer SHM_DIR NAME --stop-at mid_write|mid_publish
      creates ring (NAME, worker 0), prints "path PATH EPOCH", and stops inside the first slot.

Every stop prints "at POINT INDEX PUB_SEQ" and then sleeps until killed (before_ack instead
waits for a stdin line "ack", acks, and prints "acked").
"""
from __future__ import annotations

import argparse
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable
from typing import IO

import torch

from machine_speed import scaled

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
STOP_POINTS_CONSUMER = ("before_claim", "mid_read", "after_read", "before_ack")
STOP_POINTS_PRODUCER = ("mid_write", "mid_publish")
PAYLOAD_BYTES = 1 << 20  # producer-crash payload: big enough that "mid_write" is a real partial write


def payload_crc(tensors: dict[str, torch.Tensor]) -> int:
    """crc32 over the raw bytes of the tensors, in table order."""
    crc = 0
    for t in tensors.values():
        crc = zlib.crc32(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes(), crc)
    return crc


# -- driver (used by the tests) ------------------------------------------------------------------
class Child:
    """A child process of this script; lines of its stdout arrive through a queue."""

    def __init__(self, *args: str, on_line: Callable[[str], None] | None = None) -> None:
        self._on_line = on_line
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), *args], cwd=REPO, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.last_line_at = time.monotonic()
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.last_line_at = time.monotonic()
            if self._on_line is not None:
                self._on_line(line)
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def expect(self, prefix: str, timeout: float = 60.0, skip: tuple[str, ...] = ("hb",)) -> list[str]:
        """Next line starting with `prefix` (lines starting with one of `skip` are ignored), split into words;
        `timeout` s on the reference machine (scaled to this one)."""
        timeout = scaled(timeout)
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"child {self.proc.pid}: no line {prefix!r} within {timeout} s") from None
            if line is None:
                raise EOFError(f"child {self.proc.pid} exited ({self.proc.wait()}) before printing {prefix!r}")
            if line.startswith(skip):
                continue
            if not line.startswith(prefix):
                raise AssertionError(f"child {self.proc.pid}: expected {prefix!r}, got {line!r}")
            return line.split()

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill9()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


# -- child roles ---------------------------------------------------------------------------------
class _Out:
    """Line output shared by the main thread and the heartbeat thread."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream, self._lock = stream, threading.Lock()

    def __call__(self, *words: object) -> None:
        with self._lock:
            self._stream.write(" ".join(map(str, words)) + "\n")
            self._stream.flush()


def _park() -> None:
    while True:  # wait to be killed
        time.sleep(3600)


def run_consumer(args: argparse.Namespace) -> None:
    from multiprocessing import resource_tracker

    from common.liveness import RoleLock
    from common.ring import ConsumerRing, StaleSlot

    out = _Out(sys.stdout)
    resource_tracker.ensure_running()  # a live tracker that must not unlink our ring at exit
    lock = RoleLock(args.shm_dir, args.name, "consumer")
    lock.acquire(timeout=10)
    ring = ConsumerRing.attach(args.path, cuda_register="off")
    if args.heartbeat:
        def beat() -> None:
            while True:
                out("hb")
                time.sleep(0.05)
        threading.Thread(target=beat, daemon=True).start()
    out("attached", os.getpid())
    counts = {"ok": 0, "bad": 0, "stale": 0}

    def report(index: int, pub_seq: int, status: str) -> None:
        counts[status] += 1
        if not args.quiet:
            out("A", index, pub_seq, status)

    for line in sys.stdin:
        words = line.split()
        if words == ["quit"]:
            break
        index, pub_seq, epoch, crc = map(int, words)
        if args.stop_at == "before_claim":
            out("at before_claim", index, pub_seq)
            _park()
        try:
            view = ring.read(index, pub_seq)
        except StaleSlot:
            report(index, pub_seq, "stale")
            continue
        copies = {}
        for n, (name, t) in enumerate(view.tensors.items()):
            copies[name] = t.clone()
            if args.stop_at == "mid_read" and n == 0:
                out("at mid_read", index, pub_seq)
                _park()
        if not view.still_valid():
            report(index, pub_seq, "stale")
            continue
        if args.stop_at == "after_read":
            out("at after_read", index, pub_seq)
            _park()
        if args.stop_at == "before_ack":
            out("at before_ack", index, pub_seq)
            sys.stdin.readline()
            ring.ack(index, pub_seq, epoch)
            out("acked", index, pub_seq)
            _park()
        ring.ack(index, pub_seq, epoch)
        report(index, pub_seq, "ok" if payload_crc(copies) == crc else "bad")
    out("done", counts["ok"], counts["bad"], counts["stale"])
    ring.close()
    lock.release()


def run_producer(args: argparse.Namespace) -> None:
    from common.ring import ProducerRing

    out = _Out(sys.stdout)
    ring = ProducerRing.create(args.shm_dir, args.name, 0, slot_count=2, slot_size=PAYLOAD_BYTES,
                               cuda_register="off")
    out("path", ring.path, ring.producer_epoch)
    if args.stop_at == "mid_publish":
        def stop_before_ready(writer: object) -> None:
            out("at mid_publish", writer.index, writer.pub_seq)  # type: ignore[attr-defined]
            _park()
        ring._mark_ready = stop_before_ready  # type: ignore[method-assign]
    with ring.acquire(timeout=10) as slot:
        data = slot.tensor("data", torch.uint8, (PAYLOAD_BYTES // 2,))
        if args.stop_at == "mid_write":
            data[: data.numel() // 2] = 7
            out("at mid_write", slot.index, slot.pub_seq)
            _park()
        data.fill_(7)
        slot.publish({"seq": 1})


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="role", required=True)
    c = sub.add_parser("consumer")
    c.add_argument("shm_dir")
    c.add_argument("name")
    c.add_argument("path")
    c.add_argument("--stop-at", choices=STOP_POINTS_CONSUMER)
    c.add_argument("--heartbeat", action="store_true")
    c.add_argument("--quiet", action="store_true")
    p = sub.add_parser("producer")
    p.add_argument("shm_dir")
    p.add_argument("name")
    p.add_argument("--stop-at", choices=STOP_POINTS_PRODUCER, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    (run_consumer if args.role == "consumer" else run_producer)(args)


if __name__ == "__main__":
    main()
