"""Part `tests`: the CUDA tests of tests/ as CI has them (`pytest -k "gpu or cuda"`), then
test_target_packing's GPU tests again with FLA really loaded (bench.gpu.pytest_real_fla), and with
--e2e-tests the end-to-end tests with both services on CUDA. Result: fails on a failed test, on any
CUDA test skipped on a CUDA host, or if packed == per-document did not run on FLA."""
from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from typing import Any

from bench.gpu.shared import REPO, Ctx, read_json

TEST_FILES = ("tests/test_target_packing.py", "tests/test_target_capture.py", "tests/test_fp8_target.py",
              "tests/test_ring.py", "tests/test_drafter_model.py", "tests/test_drafter_compile.py", "tests/test_optim.py",
              "tests/test_step_syncs.py", "tests/test_block_flash.py", "tests/test_block_mask.py")
GPU_TEST_FILTER = "gpu or cuda"   # test names and the gpu marker (substring match: not "fla", which matches "dflash")
EXPECTED_SKIPS = ("checks the behaviour without CUDA",   # test_ring's CPU-only check, skipped on a GPU host
                  "two CUDA ranks need two GPUs")          # test_e2e_trainer's two ranks, on a one-GPU host


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
    backends = read_json(os.path.join(work, "backends.json"))
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
