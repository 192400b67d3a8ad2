"""Flex attention of the drafter at the published density, alone: kernel configurations compared.

The P5d profile puts flex attention at about a fifth of the drafter step's device time for under
2% of its FLOPs. This times forward + backward of exactly the attention the step runs (the
27B shape's query/key heads and head size, each chunk's real block mask from the prepared
dataset's batches) under:

- `default`: compiled as the model compiles it (inductor's default kernel configuration);
- `autotune`: compiled with inductor's max_autotune (it benchmarks its list of flex
  configurations for the forward and the backward and keeps the fastest);
- `opts:<json>`: explicit `kernel_options` given with --options (one JSON object per variant).

Needs the fixtures of `gpu_bench.py env`. Prints one JSON line per variant and writes
$OUT/flex_sweep.json:

    python -m bench.gpu.flex_sweep --batches 2 --options '{"BLOCK_M": 64, "BLOCK_N": 64}'
"""
from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch

from bench.gpu import fixtures


def chunk_masks(manifest: dict[str, Any], device: torch.device, batches: int, blocks_per_chunk: int,
                anchors: int, block: int, seed: int) -> tuple[list[tuple[int, int, Any]], Any]:
    """(queries, keys, BlockMask) of every chunk of the first `batches` dataset batches, and the drafter config."""
    from bench.gpu.drafter_rig import DrafterRig
    from drafter_trainer.blocks import AttentionLayout

    rig = DrafterRig(manifest, device, 1, block, anchors, 0, seed, attn="flex", compile_mode="off")
    out = []
    for _batch, blocks in rig.dataset_work(list(range(batches)), lazy_hidden=True):
        for chunk, first, end in blocks.chunks(blocks_per_chunk):
            layout = AttentionLayout.from_blocks(chunk, rig.model.segment_rows)
            out.append((layout.num_queries, layout.num_keys, layout.flex_mask(None)))
    config = rig.config
    del rig
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out, config


def time_variant(flex: Any, masks: list[tuple[int, int, Any]], config: Any, device: torch.device,
                 kernel_options: dict[str, Any] | None, repeats: int) -> dict[str, float]:
    """Seconds of forward and of forward + backward over all chunks (after one untimed pass)."""
    heads, kv_heads, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tensors = []
    for nq, nk, mask in masks:
        q = torch.randn(1, heads, nq, hd, device=device, dtype=dtype, generator=gen).requires_grad_()
        k = torch.randn(1, kv_heads, nk, hd, device=device, dtype=dtype, generator=gen).requires_grad_()
        v = torch.randn(1, kv_heads, nk, hd, device=device, dtype=dtype, generator=gen).requires_grad_()
        tensors.append((q, k, v, mask, torch.randn(1, heads, nq, hd, device=device, dtype=dtype,
                                                   generator=gen)))

    def run(backward: bool) -> None:
        for q, k, v, mask, grad in tensors:
            out = flex(q, k, v, block_mask=mask, enable_gqa=True, kernel_options=kernel_options)
            if backward:
                out.backward(grad)

    t0 = time.perf_counter()
    run(True)                                  # compile (and autotune) every shape once
    fixtures.synchronize(device)
    first_s = time.perf_counter() - t0
    res = {"first_pass_s": first_s}
    for name, backward in (("fwd_s", False), ("fwd_bwd_s", True)):
        timer = fixtures.RegionTimer(device).start()
        for _ in range(repeats):
            with torch.set_grad_enabled(backward):
                run(backward)
        res[name] = timer.stop().seconds() / repeats
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default=os.environ.get("DFPIPE_BENCH_WORKDIR", "/tmp/dfpipe-gpu-bench"))
    p.add_argument("--batches", type=int, default=2)
    p.add_argument("--blocks-per-chunk", type=int, default=512)
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the script on the --quick fixtures")
    p.add_argument("--variants", default="default,autotune", help="default, autotune; --options add more")
    p.add_argument("--options", action="append", default=[], help="a JSON kernel_options object (repeatable)")
    a = p.parse_args(argv)
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.config.cache_size_limit = 64     # one recompile per variant's options
    device = torch.device(a.device)
    manifest = fixtures.read_manifest(a.workdir)
    masks, config = chunk_masks(manifest, device, a.batches, a.blocks_per_chunk, a.anchors, a.block, a.seed)
    print(json.dumps({"chunks": len(masks), "queries": sum(m[0] for m in masks),
                      "keys_mean": sum(m[1] for m in masks) / len(masks), "heads": config.num_attention_heads,
                      "kv_heads": config.num_key_value_heads, "head_dim": config.head_dim}), flush=True)
    variants: list[tuple[str, Any, dict[str, Any] | None]] = []
    for name in filter(None, a.variants.split(",")):
        if name == "default":
            variants.append((name, torch.compile(flex_attention, dynamic=True), None))
        elif name == "autotune":
            variants.append((name, torch.compile(flex_attention, dynamic=True, options={"max_autotune": True}), None))
        else:
            raise SystemExit(f"unknown variant {name!r}")
    shared = torch.compile(flex_attention, dynamic=True)
    explicit = [(f"opts:{o}", shared, json.loads(o)) for o in a.options]
    # autotune (slow: it compiles and times every configuration) goes last
    variants = [v for v in variants if v[0] != "autotune"] + explicit + [v for v in variants if v[0] == "autotune"]
    results = {}
    for name, fn, opts in variants:
        try:
            results[name] = time_variant(fn, masks, config, device, opts, a.repeats)
        except Exception as e:     # a configuration that does not fit (shared memory) leaves the others
            results[name] = {"error": f"{type(e).__name__}: {e}"[:400]}
        print(json.dumps({"variant": name, **results[name]}), flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "flex_sweep.json"), "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
