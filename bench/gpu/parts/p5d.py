"""Part `p5d`: P5d, the drafter step at the published anchor density: the dataset's budget-size
batches of lognormal documents, up to --anchors anchors per document, in chunks of --p5d-chunks
blocks (0 = auto), the attention path and compile mode the trainer uses on CUDA; MFU from counted
FLOPs, peak memory, tok/s. The first size listed (the trainer's default) is the headline, with a
kernel profile and the drafter-alone rate P6d and P7 price with; the others are a sweep. With
--p5d-baseline-attn the same step on another attention path; P5f: the step in --p5d-other-precision
(fp8) against the headline's, gradients compared. Result: P5d, P5f, the drafter-alone rate."""
from __future__ import annotations

import argparse
import json
import time
import traceback
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from bench.gpu import fixtures
from bench.gpu.shared import Ctx, baseline_differs, step_figures


def part_p5d(ctx: Ctx) -> str:
    from bench.gpu.drafter_rig import DrafterRig
    from drafter_trainer.fp8 import fp8_supported
    from drafter_trainer.loss import auto_blocks_per_chunk
    from drafter_trainer.model import resolve_attention

    a = ctx.args
    dev = ctx.device
    manifest = fixtures.read_manifest(ctx.workdir)
    peak = fixtures.matmul_peak_tflops(dev, a.matmul_n)
    if a.layer_compile_options:
        from drafter_trainer import model as drafter_model
        drafter_model.LAYER_COMPILE_OPTIONS.update(json.loads(a.layer_compile_options))
    rig = DrafterRig(manifest, dev, a.drafter_layers, a.block, a.anchors, a.loss_chunk, a.seed,
                     attn=a.drafter_attn or "auto", compile_mode="auto", precision=a.p5d_precision)
    rig.model.attn_impl = resolve_attention(rig.model.attn_impl, dev.type, rig.config.head_dim)
    work = rig.dataset_work(list(range(a.p5d_batches)), lazy_hidden=True)
    anchors = [blocks.num_blocks for _, blocks in work]
    tokens = [batch.num_tokens for batch, _ in work]
    numbers: dict[str, Any] = {"anchors_per_doc_max": a.anchors, "batches": len(work),
                               "layer_compile_options": a.layer_compile_options,
                               "anchors_per_batch": float(np.mean(anchors)), "tokens_per_batch": float(np.mean(tokens)),
                               "docs_per_batch": float(np.mean([int(b.doc_lens.numel()) for b, _ in work])),
                               "matmul_peak_tflops": peak, "attn": rig.model.attn_impl, "compiled": rig.model.compiled,
                               "chunks": {}}
    print(json.dumps(numbers), flush=True)
    best = None
    for chunk in [int(x) for x in a.p5d_chunks.split(",") if x != ""]:
        per = chunk or auto_blocks_per_chunk(a.block)
        rig.settings = replace(rig.settings, blocks_per_chunk=per)
        t0 = time.perf_counter()
        try:
            # every batch once before timing: each new chunk shape may still compile once
            times = rig.timed(work, max(a.p5_warmup, len(work)), a.p5d_steps)
        except Exception as e:   # a chunk size that does not fit leaves the others measured
            traceback.print_exc()
            numbers["chunks"][str(per)] = {"error": f"{type(e).__name__}: {e}"[:300]}
            rig.optimizer.zero_grad()
            if ctx.cuda:
                torch.cuda.empty_cache()
            continue
        v = {"blocks_per_chunk": per, **step_figures(rig, work, times, per, peak, t0)}
        if ctx.cuda:
            v["peak_mem_gb"] = torch.cuda.max_memory_allocated(dev) / 1e9
        numbers["chunks"][str(per)] = v
        print("chunk", per, json.dumps({k: x for k, x in v.items() if k != "step_s_all"}), flush=True)
        if best is None or v["tok_s"] > numbers["chunks"][str(best)]["tok_s"]:
            best = per
        ctx.store.figures("p5d", **numbers)
    if best is None:
        raise RuntimeError(f"every chunk size failed: {numbers['chunks']}")
    # the headline is the first size listed (by default the trainer's own, auto); the others are a sweep
    first = [str(int(x) or auto_blocks_per_chunk(a.block)) for x in a.p5d_chunks.split(",") if x != ""][0]
    if "mfu" in numbers["chunks"].get(first, {}):
        best = int(first)
    numbers["fastest_chunk"] = max((k for k, v in numbers["chunks"].items() if "tok_s" in v),
                                   key=lambda k: numbers["chunks"][k]["tok_s"])
    chosen = numbers["chunks"][str(best)]
    numbers.update({k: x for k, x in chosen.items() if k != "step_s_all"})
    if ctx.cuda and a.p5_profile:
        rig.settings = replace(rig.settings, blocks_per_chunk=best)
        numbers["profile"] = fixtures.profile_kernels(lambda: rig.step(*work[0]), dev, top=a.p5_profile)
    if baseline_differs(rig, a.p5d_baseline_attn):   # the headline's batches and chunk size on that path instead
        impl = resolve_attention(a.p5d_baseline_attn, dev.type, rig.config.head_dim)
        headline_impl, rig.model.attn_impl = rig.model.attn_impl, impl
        try:
            numbers["baseline"] = timed_against(rig, work, best, a, peak, chosen, "baseline", attn=impl)
        finally:
            rig.model.attn_impl = headline_impl
    numbers["precision"] = rig.model.precision
    ctx.store.benchmark("P5d", {"mfu": chosen["mfu"], "peak_mem_gb": chosen.get("peak_mem_gb")}, numbers)
    # the rates later parts price with (P6d, P7), kept even if P5f below runs out of time
    ctx.store.figures("p5d", drafter_alone_tok_s=chosen["tok_s"], drafter_alone_anchors_s=chosen["anchors_s"],
                      drafter_alone_peak_mem_gb=chosen.get("peak_mem_gb"),
                      drafter_gflop_per_token=chosen["gflop_per_token"], matmul_peak_tflops=peak, best_chunk=best,
                      precision=rig.model.precision)
    other = a.p5d_other_precision
    if other == "fp8" and not (ctx.cuda and fp8_supported(dev.index or 0)):
        ctx.store.benchmark("P5f", {}, {"not_measured": "no FP8 tensor cores here (compute capability < 8.9)"})
        other = ""
    if other and other != rig.model.precision:
        p5f = p5d_other_precision(rig, work, best, a, peak, chosen)
        fp8, bf16 = (p5f, chosen) if p5f["precision"].startswith("fp8") else (chosen, p5f)
        ctx.store.figures("p5d", other_precision=p5f["precision"], drafter_other_tok_s=p5f["tok_s"])
        ctx.store.benchmark("P5f", {"fp8_over_bf16_tok_s": fp8["tok_s"] / bf16["tok_s"],
                                    "peak_mem_gb": fp8.get("peak_mem_gb"),
                                    "grad_cosine_min": p5f["grad_cosine"]["min"]},
                            {**p5f, "fp8_mfu": fp8["mfu"], "bf16_mfu": bf16["mfu"], "fp8_tok_s": fp8["tok_s"],
                             "bf16_tok_s": bf16["tok_s"]})
    print(json.dumps({k: x for k, x in numbers.items() if k not in ("chunks", "profile")}, indent=1, default=str))
    return "measured"


def timed_against(rig: Any, work: list[tuple[Any, Any]], chunk: int, a: argparse.Namespace, peak: float,
                  headline: dict[str, Any], label: str, **settings: Any) -> dict[str, Any]:
    """The headline's batches stepped as the rig is set now, at `chunk` blocks a chunk: step times,
    tok/s, MFU from the same counted FLOPs, peak memory, and the headline's speed-up over it
    (`settings` are recorded)."""
    rig.settings = replace(rig.settings, blocks_per_chunk=chunk)
    figures = step_figures(rig, work, rig.timed(work, len(work), a.p5d_steps), chunk, peak, time.perf_counter())
    out = {**settings, **{k: figures[k] for k in ("step_s", "step_s_all", "tok_s", "mfu")}}
    if rig.cuda:
        out["peak_mem_gb"] = torch.cuda.max_memory_allocated(rig.device) / 1e9
    out["headline_speedup"] = headline["tok_s"] / out["tok_s"]
    print(label, json.dumps({k: x for k, x in out.items() if k != "step_s_all"}), flush=True)
    return out


def p5d_other_precision(rig: Any, work: list[tuple[Any, Any]], chunk: int, a: argparse.Namespace, peak: float,
                        headline: dict[str, Any]) -> dict[str, Any]:
    """The headline's batches and chunk size stepped in --p5d-other-precision (fp8) instead of the
    headline's (bf16), in the same process: its step, and the gradient of one batch in both
    precisions from the same weights and planes, compared weight by weight (cosine)."""
    from drafter_trainer.fp8 import resolve_precision

    headline_precision = rig.model.precision
    base = resolve_precision(a.p5d_other_precision, rig.device)
    try:
        rig.model.precision = base
        out = timed_against(rig, work, chunk, a, peak, headline, "other precision",
                            headline_precision=headline_precision, precision=base)
        if rig.cuda and a.p5_profile:     # where the other precision's step spends its time
            out["profile"] = fixtures.profile_kernels(lambda: rig.step(*work[0]), rig.device, top=a.p5_profile)
        batch, blocks = work[0]
        planed = rig.with_planes(batch)
        want = rig.gradients(planed, blocks)
        rig.model.precision = headline_precision
        got = rig.gradients(planed, blocks)
    finally:
        rig.model.precision = headline_precision
    cos = {n: float(torch.nn.functional.cosine_similarity(want[n].flatten(), got[n].flatten(), dim=0)) for n in want}
    rel = {n: float((got[n] - want[n]).norm() / want[n].norm().clamp_min(1e-30)) for n in want}
    worst = sorted(cos, key=cos.get)[:5]
    out["grad_cosine"] = {"min": min(cos.values()), "mean": float(np.mean(list(cos.values()))),
                          "worst": {n: cos[n] for n in worst}, "rel_err_of_worst": {n: rel[n] for n in worst},
                          "tokens": batch.num_tokens, "anchors": blocks.num_blocks}
    print("gradient cosine", json.dumps(out["grad_cosine"]), flush=True)
    return out
