"""P1: captured planes from the target GPU through a registered /dev/shm slot to the trainer GPU.

    producer (this process)                          consumer (child process, own CUDA context)
    source [k, T, H] on GPU                          ConsumerRing.attach(cuda_register="require")
      acquire slot -> copy stream: slot.copy_(src)     read "index pub_seq" on stdin
      event.synchronize() -> publish                   copy stream: dst.copy_(slot view) (H2D)
      "index pub_seq" -> child's stdin   ───────►      event.synchronize() -> still_valid -> ack
      reader thread: "ack ..." lines -> ring.wake() ◄── "ack index pub_seq h2d_s" on stdout

The same copies the target worker and the trainer feed make (D2H on a side stream into the
registered slot, H2D out of it on the consumer's stream, acks after the events), without the
model. The ceiling is a plain pinned-memory D2H of the same bytes measured in the same run;
the ratio is delivered payload GB/s over that ceiling. The doorbell is a pipe, not ZeroMQ: its
latency (tens of microseconds) is noise next to a 10+ ms slot copy.

On a machine without CUDA (the --quick smoke run) the same plumbing moves CPU tensors through an
unregistered ring, and the "ceiling" is a CPU memcpy: only the mechanics are checked there.
"""
from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import torch

from common.ring import ConsumerRing, ProducerRing, slot_bytes

GB = 1e9
CONSUMER_EPOCH = 1


def _copy_event(device: torch.device, stream: "torch.cuda.Stream | None", dst: torch.Tensor,
                src: torch.Tensor) -> float:
    """dst.copy_(src) on `stream`, waited for by an event; seconds the copy took on the device."""
    if stream is None:
        t0 = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - t0
    with torch.cuda.stream(stream):
        start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        dst.copy_(src, non_blocking=True)
        done.record(stream)
    done.synchronize()
    return start.elapsed_time(done) / 1e3


def ceilings(nbytes: int, device: torch.device, reps: int = 10) -> dict[str, float]:
    """Pinned D2H and H2D GB/s of `nbytes` (CUDA), or a CPU memcpy rate as a stand-in."""
    if device.type != "cuda":
        a, b = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        a.fill_(1)
        b.copy_(a)
        times = [_copy_event(device, None, b, a) for _ in range(reps)]
        rate = nbytes / statistics.median(times) / GB
        return {"d2h_pinned_gbps": rate, "h2d_pinned_gbps": rate, "ceiling": "cpu memcpy (no CUDA)"}
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream(device=device)
    out = {}
    for name, dst, src in (("d2h_pinned_gbps", pinned, gpu), ("h2d_pinned_gbps", gpu, pinned)):
        _copy_event(device, stream, dst, src)  # warm-up
        times = [_copy_event(device, stream, dst, src) for _ in range(reps)]
        out[name] = nbytes / statistics.median(times) / GB
    out["ceiling"] = "cudaMemcpyAsync, pinned host memory"
    return out


def consumer_main(path: str, device_name: str, nbytes: int, cuda_register: str) -> None:
    """The child: copy each announced slot to `device`, ack; report H2D times at "quit"."""
    device = torch.device(device_name)
    ring = ConsumerRing.attach(path, cuda_register=cuda_register)
    stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
    # this GPU's own pinned-memory H2D rate: the most any slot -> GPU copy here can reach
    own = ceilings(nbytes, device)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times: list[float] = []
    stale = 0
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "quit":
            break
        index, pub_seq = int(words[0]), int(words[1])
        view = ring.read(index, pub_seq)
        src = view.tensors["hidden"].reshape(-1).view(torch.uint8)
        times.append(_copy_event(device, stream, dst[: src.numel()], src))
        if not view.still_valid():
            stale += 1
        del view, src
        ring.ack(index, pub_seq, CONSUMER_EPOCH)
        print(f"ack {index} {pub_seq}", flush=True)
    print("stats " + json.dumps({"h2d_s": times, "stale": stale, "device": str(device),
                                 "registered": cuda_register != "off",
                                 "h2d_pinned_gbps": own["h2d_pinned_gbps"]}), flush=True)
    ring.close()


class _AckReader(threading.Thread):
    """Counts the child's acks (each wakes the producer's slot wait) and keeps its final stats."""

    def __init__(self, proc: subprocess.Popen, ring: ProducerRing) -> None:
        super().__init__(daemon=True)
        self.proc, self.ring = proc, ring
        self.acks = 0
        self.stats: dict[str, Any] | None = None
        self.closed = False   # the consumer's stdout ended: it exited
        self.cond = threading.Condition()

    def run(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("ack "):
                self.ring.wake()
                with self.cond:
                    self.acks += 1
                    self.cond.notify_all()
            elif line.startswith("stats "):
                with self.cond:
                    self.stats = json.loads(line[len("stats "):])
                    self.cond.notify_all()
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def check_alive(self) -> None:
        if self.closed:
            raise RuntimeError(f"the consumer process exited (code {self.proc.poll()}) after {self.acks} acks")

    def wait_for(self, pred, timeout: float) -> bool:
        """pred() within `timeout`; raises at once if the consumer process has exited first."""
        with self.cond:
            done = self.cond.wait_for(lambda: pred() or self.closed, timeout)
            if not pred():
                self.check_alive()
        return done


def run_transport(shape_k: int, tokens: int, hidden: int, device: torch.device, consumer_device: str,
                  shm_dir: str, ring_name: str, slots: int, iters: int, script: str,
                  timeout_s: float = 120.0) -> dict[str, Any]:
    """Move `iters` slots of [k, tokens, hidden] bf16 producer GPU -> slot -> consumer GPU; all figures."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = (shape_k, tokens, hidden)
    nbytes = shape_k * tokens * hidden * dtype.itemsize
    register = "require" if device.type == "cuda" else "off"
    figures: dict[str, Any] = {"payload_mb": nbytes / 1e6, "slots": slots, "iters": iters,
                               "producer_device": str(device), "consumer_device": consumer_device,
                               "cuda_register": register}
    figures.update(ceilings(nbytes, device))
    source = torch.randn(shape, dtype=dtype, device=device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the copies run on a side stream that does not wait for randn
    t_create = time.perf_counter()
    ring = ProducerRing.create(shm_dir, ring_name, 0, slots, slot_bytes([("hidden", dtype, shape)]),
                               cuda_register=register)
    figures["ring_create_and_register_s"] = time.perf_counter() - t_create
    ring.set_consumer_epoch(CONSUMER_EPOCH)
    proc = subprocess.Popen([sys.executable, script, "p1-consumer", "--ring-path", ring.path,
                             "--consumer-device", consumer_device, "--nbytes", str(nbytes),
                             "--cuda-register", register],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
    reader = _AckReader(proc, ring)
    reader.start()
    stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
    d2h: list[float] = []
    sent = 0

    def send_one() -> None:
        nonlocal sent
        deadline = time.monotonic() + timeout_s
        while True:   # a full ring frees only while the consumer lives: look at it every second
            try:
                cm = ring.acquire(timeout=1.0)
                slot = cm.__enter__()
                break
            except TimeoutError:
                reader.check_alive()
                if time.monotonic() > deadline:
                    raise
        with contextlib.ExitStack() as stack:
            stack.push(cm)
            view = slot.tensor("hidden", dtype, shape)
            d2h.append(_copy_event(device, stream, view, source))  # publish only after the event
            slot.publish({"seq": sent})
        proc.stdin.write(f"{slot.index} {slot.pub_seq}\n")
        proc.stdin.flush()
        sent += 1

    try:
        for _ in range(slots + 1):        # warm-up: every slot touched, both CUDA contexts busy once
            send_one()
        if not reader.wait_for(lambda: reader.acks >= sent, timeout_s):
            raise TimeoutError(f"consumer acked {reader.acks} of {sent} warm-up slots")
        warm, d2h = sent, []
        t0 = time.perf_counter()
        for _ in range(iters):
            send_one()
        if not reader.wait_for(lambda: reader.acks >= sent, timeout_s):
            raise TimeoutError(f"consumer acked {reader.acks} of {sent} slots")
        elapsed = time.perf_counter() - t0
        proc.stdin.write("quit\n")
        proc.stdin.flush()
        if not reader.wait_for(lambda: reader.stats is not None, timeout_s):
            raise TimeoutError("consumer sent no stats")
        stats = reader.stats
        h2d = stats["h2d_s"][warm:]
        figures.update({
            "ring_gbps": nbytes * iters / elapsed / GB,
            "d2h_registered_slot_gbps": nbytes / statistics.median(d2h) / GB,
            "h2d_registered_slot_gbps": nbytes / statistics.median(h2d) / GB if h2d else None,
            "slot_period_ms": 1e3 * elapsed / iters,
            "stale_reads": stats["stale"],
        })
        figures["consumer_h2d_pinned_gbps"] = stats["h2d_pinned_gbps"]
        figures["ring_over_pinned_d2h"] = figures["ring_gbps"] / figures["d2h_pinned_gbps"]
        # every byte crosses PCIe twice, D2H on the producer's GPU then H2D on the consumer's: the
        # slower of the two pinned rates bounds any two-process transport on this host
        bound = min(figures["d2h_pinned_gbps"], stats["h2d_pinned_gbps"])
        figures["transport_ceiling_gbps"] = bound
        figures["ring_over_transport_ceiling"] = figures["ring_gbps"] / bound
        return figures
    finally:
        with contextlib.suppress(OSError):
            proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        ring.close()
