"""What a verified checkpoint costs: the trainer's save (hashed while written, manifest, renames)
and its verified load, against a plain torch.save + fsync and torch.load of the same state.

    python bench/checkpoint_bench.py                                  # CPU smoke: a tiny drafter
    python bench/checkpoint_bench.py --device cuda --dir /checkpoints/bench --hidden 5120 --heads 24 \\
        --kv-heads 4 --head-dim 256 --intermediate 17408 --vocab 248320 --layers 5 --step-s 2.0
                                                                      # the 27B shape (~1.8B trainable)

The state is the trainer's: the drafter's trainable weights on --device and its AdamW moments
(after one step), saved by `TrainerState.save` as the trainer saves it. Before each load the
files' pages are dropped from the page cache (posix_fadvise), as after a reboot; `--warm` keeps
them, as on a restart right after the save. Prints one JSON line, each time the median of
--repeats runs:

    plain_save_s      torch.save into a file + fsync (what a save cost before manifests)
    save_s            TrainerState.save: the same, hashed on the way out, plus samples, meta, manifest
    verify_s          verify_checkpoint alone (every byte read once, state.pt's pieces on N threads)
    plain_load_s      torch.load
    load_s            TrainerState.load: verify, then torch.load (mapped)
    added_per_step    (save_s - plain_save_s + verify_s) / (--checkpoint-every x --step-s): what the
                      manifest adds to the average step, counting one verification per checkpoint
                      (a restart verifies only the one it resumes); the goal is <= 0.02
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.trainer_bench import add_shape_args, drafter_config  # noqa: E402
from common.config import TrainConfig  # noqa: E402
from common.seqset import SeqSet  # noqa: E402
from drafter_trainer.checkpoint import HASH_THREADS, STATE, TrainerState, verify_checkpoint  # noqa: E402
from drafter_trainer.model import DFlashDraftModel  # noqa: E402
from drafter_trainer.optim import build_adamw  # noqa: E402


def trainer_state(args: argparse.Namespace, device: torch.device) -> TrainerState:
    """The trainer's checkpoint state of a drafter of the given shape: trainable weights and AdamW moments."""
    cfg = drafter_config(args, block_size=16)
    with device:   # the frozen target head is not part of a checkpoint: never set here
        model = DFlashDraftModel(cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_adamw(params, TrainConfig(), device)
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()                       # AdamW's moments exist from the first step on
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    batches = 10_000                       # a long run's accounting: 8 samples a batch
    return TrainerState(step=batches, epoch=0, have=SeqSet.from_ranges([(0, batches)]),
                        trained_samples={0: np.arange(8 * batches)},
                        sample_seqs={0: np.repeat(np.arange(batches), 8)}, epoch_sizes=[batches],
                        model={k: v for k, v in model.state_dict().items() if k in names},
                        optimizer=optimizer.state_dict(), rng=torch.get_rng_state())


def drop_cache(files: list[str]) -> None:
    """The files' pages out of the page cache (written and fsynced, so they can go)."""
    for name in files:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dir", default="", help="where checkpoints are written (default: a temp folder); the "
                                             "trainer's train.out_dir disk is what counts")
    add_shape_args(p, hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, intermediate=1024, vocab=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warm", action="store_true", help="load from the page cache (a restart right after the save)")
    p.add_argument("--checkpoint-every", type=int, default=500, help="train.checkpoint_every (configs/gpu.yaml: 500)")
    p.add_argument("--step-s", type=float, default=0.0, help="the average step at this shape (P5d), for added_per_step")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    state = trainer_state(args, device)
    root = tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir or None)
    plain_path = os.path.join(root, "plain.pt")
    plain = {"model": state.model, "optimizer": state.optimizer, "step": state.step}

    def plain_save() -> None:
        with open(plain_path, "wb") as f:
            torch.save(plain, f)
            f.flush()
            os.fsync(f.fileno())

    saved: list[str] = []
    figures: dict[str, list[float]] = {k: [] for k in ("plain_save_s", "save_s", "verify_s", "plain_load_s", "load_s")}
    for i in range(args.repeats):
        figures["plain_save_s"].append(timed(plain_save, device))
        state.step += 1    # a new step folder each time, as the trainer's periodic saves
        figures["save_s"].append(timed(lambda: saved.append(state.save(root, keep=1, reason="bench",
                                                                       epoch_samples=0)[0]), device))
        path = saved[-1]
        for key, fn in (("verify_s", lambda: verify_checkpoint(path)),
                        ("plain_load_s", lambda: torch.load(plain_path, map_location="cpu", weights_only=False)),
                        ("load_s", lambda: TrainerState.load(path))):
            if not args.warm:
                drop_cache([plain_path, *(os.path.join(path, n) for n in os.listdir(path))])
            figures[key].append(timed(fn, device))
    med = {k: round(statistics.median(v), 4) for k, v in figures.items()}
    out = {"device": str(device), "state_bytes": os.path.getsize(os.path.join(saved[-1], STATE)),
           "hash_threads": HASH_THREADS, "warm": args.warm, **med,
           "save_added_s": round(med["save_s"] - med["plain_save_s"], 4),
           "load_added_s": round(med["load_s"] - med["plain_load_s"], 4)}
    if args.step_s:
        per_checkpoint = args.checkpoint_every * args.step_s
        out["added_per_step"] = round((out["save_added_s"] + med["verify_s"]) / per_checkpoint, 5)
    print(json.dumps(out))
    shutil.rmtree(root)


if __name__ == "__main__":
    main()
