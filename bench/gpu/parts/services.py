"""Part `services`: P4 and P6 with the real `python -m dfpipe target-server` / `trainer` processes
(services.py): cold start, both together on one GPU, warm restart; P6d against the rates of p23
and p5d in the same run. Result: ratios."""
from __future__ import annotations

import json
import traceback
from typing import Any

import torch

from bench.gpu import fixtures
from bench.gpu.shared import Ctx

# A card that holds the co-located target (16.4 GB at the proxy) and a trainer with the default
# chunk (62.8 GB on the H100, where it ran out of memory) needs this much: smaller cards step the
# services part's trainer in chunks of a third (peak memory grows with the chunk; with half, the
# warm restart's eager steps beside its background compile still reached 62.7 GB once in two runs).
SERVICES_FULL_CHUNK_GB = 100


def part_services(ctx: Ctx) -> str:
    from bench.gpu.services import ServicePlan, run_services
    from drafter_trainer.loss import auto_blocks_per_chunk

    a = ctx.args
    manifest = fixtures.read_manifest(ctx.workdir)
    small_card = ctx.cuda and torch.cuda.get_device_properties(ctx.device).total_memory < SERVICES_FULL_CHUNK_GB * 1e9
    chunk = auto_blocks_per_chunk(a.block) // 3 if small_card else 0   # drafter.blocks_per_chunk (0: auto)
    plan = ServicePlan(workdir=ctx.workdir, manifest=manifest, args=a, device=str(ctx.device) if ctx.cuda else "cpu",
                       ring_name=ctx.ring_name("svc"), shm_dir=ctx.shm_dir, cold_triton=a.cold_triton,
                       attn=ctx.drafter_attn(), blocks_per_chunk=chunk)
    figures: dict[str, Any] = {"blocks_per_chunk": plan.blocks_per_chunk}
    error = None
    try:
        run_services(plan, a.part_budget, figures)
    except Exception as e:
        traceback.print_exc()
        error = f"{type(e).__name__}: {e}"[:2000]
    finally:  # also on a timeout's SIGTERM: what was measured stays
        ctx.store.figures("services", **figures)
    warm = figures.get("warm") or {}   # the warm start-up: first step, compiled from, compiled step time
    if "over_cold_first_step" in warm and figures.get("target_load_s"):
        numbers = {k: figures.get(k) for k in ("cold_first_step_s", "target_load_s", "target_warmup_s",
                                               "cold_triton_cache", "device", "cold_compiled_median_step_s")}
        numbers.update({f"warm_{k}": warm.get(k) for k in ("first_step_s", "compiled_after_s",
                                                           "compiled_median_step_s", "eager_steps")})
        # The real target's cold start: the proxy's, with the load grown to the full depth's bytes
        # (read from the fixture's safetensors headers). The warm-up's autotune runs once per
        # kernel shape, which every layer shares, so it stays as measured.
        layer_bytes, rest, layers = fixtures.layer_and_rest_bytes(manifest["target_dir"])
        full_bytes = rest + layer_bytes / layers * a.real_layers_computed
        cold_full = figures["cold_first_step_s"] + figures["target_load_s"] * (full_bytes / (rest + layer_bytes) - 1)
        numbers.update(full_depth_cold_first_step_s=cold_full, proxy_weight_gb=(rest + layer_bytes) / 1e9,
                       full_depth_weight_gb=full_bytes / 1e9, warm_over_proxy_cold=warm["over_cold_first_step"])
        ctx.store.benchmark("P4", {"warm_over_cold_first_step": warm["first_step_s"] / cold_full}, numbers)
    else:
        ctx.store.benchmark_error("P4", error or "not measured", figures)
    target_alone, p5d = ctx.part_figures("p23").get("target_alone_tok_s"), ctx.part_figures("p5d")
    drafter_alone, drafter_anchors_s = p5d.get("drafter_alone_tok_s"), p5d.get("drafter_alone_anchors_s")
    together = figures.get("together_tok_s")
    numbers = {"together_tok_s": together, "target_alone_tok_s": target_alone, "drafter_alone_tok_s": drafter_alone,
               "drafter_alone_anchors_s": drafter_anchors_s, "together_steps": figures.get("together_steps"),
               "together_mean_step_s": figures.get("together_mean_step_s"),
               "together_tokens": figures.get("together_tokens"), "together_anchors": figures.get("together_anchors")}
    if together and target_alone and drafter_alone and drafter_anchors_s and figures.get("together_anchors"):
        # The ideal priced on the window's own batches: each costs its tokens at the target's rate
        # plus its anchors at the drafter's (a batch's drafter step grows with its anchors, 3,000 to
        # 10,000 a batch here, so a token rate from other batches would price a short window's mix
        # wrongly). together / ideal = ideal seconds of those batches / the seconds they took.
        ideal_s = figures["together_tokens"] / target_alone + figures["together_anchors"] / drafter_anchors_s
        ideal = figures["together_tokens"] / ideal_s
        numbers.update(ideal_tok_s=ideal, ideal_tok_s_token_priced=1.0 / (1.0 / target_alone + 1.0 / drafter_alone))
        ctx.store.benchmark("P6d", {"together_over_ideal": together / ideal}, numbers)
    else:
        missing = [k for k in ("together_tok_s", "target_alone_tok_s", "drafter_alone_tok_s", "drafter_alone_anchors_s",
                               "together_anchors") if not numbers[k]]
        ctx.store.benchmark_error("P6d", error or f"missing {', '.join(missing)}", numbers)
    print(json.dumps({k: v for k, v in figures.items() if not k.endswith("_stages")}, indent=1, default=str))
    if error:
        raise RuntimeError(error)
    return "measured"
