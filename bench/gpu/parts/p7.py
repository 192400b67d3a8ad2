"""Part `p7`: P7, one 8-GPU host at the real depth projected from this run's one-GPU rates: the
target's per GPU (p23's proxy worker rate scaled by computed layers: the proxy's per-layer time
equals the full stack's within 1% on the H200) and the drafter's (P5d); the best split of the GPUs
between them against the FLOP limit of the host (both services at the measured matmul peak). A
projection: multi-GPU efficiency is taken as 1 (measured 0.9-1.0 on 4 GPUs before).
Result: projected / FLOP limit."""
from __future__ import annotations

import json

from bench.gpu import fixtures
from bench.gpu.shared import Ctx, SkipPart, host_splits, target_flops_per_token


def part_p7(ctx: Ctx) -> str:
    a = ctx.args
    p23, p5d = ctx.part_figures("p23"), ctx.part_figures("p5d")
    target_proxy, drafter = p23.get("target_alone_tok_s"), p5d.get("drafter_alone_tok_s")
    peak, drafter_gflop = p5d.get("matmul_peak_tflops"), p5d.get("drafter_gflop_per_token")
    if not (target_proxy and drafter and peak and drafter_gflop):
        raise SkipPart("needs p23's target rate and p5d's drafter rate, FLOPs and matmul peak from this run")
    shape = fixtures.shape_of(fixtures.read_manifest(ctx.workdir))
    proxy_layers = max(shape.capture_ids) + 1
    target = target_proxy * proxy_layers / a.real_layers_computed
    target_gflop = target_flops_per_token(shape, a.real_layers_computed, a.median) / 1e9
    gpus = a.p7_gpus
    rows = host_splits(target, drafter, gpus)
    best = max(rows, key=lambda r: r["tok_s"])
    # the limit is bf16's: both services' counted FLOPs at the measured bf16 matmul peak
    limit = gpus * peak * 1e12 / ((target_gflop + drafter_gflop) * 1e9)
    numbers = {"gpus": gpus, "target_full_depth_tok_s_per_gpu": target, "target_proxy_tok_s": target_proxy,
               "depth_scale": f"{proxy_layers}/{a.real_layers_computed} layers", "drafter_tok_s_per_gpu": drafter,
               "drafter_precision": p5d.get("precision"),
               "target_gflop_per_token": target_gflop, "drafter_gflop_per_token": drafter_gflop,
               "matmul_peak_tflops": peak, "flop_limit_tok_s": limit, "best": best, "splits": rows,
               "projected_tok_s": best["tok_s"]}
    other = p5d.get("drafter_other_tok_s")
    if other:   # the same projection with P5f's other precision (the default's alternative)
        alt = max(host_splits(target, other, gpus), key=lambda r: r["tok_s"])
        numbers["other_precision"] = {"precision": p5d.get("other_precision"), "drafter_tok_s_per_gpu": other,
                                      "best": alt, "over_flop_limit": alt["tok_s"] / limit}
    ctx.store.benchmark("P7", {"projected_over_flop_limit": best["tok_s"] / limit}, numbers)
    print(json.dumps(numbers, indent=1), flush=True)
    return "projected"
