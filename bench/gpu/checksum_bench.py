"""What the payload checksum costs on a P2-size slot (common/checksum.py), on both sides.

    python bench/gpu/checksum_bench.py                 # 16,384 tokens x 5 layers x 5120 hidden, bf16, CUDA
    python bench/gpu/checksum_bench.py --device cpu --tokens 256 --layers 2 --hidden 64   # smoke run

producer  as the target worker does it: the hidden planes' checksum on the device (the staging
          buffer), read back with a non-blocking copy and one event wait, plus the token tensors'
          on the CPU.
consumer  as the trainer feed does it: every tensor's checksum over its copy on the device, read
          back the same way.

Prints one JSON line: {checksum_ms_producer, checksum_ms_consumer, payload_bytes, ...}, each
time the median of --repeats runs after --warmup runs; `gpu_ms_hidden` is the hidden planes'
checksum alone on the device (CUDA events), and `cpu_equal` says whether the device's sums
equal the CPU's over the same bytes (the payload copied to the host once, not timed). The goal:
each side at most 1% of P2's time per batch (tokens / P2 tokens-per-second).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from common.batch import DOC_TENSORS, PAYLOAD_TENSORS, TOKEN_TENSORS  # noqa: E402
from common.checksum import payload_checksums, tensor_checksum  # noqa: E402


def make_payload(tokens: int, layers: int, hidden: int, docs: int, device: torch.device,
                 dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A slot's tensors: random hidden planes on `device`, token tensors on the CPU (as in a slot)."""
    g = torch.Generator().manual_seed(0)
    planes = torch.randn((layers, tokens, hidden), generator=g, dtype=torch.float32) if device.type == "cpu" else \
        torch.randn((layers, tokens, hidden), device=device, dtype=torch.float32)
    payload = {"hidden": planes.to(dtype)}
    del planes
    lens = torch.full((docs,), tokens // docs, dtype=torch.int64)
    lens[: tokens % docs] += 1
    for name, dt in TOKEN_TENSORS.items():
        n = docs if name in DOC_TENSORS else tokens
        values = lens if name == "doc_lens" else torch.randint(0, 2 if name == "loss_mask" else 1 << 20, (n,), generator=g)
        payload[name] = values.to(dt)
    return payload


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _read_back(sums: torch.Tensor, device: torch.device) -> list:
    """As the worker and the feed do: a non-blocking copy to the host, then one event wait."""
    if device.type != "cuda":
        return sums.tolist()
    host = sums.to("cpu", non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    return host.tolist()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--hidden", type=int, default=5120)
    p.add_argument("--docs", type=int, default=64, help="documents in the batch (doc_lens, sample_ids)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args(argv)
    device = torch.device(a.device)
    payload = make_payload(a.tokens, a.layers, a.hidden, a.docs, device, getattr(torch, a.dtype))
    tokens_cpu = {k: payload[k] for k in TOKEN_TENSORS}
    on_device = {k: payload[k].to(device) for k in PAYLOAD_TENSORS}   # the consumer's copies
    _sync(device)

    def producer() -> None:
        hidden = _read_back(tensor_checksum(payload["hidden"]), device)
        tokens = payload_checksums(tokens_cpu).tolist()
        assert len(hidden) == 2 and len(tokens) == len(TOKEN_TENSORS)

    def consumer() -> None:
        assert len(_read_back(payload_checksums(on_device), device)) == len(PAYLOAD_TENSORS)

    result = {
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "shape": {"tokens": a.tokens, "layers": a.layers, "hidden": a.hidden, "docs": a.docs, "dtype": a.dtype},
        "payload_bytes": sum(t.numel() * t.element_size() for t in payload.values()),
        "checksum_ms_producer": round(_median_ms(producer, device, a.warmup, a.repeats), 4),
        "checksum_ms_consumer": round(_median_ms(consumer, device, a.warmup, a.repeats), 4),
        "repeats": a.repeats,
    }
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(a.repeats):
            start.record()
            tensor_checksum(payload["hidden"])
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        result["gpu_ms_hidden"] = round(statistics.median(times), 4)
    result["hidden_gb_per_s"] = round(payload["hidden"].numel() * payload["hidden"].element_size()
                                      / (result["checksum_ms_producer"] * 1e-3) / 1e9, 2)
    device_sums = _read_back(payload_checksums(on_device), device)
    cpu_sums = payload_checksums({k: t.cpu() for k, t in on_device.items()}).tolist()
    result["cpu_equal"] = device_sums == cpu_sums
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["cpu_equal"] else 1)
