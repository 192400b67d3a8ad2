"""End to end, trainer side: two torchrun ranks, a hung (SIGSTOPped) trainer, non-finite steps,
held-out eval during training, and the README's main job (`dfpipe demo`)."""
from __future__ import annotations

import glob
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from drafter_trainer.checkpoint import read_meta
from e2e import (CACHE, DEMO, REPO, Service, assert_exactly_once, ctl, inspect_run, load, serving,
                 wait_for, write_config, write_heldout)
from machine_speed import scaled

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class Torchrun(Service):
    """`torchrun --nproc-per-node N -m dfpipe trainer` (gloo ranks on CPU)."""

    def __init__(self, config: Path, log_dir: Path, nproc: int) -> None:
        self.role = "torchrun"
        self.log_path = log_dir / "torchrun.log"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--standalone", "-m", "dfpipe", "trainer", "-c", str(config)]
        self.proc = subprocess.Popen(cmd, stdout=open(self.log_path, "wb"), stderr=subprocess.STDOUT,
                                     start_new_session=True)


@pytest.mark.skipif(os.environ.get("DFPIPE_TEST_TRAINER_DEVICE", "cpu") != "cpu" and _cuda_devices() < 2,
                    reason="two CUDA ranks need two GPUs (NCCL refuses two ranks on one device)")
def test_two_ranks_in_lockstep_train_every_sampleassert_exactly_once(tmp_path: Path) -> None:
    # rank 0 also evaluates held-out batches every 2 steps: the other rank must not stall or deadlock.
    # The target is the tiny one as a block-wise FP8 checkpoint: nothing else in the pipeline changes,
    # and the precision it runs in reaches both ranks, the checkpoint and the export.
    from dfpipe.quantize_fp8 import quantize_checkpoint
    from target_server.tiny import resolve_target

    tiny = resolve_target("builtin:tiny-qwen3.5", str(CACHE), tokenizer_dir=str(DEMO / "tokenizer"))
    fp8_target = quantize_checkpoint(tiny, str(tmp_path / "fp8-target"))["out"]
    config = write_config(tmp_path, samples=100, data={"heldout_path": str(write_heldout(tmp_path))},
                          train={"eval_every": 2, "eval_batches": 2}, target={"model": fp8_target})
    cfg = load(config)
    target = Service("target-server", config, tmp_path)
    try:
        wait_for(lambda: serving(cfg["service"]["target_endpoint"]), 180, "target serving")
        ranks = Torchrun(config, tmp_path, nproc=2)
        try:
            assert ranks.wait(600) == 0, ranks.log()
        finally:
            ranks.stop()
        info = assert_exactly_once(config)
        status = ctl(cfg["service"]["target_endpoint"], "status")
        assert status["sessions"] == 1, "both ranks joined one trainer session"
        assert info["batches"] == sum(status["epoch_sizes"])
        log = ranks.log(tail=10_000)
        assert "trainer[1]" in log and "trainer[0] INFO exported drafter" in log
        assert "trainer[0] INFO eval step " in log and "trainer[1] INFO eval step" not in log
        assert status["heldout"]["acked"] == 2, "held-out batches go to rank 0 only, once"
        precision = status["target"]["precision"]
        assert precision.startswith("fp8-block"), precision
        assert read_meta(info["path"])["target_precision"] == precision
        exported = json.loads((tmp_path / "run" / "export" / "config.json").read_text())
        assert exported["dfpipe"]["target_precision"] == precision
    finally:
        target.stop()


def test_a_hung_trainer_is_fenced_and_rejoins_without_losing_or_repeating_a_sample(tmp_path: Path) -> None:
    config = write_config(tmp_path, samples=120)
    cfg = load(config)
    ep_target, ep_trainer = cfg["service"]["target_endpoint"], cfg["service"]["trainer_endpoint"]
    target = Service("target-server", config, tmp_path)
    trainer = None
    try:
        wait_for(lambda: serving(ep_target), 180, "target serving")
        trainer = Service("trainer", config, tmp_path)
        wait_for(lambda: (s := ctl(ep_trainer, "status")) and s.get("batches_trained", 0) >= 3 and s, 180,
                 "trainer stepping")
        os.kill(trainer.pid, signal.SIGSTOP)
        fenced = wait_for(lambda: (s := ctl(ep_target, "status")) and s["fenced"] >= 1 and s, 30,
                          "target to fence the stopped trainer")
        assert fenced["session"] is None
        os.kill(trainer.pid, signal.SIGCONT)
        assert trainer.wait(300) == 0, trainer.log()
        log = trainer.log(tail=10_000)
        # either it learned of the fence first, or it had already re-joined when the FENCED arrived
        assert "fenced by the target server" in log or "already superseded by a new HELLO" in log, log
        assert_exactly_once(config)
        assert ctl(ep_target, "status")["sessions"] >= 2
    finally:
        if trainer is not None:
            if trainer.alive():
                os.kill(trainer.pid, signal.SIGCONT)
            trainer.stop()
        target.stop()


def test_non_finite_steps_are_skipped_then_the_trainer_checkpoints_and_stops(tmp_path: Path) -> None:
    config = write_config(tmp_path, samples=80)
    cfg = load(config)
    target = Service("target-server", config, tmp_path)
    try:
        wait_for(lambda: serving(cfg["service"]["target_endpoint"]), 180, "target serving")
        # every step's gradient non-finite (a fault point: train.lr is bounded, so no learning rate
        # blows the weights up any more)
        trainer = Service("trainer", config, tmp_path, env={"DFPIPE_FAULT": "step.nonfinite:1000"},
                          overrides=["train.max_bad_steps=3"])
        assert trainer.wait(300) == 3, trainer.log()
        log = trainer.log(tail=10_000)
        assert "skipped: non-finite loss or gradient (seq" in log
        assert "non-finite steps in a row: checkpointed and stopping" in log
        info = inspect_run(config)
        assert info["skipped_steps"] >= 3 and info["samples_duplicated"] == 0
    finally:
        target.stop()


def test_rows_a_stock_template_makes_into_several_documents_are_trained_once_and_not_duplicated(
        tmp_path: Path) -> None:
    """A Qwen-style template drops an earlier turn's reasoning once a later user turn exists, so a
    row of two answers becomes two documents: the audit counts rows and documents apart, and one
    epoch trains every one of each once, none duplicated."""
    # the first 32 demo rows: two of them hold two answers
    config = write_config(tmp_path, samples=32,
                          data={"chat_template": str(REPO / "tests" / "data" / "qwen35_style.jinja")})
    cfg = load(config)
    target = Service("target-server", config, tmp_path)
    try:
        wait_for(lambda: serving(cfg["service"]["target_endpoint"]), 180, "target serving")
        trainer = Service("trainer", config, tmp_path)
        assert trainer.wait(300) == 0, trainer.log()
        info = assert_exactly_once(config)
        assert info["epoch_samples"] == 32 and info["epoch_documents"] == 34, info
        assert ("'samples_trained': 32, 'samples_duplicated': 0, 'epoch_samples': 32, 'documents_trained': 34, "
                "'documents_duplicated': 0, 'epoch_documents': 34" in trainer.log(tail=10_000))
    finally:
        target.stop()


@pytest.mark.usefixtures("cxx_compiler")
def test_the_trainer_steps_eagerly_while_it_compiles_and_switches_without_losing_a_sample(tmp_path: Path) -> None:
    # drafter.compile on the CPU: inductor's C++ backend. Even with its kernels in the cache the
    # compile traces the drafter's layers afresh (dynamo, autograd: ~10 CPU-s), which outlasts
    # the first eager steps (milliseconds each); an empty cache only made each compile ~4x longer
    config = write_config(tmp_path, samples=200, drafter={"compile": "on"})
    cfg = load(config)
    trainer_ep = cfg["service"]["trainer_endpoint"]

    def stepped():   # this trainer process has finished its first step
        s = ctl(trainer_ep, "status")
        return s if s and s.get("startup", {}).get("first_step_s") is not None else None

    target = Service("target-server", config, tmp_path)
    try:
        wait_for(lambda: serving(cfg["service"]["target_endpoint"]), 180, "target serving")
        # stopped while the compile thread runs: a clean exit (0) with its checkpoint
        first = Service("trainer", config, tmp_path)
        wait_for(stepped, 180, "the first trainer's first step")
        ctl(trainer_ep, "pause")
        status = ctl(trainer_ep, "status")
        assert status["compile"]["state"] == "compiling", status["compile"]
        assert status["attention"] == "split", status["attention"]     # what the CPU's steps ran
        ctl(trainer_ep, "shutdown")
        assert first.wait(120) == 0, first.log()
        assert "exiting while the background compile is still running" in first.log(tail=10_000)
        resumed_at = inspect_run(config)["step"]
        # a restart resumes eagerly, switches once its kernels are compiled, and trains the rest once
        second = Service("trainer", config, tmp_path)
        try:
            wait_for(stepped, 180, "the restarted trainer's first step")
            ctl(trainer_ep, "pause")      # a paused trainer's loop still takes the switch
            status = wait_for(lambda: (s := ctl(trainer_ep, "status")) and s["compile"]["state"] in ("compiled", "failed") and s,
                              600, "the background compile")
            assert status["compile"]["state"] == "compiled", status["compile"]
            assert status["compile"]["at_step"] > resumed_at and status["compile"]["seconds"] > 0
            ctl(trainer_ep, "resume")
            assert second.wait(600) == 0, second.log()
        finally:
            second.stop()
        assert "compiled kernels ready after" in second.log(tail=10_000)
        assert_exactly_once(config)
    finally:
        target.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_heldout_eval_reports_tau_every_n_steps_without_touchingassert_exactly_once(tmp_path: Path) -> None:
    every, port = 2, _free_port()
    config = write_config(tmp_path, samples=100, data={"heldout_path": str(write_heldout(tmp_path))},
                          train={"eval_every": every, "eval_batches": 2, "checkpoint_every": 50},
                          service={"trainer_metrics_port": port})
    cfg = load(config)
    target = Service("target-server", config, tmp_path)
    try:
        wait_for(lambda: serving(cfg["service"]["target_endpoint"]), 180, "target serving")
        trainer = Service("trainer", config, tmp_path)
        status = wait_for(lambda: (s := ctl(cfg["service"]["trainer_endpoint"], "status")) and s.get("eval") and s,
                          180, "a held-out eval in the trainer status")
        ev = status["eval"]
        assert set(ev) == {"step", "tau", "acceptance_per_position", "loss", "batches"}
        assert ev["step"] % every == 0 and ev["batches"] == 2
        assert math.isfinite(ev["tau"]) and ev["tau"] >= 1 and math.isfinite(ev["loss"])
        assert len(ev["acceptance_per_position"]) == cfg["drafter"]["block_size"] - 1
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert "dfpipe_trainer_eval_tau " in body and "dfpipe_trainer_eval_loss " in body
        # `dfpipe top` against both live services (the trainer paused, so that it cannot finish
        # first): one frame in 80x24 with both panels and the trainer's eval tau
        assert ctl(cfg["service"]["trainer_endpoint"], "pause") == {"accepted": "pause"}
        top = subprocess.run([sys.executable, "-m", "dfpipe", "top", "-c", str(config), "--once"], capture_output=True,
                             text=True, timeout=scaled(60), env={**os.environ, "COLUMNS": "80", "LINES": "24"})
        assert ctl(cfg["service"]["trainer_endpoint"], "resume") == {"accepted": "resume"}
        lines = top.stdout.rstrip("\n").split("\n")
        assert top.returncode == 0 and len(lines) <= 24 and max(map(len, lines)) <= 80, top.stdout + top.stderr
        assert "target server serving" in top.stdout and "trainer " in top.stdout, top.stdout
        assert re.search(r"eval tau \d+\.\d\d \(step \d+\)", top.stdout), top.stdout   # later evals may have come
        assert "not answering" not in top.stdout, top.stdout
        assert trainer.wait(300) == 0, trainer.log()

        info = assert_exactly_once(config)   # held-out batches are never trained on nor counted
        target_status = ctl(cfg["service"]["target_endpoint"], "status")
        assert info["batches"] == sum(target_status["epoch_sizes"])
        assert target_status["heldout"]["acked"] == 2 and target_status["batches"]["acked"] == info["batches"]
        rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        evals = [r for r in rows if "eval_tau" in r]
        last_step = max(r["step"] for r in rows if "loss" in r)
        steps = [r["step"] for r in evals]
        # every eval step from the first one on (held-out batches arrive within the first steps)
        assert steps and steps[0] <= 3 * every and steps == list(range(steps[0], last_step + 1, every)), steps
        assert all(r["eval_batches"] == 2 and r["eval_tau"] >= 1 and math.isfinite(r["eval_loss"]) for r in evals)
        log = trainer.log(tail=10_000)
        assert f"eval step {steps[-1]}: tau " in log and " on 2 held-out batches" in log
    finally:
        target.stop()


def test_demo_runs_both_services_end_to_end_and_leaves_nothing_behind(tmp_path: Path, ring_name: str) -> None:
    out = tmp_path / "demo-run"
    sockets = tmp_path / "s"   # not the default private folder: another run of this user's may be using it
    # The demo's own config, on its first 300 chats: ~10 steps instead of 65, past two held-out
    # evals (every 4 steps here, 10 in the demo), logged points for the plot and the export (the
    # full 2,000 are the same path six times longer; test_demo runs the demo on small configs too)
    rows = (DEMO / "chat.jsonl").read_text(encoding="utf-8").splitlines()[:300]
    (tmp_path / "chat.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    # nor the demo's ring: another demo on this host holds ring dfpipe-demo (the demo would say so and stop)
    res = subprocess.run([sys.executable, "-m", "dfpipe", "demo", "--set", f"train.out_dir={out}",
                          "--set", f"data.train_path={tmp_path / 'chat.jsonl'}", "--set", f"ring.name={ring_name}", "--set", "train.eval_every=4",
                          "--set", f"service.target_endpoint=ipc://{sockets}/target.sock",
                          "--set", f"service.trainer_endpoint=ipc://{sockets}/trainer.sock"],
                         capture_output=True, text=True, timeout=scaled(600), cwd=REPO)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert re.search(r"trained              samples 300/300 \(0 duplicated\), documents ([\d,]+)/\1 "
                     r"\(0 duplicated\)", res.stdout), res.stdout[-3000:]
    assert "held-out eval        step " in res.stdout and " on 2 held-out batches" in res.stdout
    assert "/dev/shm left over   none" in res.stdout
    assert (out / "demo.png").stat().st_size > 10_000
    assert (out / "export" / "config.json").exists() and (out / "export" / "model.safetensors").exists()
    assert glob.glob(str(out / "tensorboard" / "events.out.tfevents.*"))
    assert not glob.glob(f"/dev/shm/{ring_name}.*")
