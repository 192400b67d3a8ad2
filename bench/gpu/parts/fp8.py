"""Part `fp8` (P8): the target as its makers' block-wise FP8 checkpoint against the bf16 one, in one
process. First, on a GPU with FP8 matmuls, the GEMM micro-benchmark (fp8_gemm.py): each GEMM path
against bf16 on the 27B target's projections, one JSON line each. Then the proxy's random weights
quantized in memory as `dfpipe quantize-fp8` writes them, run as a load runs them
(`target_server.fp8.to_block_fp8`: FP8 matmuls where the device has them, dequantized weights
elsewhere, as in the CPU smoke run); on the same packed batches, in turns (bf16 bare loop, FP8 bare
loop, FP8 TargetWorker): FP8 over bf16 tok/s (the headline), P2 of the FP8 target (its worker over
its bare loop), and the relative difference of the two targets' captured planes. Result: ratios."""
from __future__ import annotations

import json
import time
import traceback
from typing import Any

from bench.gpu import fixtures
from bench.gpu.shared import Ctx, P2Rig


def part_fp8(ctx: Ctx) -> str:
    import copy

    from target_server import fp8
    from target_server.data import PreparedDataset
    from target_server.packer import Packer

    a = ctx.args
    manifest = fixtures.read_manifest(ctx.workdir)
    budget, max_len = manifest["token_budget"], manifest["max_len"]
    if ctx.cuda and fp8.fp8_matmul_unavailable(ctx.device) is None:
        # the GEMM micro-benchmark (fp8_gemm.py) at a batch's tokens and a quarter of them
        from bench.gpu.fp8_gemm import best, compare
        try:
            records = compare(tokens=(budget, max(1, budget // 4)), device=ctx.device)
        except Exception as e:   # logged and recorded; P8 runs on
            traceback.print_exc()
            ctx.store.figures("fp8", gemm_error=f"{type(e).__name__}: {e}")
        else:
            for r in records:
                print(json.dumps({"fp8_gemm": r}), flush=True)
            summary = best(records)
            print(json.dumps({"fp8_gemm_summary": summary}), flush=True)
            ctx.store.figures("fp8", gemm=records, gemm_summary=summary)
    baseline = fixtures.load_runner(manifest, ctx.device, a.allow_torch_linear)
    t0 = time.perf_counter()
    runner = copy.deepcopy(baseline)
    fp8_matmul = fp8.fp8_matmul_unavailable(ctx.device) is None
    quantized = fp8.to_block_fp8(runner.model, fp8_matmul)
    runner.precision = fp8.precision(True, fp8_matmul, runner.dtype)
    gemms = [m.gemm for m in runner.model.modules() if isinstance(m, fp8.BlockFp8Linear)]
    numbers: dict[str, Any] = {"precision": runner.precision, "baseline_precision": baseline.precision,
                               "quantized_linears": quantized, "quantize_s": time.perf_counter() - t0,
                               "linears_by_gemm": {g: gemms.count(g) for g in sorted(set(gemms))},
                               "cublas_block_gemm": fp8.cublas_block_gemm_unavailable(ctx.device) or "available",
                               "token_budget": budget, "batches_timed": a.p2_batches, "repeats": a.p2_repeats,
                               "weights_gb": {r.precision: sum(p.numel() * p.element_size()
                                                               for p in r.model.parameters()) / 1e9
                                              for r in (baseline, runner)},
                               "baseline_first_forward_s": baseline.warmup(budget),
                               "fp8_first_forward_s": runner.warmup(budget)}   # the FP8 kernels tune here
    dataset = PreparedDataset.open(manifest["data_dir"])
    p8 = P2Rig(ctx, runner, dataset, Packer(dataset.lengths, budget, a.seed), list(range(a.p2_warmup + a.p2_batches)),
               max_len, a.p2_warmup, "p8")
    # the planes of the first timed batch: how far the FP8 target's features are from the bf16 one's
    batch = p8.batches[a.p2_warmup]
    ref, got = baseline.capture(*batch).float(), runner.capture(*batch).float()
    numbers["feature_rel_diff"] = float((got - ref).norm() / ref.norm())
    numbers["feature_rel_diff_by_layer"] = {str(layer): float((got[i] - ref[i]).norm() / ref[i].norm())
                                            for i, layer in enumerate(runner.layer_ids)}
    del ref, got
    rates: dict[str, list[float]] = {"bf16": [], "fp8": [], "fp8_worker": []}
    for _ in range(a.p2_repeats):
        rates["bf16"].append(p8.bare_tok_s(baseline))
        rates["fp8"].append(p8.bare_tok_s())
        rates["fp8_worker"].append(p8.worker_run().tokens_per_s(a.p2_warmup - 1))
    n = len(rates["fp8"])
    ratios = [f / b for f, b in zip(rates["fp8"], rates["bf16"])]
    p2 = [w / f for w, f in zip(rates["fp8_worker"], rates["fp8"])]
    numbers.update({f"{k}_tok_s": sum(v) / n for k, v in rates.items()})
    numbers.update({f"{k}_runs_tok_s": v for k, v in rates.items()}, ratio_runs=ratios, fp8_p2_runs=p2)
    ctx.store.figures("fp8", **numbers)
    ctx.store.benchmark("P8", {"fp8_over_bf16_tok_s": sum(ratios) / n, "fp8_worker_over_bare_forward": sum(p2) / n},
                        numbers)
    print(json.dumps(numbers, indent=1), flush=True)
    return "measured"
