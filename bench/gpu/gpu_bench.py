"""The GPU benchmark suite of dfpipe: one part per process, every figure into $OUT/results.json.

    bash bench/gpu/run_all.sh [flags]            # what to run on the GPU host (runs every part below)
    python bench/gpu/gpu_bench.py <part> [flags]   # one part; `env` first (it builds the fixtures)

Parts (in run_all.sh order):

    env        versions, device, builds the 27B-shaped target and the synthetic dataset (fixtures.py)
    tests      the CUDA tests of tests/ as CI has them, then again with FLA really loaded
    copycheck  >= 100 batches through the real TargetWorker CUDA path (staging -> copy stream ->
               registered slot -> event -> publish), each slot compared bit for bit with a plain
               forward + synchronous .cpu(); and FLA packed == per-document on the 27B shape
    p1         transport: GPU -> registered slot -> second process's GPU vs pinned D2H    (P1)
    p5         drafter step: fwd+bwd+AdamW time, FLOPs, MFU vs measured matmul peak,
               and drafter-alone tok/s on the dataset's batches (for P6)                   (P5)
    p23        target worker vs bare forward (P2), packed vs padded (P3)
    fp8        the target as a block-wise FP8 checkpoint vs bf16: tok/s, feature difference, its P2 (P8)
    services   real target-server + trainer processes: cold start, together, warm restart (P4, P6)
    long       whole long documents: the target on 32K-token against 3K-token documents, P2 and
               P5d at that length (P2L, P5dL), the host split their rates recommend

run_all.sh records each part's exit code and prints the table with `python -m bench.gpu.results`.

Every size is a flag; `--quick` switches to tiny sizes (the CPU smoke run). Without CUDA and
without --quick every part says "skipped: no CUDA".
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.gpu import fixtures  # noqa: E402
from bench.gpu.results import PART_OF, ResultStore  # noqa: E402

FULL: dict[str, Any] = dict(
    # target: Qwen3.5-27B widths (its config.json), only `layers` layers, capture ids inside them
    hidden=5120, layers=8, capture_ids="1,2,4,6,7", heads=24, kv_heads=4, head_dim=256, intermediate=17408,
    linear_k_heads=16, linear_v_heads=48, linear_k_dim=128, linear_v_dim=128, vocab=248320, mask_token_id=248070,
    # data
    token_budget=16384, max_len=3072, median=512.0, sigma=1.0, dataset_docs=4000,
    # parts
    copy_batches=100, copy_budget=3072, p1_iters=40, p1_slots="3,6", p2_batches=8, p2_warmup=3, p2_repeats=2, p3_docs=0,
    p5_tokens=3072, p5_docs=2, p5_anchors=256, anchors=512, p5d_batches=4, p5d_chunks="0", p5d_steps=4,
    p7_gpus=8, block=16, drafter_layers=5, loss_chunk=1024, p5_steps=6,
    p5_warmup=2, p5_attn="sdpa,split,flex", p5_compile="on,off", p5_profile=15, p6_seconds=60.0, p6_skip_steps=3,
    ring_slots=4, matmul_n=8192, step_timeout=420.0,
    # issue 8: GPUs to scale over (0: all), batches per worker, full-depth layers of the real target
    # (Qwen3.5-27B capture at 1,16,31,46,61 runs 62 layers), placements "target/trainer" GPU ids
    scale_gpus=0, scale_batches=8, real_layers_computed=62, placements="", drafter_attn="",
    firstpass_batches=0,   # p23: fresh batches per attention variant, each timed on its first and second pass (0: none)
    p2_diagnostics=0,      # p23: after P2, the worker without audit / polling consumer / blocking inputs (0: none)
    e2e_tests="",   # tests part: also these end-to-end tests (pytest -k) with the services on CUDA
    layer_compile_options="",   # p5d: a JSON object of inductor options added to the drafter layers' (experiments)
    p5d_baseline_attn="",   # p5d: also step the headline chunk size with this attention path (an A/B in one run)
    long_baseline_attn="flash",   # long: also step with this attention path where the headline's differs (an A/B in one run)
    p5d_precision="",   # p5d: the headline's drafter.precision ("": the trainer's default, resolved on this device)
    p5d_other_precision="fp8",   # p5d (P5f): also step this precision on the same batches ("": none; skipped without FP8 tensor cores)
    # long (issue 33): documents of long_doc tokens at a budget of long_budget (configs/gpu-long.yaml),
    # against long_short_doc-token documents at the same budget; drafter chunks and fc as that config
    long_budget=32768, long_doc=32768, long_short_doc=3072, long_batches=4, long_p2_batches=6, long_p2_repeats=2,
    long_p5d_batches=2, long_p5d_steps=4, long_chunk=512, long_split_fc=1,
)
QUICK: dict[str, Any] = dict(
    FULL, hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=256, linear_k_heads=2, linear_v_heads=4,
    linear_k_dim=32, linear_v_dim=32, vocab=2048, mask_token_id=2040, token_budget=512, max_len=256,
    median=48.0, dataset_docs=400, copy_batches=24, copy_budget=256, p1_iters=8, p2_batches=6, p2_warmup=2, p2_repeats=2, p3_docs=24,
    p5_tokens=256, p5_anchors=16, anchors=32, p5d_batches=2, p5d_chunks="0,8", p5d_steps=2, loss_chunk=256, p5_steps=3, p5_warmup=1, p5_attn="split,sdpa", p6_seconds=6.0, p6_skip_steps=2,
    matmul_n=512, step_timeout=240.0, scale_batches=4, firstpass_batches=2,
    drafter_layers=2,   # two layers keep the layer-to-layer path; each more one only costs CI's CPU time
    p5_compile="off",   # an inductor compile costs ~30 s of CI's two cores; tests/test_drafter_compile.py checks it
    p5d_other_precision="fp8-emulated",   # the CPU has no FP8 matmuls: the P5f plumbing runs on the emulation
    long_budget=512, long_doc=512, long_short_doc=128, long_batches=2, long_p2_batches=2, long_p2_repeats=1,
    long_p5d_steps=2, long_chunk=16,
)
TEST_FILES = ("tests/test_target_packing.py", "tests/test_target_capture.py", "tests/test_fp8_target.py",
              "tests/test_ring.py", "tests/test_drafter_model.py", "tests/test_drafter_compile.py", "tests/test_optim.py",
              "tests/test_step_syncs.py", "tests/test_block_flash.py", "tests/test_block_mask.py")
GPU_TEST_FILTER = "gpu or cuda"   # test names and the gpu marker (substring match: not "fla", which matches "dflash")
EXPECTED_SKIPS = ("checks the behaviour without CUDA",   # test_ring's CPU-only check, skipped on a GPU host
                  "two CUDA ranks need two GPUs")          # test_e2e_trainer's two ranks, on a one-GPU host
STALE_ROW_REL_ERR = 0.25   # a row off by this much of its norm is another batch's, torn or zero: a copy fault


RING_PREFIX = "dfpgb-"   # every ring this suite creates; run_all.sh removes "dfpgb-<run id>-*" after each part
TERMINATED = 143   # exit code of a part stopped by SIGTERM (128 + 15)


class SkipPart(Exception):
    """The part cannot run here (no CUDA, missing fixtures of a skipped part); the message says why."""


@dataclass
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


# ---- parts ---------------------------------------------------------------------------------------
def part_env(ctx: Ctx) -> str:
    a = ctx.args
    info = versions(ctx.device)
    for k, v in info.items():
        print(f"{k:>24}: {v}")
    ctx.store.update(lambda d: d["meta"].update(versions=info))
    if not ctx.cuda and not a.quick:
        raise SkipPart("no CUDA: fixtures of the 27B shape are built only on a GPU host (or pass --quick)")
    shape = target_shape(a)
    key = {"shape": fixtures.shape_dict(shape), "token_budget": a.token_budget, "max_len": a.max_len,
           "median": a.median, "sigma": a.sigma, "dataset_docs": a.dataset_docs, "seed": a.seed,
           "device_type": ctx.device.type}
    target_dir, data_dir = os.path.join(ctx.workdir, "target"), os.path.join(ctx.workdir, "data")
    try:
        old = fixtures.read_manifest(ctx.workdir)
    except FileNotFoundError:
        old = {}
    if old.get("key") == key and os.path.isfile(os.path.join(target_dir, "config.json")):
        print(f"fixtures in {ctx.workdir} match these sizes: reused")
        return "reused fixtures"
    for path in (target_dir, data_dir):
        shutil.rmtree(path, ignore_errors=True)
    build_s = fixtures.build_target(target_dir, shape, ctx.device, seed=a.seed)
    lengths = fixtures.document_lengths(a.dataset_docs, a.median, a.sigma, a.max_len, a.seed)
    tokens = fixtures.write_dataset(data_dir, lengths, shape.vocab, shape.mask_token_id, a.seed)
    disk = sum(os.path.getsize(os.path.join(target_dir, f)) for f in os.listdir(target_dir))
    fixtures.write_manifest(ctx.workdir, {"key": key, "shape": key["shape"], "target_dir": target_dir,
                                          "data_dir": data_dir, "token_budget": a.token_budget, "max_len": a.max_len})
    figures = {"target_build_s": build_s, "target_gb_on_disk": disk / 1e9, "dataset_docs": len(lengths),
               "dataset_tokens": tokens, "doc_len_mean": float(lengths.mean()),
               "doc_len_p50": float(np.median(lengths)), "doc_len_max": int(lengths.max())}
    ctx.store.figures("env", **figures)
    print(json.dumps(figures, indent=1))
    return "built fixtures"


def part_tests(ctx: Ctx) -> str:
    work = os.path.join(ctx.workdir, "tests")
    os.makedirs(work, exist_ok=True)
    files = [f for f in TEST_FILES if os.path.isfile(os.path.join(REPO, f))]
    runs = {
        "as_ci": ([*files, "-k", GPU_TEST_FILTER], {}),
        # conftest blocks FLA; this run loads it first, so every Qwen3.5 path really runs FLA
        "real_fla": (["-p", "bench.gpu.pytest_real_fla", "tests/test_target_packing.py", "-k", "gpu"],
                     {"DFPIPE_BENCH_BACKENDS": os.path.join(work, "backends.json")}),
    }
    if ctx.args.e2e_tests:   # the end-to-end restart tests with both services on CUDA
        runs["e2e_cuda"] = (["tests/test_e2e_restart.py", "tests/test_e2e_trainer.py", "-x", "-k", ctx.args.e2e_tests],
                            {"DFPIPE_TEST_TARGET_DEVICES": "cuda:0", "DFPIPE_TEST_TRAINER_DEVICE": "cuda",
                             "NCCL_NVLS_ENABLE": "0"})
    summary: dict[str, Any] = {}
    problems: list[str] = []
    for stale in os.listdir(work):  # a crashed pytest must not leave an earlier run's report to be read
        os.unlink(os.path.join(work, stale))
    for name, (argv, extra_env) in runs.items():
        xml = os.path.join(work, f"{name}.xml")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", f"--junitxml={xml}", *argv]
        print(f"\n$ {' '.join(cmd)}", flush=True)
        rc = subprocess.run(cmd, cwd=REPO, env={**os.environ, **extra_env}).returncode
        cases = junit_cases(xml)
        counts = {k: sum(1 for c in cases if c["outcome"] == k) for k in ("passed", "failed", "error", "skipped")}
        unexpected = [c for c in cases if c["outcome"] == "skipped" and ctx.cuda
                      and not any(s in c["message"] for s in EXPECTED_SKIPS)]
        summary[name] = {"rc": rc, **counts, "cases": cases, "unexpected_skips": [c["test"] for c in unexpected]}
        if rc not in (0, 5) or counts["failed"] or counts["error"]:
            problems.append(f"{name}: rc {rc}, {counts['failed']} failed, {counts['error']} errors")
        if unexpected:
            problems.append(f"{name}: skipped on a CUDA host: {[c['test'] for c in unexpected]}")
    backends = _read_json(os.path.join(work, "backends.json"))
    summary["real_fla_backends"] = backends
    if ctx.cuda:
        packed = [ld for ld in backends.get("loads", []) if "packed_equals_per_document" in ld["test"]]
        if not backends.get("fla_version"):
            problems.append(f"FLA not importable: {backends.get('fla_error')}")
        elif not packed or any(ld["backend"] != "fla" for ld in packed):
            problems.append(f"packed == per-document did not run on FLA: {packed}")
    ctx.store.figures("tests", **summary)
    if problems:
        raise AssertionError("; ".join(problems))
    if not ctx.cuda:
        return "all CUDA tests skipped: no CUDA"
    return "pass"


def part_copycheck(ctx: Ctx) -> str:
    """Async copy (the worker's CUDA path) == sync copy, bit for bit, over >= --copy-batches batches.

    The reference of every batch is computed first: a plain forward, then a plain synchronous
    `.cpu()`. Then the real TargetWorker serves the same seqs and each published slot is compared
    byte for byte. Should the forward itself not be bitwise reproducible (the worker runs it in
    another thread, with its own cuBLAS handle), a differing batch is still told apart from a
    copy fault: a stale, torn or zero row differs by O(1) of its norm, rounding by far less.
    """
    from common.batch import TOKEN_TENSORS
    from target_server.data import PreparedDataset
    from target_server.packer import Packer, build_packed
    from bench.gpu.worker_harness import run_worker, worker_config

    a = ctx.args
    manifest = fixtures.read_manifest(ctx.workdir)
    if a.copy_budget < manifest["max_len"]:
        raise ValueError(f"--copy-budget {a.copy_budget} is below the dataset's max_len {manifest['max_len']}")
    runner = fixtures.load_runner(manifest, ctx.device, a.allow_torch_linear)
    dataset = PreparedDataset.open(manifest["data_dir"])
    packer = Packer(dataset.lengths, a.copy_budget, a.seed)
    seqs = list(range(min(a.copy_batches, packer.epoch_size(0))))
    figures: dict[str, Any] = {"batches": len(seqs), "token_budget": a.copy_budget, "device": str(ctx.device),
                               "linear_backend": runner.linear_backend}
    t0 = time.perf_counter()
    runner.warmup(a.copy_budget)
    figures["first_forward_s"] = time.perf_counter() - t0

    refs: dict[int, tuple[torch.Tensor, dict[str, np.ndarray]]] = {}
    for seq in seqs:
        arrays = build_packed(dataset, packer.batch(seq))
        refs[seq] = (runner.capture(*fixtures.batch_tensors(arrays)).cpu(), arrays)
    first = fixtures.batch_tensors(refs[seqs[0]][1])
    figures["forward_bitwise_deterministic"] = same_bytes(runner.capture(*first).cpu(), refs[seqs[0]][0])
    box: list[torch.Tensor] = []
    probe = threading.Thread(target=lambda: box.append(runner.capture(*first).cpu()))
    probe.start()
    probe.join()
    figures["forward_bitwise_deterministic_across_threads"] = bool(box) and same_bytes(box[0], refs[seqs[0]][0])
    figures["reference_gb"] = sum(r.numel() * r.element_size() for r, _ in refs.values()) / 1e9

    mismatches: list[dict[str, Any]] = []
    seen: list[int] = []

    def check(view: Any) -> None:
        seq = int(view.meta["seq"])
        ref, arrays = refs[seq]
        hidden = view.tensors["hidden"]
        bad_tokens = [k for k in TOKEN_TENSORS if not np.array_equal(view.tensors[k].numpy(), arrays[k])]
        if not same_bytes(hidden, ref) or bad_tokens:
            mismatches.append({"seq": seq, "bad_tokens": bad_tokens,
                               "max_row_rel_err": max_row_rel_err(hidden, ref) if hidden.shape == ref.shape else None})
        seen.append(seq)

    cfg = worker_config(a.copy_budget, manifest["max_len"], ctx.ring_name("copy"), ctx.shm_dir, 3,
                        ctx.cuda_register(), a.audit_every)
    run = run_worker(runner, cfg, dataset, packer, seqs, on_slot=check)
    refs.clear()  # ~16 GB of host memory at full size
    faults = [m for m in mismatches if m["bad_tokens"] or m["max_row_rel_err"] is None
              or m["max_row_rel_err"] > STALE_ROW_REL_ERR]
    figures.update({"compared": len(seen), "distinct_seqs": len(set(seen)), "bitwise_mismatches": len(mismatches),
                    "copy_faults": len(faults), "first_mismatches": mismatches[:5], "quarantined": run.quarantined[:5],
                    "invalid_after_read": run.invalid_after_read, "worker_stages": run.stages})
    problems = []
    if len(seen) != len(seqs) or len(set(seen)) != len(seqs) or len(seqs) < min(100, a.copy_batches):
        problems.append(f"{len(set(seen))} distinct of {len(seqs)} batches compared")
    if faults or run.quarantined or run.invalid_after_read:
        problems.append(f"{len(faults)} copy faults, {len(run.quarantined)} quarantined, "
                        f"{run.invalid_after_read} slots changed while read")
    if ctx.cuda:
        try:
            errs = fla_packed_vs_per_document(runner, manifest)
            figures["fla_packed_vs_per_document_rel_err"] = errs
            if max(errs) >= 5e-2:
                problems.append(f"FLA packed != per-document (relative errors {errs})")
        except Exception as e:
            traceback.print_exc()
            problems.append(f"FLA packed vs per-document check failed: {type(e).__name__}: {e}")
    ctx.store.figures("copycheck", **figures)
    print(json.dumps({k: v for k, v in figures.items() if k != "worker_stages"}, indent=1, default=str))
    if problems:
        raise AssertionError("; ".join(problems))
    if mismatches:
        return (f"pass: equal up to forward rounding, not bitwise ({len(mismatches)} batches, max row error "
                f"{max(m['max_row_rel_err'] for m in mismatches):.2g}; the forward differs across threads)")
    return f"pass: {len(seen)} batches bitwise equal"


def part_p1(ctx: Ctx) -> str:
    """P1 per (slots, consumer GPU): the headline is the production layout (consumer on another GPU
    when there is one) with the best slot count; the same-GPU runs show the host side alone."""
    from bench.gpu.transport import consumer_device_for, run_transport

    a = ctx.args
    manifest = fixtures.read_manifest(ctx.workdir)
    shape = fixtures.shape_of(manifest)
    other = consumer_device_for(ctx.device)
    consumers = [other] + ([str(ctx.device)] if ctx.cuda and other != str(ctx.device) else [])
    variants: dict[str, Any] = {}
    for slots in (int(x) for x in str(a.p1_slots).split(",")):
        for consumer in consumers:
            name = f"slots{slots}-{consumer}"
            try:
                variants[name] = run_transport(len(shape.capture_ids), manifest["token_budget"], shape.hidden,
                                               ctx.device, consumer, ctx.shm_dir, ctx.ring_name("p1"), slots,
                                               a.p1_iters, os.path.abspath(__file__))
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


def part_p5(ctx: Ctx) -> str:
    """P5 at the brief's size for each attention path, eager; then the fastest path compiled
    (drafter.compile: an A/B in one process); a kernel profile of the fastest variant, then
    drafter-alone tok/s on the dataset's own batches (P6's denominator)."""
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

    # P5: the brief's size (one 3072-token row, 512 anchors), each attention path of the drafter
    numbers: dict[str, Any] = {"tokens": a.p5_tokens, "docs": a.p5_docs, "anchors_per_doc_max": a.p5_anchors,
                               "block": a.block,
                               "drafter_layers": a.drafter_layers, "hidden": dcfg.hidden_size,
                               "heads": f"{dcfg.num_attention_heads}/{dcfg.num_key_value_heads}x{dcfg.head_dim}",
                               "intermediate": dcfg.intermediate_size, "vocab": dcfg.vocab_size,
                               "matmul_peak_tflops": peak,
                               "params_trainable_b": sum(p.numel() for p in rig.params) / 1e9, "variants": {}}
    best = None
    try:
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
        compiled_keys = []
        if "on" in modes:
            paths = [numbers["variants"][eager_best]["attn"]] if eager_best else impls
            compiled_keys = [measure(impl, True) for impl in paths]
        best = fastest([eager_best, *compiled_keys])
        if best is None:
            raise RuntimeError(f"every attention path failed: {numbers['variants']}")
        chosen = numbers["variants"][best]
        numbers.update({k: x for k, x in chosen.items()}, variant=best)
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
    except Exception as e:
        traceback.print_exc()
        ctx.store.benchmark_error("P5", f"{type(e).__name__}: {e}", numbers)

    return "measured"


def part_p5d(ctx: Ctx) -> str:
    """P5d: the drafter step at the published anchor density: the dataset's budget-size batches of
    lognormal documents, up to --anchors anchors per document, the step's chunks of
    --p5d-chunks blocks each (the first is the default, 0 = auto), the attention path and compile
    mode the trainer uses on CUDA; MFU from counted FLOPs, peak memory, tok/s. The first size
    listed (the trainer's default) is the headline and gives the drafter-alone rate P6d and P7 use,
    and a kernel profile; the others are a sweep."""
    from dataclasses import replace

    from bench.gpu.drafter_rig import DrafterRig
    from bench.trainer_bench import step_flops
    from drafter_trainer.fp8 import fp8_supported
    from drafter_trainer.loss import auto_blocks_per_chunk

    a = ctx.args
    dev = ctx.device
    manifest = fixtures.read_manifest(ctx.workdir)
    peak = fixtures.matmul_peak_tflops(dev, a.matmul_n)
    if a.layer_compile_options:
        from drafter_trainer import model as drafter_model
        drafter_model.LAYER_COMPILE_OPTIONS.update(json.loads(a.layer_compile_options))
    rig = DrafterRig(manifest, dev, a.drafter_layers, a.block, a.anchors, a.loss_chunk, a.seed,
                     attn=a.drafter_attn or "auto", compile_mode="auto", precision=a.p5d_precision)
    from drafter_trainer.model import resolve_attention
    rig.model.attn_impl = resolve_attention(rig.model.attn_impl, dev.type, rig.config.head_dim)
    work = rig.dataset_work(list(range(a.p5d_batches)), lazy_hidden=True)
    anchors = [blocks.num_blocks for _, blocks in work]
    tokens = [batch.num_tokens for batch, _ in work]
    numbers: dict[str, Any] = {"anchors_per_doc_max": a.anchors, "batches": len(work),
                               "layer_compile_options": a.layer_compile_options,
                               "anchors_per_batch": float(np.mean(anchors)), "tokens_per_batch": float(np.mean(tokens)),
                               "docs_per_batch": float(np.mean([int(b.doc_lens.numel()) for b, _ in work])),
                               "matmul_peak_tflops": peak, "attn": rig.model.attn_impl, "compiled": rig.model.compiled,
                               "chunks": {}}
    print(json.dumps(numbers), flush=True)
    best = None
    for chunk in [int(x) for x in a.p5d_chunks.split(",") if x != ""]:
        per = chunk or auto_blocks_per_chunk(a.block)
        rig.settings = replace(rig.settings, blocks_per_chunk=per)
        t0 = time.perf_counter()
        try:
            # every batch once before timing: each new chunk shape may still compile once
            times = rig.timed(work, max(a.p5_warmup, len(work)), a.p5d_steps)
        except Exception as e:   # a chunk size that does not fit leaves the others measured
            traceback.print_exc()
            numbers["chunks"][str(per)] = {"error": f"{type(e).__name__}: {e}"[:300]}
            rig.optimizer.zero_grad()
            if ctx.cuda:
                torch.cuda.empty_cache()
            continue
        steps = [work[i % len(work)] for i in range(len(times))]
        flops = [step_flops(rig.config, b, bl, rig.model.attn_impl, per) for b, bl in steps]
        total_s = sum(times)
        v = {"blocks_per_chunk": per, "step_s": float(np.median(times)), "step_s_all": times,
             "anchors_s": sum(bl.num_blocks for _, bl in steps) / total_s,
             "first_steps_s": time.perf_counter() - t0 - total_s,
             "tok_s": sum(b.num_tokens for b, _ in steps) / total_s,
             "model_tflop_per_step": float(np.mean([f["model_total"] for f in flops])) / 1e12,
             "mfu": sum(f["model_total"] for f in flops) / total_s / 1e12 / peak,
             "executed_mfu": sum(f["executed_total"] for f in flops) / total_s / 1e12 / peak,
             "gflop_per_token": sum(f["model_total"] for f in flops) / sum(b.num_tokens for b, _ in steps) / 1e9,
             "flops_share": {k: float(np.sum([f[k] for f in flops]) / np.sum([f["model_total"] for f in flops]))
                             for k in ("fc", "ctx_kv", "block_proj", "mlp", "attn_visible", "lm_head")}}
        if ctx.cuda:
            v["peak_mem_gb"] = torch.cuda.max_memory_allocated(dev) / 1e9
        numbers["chunks"][str(per)] = v
        print("chunk", per, json.dumps({k: x for k, x in v.items() if k != "step_s_all"}), flush=True)
        if best is None or v["tok_s"] > numbers["chunks"][str(best)]["tok_s"]:
            best = per
        ctx.store.figures("p5d", **numbers)
    if best is None:
        raise RuntimeError(f"every chunk size failed: {numbers['chunks']}")
    # the headline is the first size listed (by default the trainer's own, auto); the others are a sweep
    first = [str(int(x) or auto_blocks_per_chunk(a.block)) for x in a.p5d_chunks.split(",") if x != ""][0]
    if "mfu" in numbers["chunks"].get(first, {}):
        best = int(first)
    numbers["fastest_chunk"] = max((k for k, v in numbers["chunks"].items() if "tok_s" in v),
                                   key=lambda k: numbers["chunks"][k]["tok_s"])
    chosen = numbers["chunks"][str(best)]
    numbers.update({k: x for k, x in chosen.items() if k != "step_s_all"})
    if ctx.cuda and a.p5_profile:
        rig.settings = replace(rig.settings, blocks_per_chunk=best)
        numbers["profile"] = fixtures.profile_kernels(lambda: rig.step(*work[0]), dev, top=a.p5_profile)
    if baseline_differs(rig, a.p5d_baseline_attn):
        numbers["baseline"] = p5d_baseline(rig, work, best, a, peak, chosen)
    numbers["precision"] = rig.model.precision
    ctx.store.benchmark("P5d", {"mfu": chosen["mfu"], "peak_mem_gb": chosen.get("peak_mem_gb")}, numbers)
    # the rates later parts price with (P6d, P7), kept even if P5f below runs out of time
    ctx.store.figures("p5d", drafter_alone_tok_s=chosen["tok_s"], drafter_alone_anchors_s=chosen["anchors_s"],
                      drafter_alone_peak_mem_gb=chosen.get("peak_mem_gb"),
                      drafter_gflop_per_token=chosen["gflop_per_token"], matmul_peak_tflops=peak, best_chunk=best,
                      precision=rig.model.precision)
    other = a.p5d_other_precision
    if other == "fp8" and not (ctx.cuda and fp8_supported(dev.index or 0)):
        ctx.store.benchmark("P5f", {}, {"not_measured": "no FP8 tensor cores here (compute capability < 8.9)"})
        other = ""
    if other and other != rig.model.precision:
        p5f = p5d_other_precision(rig, work, best, a, peak, chosen)
        fp8, bf16 = (p5f, chosen) if p5f["precision"].startswith("fp8") else (chosen, p5f)
        ctx.store.figures("p5d", other_precision=p5f["precision"], drafter_other_tok_s=p5f["tok_s"])
        ctx.store.benchmark("P5f", {"fp8_over_bf16_tok_s": fp8["tok_s"] / bf16["tok_s"],
                                    "peak_mem_gb": fp8.get("peak_mem_gb"),
                                    "grad_cosine_min": p5f["grad_cosine"]["min"]},
                            {**p5f, "fp8_mfu": fp8["mfu"], "bf16_mfu": bf16["mfu"], "fp8_tok_s": fp8["tok_s"],
                             "bf16_tok_s": bf16["tok_s"]})
    print(json.dumps({k: x for k, x in numbers.items() if k not in ("chunks", "profile")}, indent=1, default=str))
    return "measured"


def baseline_differs(rig: Any, baseline_attn: str) -> bool:
    """Whether `baseline_attn` is a path other than the headline's, one that runs here."""
    from drafter_trainer.model import resolve_attention

    if not baseline_attn or not rig.cuda:
        return False
    return resolve_attention(baseline_attn, rig.device.type, rig.config.head_dim) != rig.model.attn_impl


def p5d_baseline(rig: Any, work: list[tuple[Any, Any]], chunk: int, a: argparse.Namespace, peak: float,
                 headline: dict[str, Any]) -> dict[str, Any]:
    """The headline's batches and chunk size stepped with --p5d-baseline-attn instead: the
    headline's speed-up over it, in the same process (MFU from the same model FLOPs)."""
    from dataclasses import replace

    from drafter_trainer.model import resolve_attention

    impl = resolve_attention(a.p5d_baseline_attn, rig.device.type, rig.config.head_dim)
    headline_impl, rig.model.attn_impl = rig.model.attn_impl, impl
    rig.settings = replace(rig.settings, blocks_per_chunk=chunk)
    try:
        return timed_against(rig, work, chunk, a, peak, headline, "baseline", attn=impl)
    finally:
        rig.model.attn_impl = headline_impl


def timed_against(rig: Any, work: list[tuple[Any, Any]], chunk: int, a: argparse.Namespace, peak: float,
                  headline: dict[str, Any], label: str, **settings: Any) -> dict[str, Any]:
    """The headline's batches stepped as the rig is set now: step times, tok/s, MFU from the same
    counted FLOPs, peak memory, and the headline's speed-up over it (`settings` are recorded)."""
    from bench.trainer_bench import step_flops

    times = rig.timed(work, len(work), a.p5d_steps)
    steps = [work[i % len(work)] for i in range(len(times))]
    model_flops = sum(step_flops(rig.config, b, bl, rig.model.attn_impl, chunk)["model_total"] for b, bl in steps)
    out = {**settings, "step_s": float(np.median(times)), "step_s_all": times,
           "tok_s": sum(b.num_tokens for b, _ in steps) / sum(times), "mfu": model_flops / sum(times) / 1e12 / peak}
    if rig.cuda:
        out["peak_mem_gb"] = torch.cuda.max_memory_allocated(rig.device) / 1e9
    out["headline_speedup"] = headline["tok_s"] / out["tok_s"]
    print(label, json.dumps({k: x for k, x in out.items() if k != "step_s_all"}), flush=True)
    return out


def part_fp8lib(ctx: Ctx) -> str:
    """The FP8 implementation, chosen by measurement (fp8_lib.py): one drafter MLP at the target's
    widths over a chunk's block tokens, forward + backward compiled, bf16 against dfpipe's fp8
    against torchao's Float8Linear (rowwise), where torchao works with this torch."""
    from bench.gpu.fp8_lib import compare
    from drafter_trainer.fp8 import fp8_supported
    from drafter_trainer.loss import AUTO_CHUNK_ROWS

    if not ctx.cuda or not fp8_supported(ctx.device.index or 0):
        raise SkipPart("needs a GPU with FP8 tensor cores")
    shape = target_shape(ctx.args)
    numbers = compare(shape.hidden, shape.intermediate, AUTO_CHUNK_ROWS)
    ctx.store.figures("fp8lib", **numbers)
    print(json.dumps(numbers, indent=1), flush=True)
    return "measured"


def p5d_other_precision(rig: Any, work: list[tuple[Any, Any]], chunk: int, a: argparse.Namespace, peak: float,
                        headline: dict[str, Any]) -> dict[str, Any]:
    """The headline's batches and chunk size stepped in --p5d-other-precision (fp8) instead of the
    headline's (bf16), in the same process: its step, and the gradient of one batch in both
    precisions from the same weights and planes, compared weight by weight (cosine)."""
    from dataclasses import replace

    from drafter_trainer.fp8 import resolve_precision

    headline_precision = rig.model.precision
    base = resolve_precision(a.p5d_other_precision, rig.device)
    rig.settings = replace(rig.settings, blocks_per_chunk=chunk)
    try:
        rig.model.precision = base
        out = timed_against(rig, work, chunk, a, peak, headline, "other precision",
                            headline_precision=headline_precision, precision=base)
        if rig.cuda and a.p5_profile:     # where the other precision's step spends its time
            out["profile"] = fixtures.profile_kernels(lambda: rig.step(*work[0]), rig.device, top=a.p5_profile)
        batch, blocks = work[0]
        planed = rig.with_planes(batch)
        want = rig.gradients(planed, blocks)
        rig.model.precision = headline_precision
        got = rig.gradients(planed, blocks)
    finally:
        rig.model.precision = headline_precision
    cos = {n: float(torch.nn.functional.cosine_similarity(want[n].flatten(), got[n].flatten(), dim=0)) for n in want}
    rel = {n: float((got[n] - want[n]).norm() / want[n].norm().clamp_min(1e-30)) for n in want}
    worst = sorted(cos, key=cos.get)[:5]
    out["grad_cosine"] = {"min": min(cos.values()), "mean": float(np.mean(list(cos.values()))),
                          "worst": {n: cos[n] for n in worst}, "rel_err_of_worst": {n: rel[n] for n in worst},
                          "tokens": batch.num_tokens, "anchors": blocks.num_blocks}
    print("gradient cosine", json.dumps(out["grad_cosine"]), flush=True)
    return out


def part_p7(ctx: Ctx) -> str:
    """P7: one 8-GPU host at the real depth, projected from this run's one-GPU rates: the target's
    rate per GPU (the proxy's worker rate from p23, scaled by computed layers: the proxy's per-layer
    time equals the full stack's within 1% on the H200), the drafter's (P5d), the best split of 8
    GPUs between them, against the FLOP limit of the host (both services at the measured matmul
    peak). A projection: multi-GPU efficiency is taken as 1 (measured 0.9-1.0 on 4 GPUs before)."""
    a = ctx.args
    parts = ctx.store.read()["parts"]
    p23, p5d = parts.get("p23", {}).get("figures", {}), parts.get("p5d", {}).get("figures", {})
    target_proxy, drafter = p23.get("target_alone_tok_s"), p5d.get("drafter_alone_tok_s")
    peak, drafter_gflop = p5d.get("matmul_peak_tflops"), p5d.get("drafter_gflop_per_token")
    if not (target_proxy and drafter and peak and drafter_gflop):
        raise SkipPart("needs p23's target rate and p5d's drafter rate, FLOPs and matmul peak from this run")
    shape = fixtures.shape_of(fixtures.read_manifest(ctx.workdir))
    proxy_layers = max(shape.capture_ids) + 1
    target = target_proxy * proxy_layers / a.real_layers_computed
    target_gflop = target_flops_per_token(shape, a.real_layers_computed, a.median) / 1e9
    gpus = a.p7_gpus
    rows = host_splits(target, drafter, gpus)
    best = max(rows, key=lambda r: r["tok_s"])
    # the limit is bf16's: both services' counted FLOPs at the measured bf16 matmul peak
    limit = gpus * peak * 1e12 / ((target_gflop + drafter_gflop) * 1e9)
    numbers = {"gpus": gpus, "target_full_depth_tok_s_per_gpu": target, "target_proxy_tok_s": target_proxy,
               "depth_scale": f"{proxy_layers}/{a.real_layers_computed} layers", "drafter_tok_s_per_gpu": drafter,
               "drafter_precision": p5d.get("precision"),
               "target_gflop_per_token": target_gflop, "drafter_gflop_per_token": drafter_gflop,
               "matmul_peak_tflops": peak, "flop_limit_tok_s": limit, "best": best, "splits": rows,
               "projected_tok_s": best["tok_s"]}
    other = p5d.get("drafter_other_tok_s")
    if other:   # the same projection with P5f's other precision (the default's alternative)
        alt = max(host_splits(target, other, gpus), key=lambda r: r["tok_s"])
        numbers["other_precision"] = {"precision": p5d.get("other_precision"), "drafter_tok_s_per_gpu": other,
                                      "best": alt, "over_flop_limit": alt["tok_s"] / limit}
    ctx.store.benchmark("P7", {"projected_over_flop_limit": best["tok_s"] / limit}, numbers)
    print(json.dumps(numbers, indent=1), flush=True)
    return "projected"


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


def part_long(ctx: Ctx) -> str:
    """Whole long documents (issue 33), at one token budget (--long-budget): the target on documents
    of --long-doc tokens against documents of --long-short-doc tokens (tok/s, the cost per token
    and the FLOPs behind it); P2 on the long documents (the worker against the bare forward); P5d
    on them (the drafter step at the published density, up to --anchors anchors per document, in
    chunks of --long-chunk blocks; MFU by counted FLOPs, the attention over the long contexts
    counted; peak memory); then the split of a host's GPUs these rates recommend, as P7 does for
    chat-length data. The target goes first and is freed before the drafter is built."""
    import gc

    from bench.trainer_bench import step_flops
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
    t0 = time.perf_counter()
    runner.warmup(budget)
    figures["first_forward_s"] = time.perf_counter() - t0
    g = torch.Generator().manual_seed(a.seed)
    top = min(runner.vocab_size, shape.mask_token_id)
    proxy_layers = max(shape.capture_ids) + 1
    target: dict[str, Any] = {}
    for name, doc in (("long", long_doc), ("short", short_doc)):
        q, r = divmod(budget, doc)
        lens = torch.tensor([doc] * q + ([r] if r else []), dtype=torch.int32)
        rows = [(torch.randint(0, top, (budget,), generator=g), document_positions(lens), lens)
                for _ in range(1 + a.long_batches)]
        runner.capture(*rows[0])          # untimed: a new document length may still tune a kernel
        timer = fixtures.RegionTimer(dev).start()
        for row in rows[1:]:
            runner.capture(*row)
        tok_s = a.long_batches * budget / timer.stop().seconds()
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
    try:
        dataset = PreparedDataset.open(data_dir)
        packer = Packer(dataset.lengths, budget, a.seed)
        p2 = P2Rig(ctx, runner, dataset, packer, list(range(a.p2_warmup + a.long_p2_batches)), long_doc,
                   a.p2_warmup, "p2long")
        numbers.update(p2.turns(a.long_p2_repeats), tokens_timed=p2.tokens)
        ratios = numbers["ratio_runs"]
        ctx.store.benchmark("P2L", {"worker_over_bare_forward": sum(ratios) / len(ratios)}, numbers)
        figures["target_worker_tok_s"] = numbers["worker_tok_s"]
        print(json.dumps({k: v for k, v in numbers.items() if "stages" not in k}, default=str), flush=True)
    except Exception as e:
        traceback.print_exc()
        failed.append("P2L")
        ctx.store.benchmark_error("P2L", f"{type(e).__name__}: {e}", numbers)
    del runner, p2      # the drafter gets the GPU to itself
    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()

    # P5d on the long documents
    from bench.gpu.drafter_rig import DrafterRig
    from drafter_trainer.fp8 import fp8_supported, resolve_precision
    from drafter_trainer.model import resolve_attention

    peak = fixtures.matmul_peak_tflops(dev, a.matmul_n)
    numbers = {"token_budget": budget, "doc_tokens": long_doc, "anchors_per_doc_max": a.anchors,
               "blocks_per_chunk": a.long_chunk, "split_fc": bool(a.long_split_fc), "matmul_peak_tflops": peak}
    try:
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
            out: dict[str, Any] = {"precision": precision}
            if ctx.cuda:     # read before anything else allocates
                out["peak_mem_gb"] = torch.cuda.max_memory_allocated(dev) / 1e9
            steps = [work[i % len(work)] for i in range(len(times))]
            flops = [step_flops(rig.config, b, bl, rig.model.attn_impl, a.long_chunk) for b, bl in steps]
            total_s, tokens = sum(times), sum(b.num_tokens for b, _ in steps)
            out.update(
                step_s=float(np.median(times)), step_s_all=times, first_steps_s=time.perf_counter() - t0 - total_s,
                tok_s=tokens / total_s, anchors_s=sum(bl.num_blocks for _, bl in steps) / total_s,
                model_tflop_per_step=float(np.mean([f["model_total"] for f in flops])) / 1e12,
                mfu=sum(f["model_total"] for f in flops) / total_s / 1e12 / peak,
                executed_mfu=sum(f["executed_total"] for f in flops) / total_s / 1e12 / peak,
                gflop_per_token=sum(f["model_total"] for f in flops) / tokens / 1e9,
                flops_share={k: float(np.sum([f[k] for f in flops]) / np.sum([f["model_total"] for f in flops]))
                             for k in ("fc", "ctx_kv", "block_proj", "mlp", "attn_visible", "lm_head")})
            return out

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
        p5d = ctx.store.read()["parts"].get("p5d", {}).get("figures", {})
        if p5d.get("drafter_gflop_per_token"):     # the chat-length figure of this run, beside it
            numbers["p5d_gflop_per_token"] = p5d["drafter_gflop_per_token"]
        ctx.store.benchmark("P5dL", {"mfu": numbers["mfu"], "peak_mem_gb": numbers.get("peak_mem_gb")}, numbers)
        print(json.dumps({k: v for k, v in numbers.items() if k not in ("step_s_all", "profile")}, default=str), flush=True)
        del rig, work
    except Exception as e:
        traceback.print_exc()
        failed.append("P5dL")
        ctx.store.benchmark_error("P5dL", f"{type(e).__name__}: {e}", numbers)

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


class _Skip(Exception):
    """The rest of a measured block is left out on purpose (its figures are already recorded)."""


def part_p23(ctx: Ctx) -> str:
    from target_server.data import PreparedDataset
    from target_server.packer import Packer

    a = ctx.args
    dev = ctx.device
    manifest = fixtures.read_manifest(ctx.workdir)
    budget, max_len = manifest["token_budget"], manifest["max_len"]
    runner = fixtures.load_runner(manifest, dev, a.allow_torch_linear)
    t0 = time.perf_counter()
    runner.warmup(budget)
    ctx.store.figures("p23", first_forward_s=time.perf_counter() - t0, linear_backend=runner.linear_backend)
    failed = []
    try:
        if a.firstpass_batches > 0:
            first_pass_by_attention(ctx, runner, manifest)
    except Exception as e:  # a diagnostic: P2 and P3 still run
        traceback.print_exc()
        ctx.store.figures("p23", first_pass_error=f"{type(e).__name__}: {e}"[:500])
    runner.attention_path = "auto"
    if ctx.cuda:
        torch.backends.cuda.enable_cudnn_sdp(False)   # as TargetRunner.load leaves it

    # P2: the server's worker path vs the bare forward over the same batches, repeated in turns
    numbers: dict[str, Any] = {"batches_timed": a.p2_batches, "token_budget": budget, "audit_every": a.audit_every,
                               "repeats": a.p2_repeats}
    try:
        dataset = PreparedDataset.open(manifest["data_dir"])
        packer = Packer(dataset.lengths, budget, a.seed)
        p2 = P2Rig(ctx, runner, dataset, packer, list(range(a.p2_warmup + a.p2_batches)), max_len, a.p2_warmup, "p2")
        numbers["tokens_timed"] = p2.tokens
        numbers.update(p2.turns(a.p2_repeats))
        ratios = numbers["ratio_runs"]
        # P2 and the target-alone rate (P6d, P7) are recorded before the diagnostics, which a
        # part's timeout may cut short (--p2-diagnostics 0 leaves them out)
        ctx.store.figures("p23", target_alone_tok_s=numbers["worker_tok_s"], bare_forward_tok_s=numbers["bare_tok_s"])
        ctx.store.benchmark("P2", {"worker_over_bare_forward": sum(ratios) / len(ratios)}, numbers)
        if not a.p2_diagnostics:
            raise _Skip()
        bare_tok_s, worker_tok_s = p2.bare_tok_s, p2.worker_run
        # diagnostics, each against the bare rate above: the worker without its per-batch audit; a
        # consumer in this process that polls every millisecond (the harness before the seventh
        # session); and the input copies as they were before it (blocking: every batch first waited
        # for the previous forward to finish), the bare loop then measured the same way
        numbers["worker_without_audit_tok_s"] = worker_tok_s(
            patch=lambda w: setattr(w, "_audit", lambda seq, hidden, arrays: True)).tokens_per_s(a.p2_warmup - 1)
        numbers["worker_consumer_polling_tok_s"] = worker_tok_s(poll_interval_s=0.001).tokens_per_s(a.p2_warmup - 1)
        with blocking_input_copies():
            numbers["bare_blocking_inputs_tok_s"] = bare_tok_s()
            blocked = worker_tok_s()
            numbers["worker_blocking_inputs_tok_s"] = blocked.tokens_per_s(a.p2_warmup - 1)
            numbers["worker_blocking_inputs_stages"] = blocked.stages
            # both as they were: the producer and harness of runs before the seventh session
            numbers["worker_blocking_inputs_consumer_polling_tok_s"] = worker_tok_s(
                poll_interval_s=0.001).tokens_per_s(a.p2_warmup - 1)
        # the baseline again, after the workers: how much the bare rate itself moves within a run
        numbers["bare_after_tok_s"] = bare_tok_s()
        del p2
        ctx.store.figures("p23", target_alone_tok_s=numbers["worker_tok_s"], bare_forward_tok_s=numbers["bare_tok_s"])
        ratio = sum(ratios) / len(ratios)
        print(json.dumps({k: v for k, v in numbers.items() if "stages" not in k}, indent=1))
        ctx.store.benchmark("P2", {"worker_over_bare_forward": ratio}, numbers)
    except _Skip:
        print(json.dumps({k: v for k, v in numbers.items() if "stages" not in k}, indent=1))
    except Exception as e:
        traceback.print_exc()
        failed.append("P2")
        ctx.store.benchmark_error("P2", f"{type(e).__name__}: {e}", numbers)

    # P3: packed (varlen) vs padded (transformers' batched forward), bench/target_bench's own runs
    # --p3-docs 0: P3 not run (its padded baseline is the slow half of the part; P2 alone is quick)
    if a.p3_docs <= 0:
        ctx.store.benchmark_error("P3", "not run: --p3-docs 0")
    else:
        numbers = {"docs": a.p3_docs, "median": a.median, "sigma": a.sigma, "max_len": max_len, "token_budget": budget}
        try:
            from bench.target_bench import lognormal_lengths, pack_rows, run_packed, run_padded

            lens = lognormal_lengths(a.p3_docs, a.median, a.sigma, max_len, a.seed + 1)
            g = torch.Generator().manual_seed(a.seed + 1)
            top = min(runner.vocab_size, manifest["shape"]["mask_token_id"])
            docs = [torch.randint(0, top, (n,), generator=g) for n in lens]
            rows = pack_rows(lens, budget)
            per_batch = max(1, budget // max_len)
            real = sum(lens)
            # each run twice: the first pays for new kernel shapes (padded widths, autotune)
            for _ in range(2):
                _, t_packed = run_packed(runner, docs, rows)
            for _ in range(2):
                computed_padded, t_padded = run_padded(runner, docs, per_batch)
            packed_computed = sum(sum(lens[i] for i in row) for row in rows)
            numbers.update({"real_tokens": real, "packed_rows": len(rows), "packed_fill": real / (len(rows) * budget),
                            "padded_batch_docs": per_batch, "packed_tok_s": real / t_packed,
                            "padded_tok_s": real / t_padded,
                            "packed_computed_over_real": packed_computed / real,
                            "padded_computed_over_real": computed_padded / real,
                            "static_padded_computed_over_real": len(lens) * max_len / real})
            print(json.dumps(numbers, indent=1))
            ctx.store.benchmark("P3", {"packed_over_padded_tok_s": numbers["packed_tok_s"] / numbers["padded_tok_s"],
                                       "packed_computed_over_real": numbers["packed_computed_over_real"]}, numbers)
        except Exception as e:
            traceback.print_exc()
            failed.append("P3")
            ctx.store.benchmark_error("P3", f"{type(e).__name__}: {e}", numbers)
    if failed:
        raise RuntimeError(f"{', '.join(failed)} failed (see the log)")
    return "measured"


def part_fp8(ctx: Ctx) -> str:
    """P8: the target as its makers' block-wise FP8 checkpoint against the bf16 one, in one process.
    The proxy's random weights are quantized in memory as `dfpipe quantize-fp8` writes them and run
    as a load runs them (`target_server.fp8.to_block_fp8`: FP8 matmuls where the device has them,
    dequantized weights elsewhere, as in the CPU smoke run). On the same packed batches, in turns
    (bf16 bare loop, FP8 bare loop, FP8 TargetWorker): FP8 over bf16 tok/s (the headline), P2 of
    the FP8 target (its worker over its bare loop), and the relative difference of the two targets'
    captured planes. First, on a GPU with FP8 matmuls, the GEMM micro-benchmark (fp8_gemm.py): each
    GEMM path against bf16 on the 27B target's projections, one JSON line each."""
    import copy

    from bench.gpu.worker_harness import run_worker, worker_config
    from target_server import fp8
    from target_server.data import PreparedDataset
    from target_server.packer import Packer, build_packed

    a = ctx.args
    manifest = fixtures.read_manifest(ctx.workdir)
    budget, max_len = manifest["token_budget"], manifest["max_len"]
    if ctx.cuda and fp8.fp8_matmul_unavailable(ctx.device) is None:
        _fp8_gemm_micro(ctx, budget)
    baseline = fixtures.load_runner(manifest, ctx.device, a.allow_torch_linear)
    t0 = time.perf_counter()
    runner = copy.deepcopy(baseline)
    fp8_matmul = fp8.fp8_matmul_unavailable(ctx.device) is None
    quantized = fp8.to_block_fp8(runner.model, fp8_matmul)
    runner.precision = fp8.precision(True, fp8_matmul, runner.dtype)
    gemms = [m.gemm for m in runner.model.modules() if isinstance(m, fp8.BlockFp8Linear)]
    numbers: dict[str, Any] = {"precision": runner.precision, "baseline_precision": baseline.precision,
                               "quantized_linears": quantized, "quantize_s": time.perf_counter() - t0,
                               "linears_by_gemm": {g: gemms.count(g) for g in sorted(set(gemms))},
                               "cublas_block_gemm": fp8.cublas_block_gemm_unavailable(ctx.device) or "available",
                               "token_budget": budget, "batches_timed": a.p2_batches, "repeats": a.p2_repeats,
                               "weights_gb": {r.precision: sum(p.numel() * p.element_size()
                                                               for p in r.model.parameters()) / 1e9
                                              for r in (baseline, runner)},
                               "baseline_first_forward_s": baseline.warmup(budget),
                               "fp8_first_forward_s": runner.warmup(budget)}   # the FP8 kernels tune here
    dataset = PreparedDataset.open(manifest["data_dir"])
    packer = Packer(dataset.lengths, budget, a.seed)
    seqs = list(range(a.p2_warmup + a.p2_batches))
    batches = [fixtures.batch_tensors(build_packed(dataset, packer.batch(s))) for s in seqs]
    tokens = sum(int(b[0].numel()) for b in batches[a.p2_warmup:])

    def bare_tok_s(r: Any) -> float:
        for b in batches[: a.p2_warmup]:
            r.capture(*b)
        timer = fixtures.RegionTimer(ctx.device).start()
        for b in batches[a.p2_warmup:]:
            r.capture(*b)
        return tokens / timer.stop().seconds()

    # the planes of the first timed batch: how far the FP8 target's features are from the bf16 one's
    batch = batches[a.p2_warmup]
    ref, got = baseline.capture(*batch).float(), runner.capture(*batch).float()
    numbers["feature_rel_diff"] = float((got - ref).norm() / ref.norm())
    numbers["feature_rel_diff_by_layer"] = {str(layer): float((got[i] - ref[i]).norm() / ref[i].norm())
                                            for i, layer in enumerate(runner.layer_ids)}
    del ref, got
    rates: dict[str, list[float]] = {"bf16": [], "fp8": [], "fp8_worker": []}
    for _ in range(a.p2_repeats):
        rates["bf16"].append(bare_tok_s(baseline))
        rates["fp8"].append(bare_tok_s(runner))
        cfg = worker_config(budget, max_len, ctx.ring_name("p8"), ctx.shm_dir, a.ring_slots, ctx.cuda_register(),
                            a.audit_every)
        rates["fp8_worker"].append(run_worker(runner, cfg, dataset, packer, seqs).tokens_per_s(a.p2_warmup - 1))
    n = len(rates["fp8"])
    ratios = [f / b for f, b in zip(rates["fp8"], rates["bf16"])]
    p2 = [w / f for w, f in zip(rates["fp8_worker"], rates["fp8"])]
    numbers.update({f"{k}_tok_s": sum(v) / n for k, v in rates.items()})
    numbers.update({f"{k}_runs_tok_s": v for k, v in rates.items()}, ratio_runs=ratios, fp8_p2_runs=p2)
    ctx.store.figures("fp8", **numbers)
    ctx.store.benchmark("P8", {"fp8_over_bf16_tok_s": sum(ratios) / n, "fp8_worker_over_bare_forward": sum(p2) / n},
                        numbers)
    print(json.dumps(numbers, indent=1), flush=True)
    return "measured"


def _fp8_gemm_micro(ctx: Ctx, budget: int) -> None:
    """P8's GEMM micro-benchmark (bench/gpu/fp8_gemm.py) at a batch's tokens and a quarter of them;
    a failure is logged and recorded, and P8 runs on."""
    from bench.gpu.fp8_gemm import best, compare

    try:
        records = compare(tokens=(budget, max(1, budget // 4)), device=ctx.device)
    except Exception as e:
        traceback.print_exc()
        ctx.store.figures("fp8", gemm_error=f"{type(e).__name__}: {e}")
        return
    for r in records:
        print(json.dumps({"fp8_gemm": r}), flush=True)
    summary = best(records)
    print(json.dumps({"fp8_gemm_summary": summary}), flush=True)
    ctx.store.figures("fp8", gemm=records, gemm_summary=summary)


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

    def bare_tok_s(self) -> float:
        for b in self.batches[: self.warmup]:
            self.runner.capture(*b)
        timer = fixtures.RegionTimer(self.ctx.device).start()
        for b in self.batches[self.warmup:]:
            self.runner.capture(*b)
        return self.tokens / timer.stop().seconds()

    def worker_run(self, **kwargs: Any) -> Any:
        """One TargetWorker run over the seqs (run_worker's keyword arguments: a patch, a polling consumer)."""
        from bench.gpu.worker_harness import run_worker, worker_config

        a = self.ctx.args
        cfg = worker_config(self.packer.token_budget, self.max_len, self.ctx.ring_name(self.ring), self.ctx.shm_dir,
                            a.ring_slots, self.ctx.cuda_register(), a.audit_every)
        return run_worker(self.runner, cfg, self.dataset, self.packer, self.seqs, **kwargs)

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


def first_pass_by_attention(ctx: Ctx, runner: Any, manifest: dict[str, Any]) -> None:
    """Why a target's first pass over a batch is slower than a repeat: for each attention variant,
    fresh batches (never seen by this process) timed once, then the same batches again. Variants:
    SDPA per document with cuDNN's attention allowed (torch's default) and without it, and one flash
    varlen call per row (the default on CUDA). Figures `first_pass` in part p23."""
    from target_server.data import PreparedDataset
    from target_server.packer import Packer, build_packed

    a = ctx.args
    variants = [("per_document+cudnn", "per_document", True), ("per_document", "per_document", False)]
    if ctx.cuda:
        variants.append(("varlen", "varlen", False))
    dataset = PreparedDataset.open(manifest["data_dir"])
    packer = Packer(dataset.lengths, manifest["token_budget"], a.seed)
    out: dict[str, Any] = {"batches": a.firstpass_batches}
    for i, (name, path, cudnn) in enumerate(variants):
        # seqs far past those P2 and the services use, and different for every variant
        seqs = range(10_000 + 100 * i, 10_000 + 100 * i + a.firstpass_batches)
        batches = [fixtures.batch_tensors(build_packed(dataset, packer.batch(s))) for s in seqs]
        tokens = sum(int(b[0].numel()) for b in batches)
        runner.attention_path = path
        if ctx.cuda:
            torch.backends.cuda.enable_cudnn_sdp(cudnn)
        rates = []
        for _ in range(2):
            timer = fixtures.RegionTimer(ctx.device).start()
            for b in batches:
                runner.capture(*b)
            rates.append(tokens / timer.stop().seconds())
        out[name] = {"first_tok_s": rates[0], "repeat_tok_s": rates[1], "first_over_repeat": rates[0] / rates[1],
                     "docs_per_batch": sum(int(b[2].numel()) for b in batches) / len(batches)}
        print(f"first pass, {name}: {rates[0]:,.0f} tok/s first, {rates[1]:,.0f} repeat", flush=True)
        ctx.store.figures("p23", first_pass=out)


# A card that holds the co-located target (16.4 GB at the proxy) and a trainer with the default
# chunk (62.8 GB on the H100, where it ran out of memory) needs this much: smaller cards step the
# services part's trainer in half-size chunks (peak memory grows with the chunk; P6d is a ratio of
# rates measured on the same chunk's step, p5d's, so it stays comparable).
SERVICES_FULL_CHUNK_GB = 100


def services_chunk(ctx: Ctx) -> int:
    """drafter.blocks_per_chunk for the services part: 0 (auto) on a card of at least
    SERVICES_FULL_CHUNK_GB, else half the auto chunk."""
    from drafter_trainer.loss import auto_blocks_per_chunk

    if not ctx.cuda or torch.cuda.get_device_properties(ctx.device).total_memory >= SERVICES_FULL_CHUNK_GB * 1e9:
        return 0
    return auto_blocks_per_chunk(ctx.args.block) // 2


def part_services(ctx: Ctx) -> str:
    from bench.gpu.services import ServicePlan, run_services

    a = ctx.args
    manifest = fixtures.read_manifest(ctx.workdir)
    plan = ServicePlan(workdir=ctx.workdir, manifest=manifest, device=str(ctx.device) if ctx.cuda else "cpu",
                       ring_name=ctx.ring_name("svc"), shm_dir=ctx.shm_dir, slots=a.ring_slots, anchors=a.anchors,
                       block=a.block, drafter_layers=a.drafter_layers, loss_chunk=a.loss_chunk,
                       audit_every=a.audit_every, p6_seconds=a.p6_seconds, p6_skip_steps=a.p6_skip_steps,
                       cold_triton=a.cold_triton, step_timeout_s=a.step_timeout,
                       attn=a.drafter_attn or ctx.store.read()["parts"].get("p5", {}).get("figures", {}).get(
                           "best_attn") or "auto", blocks_per_chunk=services_chunk(ctx))
    figures: dict[str, Any] = {"blocks_per_chunk": plan.blocks_per_chunk}
    error = None
    try:
        run_services(plan, a.part_budget, figures)
    except Exception as e:
        traceback.print_exc()
        error = f"{type(e).__name__}: {e}"[:2000]
    finally:  # also on a timeout's SIGTERM: what was measured stays
        ctx.store.figures("services", **figures)
    warm = figures.get("warm") or {}   # the warm start-up: first step, compiled from, compiled step time
    if "over_cold_first_step" in warm and figures.get("target_load_s"):
        numbers = {k: figures.get(k) for k in ("cold_first_step_s", "target_load_s", "target_warmup_s",
                                               "cold_triton_cache", "device", "cold_compiled_median_step_s")}
        numbers.update({f"warm_{k}": warm.get(k) for k in ("first_step_s", "compiled_after_s",
                                                           "compiled_median_step_s", "eager_steps")})
        # The real target's cold start: the proxy's, with the load grown to the full depth's bytes
        # (read from the fixture's safetensors headers). The warm-up's autotune runs once per
        # kernel shape, which every layer shares, so it stays as measured.
        layer_bytes, rest, layers = fixtures.layer_and_rest_bytes(manifest["target_dir"])
        full_bytes = rest + layer_bytes / layers * a.real_layers_computed
        cold_full = figures["cold_first_step_s"] + figures["target_load_s"] * (full_bytes / (rest + layer_bytes) - 1)
        numbers.update(full_depth_cold_first_step_s=cold_full, proxy_weight_gb=(rest + layer_bytes) / 1e9,
                       full_depth_weight_gb=full_bytes / 1e9, warm_over_proxy_cold=warm["over_cold_first_step"])
        ctx.store.benchmark("P4", {"warm_over_cold_first_step": warm["first_step_s"] / cold_full}, numbers)
    else:
        ctx.store.benchmark_error("P4", error or "not measured", figures)
    parts = ctx.store.read()["parts"]
    target_alone = parts.get("p23", {}).get("figures", {}).get("target_alone_tok_s")
    p5d = parts.get("p5d", {}).get("figures", {})
    drafter_alone, drafter_anchors_s = p5d.get("drafter_alone_tok_s"), p5d.get("drafter_alone_anchors_s")
    together = figures.get("together_tok_s")
    numbers = {"together_tok_s": together, "target_alone_tok_s": target_alone, "drafter_alone_tok_s": drafter_alone,
               "drafter_alone_anchors_s": drafter_anchors_s, "together_steps": figures.get("together_steps"),
               "together_mean_step_s": figures.get("together_mean_step_s"),
               "together_tokens": figures.get("together_tokens"), "together_anchors": figures.get("together_anchors")}
    if together and target_alone and drafter_alone and drafter_anchors_s and figures.get("together_anchors"):
        # The ideal priced on the window's own batches: each costs its tokens at the target's rate
        # plus its anchors at the drafter's (a batch's drafter step grows with its anchors, 3,000 to
        # 10,000 a batch here, so a token rate from other batches would price a short window's mix
        # wrongly). together / ideal = ideal seconds of those batches / the seconds they took.
        ideal_s = figures["together_tokens"] / target_alone + figures["together_anchors"] / drafter_anchors_s
        ideal = figures["together_tokens"] / ideal_s
        numbers.update(ideal_tok_s=ideal, ideal_tok_s_token_priced=1.0 / (1.0 / target_alone + 1.0 / drafter_alone))
        ctx.store.benchmark("P6d", {"together_over_ideal": together / ideal}, numbers)
    else:
        missing = [k for k in ("together_tok_s", "target_alone_tok_s", "drafter_alone_tok_s", "drafter_alone_anchors_s",
                               "together_anchors") if not numbers[k]]
        ctx.store.benchmark_error("P6d", error or f"missing {', '.join(missing)}", numbers)
    print(json.dumps({k: v for k, v in figures.items() if not k.endswith("_stages")}, indent=1, default=str))
    if error:
        raise RuntimeError(error)
    return "measured"


def part_scale(ctx: Ctx) -> str:
    """Issue 8: target workers N = 1..G (one per GPU in one server-shaped process, a consumer that
    acks at once) and drafter ranks M = 1..G over NCCL (torchrun, the trainer's step and all-reduce),
    each against N (M) times the single one measured in the same run; then the split of a host's
    GPUs between the two that the measured rates recommend."""
    import gc

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
    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()

    attn = a.drafter_attn or ctx.store.read()["parts"].get("p5", {}).get("figures", {}).get("best_attn") or "auto"
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
        got = _read_json(out_json)
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


@contextlib.contextmanager
def blocking_input_copies() -> Iterator[None]:
    """The target's input copies as they were before the seventh session: one `.to(device)` per
    tensor from pageable memory, each of which waits for the stream (the previous forward)."""
    from target_server import varlen

    def blocking(device: Any, *items: Any) -> list[Any]:
        return [item.with_tensors([t.to(device) for t in item.tensors()]) if isinstance(item, varlen.PackedDocs)
                else item.to(device) for item in items]

    shipped = varlen.to_device
    varlen.to_device = blocking
    try:
        yield
    finally:
        varlen.to_device = shipped


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
    try:
        start.wait()
    except threading.BrokenBarrierError:
        pass
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


def part_placements(ctx: Ctx) -> str:
    """Issue 8: both real services placed on chosen GPUs (target devices / trainer ranks), end to end,
    against the ideal from the scale part's rates in the same run: co-located placements against
    1/(1/target + 1/drafter), disjoint ones against min(target, drafter)."""
    from bench.gpu.services import ServicePlan, run_placement

    a = ctx.args
    manifest = fixtures.read_manifest(ctx.workdir)
    gpus = torch.cuda.device_count() if ctx.cuda else 1
    specs = [x for x in (a.placements or ("0/1,01/01" if gpus >= 2 else "0/0")).split(",") if x]
    scale = ctx.store.read()["parts"].get("scale", {}).get("figures", {})
    attn = a.drafter_attn or ctx.store.read()["parts"].get("p5", {}).get("figures", {}).get("best_attn") or "auto"
    results: dict[str, Any] = {}
    deadline = time.monotonic() + a.part_budget
    for spec in specs:
        t_ids, d_ids = spec.split("/")
        name = spec.replace("/", "-")
        as_dev = (lambda ids: [f"cuda:{c}" for c in ids]) if ctx.cuda else (lambda ids: ["cpu"] * len(ids))
        plan = ServicePlan(workdir=ctx.workdir, manifest=manifest, device=str(ctx.device) if ctx.cuda else "cpu",
                           ring_name=ctx.ring_name(f"pl{name}"), shm_dir=ctx.shm_dir, slots=a.ring_slots,
                           anchors=a.anchors, block=a.block, drafter_layers=a.drafter_layers,
                           loss_chunk=a.loss_chunk, audit_every=a.audit_every, p6_seconds=a.p6_seconds,
                           p6_skip_steps=a.p6_skip_steps, cold_triton="shared", step_timeout_s=a.step_timeout,
                           attn=attn, target_devices=as_dev(t_ids), trainer_devices=as_dev(d_ids))
        figures: dict[str, Any] = {}
        try:
            run_placement(plan, name, max(30.0, deadline - time.monotonic()), figures)
        except Exception as e:
            traceback.print_exc()
            figures["error"] = f"{type(e).__name__}: {e}"[:1000]
        t_alone = scale.get("target", {}).get(str(len(t_ids)), {}).get("tok_s")
        d_alone = scale.get("drafter", {}).get(str(len(d_ids)), {}).get("tok_s")
        shared = set(t_ids) & set(d_ids)
        if t_alone and d_alone and (not shared or set(t_ids) == set(d_ids)):
            ideal = min(t_alone, d_alone) if not shared else 1.0 / (1.0 / t_alone + 1.0 / d_alone)
            figures.update(target_alone_tok_s=t_alone, drafter_alone_tok_s=d_alone, ideal_tok_s=ideal,
                           ideal_rule="min" if not shared else "harmonic")
            if figures.get("together_tok_s"):
                figures["together_over_ideal"] = figures["together_tok_s"] / ideal
        results[name] = figures
        ctx.store.figures("placements", **results)
        print(name, json.dumps({k: v for k, v in figures.items() if k != "target_stages"}), flush=True)
    if not any("together_tok_s" in f for f in results.values()):
        raise RuntimeError("no placement ran to the end")
    return "measured"


# ---- helpers -------------------------------------------------------------------------------------
def target_shape(a: argparse.Namespace) -> fixtures.TargetShape:
    ids = tuple(int(x) for x in a.capture_ids.split(","))
    if any(not 0 <= i < a.layers for i in ids) or list(ids) != sorted(set(ids)):
        raise SystemExit(f"--capture-ids {a.capture_ids}: strictly increasing ids inside the {a.layers} layers")
    if not 0 <= a.mask_token_id < a.vocab:
        raise SystemExit(f"--mask-token-id {a.mask_token_id} outside the vocabulary of {a.vocab}")
    return fixtures.TargetShape(hidden=a.hidden, layers=a.layers, capture_ids=ids, heads=a.heads, kv_heads=a.kv_heads,
                                head_dim=a.head_dim, intermediate=a.intermediate, linear_k_heads=a.linear_k_heads,
                                linear_v_heads=a.linear_v_heads, linear_k_dim=a.linear_k_dim,
                                linear_v_dim=a.linear_v_dim, vocab=a.vocab, mask_token_id=a.mask_token_id)


def versions(device: torch.device) -> dict[str, Any]:
    out: dict[str, Any] = {"python": platform.python_version(), "host": platform.node(), "torch": torch.__version__,
                           "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
                           "device": str(device), "cpus": os.cpu_count()}
    for mod in ("transformers", "triton", "fla", "zmq", "msgpack", "numpy", "safetensors"):
        try:
            out[mod] = getattr(importlib.import_module(mod), "__version__", "unknown")
        except Exception as e:  # a missing or broken package is a finding, not a crash
            out[mod] = f"missing ({type(e).__name__}: {e})"[:200]
    try:
        import triton
        autotuning = getattr(getattr(triton, "knobs", None), "autotuning", None)
        out["triton_autotune_cache_knob"] = hasattr(autotuning, "cache")  # TRITON_CACHE_AUTOTUNING is read
    except ImportError:
        pass
    for var in ("TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING", "PYTHONPATH"):
        out[var] = os.environ.get(var, "")
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        out.update(gpu=p.name, gpu_count=torch.cuda.device_count(), gpu_memory_gb=round(p.total_memory / 1e9, 1),
                   sm_count=p.multi_processor_count, capability=f"{p.major}.{p.minor}")
    # what bounds the transport: GPU <-> CPU/NUMA affinity, and whether /dev/shm may use huge pages
    for name, cmd in (("gpu_topology", ["nvidia-smi", "topo", "-m"]), ("numa", ["numactl", "--hardware"])):
        try:
            out[name] = subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout[-3000:]
        except (OSError, subprocess.SubprocessError) as e:
            out[name] = f"unavailable ({type(e).__name__})"
    for name, path in (("shmem_thp", "/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
                       ("thp", "/sys/kernel/mm/transparent_hugepage/enabled")):
        try:
            with open(path, encoding="ascii") as f:
                out[name] = f.read().strip()
        except OSError:
            out[name] = "unavailable"
    try:
        with open("/proc/mounts", encoding="ascii") as f:
            out["dev_shm_mount"] = next((line.strip() for line in f if " /dev/shm " in line), "not mounted")
    except OSError:
        out["dev_shm_mount"] = "unavailable"
    return out


def max_row_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| / |b| over the hidden rows (one token of one plane)."""
    a, b = a.float(), b.float()
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)).max())


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN == NaN, -0 != +0), the meaning of 'the copy is the data'."""
    return (a.shape == b.shape and a.dtype == b.dtype
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))


def fla_packed_vs_per_document(runner: Any, manifest: dict[str, Any]) -> list[float]:
    """Relative error of each document's planes, packed (FLA varlen) vs alone (transformers' forward)."""
    from common.batch import document_positions

    lens = [n for n in (1, 3, 70, 300, 1200) if n <= manifest["max_len"]]
    g = torch.Generator().manual_seed(7)
    top = min(runner.vocab_size, manifest["shape"]["mask_token_id"])
    docs = [torch.randint(0, top, (n,), generator=g) for n in lens]
    doc_lens = torch.tensor(lens, dtype=torch.int32)
    packed = runner.capture(torch.cat(docs), document_positions(doc_lens), doc_lens).float()
    errs, start = [], 0
    for doc in docs:
        alone = runner.capture_unpacked(doc).float()
        part = packed[:, start:start + len(doc)]
        errs.append(float((part - alone).norm() / alone.norm().clamp_min(1e-12)))
        start += len(doc)
    return errs


def junit_cases(path: str) -> list[dict[str, str]]:
    if not os.path.isfile(path):
        return []
    cases = []
    for tc in ET.parse(path).iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            child = tc.find(tag)
            if child is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (child.get("message") or "")[:300]
                break
        cases.append({"test": f"{tc.get('classname')}::{tc.get('name')}", "outcome": outcome, "message": message})
    return cases


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}


# ---- the command line ----------------------------------------------------------------------------
PARTS: dict[str, Callable[[Ctx], str]] = {
    "env": part_env, "tests": part_tests, "copycheck": part_copycheck, "p1": part_p1, "p5": part_p5,
    "p5d": part_p5d, "p23": part_p23, "fp8": part_fp8, "services": part_services, "p7": part_p7, "scale": part_scale,
    "placements": part_placements, "fp8lib": part_fp8lib, "long": part_long,
}
NEEDS_CUDA_UNLESS_QUICK = set(PARTS) - {"env", "p7"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("part", choices=[*PARTS, "p1-consumer"])
    p.add_argument("--quick", action="store_true", help="tiny sizes: the CPU smoke run")
    p.add_argument("--out", default=os.environ.get("OUT") or "./out")
    p.add_argument("--workdir", default=os.environ.get("DFPIPE_BENCH_WORKDIR") or "/tmp/dfpipe-gpu-bench")
    p.add_argument("--device", default="auto", help="auto: cuda:0 when CUDA is available, else cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--allow-torch-linear", action="store_true",
                   help="carry on when FLA is missing on CUDA (the target then runs the slow torch GDN path)")
    p.add_argument("--audit-every", type=int, default=0,
                   help="target.audit_every for the worker and the services (configs/gpu.yaml: 200)")
    p.add_argument("--cold-triton", choices=["fresh", "shared"], default="fresh",
                   help="P4 cold start with an empty Triton cache (a new host) or the run's warm one")
    p.add_argument("--part-budget", type=float, default=300.0, help="seconds this part may take (run_all.sh sets it)")
    for name, value in FULL.items():
        flag = "--" + name.replace("_", "-")
        p.add_argument(flag, type=type(value), default=None, help=f"default {value} (--quick: {QUICK[name]})")
    # p1-consumer (internal)
    p.add_argument("--ring-path", default="")
    p.add_argument("--consumer-device", default="cpu")
    p.add_argument("--nbytes", type=int, default=0)
    p.add_argument("--cuda-register", default="off")
    return p


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    sizes = QUICK if args.quick else FULL
    for name, value in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def main(argv: list[str] | None = None) -> int:
    args = resolve(build_parser().parse_args(argv))
    if args.part == "p1-consumer":
        from bench.gpu.transport import consumer_main
        consumer_main(args.ring_path, args.consumer_device, args.nbytes, args.cuda_register)
        return 0
    os.makedirs(args.workdir, exist_ok=True)
    os.environ["DFPIPE_BENCH_WORKDIR"] = args.workdir
    store = ResultStore(os.path.join(args.out, "results.json"))

    device = torch.device(("cuda:0" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    if device.type == "cpu":
        # small ops of the torch GDN path run ~3x slower with 2 OpenMP threads than with 1 (docs/benchmarks.md)
        torch.set_num_threads(1)
    else:
        import torch._dynamo as dynamo   # `import torch._dynamo` here would make torch local to main

        # a part steps one model on several attention paths and precisions (its A/Bs), each with
        # graphs of its own: past dynamo's default of 8 a layer would quietly run eager
        dynamo.config.recompile_limit = 64
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else args.workdir
    ctx = Ctx(args=args, store=store, device=device, workdir=args.workdir, shm_dir=shm)
    store.update(lambda d: d["meta"].update(quick=args.quick, device=str(device), workdir=args.workdir,
                                            smoke=args.quick or device.type != "cuda"))
    # a timeout's SIGTERM must run the finally-blocks (rings unlinked, service processes ended)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(TERMINATED))
    name = args.part
    print(f"=== part {name}: device {device}, quick={args.quick}, budget {args.part_budget:.0f}s", flush=True)
    store.part(name, "running", started=time.time())
    t0 = time.time()
    status, verdict, error = "ok", "", None
    try:
        if name in NEEDS_CUDA_UNLESS_QUICK and device.type != "cuda" and not args.quick:
            raise SkipPart("no CUDA")
        verdict = PARTS[name](ctx)
    except SkipPart as e:
        status, error = "skipped", str(e)
        print(f"skipped: {e}", flush=True)
        for key in (k for k, owner in PART_OF.items() if owner == name):
            store.benchmark_error(key, f"skipped: {e}")
    except SystemExit as e:
        if e.code != TERMINATED:
            raise
        status, error = "timeout", "stopped by SIGTERM (run_all.sh's per-part timeout)"
        print(error, flush=True)
    except BaseException as e:  # noqa: BLE001  (recorded, then the run goes on with the next part)
        traceback.print_exc()
        status, error = "error", f"{type(e).__name__}: {e}"[:2000]
    finally:
        store.part(name, status, seconds=round(time.time() - t0, 2), verdict=verdict, error=error)
    print(f"=== part {name}: {status} {verdict or ''} {error or ''} ({time.time() - t0:.1f}s)", flush=True)
    return 0 if status in ("ok", "skipped") else 1


if __name__ == "__main__":
    sys.exit(main())
