"""Part `p5`: P5, the drafter step (fwd + bwd + clip + AdamW) at the brief's size for each attention
path (--p5-attn) eager, then the fastest compiled (drafter.compile: an A/B in one process); MFU
against the measured bf16 matmul peak and the fastest variant's kernel profile. Result: ratio."""
from __future__ import annotations

import json
import time
import traceback
from typing import Any

import numpy as np
import torch

from bench.gpu import fixtures
from bench.gpu.shared import Ctx


def part_p5(ctx: Ctx) -> str:
    from bench.gpu.drafter_rig import DrafterRig
    from bench.trainer_bench import step_flops, synthetic_batch

    a = ctx.args
    dev = ctx.device
    manifest = fixtures.read_manifest(ctx.workdir)
    shape = fixtures.shape_of(manifest)
    peak = fixtures.matmul_peak_tflops(dev, a.matmul_n)
    ctx.store.figures("p5", matmul_peak_tflops=peak, matmul_n=a.matmul_n)
    print(f"matmul {a.matmul_n}^3 peak: {peak:.1f} TFLOP/s")
    rig = DrafterRig(manifest, dev, a.drafter_layers, a.block, a.p5_anchors, a.loss_chunk, a.seed, compile_mode="off")
    dcfg = rig.config
    impls = [x for x in a.p5_attn.split(",") if x]
    modes = [x for x in a.p5_compile.split(",") if x]
    if not modes or set(modes) - {"on", "off"}:
        raise ValueError(f"--p5-compile {a.p5_compile!r}: a list of on / off")

    numbers: dict[str, Any] = {"tokens": a.p5_tokens, "docs": a.p5_docs, "anchors_per_doc_max": a.p5_anchors,
                               "block": a.block, "drafter_layers": a.drafter_layers, "hidden": dcfg.hidden_size,
                               "heads": f"{dcfg.num_attention_heads}/{dcfg.num_key_value_heads}x{dcfg.head_dim}",
                               "intermediate": dcfg.intermediate_size, "vocab": dcfg.vocab_size,
                               "matmul_peak_tflops": peak,
                               "params_trainable_b": sum(p.numel() for p in rig.params) / 1e9, "variants": {}}
    with ctx.recorded("P5", numbers):
        batch = synthetic_batch(a.p5_tokens, a.p5_docs, len(shape.capture_ids), shape.hidden, dcfg.vocab_size,
                                a.seed, dev, rig.hidden_dtype)
        blocks = rig.blocks_for(batch, 0)
        numbers["anchors"] = blocks.num_blocks
        base_mem = torch.cuda.memory_allocated(dev) if ctx.cuda else 0

        def measure(impl: str, compiled: bool) -> str | None:
            """One variant, keyed "<attn>" or "<attn>+compile"; its key, None when it failed."""
            key = impl + ("+compile" if compiled else "")
            rig.model.attn_impl = impl
            rig.model.compile_for(dev, "on" if compiled else "off")
            t0 = time.perf_counter()   # first_steps_s: the warm-up steps, a compile included
            try:
                times = rig.timed([(batch, blocks)], a.p5_warmup, a.p5_steps)
            except Exception as e:  # one path failing (a compile error, memory) leaves the others measured
                traceback.print_exc()
                numbers["variants"][key] = {"attn": impl, "compile": compiled,
                                            "error": f"{type(e).__name__}: {e}"[:500]}
                rig.optimizer.zero_grad()
                return None
            flops = step_flops(dcfg, batch, blocks, impl)
            step_s = float(np.median(times))
            v = {"attn": impl, "compile": compiled, "step_s": step_s, "step_s_all": times,
                 "first_steps_s": time.perf_counter() - t0 - sum(times),
                 "model_tflop": flops["model_total"] / 1e12, "executed_tflop": flops["executed_total"] / 1e12,
                 "flops_by_component_tflop": {k: x / 1e12 for k, x in flops.items()},
                 "model_tflops_per_s": flops["model_total"] / step_s / 1e12,
                 "mfu": flops["model_total"] / step_s / 1e12 / peak,
                 "executed_mfu": flops["executed_total"] / step_s / 1e12 / peak}
            if ctx.cuda:
                v["peak_mem_gb"] = torch.cuda.max_memory_allocated(dev) / 1e9
                v["step_mem_above_state_gb"] = (torch.cuda.max_memory_allocated(dev) - base_mem) / 1e9
            numbers["variants"][key] = v
            print(key, json.dumps({k: x for k, x in v.items() if k != "flops_by_component_tflop"}), flush=True)
            return key

        def fastest(keys: list[str | None]) -> str | None:
            done = [k for k in keys if k is not None]
            return min(done, key=lambda k: numbers["variants"][k]["step_s"]) if done else None

        # Compiling speeds up the same non-attention work on every path, so the eager ranking picks
        # the path to compile; a compile per path would not fit the part's time limit.
        eager_best = fastest([measure(impl, False) for impl in impls]) if "off" in modes else None
        paths = [numbers["variants"][eager_best]["attn"]] if eager_best else impls
        compiled_keys = [measure(impl, True) for impl in paths] if "on" in modes else []
        best = fastest([eager_best, *compiled_keys])
        if best is None:
            raise RuntimeError(f"every attention path failed: {numbers['variants']}")
        chosen = numbers["variants"][best]
        numbers.update(chosen, variant=best)
        pair = [numbers["variants"].get(k, {}) for k in (chosen["attn"], chosen["attn"] + "+compile")]
        if all("step_s" in v for v in pair):
            numbers["compile_ab"] = {"attn": chosen["attn"], "eager_step_s": pair[0]["step_s"],
                                     "compiled_step_s": pair[1]["step_s"],
                                     "saved_ms": 1e3 * (pair[0]["step_s"] - pair[1]["step_s"]),
                                     "compile_first_steps_s": pair[1]["first_steps_s"]}
        rig.model.attn_impl = chosen["attn"]
        rig.model.compile_for(dev, "on" if chosen["compile"] else "off")
        if ctx.cuda and a.p5_profile:
            numbers["profile"] = fixtures.profile_kernels(lambda: rig.step(batch, blocks), dev, top=a.p5_profile)
        print(json.dumps({k: x for k, x in numbers.items() if k != "variants"}, indent=1, default=str))
        ctx.store.benchmark("P5", {"mfu": numbers["mfu"]}, numbers)
        ctx.store.figures("p5", best_attn=chosen["attn"], best_compile="on" if chosen["compile"] else "off")
        del batch, blocks
    return "measured"
