"""Part `placements` (issue 8): both real services on chosen GPUs (--placements "target/trainer" ids),
end to end, against the ideal from the scale part's rates in the same run: min(target, drafter) for
disjoint GPUs, 1/(1/target + 1/drafter) for shared ones. Result: end-to-end tok/s per placement."""
from __future__ import annotations

import json
import time
import traceback
from typing import Any

import torch

from bench.gpu import fixtures
from bench.gpu.shared import Ctx


def part_placements(ctx: Ctx) -> str:
    from bench.gpu.services import ServicePlan, run_placement

    a = ctx.args
    manifest = fixtures.read_manifest(ctx.workdir)
    gpus = torch.cuda.device_count() if ctx.cuda else 1
    specs = [x for x in (a.placements or ("0/1,01/01" if gpus >= 2 else "0/0")).split(",") if x]
    scale, attn = ctx.part_figures("scale"), ctx.drafter_attn()
    results: dict[str, Any] = {}
    deadline = time.monotonic() + a.part_budget
    for spec in specs:
        t_ids, d_ids = spec.split("/")
        name = spec.replace("/", "-")
        as_dev = (lambda ids: [f"cuda:{c}" for c in ids]) if ctx.cuda else (lambda ids: ["cpu"] * len(ids))
        plan = ServicePlan(workdir=ctx.workdir, manifest=manifest, args=a, ring_name=ctx.ring_name(f"pl{name}"),
                           device=str(ctx.device) if ctx.cuda else "cpu", shm_dir=ctx.shm_dir, cold_triton="shared",
                           attn=attn, target_devices=as_dev(t_ids), trainer_devices=as_dev(d_ids))
        figures: dict[str, Any] = {}
        try:
            run_placement(plan, name, max(30.0, deadline - time.monotonic()), figures)
        except Exception as e:
            traceback.print_exc()
            figures["error"] = f"{type(e).__name__}: {e}"[:1000]
        t_alone = scale.get("target", {}).get(str(len(t_ids)), {}).get("tok_s")
        d_alone = scale.get("drafter", {}).get(str(len(d_ids)), {}).get("tok_s")
        shared = set(t_ids) & set(d_ids)
        if t_alone and d_alone and (not shared or set(t_ids) == set(d_ids)):
            ideal = min(t_alone, d_alone) if not shared else 1.0 / (1.0 / t_alone + 1.0 / d_alone)
            figures.update(target_alone_tok_s=t_alone, drafter_alone_tok_s=d_alone, ideal_tok_s=ideal,
                           ideal_rule="min" if not shared else "harmonic")
            if figures.get("together_tok_s"):
                figures["together_over_ideal"] = figures["together_tok_s"] / ideal
        results[name] = figures
        ctx.store.figures("placements", **results)
        print(name, json.dumps({k: v for k, v in figures.items() if k != "target_stages"}), flush=True)
    if not any("together_tok_s" in f for f in results.values()):
        raise RuntimeError("no placement ran to the end")
    return "measured"
