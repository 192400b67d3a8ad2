"""Where a restarted trainer's first eager step spends its time (P4's largest phase).

    python bench/gpu/first_step.py --workdir W --out-json F [--reserve] [--profile F.txt]

A fresh process builds the drafter as the trainer starts it (eager: the split path where flex
is the compiled one, unless --attn says otherwise; the trainer's AdamW; dynamo imported before the
steps, none beside them), then times three steps on one of the fixtures' packed batches, each phase behind a
device synchronize: blocks, then the trainer's whole step (`train_step`: forward and backward interleave chunk by chunk). Also recorded: the caching
allocator's device allocations (cudaMalloc calls) and reserved bytes after each step.
`--reserve` first grows the allocator by the step's footprint in one allocation (freed at once,
kept cached) and times that: whether the first step's extra time is the allocator's growth.
`--profile` writes torch.profiler's table of the first step (CPU side, incl. CUDA runtime calls).
Run by hand or from the GPU suite's shell; fixtures come from `run_all.sh` part env.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

T_START = time.perf_counter()

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.gpu import fixtures  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", required=True)
    p.add_argument("--out-json", required=True)
    p.add_argument("--reserve", type=float, default=0.0, help="GB to grow the allocator by before step 1")
    p.add_argument("--profile", default="", help="write the first step's profiler table here")
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--loss-chunk", type=int, default=8192)
    p.add_argument("--device", default="cuda:0", help="cpu: a smoke run of the script itself")
    p.add_argument("--attn", default="flex", help="drafter.attn (the eager steps' path follows from it)")
    p.add_argument("--segment-rows", type=int, default=0, help="the split path's query rows per segment (0: the model's)")
    a = p.parse_args(argv)

    from bench.gpu.drafter_rig import DrafterRig
    from drafter_trainer.step import train_step
    from drafter_trainer.warmup import eager_attention

    device = torch.device(a.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)

    def memory() -> dict:
        st = torch.cuda.memory_stats(device) if cuda else {}
        return {"reserved_gb": st.get("reserved_bytes.all.current", 0) / 1e9,
                "device_allocs": st.get("num_device_alloc", 0), "alloc_retries": st.get("num_alloc_retries", 0)}

    out: dict = {"import_s": time.perf_counter() - T_START}
    manifest = fixtures.read_manifest(a.workdir)
    t = time.perf_counter()
    rig = DrafterRig(manifest, device, a.layers, a.block, a.anchors, a.loss_chunk, seed=0, attn=a.attn,
                     compile_mode="off")
    rig.model.attn_impl = eager_attention(a.attn, device, rig.config.head_dim)
    if a.segment_rows:
        rig.model.segment_rows = a.segment_rows
    out.update(attn=rig.model.attn_impl, segment_rows=rig.model.segment_rows)
    fixtures.synchronize(device)
    out["build_s"] = time.perf_counter() - t
    (batch, _), = rig.dataset_work([0])
    fixtures.synchronize(device)
    out["before_steps"] = memory()
    if a.reserve:
        t = time.perf_counter()
        torch.empty(int(a.reserve * 1e9), dtype=torch.uint8, device=device)   # freed at once, kept cached
        fixtures.synchronize(device)
        out["reserve_s"] = time.perf_counter() - t
    steps = []
    for i in range(3):
        phases: dict[str, float] = {}

        def mark(name: str, t0: float) -> float:
            fixtures.synchronize(device)
            now = time.perf_counter()
            phases[name] = now - t0
            return now

        prof = None
        if i == 0 and a.profile:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                          + ([torch.profiler.ProfilerActivity.CUDA] if cuda else []))
            prof.__enter__()
        t0 = start = time.perf_counter()
        blocks = rig.blocks_for(batch, 0)
        t0 = mark("blocks", t0)
        # the trainer's step: forward and backward interleave chunk by chunk, so they are one phase
        result = train_step(rig.model, rig.optimizer, batch, blocks, 1e-4, rig.settings, rig.one_rank)
        phases["loss"] = float(result.out.loss)
        mark("train_step", t0)
        phases["step"] = time.perf_counter() - start
        if prof is not None:
            prof.__exit__(None, None, None)
            with open(a.profile, "w") as f:
                f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
        phases.update(memory())
        steps.append(phases)
        print(f"step {i + 1}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                            for k, v in phases.items()), flush=True)
    out["steps"] = steps
    out["process_s"] = time.perf_counter() - T_START
    with open(a.out_json, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
