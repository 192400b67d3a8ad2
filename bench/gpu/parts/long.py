"""Part `long`: whole long documents (issue 33) at one budget (--long-budget): the target on --long-doc
documents against --long-short-doc ones (tok/s, µs a token, forward FLOPs a token); P2 on the long
documents (P2L); P5d on them (P5dL: up to --anchors anchors per document, chunks of --long-chunk
blocks, MFU with the attention over the long contexts counted, peak memory; the other precision and
the baseline attention path beside it); then the split of a host these rates recommend, as P7 does
for chat-length data. The target goes first and is freed before the drafter is built.
Result: P2L, P5dL, figures `long`."""
from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any

import numpy as np
import torch

from bench.gpu import fixtures
from bench.gpu.shared import Ctx, P2Rig, baseline_differs, host_splits, step_figures, target_flops_per_token


def part_long(ctx: Ctx) -> str:
    from common.batch import document_positions
    from target_server.data import PreparedDataset
    from target_server.packer import Packer

    a = ctx.args
    dev = ctx.device
    manifest = fixtures.read_manifest(ctx.workdir)
    shape = fixtures.shape_of(manifest)
    budget, long_doc, short_doc = a.long_budget, a.long_doc, a.long_short_doc
    if not short_doc <= long_doc <= budget:
        raise ValueError(f"need --long-short-doc {short_doc} <= --long-doc {long_doc} <= --long-budget {budget}")
    per_batch = budget // long_doc
    batches = max(a.p2_warmup + a.long_p2_batches, a.long_p5d_batches)
    data_dir = os.path.join(ctx.workdir, "long-data")      # random tokens: written anew in a moment
    shutil.rmtree(data_dir, ignore_errors=True)
    fixtures.write_dataset(data_dir, np.full(batches * per_batch, long_doc, dtype=np.int64), shape.vocab,
                           shape.mask_token_id, a.seed)
    long_manifest = {**manifest, "data_dir": data_dir, "token_budget": budget, "max_len": long_doc}
    figures: dict[str, Any] = {"token_budget": budget, "long_doc": long_doc, "short_doc": short_doc}
    failed: list[str] = []

    # the target: the same budget filled with long or with short documents
    runner = fixtures.load_runner(long_manifest, dev, a.allow_torch_linear)
    figures["first_forward_s"] = runner.warmup(budget)
    g = torch.Generator().manual_seed(a.seed)
    top = min(runner.vocab_size, shape.mask_token_id)
    proxy_layers = max(shape.capture_ids) + 1
    target: dict[str, Any] = {}
    for name, doc in (("long", long_doc), ("short", short_doc)):
        q, r = divmod(budget, doc)
        lens = torch.tensor([doc] * q + ([r] if r else []), dtype=torch.int32)
        rows = [(torch.randint(0, top, (budget,), generator=g), document_positions(lens), lens)
                for _ in range(1 + a.long_batches)]
        # the first untimed: a new document length may still tune a kernel
        tok_s = fixtures.capture_tok_s(runner, rows, dev, warmup=1)
        gflop = target_flops_per_token(shape, proxy_layers, doc) / 1e9
        target[name] = {"doc_tokens": doc, "docs_per_batch": len(lens), "tok_s": tok_s, "us_per_token": 1e6 / tok_s,
                        "gflop_per_token": gflop, "tflop_s": tok_s * gflop / 1e3}
        print(f"target, {doc}-token documents: {tok_s:,.0f} tok/s, {gflop:.3g} GFLOP a token", flush=True)
    target["long_over_short_tok_s"] = target["long"]["tok_s"] / target["short"]["tok_s"]
    target["long_over_short_cost_per_token"] = 1.0 / target["long_over_short_tok_s"]
    target["long_over_short_gflop_per_token"] = target["long"]["gflop_per_token"] / target["short"]["gflop_per_token"]
    figures["target"] = target
    ctx.store.figures("long", **figures)

    # P2 at that length
    numbers: dict[str, Any] = {"token_budget": budget, "doc_tokens": long_doc, "batches_timed": a.long_p2_batches,
                               "repeats": a.long_p2_repeats, "audit_every": a.audit_every, "target": target}
    p2 = None
    with ctx.recorded("P2L", numbers, failed):
        dataset = PreparedDataset.open(data_dir)
        p2 = P2Rig(ctx, runner, dataset, Packer(dataset.lengths, budget, a.seed),
                   list(range(a.p2_warmup + a.long_p2_batches)), long_doc, a.p2_warmup, "p2long")
        numbers.update(p2.turns(a.long_p2_repeats), tokens_timed=p2.tokens)
        ratios = numbers["ratio_runs"]
        ctx.store.benchmark("P2L", {"worker_over_bare_forward": sum(ratios) / len(ratios)}, numbers)
        figures["target_worker_tok_s"] = numbers["worker_tok_s"]
        print(json.dumps({k: v for k, v in numbers.items() if "stages" not in k}, default=str), flush=True)
    del runner, p2      # the drafter gets the GPU to itself
    ctx.free_memory()

    # P5d on the long documents
    from bench.gpu.drafter_rig import DrafterRig
    from drafter_trainer.fp8 import fp8_supported, resolve_precision
    from drafter_trainer.model import resolve_attention

    peak = fixtures.matmul_peak_tflops(dev, a.matmul_n)
    numbers = {"token_budget": budget, "doc_tokens": long_doc, "anchors_per_doc_max": a.anchors,
               "blocks_per_chunk": a.long_chunk, "split_fc": bool(a.long_split_fc), "matmul_peak_tflops": peak}
    with ctx.recorded("P5dL", numbers, failed):
        rig = DrafterRig(long_manifest, dev, a.drafter_layers, a.block, a.anchors, a.loss_chunk, a.seed,
                         attn=a.drafter_attn or "auto", compile_mode="auto", blocks_per_chunk=a.long_chunk,
                         precision=a.p5d_precision)
        rig.model.split_fc = bool(a.long_split_fc)
        rig.model.attn_impl = resolve_attention(rig.model.attn_impl, dev.type, rig.config.head_dim)
        work = rig.dataset_work(list(range(a.long_p5d_batches)), lazy_hidden=True)
        numbers.update(attn=rig.model.attn_impl, compiled=rig.model.compiled, batches=len(work),
                       anchors_per_batch=float(np.mean([bl.num_blocks for _, bl in work])),
                       docs_per_batch=float(np.mean([int(b.doc_lens.numel()) for b, _ in work])))
        def timed_step(precision: str) -> dict[str, Any]:
            rig.model.precision = precision
            if ctx.cuda:
                torch.cuda.reset_peak_memory_stats(dev)
            t0 = time.perf_counter()
            times = rig.timed(work, max(a.p5_warmup, len(work)), a.long_p5d_steps)
            # peak memory read before anything else allocates
            peak_mem = {"peak_mem_gb": torch.cuda.max_memory_allocated(dev) / 1e9} if ctx.cuda else {}
            return {"precision": precision, **peak_mem, **step_figures(rig, work, times, a.long_chunk, peak, t0)}

        # the trainer's default precision, as P5d's headline; then the other one (P5f's) on the same batches
        numbers.update(timed_step(rig.model.precision))
        other = a.p5d_other_precision
        if other == "fp8" and not (ctx.cuda and fp8_supported(dev.index or 0)):
            other = ""
        if other and resolve_precision(other, dev) != numbers["precision"]:
            headline_precision = rig.model.precision
            try:
                theirs = timed_step(resolve_precision(other, dev))
            finally:
                rig.model.precision = headline_precision
            numbers["other_precision"] = {k: v for k, v in theirs.items() if k != "step_s_all"}
            print("other precision", json.dumps(numbers["other_precision"]), flush=True)
        def profile() -> dict[str, Any]:   # where a long document's step spends its time
            t0 = time.perf_counter()
            kernels = fixtures.profile_kernels(lambda: rig.step(*work[0]), dev, top=2 * a.p5_profile)
            kernels["wall_ms"] = (time.perf_counter() - t0) * 1e3
            print("profile", rig.model.attn_impl, json.dumps(kernels), flush=True)
            return kernels

        if ctx.cuda and a.p5_profile:
            numbers["profile"] = profile()
        if baseline_differs(rig, a.long_baseline_attn):     # the same batches on the baseline path (FA2)
            headline_impl = rig.model.attn_impl
            rig.model.attn_impl = resolve_attention(a.long_baseline_attn, dev.type, rig.config.head_dim)
            try:
                base = timed_step(rig.model.precision)
                base["attn"] = rig.model.attn_impl
                base["headline_speedup"] = numbers["tok_s"] / base["tok_s"]
                if a.p5_profile:
                    base["profile"] = profile()
            finally:
                rig.model.attn_impl = headline_impl
            numbers["baseline"] = {k: v for k, v in base.items() if k != "step_s_all"}
            print("baseline", json.dumps({k: v for k, v in numbers["baseline"].items() if k != "profile"}), flush=True)
        if gflop := ctx.part_figures("p5d").get("drafter_gflop_per_token"):   # this run's chat-length figure
            numbers["p5d_gflop_per_token"] = gflop
        ctx.store.benchmark("P5dL", {"mfu": numbers["mfu"], "peak_mem_gb": numbers.get("peak_mem_gb")}, numbers)
        print(json.dumps({k: v for k, v in numbers.items() if k not in ("step_s_all", "profile")}, default=str), flush=True)
        del rig, work

    # the host split these rates recommend (P7's projection, for long documents)
    drafter = numbers.get("tok_s")
    if drafter and figures.get("target_worker_tok_s"):
        per_gpu = figures["target_worker_tok_s"] * proxy_layers / a.real_layers_computed
        rows = host_splits(per_gpu, drafter, a.p7_gpus)
        figures["split"] = {"target_full_depth_tok_s_per_gpu": per_gpu, "drafter_tok_s_per_gpu": drafter,
                            "depth_scale": f"{proxy_layers}/{a.real_layers_computed} layers",
                            "best": max(rows, key=lambda r: r["tok_s"]), "splits": rows}
        print("split", json.dumps(figures["split"]["best"]), flush=True)
        theirs = numbers.get("other_precision", {}).get("tok_s")
        if theirs:
            figures["split_other_precision"] = {
                "precision": numbers["other_precision"]["precision"], "drafter_tok_s_per_gpu": theirs,
                "best": max(host_splits(per_gpu, theirs, a.p7_gpus), key=lambda r: r["tok_s"])}
            print("split, other precision", json.dumps(figures["split_other_precision"]), flush=True)
    ctx.store.figures("long", **figures)
    if failed:
        raise RuntimeError(f"{', '.join(failed)} failed (see the log)")
    return "measured"
