"""Part `scale` (issue 8): target workers N = 1..G (one per GPU in one server-shaped process, a
consumer that acks at once), each count also against the bare forward loop on the same runners (P2
per configuration), and drafter ranks M = 1..G over NCCL (torchrun + ranks.py: the trainer's step
and all-reduce), each against N (M) times the single one measured in the same run; then the split
of 2/4/8-GPU hosts the rates recommend. Result: tok/s and efficiency per count."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from typing import Any

import torch

from bench.gpu import fixtures
from bench.gpu.shared import REPO, Ctx, read_json


def part_scale(ctx: Ctx) -> str:
    from bench.gpu.worker_harness import run_workers, worker_config
    from target_server.data import PreparedDataset
    from target_server.packer import Packer, build_packed

    a = ctx.args
    manifest = fixtures.read_manifest(ctx.workdir)
    budget, max_len = manifest["token_budget"], manifest["max_len"]
    gpus = torch.cuda.device_count() if ctx.cuda else 2
    top = min(gpus, a.scale_gpus) if a.scale_gpus else gpus
    devices = [torch.device(f"cuda:{i}") for i in range(top)] if ctx.cuda else [torch.device("cpu")] * top
    figures: dict[str, Any] = {"gpus": gpus, "target": {}, "drafter": {}}
    runners = []
    for d in devices:
        runner = fixtures.load_runner(manifest, d, a.allow_torch_linear)
        runner.warmup(budget)
        runners.append(runner)
    dataset = PreparedDataset.open(manifest["data_dir"])
    packer = Packer(dataset.lengths, budget, a.seed)
    for n in range(1, top + 1):
        cfg = worker_config(budget, max_len, ctx.ring_name(f"scale{n}"), ctx.shm_dir, a.ring_slots,
                            ctx.cuda_register(), a.audit_every)
        seqs = list(range(a.scale_batches * n))
        run = run_workers(runners[:n], cfg, dataset, packer, seqs)
        tok_s = run.tokens_per_s(n)   # from the n-th publish on: every worker past its first batch
        one = figures["target"].get("1", {}).get("tok_s", tok_s)
        bare = bare_forward_tok_s(runners[:n], [fixtures.batch_tensors(build_packed(dataset, packer.batch(q)))
                                                for q in seqs])
        figures["target"][str(n)] = {"tok_s": tok_s, "efficiency": tok_s / (n * one),
                                     "batches": a.scale_batches * n, "quarantined": len(run.quarantined),
                                     "bare_tok_s": bare, "worker_over_bare": tok_s / bare}
        print(f"target workers {n}: {tok_s:,.0f} tok/s, efficiency {tok_s / (n * one):.3f}, "
              f"P2 {tok_s / bare:.3f} (bare forward {bare:,.0f})", flush=True)
        ctx.store.figures("scale", **figures)
    del runners, run
    ctx.free_memory()

    attn = ctx.drafter_attn()
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    for m in range(1, top + 1):
        out_json = os.path.join(ctx.workdir, f"ranks{m}.json")
        if os.path.exists(out_json):
            os.unlink(out_json)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(m),
               os.path.join(REPO, "bench", "gpu", "ranks.py"), "--workdir", ctx.workdir, "--out-json", out_json,
               "--layers", str(a.drafter_layers), "--block", str(a.block), "--anchors", str(a.anchors),
               "--loss-chunk", str(a.loss_chunk), "--attn", attn, "--seed", str(a.seed),
               "--warmup", str(a.p5_warmup), "--steps", str(a.p5_steps)]
        if not ctx.cuda:
            cmd[cmd.index("--workdir"):cmd.index("--workdir")] = ["--devices", ",".join(["cpu"] * m)]
        rc = subprocess.run(cmd, env=env, cwd=REPO, timeout=max(60.0, a.part_budget / 2)).returncode
        if rc != 0 or not os.path.exists(out_json):
            figures["drafter"][str(m)] = {"error": f"torchrun exited {rc}"}
            continue
        got = read_json(out_json)
        one = figures["drafter"].get("1", {}).get("tok_s", got["tok_s"])
        figures["drafter"][str(m)] = {**got, "efficiency": got["tok_s"] / (m * one)}
        print(f"drafter ranks {m}: {got['tok_s']:,.0f} tok/s, efficiency {got['tok_s'] / (m * one):.3f}", flush=True)
        ctx.store.figures("scale", **figures)
    computed = max(fixtures.shape_of(manifest).capture_ids) + 1
    figures["split"] = {
        "proxy": recommend_split(figures["target"], figures["drafter"], 1.0),
        "27b_depth": recommend_split(figures["target"], figures["drafter"], computed / a.real_layers_computed),
        "depth_scale": f"{computed}/{a.real_layers_computed} layers computed per target forward"}
    ctx.store.figures("scale", **figures)
    print(json.dumps(figures["split"], indent=1))
    return "measured"


def bare_forward_tok_s(runners: list[Any], batches: list[tuple[torch.Tensor, ...]]) -> float:
    """P2's baseline for N workers: each runner's thread runs `capture` over its share of the
    batches (round robin, as the dispatcher hands them out), no ring, no publishing. Each thread's
    first batch is untimed, as the worker rate starts after every worker's first publish."""
    import threading

    errors: list[BaseException] = []
    t0 = [0.0]
    # the clock starts in the barrier's action, before any thread is released: read by the caller
    # after its own wait, it could start after the timed batches had begun
    start = threading.Barrier(len(runners) + 1, action=lambda: t0.__setitem__(0, time.perf_counter()))

    def loop(runner: Any, share: list[tuple[torch.Tensor, ...]]) -> None:
        try:
            for b in share[:1]:
                runner.capture(*b)
            fixtures.synchronize(runner.device)
            start.wait()
            for b in share[1:]:
                runner.capture(*b)
            fixtures.synchronize(runner.device)
        except threading.BrokenBarrierError:
            pass   # another thread failed: its error is the one reported
        except BaseException as e:   # reported below, in the caller's thread
            errors.append(e)
            start.abort()

    shares = [batches[i::len(runners)] for i in range(len(runners))]
    threads = [threading.Thread(target=loop, args=(r, sh)) for r, sh in zip(runners, shares)]
    for t in threads:
        t.start()
    with contextlib.suppress(threading.BrokenBarrierError):
        start.wait()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    timed_tokens = sum(int(b[0].numel()) for sh in shares for b in sh[1:])
    return timed_tokens / (time.perf_counter() - t0[0])


def recommend_split(target: dict[str, Any], drafter: dict[str, Any], depth_scale: float,
                    hosts: tuple[int, ...] = (2, 4, 8)) -> dict[str, Any]:
    """For a host of G GPUs, n target GPUs and G - n trainer GPUs: min(supply, demand) from the
    measured per-count rates (`depth_scale` turns the proxy target into the full-depth one); counts
    beyond the measured ones take the efficiency of the largest measured count."""
    def rate(table: dict[str, Any], k: int, scale: float) -> float | None:
        measured = sorted(int(n) for n, v in table.items() if "tok_s" in v)
        if not measured:
            return None
        one = table[str(measured[0])]["tok_s"] / measured[0]
        eff = table[str(min(k, measured[-1]))]["efficiency"] if k > 1 else 1.0
        return one * k * eff * scale

    out: dict[str, Any] = {}
    for g in hosts:
        rows = []
        for n in range(1, g):
            t, d = rate(target, n, depth_scale), rate(drafter, g - n, 1.0)
            if t is None or d is None:
                continue
            rows.append({"target_gpus": n, "trainer_gpus": g - n, "supply_tok_s": t, "demand_tok_s": d,
                         "tok_s": min(t, d), "bound_by": "target" if t < d else "trainer"})
        if rows:
            out[str(g)] = {"best": max(rows, key=lambda r: r["tok_s"]), "all": rows}
    return out
