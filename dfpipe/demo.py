"""`dfpipe demo`: the whole pipeline on CPU, as two real service processes.

Starts `dfpipe target-server` and `dfpipe trainer` with configs/demo.yaml, shows progress from
their control endpoints, waits for the trainer to finish its epoch (checkpoint + export), shuts
the target down over its control endpoint, plots loss and throughput, prints a summary, and
checks that no /dev/shm file and no process is left behind.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common.config import Config, load_config

from .ctl import summary_line, try_status

REPO = Path(__file__).resolve().parents[1]
DEMO_CONFIG = REPO / "configs" / "demo.yaml"


def _spawn(role: str, config: str, overrides: list[str], log_path: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dfpipe", role, "-c", config]
    for o in overrides:
        cmd += ["--set", o]
    log = open(log_path, "ab")
    # two services on a small CPU box: one intra-op thread each, or they slow each other down
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    # own process group: Ctrl-C on the demo reaches the children only through us (clean shutdown)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)


def _stop(proc: subprocess.Popen, timeout: float = 20.0) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def plot_metrics(metrics_path: str, png_path: str) -> bool:
    rows = [json.loads(line) for line in open(metrics_path, encoding="utf-8") if line.strip()] \
        if os.path.exists(metrics_path) else []
    train = [r for r in rows if "loss" in r]          # training steps; held-out evals carry eval_* keys
    evals = [r for r in rows if "eval_tau" in r]
    if not train:
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = [r["step"] for r in train]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(14, 3.6))
    ax1.plot(steps, [r["loss"] for r in train], color="tab:blue", label="training batch")
    ax2.plot(steps, [r["tau"] for r in train], color="tab:blue", label="training batch")
    if evals:
        ax1.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", color="tab:orange",
                 label="held-out")
        ax2.plot([r["step"] for r in evals], [r["eval_tau"] for r in evals], "o-", color="tab:orange",
                 label="held-out")
    for ax, ylabel, title in ((ax1, "DFlash loss", "loss"), (ax2, "tokens per block", "implied acceptance length")):
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=8)
    ax3.plot(steps, [r["tokens_per_s"] for r in train], color="tab:green")
    ax3.set_xlabel("step")
    ax3.set_ylabel("tokens / s")
    ax3.set_title("trainer throughput")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return True


def _leftover_shm(cfg: Config) -> list[str]:
    return sorted(glob.glob(os.path.join(cfg.ring.shm_dir, f"{cfg.ring.name}.*")))


def _fmt_stages(stages: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v['seconds']:.1f}s" for k, v in sorted(stages.items(), key=lambda kv: -kv[1]["seconds"]))


def run_demo(config: str | None = None, overrides: list[str] | None = None, keep: bool = False) -> int:
    config = config or str(DEMO_CONFIG)
    overrides = overrides or []
    cfg = load_config(config, overrides)
    out_dir = cfg.resolve(cfg.train.out_dir)
    if os.path.isdir(out_dir) and not keep:
        shutil.rmtree(out_dir)
    os.makedirs(os.path.join(out_dir, "logs"), exist_ok=True)
    t0 = time.time()
    print(f"dfpipe demo: config {config}\n  logs in {out_dir}/logs", flush=True)
    target = _spawn("target-server", config, overrides, os.path.join(out_dir, "logs", "target.log"))
    trainer = _spawn("trainer", config, overrides, os.path.join(out_dir, "logs", "trainer.log"))
    target_status: dict | None = None
    trainer_status: dict | None = None
    rc = 1
    try:
        while True:
            t_status = try_status(cfg.service.target_endpoint, timeout_s=1.0)
            r_status = try_status(cfg.service.trainer_endpoint, timeout_s=1.0)
            target_status = t_status or target_status
            trainer_status = r_status or trainer_status
            print(f"  [{time.time() - t0:6.1f}s] {summary_line(t_status, r_status)}", flush=True)
            if trainer.poll() is not None:
                break
            if target.poll() is not None:
                print(f"dfpipe demo: the target server exited with {target.returncode}; see logs/target.log")
                break
            time.sleep(2.0)
        rc = trainer.returncode if trainer.poll() is not None else 1
        final_target = try_status(cfg.service.target_endpoint, timeout_s=2.0) or target_status
        if target.poll() is None:
            from .ctl import control
            try:
                control(cfg.service.target_endpoint, "target", "shutdown", timeout_s=5.0)
            except SystemExit as e:
                print(e)
            try:
                target.wait(30)
            except subprocess.TimeoutExpired:
                _stop(target)
    except KeyboardInterrupt:
        print("dfpipe demo: interrupted; stopping both services")
        rc = 130
        final_target = target_status
    finally:
        _stop(trainer)
        _stop(target)
    elapsed = time.time() - t0
    if rc != 0:
        print(f"dfpipe demo: the trainer exited with {rc}; see {out_dir}/logs/trainer.log")
        _tail(os.path.join(out_dir, "logs", "trainer.log"))
        return rc or 1
    png = os.path.join(out_dir, "demo.png")
    plotted = plot_metrics(os.path.join(out_dir, "metrics.jsonl"), png)
    from drafter_trainer.checkpoint import inspect, latest_checkpoint
    ckpt = latest_checkpoint(out_dir)
    info = inspect(ckpt) if ckpt else {}
    leftovers = _leftover_shm(cfg)
    ts = trainer_status or {}
    print("\n== dfpipe demo summary ==")
    print(f"wall time            {elapsed:.1f} s")
    print(f"checkpoint           {ckpt}")
    print(f"samples trained      {info.get('samples_trained')} of {info.get('epoch_samples')} "
          f"(duplicated: {info.get('samples_duplicated')})")
    print(f"trainer              step {ts.get('step')}, loss {ts.get('loss')}, {ts.get('tokens_per_s')} tok/s")
    print(f"anchors per batch    {ts.get('anchors_per_batch')} (up to drafter.max_anchors = "
          f"{cfg.drafter.max_anchors} per document)")
    print(f"implied acceptance   {ts.get('implied_acceptance_length')} tokens per block "
          f"(random-weight target: a pipeline check, not a quality figure)")
    ev = ts.get("eval")
    if ev:
        print(f"held-out eval        step {ev['step']}: tau {ev['tau']:.3f}, loss {ev['loss']:.4f} "
              f"on {ev['batches']} held-out batches")
    if final_target:
        b = final_target.get("batches", {})
        print(f"target               {b.get('produced')} batches, {final_target.get('tokens')} tokens, "
              f"quarantined {b.get('quarantined')}")
        print(f"target stages        {_fmt_stages(final_target.get('stages', {}))}")
    if ts.get("stages"):
        print(f"trainer stages       {_fmt_stages(ts['stages'])}")
    print(f"export               {os.path.join(out_dir, 'export')}")
    print(f"plot                 {png if plotted else '(no metrics)'}")
    print(f"/dev/shm left over   {leftovers or 'none'}")
    if leftovers:
        return 1
    return 0


def _tail(path: str, n: int = 30) -> None:
    if os.path.exists(path):
        lines = open(path, encoding="utf-8", errors="replace").read().splitlines()[-n:]
        print("\n".join("    " + line for line in lines))
