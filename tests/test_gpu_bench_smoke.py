"""The GPU benchmark suite's plumbing, at tiny sizes on the CPU (`run_all.sh --quick`): every part
that needs no CUDA-only feature runs to the end and writes its figures. Device time on the GPU
host is scarce; a benchmark broken by a refactor must fail here, not there. (The figures of a CPU
run mean nothing and are not checked.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from machine_speed import scaled, slowness
from tolerances import tol

REPO = Path(__file__).resolve().parents[1]
# Two halves, each its own run of run_all.sh on its own fixtures, so two test workers share the
# suite's slowest test: the chat-length headline parts, and the others (with the scripts run by hand).
HEADLINE = ("env", "p1", "p5", "p5d", "p23", "services", "p7")
OTHERS = ("env", "scale", "placements", "long")
# Below --quick's sizes, to the least that still runs each part's code (once where --quick repeats):
# one P2 turn of 3 timed batches (after the 2 warm-up ones a worker's rate needs), 2 drafter steps
# (scale's ranks, p5), 3 batches a target worker (scale: a rate needs more publishes than workers),
# a 3 s P6 window and 12 P3 documents.
SMOKE_SIZES = ("--p2-repeats", "1", "--p2-batches", "3", "--p5-steps", "2", "--scale-batches", "3",
               "--p6-seconds", "3", "--p3-docs", "12")

# The two runs of the suite (bench_smoke) take ~150 CPU-s, an eighth of all the other tests together:
# `make test` leaves them out, `make test-bench` runs them (two workers, a half each), and so does
# CI (.ci/run) after `make test`. The other tests here take seconds and stay in `make test`.
pytestmark = pytest.mark.slow


def limits_env(budget_s: float) -> dict[str, str]:
    """run_all.sh's wall-clock limits, set for the reference machine, scaled to this one: the run's
    budget and every part's upper limit."""
    return {"BENCH_BUDGET_S": str(round(scaled(budget_s))), "BENCH_LIMIT_PERCENT": str(round(100 * slowness()))}


def run_quick(tmp_path: Path, parts: tuple[str, ...]) -> tuple[dict, dict, str]:
    """run_all.sh --quick over `parts`: (its environment, results.json, the run id); every part ok
    and no ring of the run left in /dev/shm."""
    run_id = f"smoke{os.getpid()}{parts[1]}"
    env = {**os.environ, "OUT": str(tmp_path / "out"), "DFPIPE_BENCH_WORKDIR": str(tmp_path / "work"),
           "PYTHON": sys.executable, "BENCH_PARTS": " ".join(parts), **limits_env(900),
           "OMP_NUM_THREADS": "1", "DFPIPE_BENCH_RUN_ID": run_id}
    res = subprocess.run(["bash", str(REPO / "bench" / "gpu" / "run_all.sh"), "--quick", *SMOKE_SIZES,
                          "--step-timeout", str(scaled(240))], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=scaled(660))
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    logs = {p: (tmp_path / "out" / f"{p}.log").read_text(errors="replace")[-3000:]
            for p in parts if (tmp_path / "out" / f"{p}.log").exists()}
    for part in parts:
        assert results["parts"].get(part, {}).get("status") == "ok", (part, logs.get(part), res.stdout[-2000:])
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"dfpgb-{run_id}-")], "rings left in /dev/shm"
    return env, results, run_id


def test_a_part_starts_while_the_budget_left_covers_its_own_need(tmp_path: Path) -> None:
    """P7's projection needs ~5 s: with 14 s of the run's budget left it runs (a default run once
    ended 10 s short of a fixed 15 s floor and printed P7 as not run). Alone, it says what it lacks."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "DFPIPE_BENCH_WORKDIR": str(tmp_path / "work"),
           "PYTHON": sys.executable, "BENCH_PARTS": "p7", "BENCH_BUDGET_S": "14", "OMP_NUM_THREADS": "1"}
    res = subprocess.run(["bash", str(REPO / "bench" / "gpu" / "run_all.sh"), "--quick"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=scaled(120))
    p7 = json.loads((tmp_path / "out" / "results.json").read_text())["parts"]["p7"]
    assert p7["status"] == "skipped" and "needs p23" in p7["error"], (p7, res.stdout[-2000:])


@pytest.mark.bench_smoke
@pytest.mark.timeout(720)
def test_the_headline_benchmark_parts_run_at_quick_sizes(tmp_path: Path) -> None:
    _, results, _ = run_quick(tmp_path, HEADLINE)
    figures = {p: results["parts"][p].get("figures", {}) for p in HEADLINE}
    assert figures["p1"]["variants"] and figures["p5"]["best_attn"] in ("split", "sdpa")
    assert figures["services"]["warm"]["startup"]["first_step_s"] > 0
    first_pass = figures["p23"]["first_pass"]
    assert {"per_document+cudnn", "per_document"} <= set(first_pass), first_pass   # varlen: CUDA only
    assert all(v["first_tok_s"] > 0 and v["repeat_tok_s"] > 0 for k, v in first_pass.items() if k != "batches")
    p5d = figures["p5d"]
    assert p5d["anchors_per_batch"] > 0 and p5d["drafter_alone_tok_s"] > 0 and len(p5d["chunks"]) == 2
    # P5f's plumbing (FP8 emulated on the CPU) and P7 projected with both precisions
    assert p5d["other_precision"] == "fp8-emulated" and p5d["drafter_other_tok_s"] > 0
    p7 = results["benchmarks"]["P7"]["numbers"]
    assert p7["other_precision"]["best"]["tok_s"] > 0 and 0 <= p7["best"]["idle_share"] < 1
    for key in ("P1", "P2", "P3", "P4", "P5", "P5d", "P5f", "P6d", "P7"):
        bench = results["benchmarks"][key]
        assert bench["ratio"] is not None and bench["error"] is None, (key, bench)


@pytest.mark.bench_smoke
@pytest.mark.timeout(720)
def test_the_other_benchmark_parts_and_scripts_run_at_quick_sizes(tmp_path: Path) -> None:
    env, results, run_id = run_quick(tmp_path, OTHERS)
    figures = {p: results["parts"][p].get("figures", {}) for p in OTHERS}
    assert set(figures["scale"]["target"]) == {"1", "2"} and set(figures["scale"]["drafter"]) == {"1", "2"}
    assert all(v["bare_tok_s"] > 0 and v["worker_over_bare"] > 0 for v in figures["scale"]["target"].values())
    assert figures["scale"]["split"]["proxy"]["8"]["best"]["target_gpus"] >= 1
    placement = figures["placements"]["0-0"]
    assert placement["together_tok_s"] > 0 and placement["produced_tok_s"] is not None
    long = figures["long"]
    assert long["target"]["long"]["tok_s"] > 0 and long["target"]["short"]["tok_s"] > 0
    assert long["target"]["long"]["docs_per_batch"] == 1 and long["target"]["short"]["docs_per_batch"] > 1
    assert long["split"]["best"]["target_gpus"] >= 1
    for key in ("P2L", "P5dL"):
        bench = results["benchmarks"][key]
        assert bench["ratio"] is not None and bench["error"] is None, (key, bench)
    # P5dL steps the trainer's default precision, then the other one on the same batches
    p5dl = results["benchmarks"]["P5dL"]["numbers"]
    assert p5dl["precision"] == "bf16" and p5dl["other_precision"]["precision"] == "fp8-emulated"
    assert p5dl["other_precision"]["tok_s"] > 0 and long["split_other_precision"]["best"]["target_gpus"] >= 1

    # the FP8 target part (not in the default run: BENCH_PARTS="env fp8") on the same fixtures; no
    # FP8 matmuls on the CPU, so its quantized weights run dequantized
    res = subprocess.run([sys.executable, str(REPO / "bench" / "gpu" / "gpu_bench.py"), "fp8", "--quick", *SMOKE_SIZES],
                         cwd=REPO, env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=scaled(300))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    fp8 = results["parts"]["fp8"]["figures"]
    assert fp8["precision"] == "fp8-block-dequantized-fp32" and fp8["quantized_linears"] > 0
    assert 0 < fp8["feature_rel_diff"] < 1 and set(fp8["feature_rel_diff_by_layer"]) == {"1", "2", "4", "6", "7"}
    assert results["benchmarks"]["P8"]["ratio"] is not None and results["benchmarks"]["P8"]["error"] is None
    assert fp8["fp8_worker_tok_s"] > 0 and len(fp8["fp8_p2_runs"]) == fp8["repeats"]
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"dfpgb-{run_id}-")], "rings left in /dev/shm"

    # the first-step profile script (run by hand on the GPU host) on the same fixtures
    first = tmp_path / "first_step.json"
    res = subprocess.run([sys.executable, str(REPO / "bench" / "gpu" / "first_step.py"), "--workdir",
                          str(tmp_path / "work"), "--out-json", str(first), "--device", "cpu", "--attn", "split",
                          "--layers", "1", "--anchors", "8", "--block", "4", "--loss-chunk", "64",
                          "--profile", str(tmp_path / "profile.txt")],
                         cwd=REPO, env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=scaled(300))
    assert res.returncode == 0, res.stderr[-3000:]
    steps = json.loads(first.read_text())["steps"]
    assert len(steps) == 3 and all(s["step"] > 0 and s["train_step"] > 0 and s["loss"] > 0 for s in steps)
    assert "aten::" in (tmp_path / "profile.txt").read_text()

    # the attention sweep (run by hand on the GPU host): every variant against the split path
    sweep_out = tmp_path / "sweep"
    sweep_out.mkdir()
    res = subprocess.run([sys.executable, "-m", "bench.gpu.attn_sweep", "--workdir", str(tmp_path / "work"),
                          "--device", "cpu", "--forward-only", "--repeats", "1", "--segment-rows", "64",
                          "--blocks-per-chunk", "32", "--variants", "split,flex,flash"],
                         cwd=REPO, env={**env, "PYTHONPATH": str(REPO), "OUT": str(sweep_out)},
                         capture_output=True, text=True, timeout=scaled(300))
    assert res.returncode == 0, res.stderr[-3000:]
    sweep = json.loads((sweep_out / "attn_sweep.json").read_text())
    shape = json.loads(res.stdout.splitlines()[0])
    # fp32 on the CPU: the same attention summed in another order, scores over head_dim terms, then
    # the softmax and the weighted sum over at most keys_max keys (relative to the output's largest)
    bound = tol(shape["head_dim"] + 2 * shape["keys_max"])["rtol"]
    for variant in ("flex", "flash"):
        assert sweep[variant]["max_rel_err_vs_split"]["out"] <= bound, (variant, sweep[variant], bound)


def test_transport_fails_fast_when_its_consumer_process_dies(tmp_path: Path) -> None:
    import time

    import torch

    from bench.gpu.transport import run_transport

    dead = tmp_path / "dead_consumer.py"
    dead.write_text("import sys\nsys.exit(3)\n")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"consumer process exited \(code 3\)"):
        run_transport(2, 64, 32, torch.device("cpu"), "cpu", str(tmp_path), "dfpgb-deadtest", 2, 4, str(dead),
                      timeout_s=scaled(60.0))
    assert time.monotonic() - t0 < scaled(20), "a dead consumer must not leave the producer waiting out its timeout"


def test_killing_a_service_also_kills_ranks_in_sessions_of_their_own(tmp_path: Path) -> None:
    import signal
    import subprocess
    import time

    from bench.gpu.services import Children

    pid_file = tmp_path / "rank.pid"
    rank = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    launcher = ("import subprocess, sys, time\n"
                f"subprocess.Popen([sys.executable, '-c', {rank!r}], start_new_session=True)\n"
                "time.sleep(60)\n")
    children = Children(str(tmp_path))
    children.procs["trainer"] = subprocess.Popen([sys.executable, "-c", launcher], start_new_session=True)
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    rank_pid = int(pid_file.read_text())
    try:
        assert children.kill("trainer") == -signal.SIGKILL
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{rank_pid}") and "Z" not in open(f"/proc/{rank_pid}/stat").read().split()[2]:
            assert time.monotonic() < deadline, "the rank in its own session survived the kill"
            time.sleep(0.05)
    finally:
        try:
            os.kill(rank_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_bare_forward_baseline_times_all_but_each_runners_first_batch() -> None:
    import time

    import torch

    from bench.gpu.gpu_bench import bare_forward_tok_s

    class Runner:
        device = torch.device("cpu")

        def __init__(self) -> None:
            self.calls = 0

        def capture(self, ids: torch.Tensor, *_rest: torch.Tensor) -> None:
            self.calls += 1
            time.sleep(0.5 if self.calls == 1 else 0.02)   # a slow first batch must not count

    runners = [Runner(), Runner()]
    batches = [(torch.zeros(100), torch.zeros(100), torch.zeros(1)) for _ in range(6)]
    rate = bare_forward_tok_s(runners, batches)
    assert [r.calls for r in runners] == [3, 3]
    assert 400 / 0.2 < rate < 400 / 0.04        # 4 timed batches of 100 tokens, two at a time
