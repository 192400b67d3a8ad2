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
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402

from bench.gpu.parts import (copycheck, env, fp8, fp8lib, long, p1, p5, p5d, p7, p23,  # noqa: E402
                             placements, scale, services, tests)
from bench.gpu.parts.scale import bare_forward_tok_s, recommend_split  # noqa: E402,F401  (tests import them from here)
from bench.gpu.results import PART_OF, ResultStore  # noqa: E402
from bench.gpu.shared import Ctx, SkipPart  # noqa: E402

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
    median=48.0, dataset_docs=400, copy_batches=24, copy_budget=256, p1_iters=8, p2_batches=6, p2_warmup=2, p3_docs=24,
    p5_tokens=256, p5_anchors=16, anchors=32, p5d_batches=2, p5d_chunks="0,8", p5d_steps=2, loss_chunk=256, p5_steps=3, p5_warmup=1, p5_attn="split,sdpa", p6_seconds=6.0, p6_skip_steps=2,
    matmul_n=512, step_timeout=240.0, scale_batches=4, firstpass_batches=2,
    drafter_layers=2,   # two layers keep the layer-to-layer path; each more one only costs CI's CPU time
    p5_compile="off",   # an inductor compile costs ~30 s of CI's two cores; tests/test_drafter_compile.py checks it
    p5d_other_precision="fp8-emulated",   # the CPU has no FP8 matmuls: the P5f plumbing runs on the emulation
    long_budget=512, long_doc=512, long_short_doc=128, long_batches=2, long_p2_batches=2, long_p2_repeats=1,
    long_p5d_steps=2, long_chunk=16,
)
TERMINATED = 143   # exit code of a part stopped by SIGTERM (128 + 15)


# ---- the command line: the registry of parts (bench/gpu/parts/), one part a process --------------
PARTS: dict[str, Callable[[Ctx], str]] = {
    "env": env.part_env, "tests": tests.part_tests, "copycheck": copycheck.part_copycheck, "p1": p1.part_p1,
    "p5": p5.part_p5, "p5d": p5d.part_p5d, "p23": p23.part_p23, "fp8": fp8.part_fp8, "services": services.part_services,
    "p7": p7.part_p7, "scale": scale.part_scale, "placements": placements.part_placements,
    "fp8lib": fp8lib.part_fp8lib, "long": long.part_long,
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():   # the sizes no flag set
        if getattr(args, name) is None:
            setattr(args, name, value)
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
