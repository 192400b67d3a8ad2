"""Part `p1`: P1, the transport (transport.py): payload GB/s of `[k, budget, hidden]` bf16 slots from
the producer GPU through a registered slot to a consumer process's GPU, against a pinned D2H copy of
the same bytes, per slot count (--p1-slots) and consumer GPU. Result: the ratio of the production
layout (the consumer on another GPU where there is one) at its best slot count; same-GPU runs show
the host side alone."""
from __future__ import annotations

import json
import traceback
from typing import Any

import torch

from bench.gpu import fixtures
from bench.gpu.shared import RUNNER, Ctx


def part_p1(ctx: Ctx) -> str:
    from bench.gpu.transport import run_transport

    a = ctx.args
    manifest = fixtures.read_manifest(ctx.workdir)
    shape = fixtures.shape_of(manifest)
    # the 'trainer GPU': a second GPU when there is one (the production layout), else the same one
    other = f"cuda:{1 if torch.cuda.device_count() > 1 else 0}" if ctx.cuda else "cpu"
    consumers = [other] + ([str(ctx.device)] if ctx.cuda and other != str(ctx.device) else [])
    variants: dict[str, Any] = {}
    for slots in (int(x) for x in str(a.p1_slots).split(",")):
        for consumer in consumers:
            name = f"slots{slots}-{consumer}"
            try:
                variants[name] = run_transport(len(shape.capture_ids), manifest["token_budget"], shape.hidden,
                                               ctx.device, consumer, ctx.shm_dir, ctx.ring_name("p1"), slots,
                                               a.p1_iters, RUNNER)
            except Exception as e:
                traceback.print_exc()
                variants[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
            print(name, json.dumps(variants[name]), flush=True)
    ctx.store.figures("p1", variants=variants)
    measured = {k: v for k, v in variants.items() if "ring_gbps" in v and v["consumer_device"] == other}
    if not measured:
        raise RuntimeError(f"no P1 transport run finished: {variants}")
    best = max(measured, key=lambda k: measured[k]["ring_gbps"])
    figures = {**measured[best], "variant": best, "variants": variants}
    ctx.store.benchmark("P1", {"ring_over_pinned_d2h": figures["ring_over_pinned_d2h"],
                               "ring_over_transport_ceiling": figures["ring_over_transport_ceiling"]}, figures)
    return "measured"
