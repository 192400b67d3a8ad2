"""`dfpipe demo`: the whole pipeline on CPU, as two real service processes.

Starts `dfpipe target-server` and `dfpipe trainer` with configs/demo.yaml, shows progress from
their control endpoints, waits for the trainer to finish its epoch (checkpoint + export), shuts
the target down over its control endpoint, plots loss and throughput, prints a summary, and
checks that no /dev/shm file and no process is left behind.

The demo owns its two services: the kernel sends each SIGTERM when the demo dies, however it
dies (PDEATHSIG, which each arms as it starts: `liveness.stop_with_launcher`), so a killed demo
leaves no process and no ring behind. Ctrl-C (or SIGTERM)
stops both cleanly; the trainer writes its checkpoint, and the next `dfpipe demo` continues from
it (`--fresh` starts afresh; a run that finished its epoch is started afresh anyway).
"""
from __future__ import annotations

import glob
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common.config import Config, load_config
from common.liveness import STOP_WITH_ENV
from common.metrics import RATE_WINDOW_S

from .ctl import audit_text, summary_line, try_status

REPO = Path(__file__).resolve().parents[1]
DEMO_CONFIG = REPO / "configs" / "demo.yaml"


def _spawn(role: str, config: str, overrides: list[str], log_path: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dfpipe", role, "-c", config]
    for o in overrides:
        cmd += ["--set", o]
    log = open(log_path, "ab")
    # two services on a small CPU box: one intra-op thread each, or they slow each other down;
    # and they stop when the demo dies, whatever kills it (`dfpipe` arms that first thing)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), STOP_WITH_ENV: str(os.getpid())}
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


def read_metrics(metrics_path: str) -> list[dict[str, Any]]:
    """The trainer's metrics.jsonl records (training steps, and held-out evals with eval_* keys)."""
    if not os.path.exists(metrics_path):
        return []
    with open(metrics_path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_metrics(rows: list[dict[str, Any]], png_path: str) -> bool:
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
    ax3.set_title(f"trainer throughput (last {RATE_WINDOW_S:.0f} s)")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return True


def _fmt(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def _leftover_shm(cfg: Config) -> list[str]:
    return sorted(glob.glob(os.path.join(cfg.ring.shm_dir, f"{cfg.ring.name}.*")))


def _fmt_stages(stages: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v['seconds']:.1f}s" for k, v in sorted(stages.items(), key=lambda kv: -kv[1]["seconds"]))


def run_demo(config: str | None = None, overrides: list[str] | None = None, fresh: bool = False) -> int:
    rerun = " ".join(["dfpipe demo", *(["-c", shlex.quote(config)] if config else []),
                      *(f"--set {shlex.quote(o)}" for o in overrides or [])])
    config = config or str(DEMO_CONFIG)
    overrides = overrides or []
    cfg = load_config(config, overrides)
    out_dir = cfg.resolve(cfg.train.out_dir)
    resumed = _continue_or_clear(out_dir, fresh)
    os.makedirs(os.path.join(out_dir, "logs"), exist_ok=True)
    t0 = time.time()
    print(f"dfpipe demo: config {config}\n  logs in {out_dir}/logs", flush=True)
    if resumed is not None:
        print(f"  continuing from the checkpoint at step {resumed} (`{rerun} --fresh` starts afresh)", flush=True)
    logs = {role: os.path.join(out_dir, "logs", f"{role}.log") for role in ("target", "trainer")}
    interrupted: list[int] = []     # the signal that stopped the demo

    def on_signal(signum: int, _frame: Any) -> None:
        interrupted.append(signum)
        raise KeyboardInterrupt
    handlers = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    target = trainer = None
    target_status: dict | None = None
    trainer_status: dict | None = None
    final_target: dict | None = None
    failure = ""
    try:
        target = _spawn("target-server", config, overrides, logs["target"])
        trainer = _spawn("trainer", config, overrides, logs["trainer"])
        while True:
            t_status = try_status(cfg.service.target_endpoint, timeout_s=1.0)
            r_status = try_status(cfg.service.trainer_endpoint, timeout_s=1.0)
            target_status = t_status or target_status
            trainer_status = r_status or trainer_status
            print(f"  [{time.time() - t0:6.1f}s] {summary_line(t_status, r_status)}", flush=True)
            if trainer.poll() is not None:
                break
            if target.poll() is not None:
                failure = (f"the target server exited with {target.returncode}: {_reason(logs['target'])} "
                           f"(see {logs['target']})")
                break
            time.sleep(2.0)
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
        print("\ndfpipe demo: stopping both services (the trainer writes its checkpoint)", flush=True)
    finally:
        for sig in handlers:        # a second Ctrl-C must not cut the services' clean stop short
            signal.signal(sig, signal.SIG_IGN)
        for proc in (trainer, target):
            if proc is not None:
                _stop(proc)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if interrupted:
        print(f"dfpipe demo: interrupted; {_how_to_continue(out_dir, rerun)}")
        return 128 + interrupted[0]
    if failure:
        print(f"dfpipe demo: {failure}")
        return 1
    if trainer.returncode != 0:
        print(f"dfpipe demo: the trainer exited with {trainer.returncode}: {_reason(logs['trainer'])} "
              f"(see {logs['trainer']})")
        return trainer.returncode
    elapsed = time.time() - t0
    rows = read_metrics(os.path.join(out_dir, "metrics.jsonl"))
    png = os.path.join(out_dir, "demo.png")
    plotted = plot_metrics(rows, png)
    from drafter_trainer.checkpoint import inspect_run
    info = inspect_run(out_dir)
    ckpt = info.get("path")
    leftovers = _leftover_shm(cfg)
    ts = trainer_status or {}
    # the trainer's last metrics record: the plot's last points (the status polled last may be a few steps older)
    last = ([r for r in rows if "loss" in r] or [{}])[-1]
    print("\n== dfpipe demo summary ==")
    print(f"wall time            {elapsed:.1f} s")
    print(f"checkpoint           {ckpt}")
    print(f"trained              {audit_text(info)}")
    print(f"trainer              step {info.get('step')}; at step {last.get('step')} (the plot's last point): "
          f"loss {_fmt(last.get('loss'), '.4f')}, {_fmt(last.get('tokens_per_s'), ',.0f')} tok/s "
          f"(its last {RATE_WINDOW_S:.0f} s)")
    print(f"anchors per batch    {ts.get('anchors_per_batch')} (up to drafter.max_anchors = "
          f"{cfg.drafter.max_anchors} per document)")
    print(f"implied acceptance   {_fmt(last.get('tau'), '.3f')} tokens per block "
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


def _continue_or_clear(out_dir: str, fresh: bool) -> int | None:
    """The step of the checkpoint this run continues from; None when it starts afresh (asked to,
    or nothing to continue: no checkpoint, or the last run finished), with the run folder cleared."""
    step = None if fresh else _unfinished_step(out_dir)
    if step is None and os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    return step


def _unfinished_step(out_dir: str) -> int | None:
    """The step of the run folder's latest checkpoint, unless the trainer wrote it as finished."""
    from drafter_trainer.checkpoint import FINISHED, latest_checkpoint, read_meta
    ckpt = latest_checkpoint(out_dir) if os.path.isdir(out_dir) else None
    meta = read_meta(ckpt) if ckpt else {}
    return None if not meta or meta.get("reason") == FINISHED else int(meta["step"])


def _how_to_continue(out_dir: str, rerun: str) -> str:
    step = _unfinished_step(out_dir)
    if step is None:
        return f"no checkpoint to continue from; rerun `{rerun}` to start again"
    return f"rerun `{rerun}` to continue from the checkpoint at step {step}"


# a service's log line: "<date> <time> <service> <LEVEL> <message>"; `dfpipe: ...` is the command line's own
_ERROR_LINE = re.compile(r"^\S+ \S+ \S+ (?:ERROR|CRITICAL) (?P<message>.*)$|^(?P<cli>dfpipe: .*)$")


def _reason(log_path: str) -> str:
    """Why a service stopped: its log's last error line (else its last line)."""
    try:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            lines = [line.rstrip() for line in f if line.strip()]
    except OSError:
        return "(no log)"
    for line in reversed(lines):
        m = _ERROR_LINE.match(line)
        if m:
            return m["message"] or m["cli"]
    return lines[-1] if lines else "(empty log)"
