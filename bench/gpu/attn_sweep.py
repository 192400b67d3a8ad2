"""The drafter's attention at the published density, alone: attention paths and masks compared.

The P5d profile puts flex attention at about a fifth of the drafter step's device time for under
2% of its FLOPs. This times forward and forward + backward of exactly the attention the step
runs (the 27B shape's query/key heads and head size, one layer, every chunk of the prepared
dataset's first batches) under these variants:

- `flex`: the model's one masked call (drafter_trainer.block_mask: folded queries, a block mask of
  two key ranges a row), flex's Triton kernels, compiled;
- `fa4`: the same call on FlashAttention 4's kernels (flex's FLASH backend; SM90, flash-attn-4);
- `split`: the split path (per-segment matmuls, eager, as the model runs it);
- `flash`: FlashAttention 2's varlen kernels over segment-copied keys (drafter_trainer.block_flash),
  segments of `--segment-rows` queries; `flash:A` and `flash:B` time one of its parts alone.

Each variant's output on the first chunk is compared with the split path's. Needs the fixtures
of `gpu_bench.py env`. Prints one JSON line per variant and writes $OUT/attn_sweep.json:

    python -m bench.gpu.attn_sweep --batches 1 --variants split,flash,fa4
"""
from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any, Callable

import torch

from bench.gpu import fixtures


def chunk_layouts(manifest: dict[str, Any], device: torch.device, batches: int, blocks_per_chunk: int,
                  anchors: int, block: int, seed: int, segment_rows: int) -> tuple[list[Any], Any]:
    """The AttentionLayout of every chunk of the first `batches` dataset batches, and the drafter config."""
    from bench.gpu.drafter_rig import DrafterRig
    from drafter_trainer.blocks import AttentionLayout

    rig = DrafterRig(manifest, device, 1, block, anchors, 0, seed, attn="flex", compile_mode="off")
    out = [AttentionLayout.from_blocks(chunk, segment_rows)
           for _batch, blocks in rig.dataset_work(list(range(batches)), lazy_hidden=True)
           for chunk, _first, _end in blocks.chunks(blocks_per_chunk)]
    config = rig.config
    del rig
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out, config


def make_variants(names: list[str], layouts: list[Any], block: int) -> list[tuple[str, Callable]]:
    """(name, attend) pairs: attend(i, q, k, v) runs chunk i's attention on q [1, h, Q, d], k/v [1, h_kv, K, d]."""
    from drafter_trainer.block_flash import (FlashPlan, block_flash_attention, fold_queries, group_major, plan_of_blocks,
                                             unfold_queries)
    from drafter_trainer.block_mask import block_mask_of_blocks, masked_attention
    from drafter_trainer.model import split_attention

    def folded(attend: Callable) -> Callable:
        """attend(i, folded q [L*g, h_kv, d], k [K, h_kv, d], v) as a [1, h, L, d] attention: heads
        reordered group-major and folded (the model gets group-major heads from its reordered q_proj
        weight: these reorders are the sweep's own copies)."""
        def run(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            h, length, d = q.shape[1:]
            h_kv = k.shape[1]
            g = h // h_kv
            rows = fold_queries(group_major(q[0].transpose(0, 1).flatten(1), h_kv, g, dim=1).view(length, h, d), g)
            out = attend(i, g, rows, k[0].transpose(0, 1).contiguous(), v[0].transpose(0, 1).contiguous())
            return group_major(unfold_queries(out, g), g, h_kv, dim=1).view(length, h, d).transpose(0, 1)[None]
        return run

    plans: dict[int, Any] = {}

    def flash_of(parts: slice) -> Callable:
        def flash(i: int, g: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if i not in plans:
                plans[i] = plan_of_blocks(layouts[i].blocks, max(1, layouts[i].segment_rows // block), g)
            plan = plans[i] if parts == slice(None) else FlashPlan(plans[i].parts[parts])
            return block_flash_attention(q, k, v, plan)
        return folded(flash)

    masks: dict[int, Any] = {}

    def masked(fa4: bool) -> Callable:
        def attend(i: int, g: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if i not in masks:
                masks[i] = block_mask_of_blocks(layouts[i].blocks, g, None, static=True)
            return masked_attention(q, k, v, masks[i], fa4)
        return folded(attend)

    split_masks: dict[int, list[torch.Tensor]] = {}

    def split_of(i: int) -> list[torch.Tensor]:
        if i not in split_masks:
            split_masks[i] = layouts[i].split_masks(None)
        return split_masks[i]

    out: list[tuple[str, Callable]] = []
    for name in names:
        if name == "flash":
            out.append((name, flash_of(slice(None))))
        elif name in ("flash:A", "flash:B"):     # one part alone: its cost (the output is not the attention)
            out.append((name, flash_of(slice(0, 1) if name == "flash:A" else slice(-1, None))))
        elif name in ("flex", "fa4"):
            out.append((name, masked(name == "fa4")))
        elif name == "split":
            out.append((name, lambda i, q, k, v: split_attention(q, k, v, layouts[i].segments, split_of(i), block)))
        else:
            raise SystemExit(f"unknown variant {name!r}")
    return out


def time_variant(attend: Callable, layouts: list[Any], config: Any, device: torch.device,
                 repeats: int, reference: list[torch.Tensor] | None, backward: bool,
                 profile: int = 0) -> dict[str, Any]:
    """Seconds of forward and of forward + backward over all chunks (after one untimed pass),
    peak memory of a forward + backward pass, and the first chunk's output (and gradients)
    against `reference`'s."""
    heads, kv_heads, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tensors = []
    for lay in layouts:
        nq, nk = lay.num_queries, lay.num_keys
        q = torch.randn(1, heads, nq, hd, device=device, dtype=dtype, generator=gen).requires_grad_(backward)
        k = torch.randn(1, kv_heads, nk, hd, device=device, dtype=dtype, generator=gen).requires_grad_(backward)
        v = torch.randn(1, kv_heads, nk, hd, device=device, dtype=dtype, generator=gen).requires_grad_(backward)
        tensors.append((q, k, v, torch.randn(1, heads, nq, hd, device=device, dtype=dtype, generator=gen)))

    def run(with_grad: bool) -> None:
        for i, (q, k, v, grad) in enumerate(tensors):
            out = attend(i, q, k, v)
            if with_grad:
                out.backward(grad)

    t0 = time.perf_counter()
    run(backward)                              # compile every shape once
    fixtures.synchronize(device)
    res: dict[str, Any] = {"first_pass_s": time.perf_counter() - t0}
    q, k, v, grad = tensors[0]
    with torch.set_grad_enabled(backward):
        out0 = attend(0, q, k, v)
    first = [out0.detach().float()]
    if backward:
        first += [g.float() for g in torch.autograd.grad(out0, (q, k, v), grad)]
    if reference is not None:
        res["max_rel_err_vs_split"] = {name: float((x - r).abs().max() / r.abs().max())
                                       for name, x, r in zip(("out", "dq", "dk", "dv"), first, reference)}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    for name, with_grad in (("fwd_s", False), ("fwd_bwd_s", True))[:1 + backward]:
        timer = fixtures.RegionTimer(device).start()
        for _ in range(repeats):
            with torch.set_grad_enabled(with_grad):
                run(with_grad)
        res[name] = timer.stop().seconds() / repeats
    if device.type == "cuda":
        res["peak_above_inputs_gb"] = (torch.cuda.max_memory_allocated(device) - base) / 1e9
        if profile:
            res["profile"] = fixtures.profile_kernels(lambda: run(backward), device, top=profile)
    res["_first"] = first
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default=os.environ.get("DFPIPE_BENCH_WORKDIR", "/tmp/dfpipe-gpu-bench"))
    p.add_argument("--batches", type=int, default=1)
    p.add_argument("--blocks-per-chunk", type=int, default=512)
    p.add_argument("--segment-rows", type=int, default=1024, help="the split and flash paths")
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--data-dir", default="", help="another prepared dataset (the long part's long-data) in place of the fixtures'")
    p.add_argument("--token-budget", type=int, default=0, help="with --data-dir: its batches' token budget")
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the script on the --quick fixtures")
    p.add_argument("--variants", default="split,flex,flash")
    p.add_argument("--profile", type=int, default=0, help="CUDA: the top N kernels of one pass per variant")
    p.add_argument("--forward-only", action="store_true", help="the CPU smoke run (flex has no CPU backward)")
    a = p.parse_args(argv)

    torch._dynamo.config.cache_size_limit = 64
    device = torch.device(a.device)
    manifest = fixtures.read_manifest(a.workdir)
    if a.data_dir:
        manifest = {**manifest, "data_dir": a.data_dir, "token_budget": a.token_budget or manifest["token_budget"],
                    "max_len": a.token_budget or manifest["max_len"]}
    layouts, config = chunk_layouts(manifest, device, a.batches, a.blocks_per_chunk, a.anchors, a.block, a.seed,
                                    a.segment_rows)
    print(json.dumps({"chunks": len(layouts), "queries": sum(x.num_queries for x in layouts),
                      "keys_mean": sum(x.num_keys for x in layouts) / len(layouts),
                      "keys_max": max(x.num_keys for x in layouts),
                      "context_keys_mean": sum(x.num_context for x in layouts) / len(layouts),
                      "segments": sum(len(x.segments) for x in layouts), "heads": config.num_attention_heads,
                      "kv_heads": config.num_key_value_heads, "head_dim": config.head_dim}), flush=True)
    # the counted FLOPs of the visible keys (bench/trainer_bench.py's attn_visible, one layer):
    # 4 q_dim per visible key forward, twice that backward
    from bench.trainer_bench import visible_keys
    fwd_tflop = 4.0 * config.num_attention_heads * config.head_dim * sum(visible_keys(x.blocks, None) for x in layouts) / 1e12
    # the split path first: the others are checked against its output
    names = sorted((n for n in a.variants.split(",") if n), key=lambda n: n != "split")
    results: dict[str, Any] = {}
    reference = None
    for name, attend in make_variants(names, layouts, a.block):
        try:
            r = time_variant(attend, layouts, config, device, a.repeats, reference, not a.forward_only, a.profile)
            first = r.pop("_first")
            if name == "split":
                reference = first
            r["fwd_tflop_s"] = fwd_tflop / r["fwd_s"]
            if "fwd_bwd_s" in r:
                r["fwd_bwd_tflop_s"] = 3 * fwd_tflop / r["fwd_bwd_s"]
        except Exception as e:     # a variant that does not fit or compile leaves the others measured
            r = {"error": f"{type(e).__name__}: {e}"[:400]}
        results[name] = r
        print(json.dumps({"variant": name, **r}), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "attn_sweep.json"), "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
