"""What the parts of the GPU benchmark share: the context a part runs in (`Ctx`), `SkipPart`, and the
helpers of more than one part (the target shape from the flags, P2's two rates over the same batches,
a host's splits between target and trainer GPUs, the target's forward FLOPs a token)."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import time
import traceback
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from bench.gpu import fixtures
from bench.gpu.results import ResultStore

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUNNER = os.path.join(REPO, "bench", "gpu", "gpu_bench.py")   # P1's consumer runs as its part p1-consumer

RING_PREFIX = "dfpgb-"   # every ring this suite creates; run_all.sh removes "dfpgb-<run id>-*" after each part


class SkipPart(Exception):
    """The part cannot run here (no CUDA, missing fixtures of a skipped part); the message says why."""


@dataclasses.dataclass
class Ctx:
    args: argparse.Namespace
    store: ResultStore
    device: torch.device
    workdir: str
    shm_dir: str

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def ring_name(self, part: str) -> str:
        # run_all.sh's run id first: its clean-up removes this run's rings only, never those of
        # another run on the same host
        return f"{RING_PREFIX}{os.environ.get('DFPIPE_BENCH_RUN_ID', 'solo')}-{part}-{os.getpid()}"

    def cuda_register(self) -> str:
        return "require" if self.cuda else "off"

    def part_figures(self, part: str) -> dict[str, Any]:
        """The figures an earlier part of this run recorded ({} if none)."""
        return self.store.read()["parts"].get(part, {}).get("figures", {})

    def drafter_attn(self) -> str:
        """--drafter-attn, else P5's fastest path in this run, else auto."""
        return self.args.drafter_attn or self.part_figures("p5").get("best_attn") or "auto"

    def free_memory(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    @contextlib.contextmanager
    def recorded(self, key: str, numbers: dict[str, Any], failed: list[str] | None = None) -> Iterator[None]:
        """Benchmark `key` measured inside: an error is printed, recorded with `numbers` as far as
        they got, added to `failed`, and the part goes on."""
        try:
            yield
        except Exception as e:
            traceback.print_exc()
            if failed is not None:
                failed.append(key)
            self.store.benchmark_error(key, f"{type(e).__name__}: {e}", numbers)


def target_shape(a: argparse.Namespace) -> fixtures.TargetShape:
    ids = tuple(int(x) for x in a.capture_ids.split(","))
    if any(not 0 <= i < a.layers for i in ids) or list(ids) != sorted(set(ids)):
        raise SystemExit(f"--capture-ids {a.capture_ids}: strictly increasing ids inside the {a.layers} layers")
    if not 0 <= a.mask_token_id < a.vocab:
        raise SystemExit(f"--mask-token-id {a.mask_token_id} outside the vocabulary of {a.vocab}")
    flags = {f.name: getattr(a, f.name) for f in dataclasses.fields(fixtures.TargetShape)}   # the flags of its fields
    return fixtures.TargetShape(**{**flags, "capture_ids": ids})


def host_splits(target: float, drafter: float, gpus: int) -> list[dict[str, Any]]:
    """Each split of `gpus` GPUs into n target and gpus - n trainer GPUs, at `target` and `drafter`
    tok/s per GPU: what it delivers (the lesser side) and which side bounds it."""
    rows = []
    for n in range(1, gpus):
        tok_s = min(n * target, (gpus - n) * drafter)
        # GPU time the bound side leaves unused on the other side, as a share of the host
        idle = (n - tok_s / target) + (gpus - n - tok_s / drafter)
        rows.append({"target_gpus": n, "trainer_gpus": gpus - n, "tok_s": tok_s, "idle_share": idle / gpus,
                     "bound_by": "target" if n * target < (gpus - n) * drafter else "trainer"})
    return rows


def target_flops_per_token(shape: fixtures.TargetShape, layers: int, median_len: float) -> float:
    """Forward FLOPs per token of `layers` decoder layers of the target shape: 2 per weight of every
    linear (attention, Gated-DeltaNet projections, MLP) plus full attention's scores over a mean
    context of half the median document (every 4th layer), the GDN state work left out (small
    beside the projections at this width). The lm_head and embedding never run (stopped early)."""
    h, i = shape.hidden, shape.intermediate
    attn = h * (2 * shape.heads * shape.head_dim) + 2 * h * shape.kv_heads * shape.head_dim \
        + shape.heads * shape.head_dim * h            # q (with its gate), k, v, o
    qk, v = shape.linear_k_heads * shape.linear_k_dim, shape.linear_v_heads * shape.linear_v_dim
    gdn = h * (2 * qk + 2 * v + 2 * shape.linear_v_heads) + v * h   # q, k, v, z, a, b in; out
    mlp = 3 * h * i
    full = layers // 4
    weights = full * attn + (layers - full) * gdn + layers * mlp
    scores = full * 4 * shape.heads * shape.head_dim * median_len / 2
    return 2.0 * weights + scores


def baseline_differs(rig: Any, baseline_attn: str) -> bool:
    """Whether `baseline_attn` is a path other than the headline's, one that runs here."""
    from drafter_trainer.model import resolve_attention

    if not baseline_attn or not rig.cuda:
        return False
    return resolve_attention(baseline_attn, rig.device.type, rig.config.head_dim) != rig.model.attn_impl


class P2Rig:
    """P2's two rates over the same batches (seqs of `packer`): the bare `runner.capture` loop, and
    the real TargetWorker serving them into a ring whose consumer acks at once (worker_harness).
    The first `warmup` batches are untimed in both."""

    def __init__(self, ctx: Ctx, runner: Any, dataset: Any, packer: Any, seqs: list[int], max_len: int,
                 warmup: int, ring: str) -> None:
        from target_server.packer import build_packed

        self.ctx, self.runner, self.dataset, self.packer, self.seqs = ctx, runner, dataset, packer, seqs
        self.max_len, self.warmup, self.ring = max_len, warmup, ring
        self.batches = [fixtures.batch_tensors(build_packed(dataset, packer.batch(s))) for s in seqs]
        self.tokens = sum(int(b[0].numel()) for b in self.batches[warmup:])

    def bare_tok_s(self, runner: Any = None) -> float:
        """The bare loop's rate, of `runner` when given (the same batches on another target)."""
        return fixtures.capture_tok_s(self.runner if runner is None else runner, self.batches, self.ctx.device,
                                      self.warmup)

    def worker_run(self, **kwargs: Any) -> Any:
        """One TargetWorker run over the seqs (run_workers' keyword arguments: a patch, a polling consumer)."""
        from bench.gpu.worker_harness import run_workers, worker_config

        a = self.ctx.args
        cfg = worker_config(self.packer.token_budget, self.max_len, self.ctx.ring_name(self.ring), self.ctx.shm_dir,
                            a.ring_slots, self.ctx.cuda_register(), a.audit_every)
        return run_workers([self.runner], cfg, self.dataset, self.packer, self.seqs, **kwargs)

    def turns(self, repeats: int) -> dict[str, Any]:
        """`repeats` turns of the bare loop then the worker; the ratio is the mean of the turns' ratios."""
        bare, worker = [], []
        for _ in range(repeats):
            bare.append(self.bare_tok_s())
            run = self.worker_run()
            worker.append(run.tokens_per_s(self.warmup - 1))
        return {"bare_tok_s": sum(bare) / len(bare), "worker_tok_s": sum(worker) / len(worker),
                "bare_runs_tok_s": bare, "worker_runs_tok_s": worker,
                "ratio_runs": [w / b for w, b in zip(worker, bare)], "worker_stages": run.stages,
                "quarantined": len(run.quarantined)}


def step_figures(rig: Any, work: list[tuple[Any, Any]], times: list[float], chunk: int, peak: float,
                 t0: float) -> dict[str, Any]:
    """The drafter steps `times` (rig.timed over `work`, started at perf_counter `t0`): step time,
    tok/s, anchors/s, MFU from the counted FLOPs (model and executed) at `chunk` blocks a chunk."""
    from bench.trainer_bench import step_flops

    steps = [work[i % len(work)] for i in range(len(times))]
    flops = [step_flops(rig.config, b, bl, rig.model.attn_impl, chunk) for b, bl in steps]
    total_s, tokens = sum(times), sum(b.num_tokens for b, _ in steps)
    return {"step_s": float(np.median(times)), "step_s_all": times,
            "anchors_s": sum(bl.num_blocks for _, bl in steps) / total_s,
            "first_steps_s": time.perf_counter() - t0 - total_s, "tok_s": tokens / total_s,
            "model_tflop_per_step": float(np.mean([f["model_total"] for f in flops])) / 1e12,
            "mfu": sum(f["model_total"] for f in flops) / total_s / 1e12 / peak,
            "executed_mfu": sum(f["executed_total"] for f in flops) / total_s / 1e12 / peak,
            "gflop_per_token": sum(f["model_total"] for f in flops) / tokens / 1e9,
            "flops_share": {k: float(np.sum([f[k] for f in flops]) / np.sum([f["model_total"] for f in flops]))
                            for k in ("fc", "ctx_kv", "block_proj", "mlp", "attn_visible", "lm_head")}}


def read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}
