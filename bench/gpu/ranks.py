"""Drafter ranks over NCCL: the trainer's step (flat gradient all-reduce included) on M GPUs.

    torchrun --standalone --nproc-per-node M bench/gpu/ranks.py --workdir W --out-json F [sizes]

Every rank builds the benchmark drafter on cuda:<LOCAL_RANK> (or train.devices-style placement
through --devices), steps on its own packed batches of the prepared dataset (rank r takes seqs
r, r+M, ...), and rank 0 writes tokens/s of the whole group to --out-json. The steps are in
lockstep (the all-reduce), so rank 0's step time is the group's.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import numpy as np  # noqa: E402
import torch  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", required=True)
    p.add_argument("--out-json", required=True)
    p.add_argument("--devices", default="", help="comma list, rank r on the r-th (default cuda:<LOCAL_RANK>)")
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--loss-chunk", type=int, default=1024)
    p.add_argument("--attn", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    a = p.parse_args(argv)

    from bench.gpu import fixtures
    from bench.gpu.drafter_rig import DrafterRig
    from drafter_trainer.step import Ranks

    ranks = Ranks("auto", [d for d in a.devices.split(",") if d])
    manifest = fixtures.read_manifest(a.workdir)
    rig = DrafterRig(manifest, ranks.device, a.layers, a.block, a.anchors, a.loss_chunk, a.seed, a.attn)
    work = rig.dataset_work([ranks.rank + i * ranks.world for i in range(3)])
    times = rig.timed(work, a.warmup, a.steps, ranks if ranks.world > 1 else None)
    tokens = float(np.mean([work[i % len(work)][0].num_tokens for i in range(len(times))]))
    mine = {"rank": ranks.rank, "device": str(ranks.device), "step_s": float(np.median(times)), "tokens": tokens,
            "peak_mem_gb": torch.cuda.max_memory_allocated(ranks.device) / 1e9 if rig.cuda else None}
    every = ranks.gather_objects(mine)
    if ranks.rank == 0:
        step_s = max(r["step_s"] for r in every)
        out = {"world": ranks.world, "step_s": step_s, "tokens_per_step": sum(r["tokens"] for r in every),
               "tok_s": sum(r["tokens"] for r in every) / step_s, "attn": rig.model.attn_impl,
               "params_trainable_b": sum(q.numel() for q in rig.params) / 1e9, "ranks": every,
               "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE", "")}
        with open(a.out_json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
        print(json.dumps(out), flush=True)
    ranks.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
