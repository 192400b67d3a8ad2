"""Which block-FP8 GEMM the FP8 target runs, chosen by measurement: every GEMM path of
target_server.fp8 (GEMMS) against bf16 on the projections of the 27B target (tokens x K by N x K),
each timed with its activation quantization (what a BlockFp8Linear's forward costs) and without
(the GEMM alone), and its result compared with the same e4m3 values and scales multiplied in fp32.

    python bench/gpu/fp8_gemm.py [--tokens 16384,4096] [--iters 20]    # one JSON line per shape and path

part fp8 (P8, parts/fp8.py) runs it first and keeps the lines as its `fp8_gemm` figures.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from target_server import fp8  # noqa: E402

# (name, N, K) of Qwen3.5-27B's quantized projections (hidden 5120, intermediate 17408, 24 query
# heads of 256 with their gates, 4 kv heads, Gated DeltaNet 16 key and 48 value heads of 128)
SHAPES_27B = (("mlp.gate_up", 2 * 17408, 5120), ("mlp.gate|up", 17408, 5120), ("mlp.down", 5120, 17408),
              ("attn.q", 2 * 24 * 256, 5120), ("attn.k|v", 4 * 256, 5120), ("attn.o", 5120, 24 * 256),
              ("gdn.in_qkv", 2 * 16 * 128 + 48 * 128, 5120), ("gdn.in_z", 48 * 128, 5120),
              ("gdn.out", 5120, 48 * 128))


def _ms(fn: Callable[[], Any], iters: int) -> float:
    """Median milliseconds of one call, by CUDA events, after two warm-up calls (compile, autotune)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def compare(shapes: tuple[tuple[str, int, int], ...] = SHAPES_27B, tokens: tuple[int, ...] = (16384,),
            iters: int = 20, device: torch.device | None = None) -> list[dict[str, Any]]:
    """One record per (shape, tokens, path): ms, TFLOP/s, speed over bf16, relative error."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    why = fp8.fp8_matmul_unavailable(device)
    if why:
        raise RuntimeError(f"no FP8 matmuls here: {why}")
    g = torch.Generator(device=device).manual_seed(0)
    records = []
    for name, n, k in shapes:
        w = torch.randn(n, k, device=device, generator=g) / k ** 0.5
        wq, ws = fp8.quantize_weight(w)
        w_bf16 = fp8.dequantize_weight(wq, ws, fp8.BLOCK, torch.bfloat16)
        for m in tokens:
            x = torch.randn(m, k, device=device, generator=g).to(torch.bfloat16)
            q, qs = fp8.quantize_activations(x, fp8.BLOCK[1], rows=-(-m // fp8.CUBLAS_ROWS) * fp8.CUBLAS_ROWS)
            flops = 2.0 * m * n * k
            base = {"shape": name, "M": m, "N": n, "K": k}
            bf16_ms = _ms(lambda: F.linear(x, w_bf16), iters)
            records.append({**base, "path": "bf16", "ms": bf16_ms, "tflops": flops / bf16_ms / 1e9,
                            "over_bf16": 1.0})
            # the error on the first 1024 tokens (the fp32 reference of all of them is large)
            q1, qs1 = fp8.quantize_activations(x[:1024], fp8.BLOCK[1])
            ref = fp8.dequantized_matmul(q1, qs1, wq, ws, fp8.BLOCK)
            quant_ms = _ms(lambda: fp8.quantize_activations(x, fp8.BLOCK[1]), iters)
            for gemm in fp8.GEMMS:
                record: dict[str, Any] = {**base, "path": gemm, "quantize_ms": quant_ms}
                if gemm == fp8.GEMM_CUBLAS and (reason := fp8.cublas_block_gemm_unavailable(device)):
                    records.append({**record, "unavailable": reason})
                    continue
                if gemm == fp8.GEMM_CUBLAS and fp8.choose_gemm(device, n, k, fp8.BLOCK, torch.bfloat16) != gemm:
                    records.append({**record, "unavailable": "shape outside cuBLAS's constraints"})
                    continue
                try:
                    gemm_ms = _ms(lambda: fp8.block_fp8_matmul(q, qs, wq, ws, fp8.BLOCK, torch.bfloat16, gemm), iters)
                    linear_ms = _ms(lambda: fp8.block_fp8_linear(x, wq, ws, fp8.BLOCK, gemm), iters)
                    y = fp8.block_fp8_matmul(q1, qs1, wq, ws, fp8.BLOCK, torch.bfloat16, gemm).float()
                except Exception as e:   # one path failing must not hide the others' figures
                    records.append({**record, "error": f"{type(e).__name__}: {e}"[:300]})
                    continue
                records.append({**record, "ms": linear_ms, "gemm_ms": gemm_ms, "tflops": flops / linear_ms / 1e9,
                                "gemm_tflops": flops / gemm_ms / 1e9, "over_bf16": bf16_ms / linear_ms,
                                "gemm_over_bf16": bf16_ms / gemm_ms,
                                "rel_err": float((y - ref).norm() / ref.norm())})
    return records


def best(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per FP8 path: its time over all shapes and token counts against bf16's (a whole forward's mix)."""
    total: dict[str, float] = {}
    for r in records:
        if "ms" in r:
            total[r["path"]] = total.get(r["path"], 0.0) + r["ms"]
    complete = {p for p in total
                if all(any(r["path"] == p and "ms" in r for r in records if (r["shape"], r["M"]) == key)
                       for key in {(r["shape"], r["M"]) for r in records})}
    return {f"{p}_over_bf16": total["bf16"] / total[p] for p in sorted(complete) if p != "bf16" and "bf16" in total}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="16384,4096", help="token counts M, comma-separated")
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("fp8_gemm: skipped: no CUDA", file=sys.stderr)
        return 0
    records = compare(tokens=tuple(int(t) for t in a.tokens.split(",")), iters=a.iters)
    for r in records:
        print(json.dumps(r), flush=True)
    print(json.dumps({"summary": best(records)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
