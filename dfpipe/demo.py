"""`dfpipe demo`: the whole pipeline on CPU, as two real service processes.

Starts `dfpipe target-server` and `dfpipe trainer` with configs/demo.yaml, shows progress from
their control endpoints (`Progress`: one redrawn line on a terminal, a plain line now and then in
a file), waits for the trainer to finish its epoch (checkpoint + export), shuts the target down
over its control endpoint, plots loss and throughput, prints a summary, and checks that no
/dev/shm file and no process is left behind.

Runs of one user side by side: the ring and endpoints are the run's own (derived from
train.out_dir, common/config.py `run_tag`); the demo polls and stops only the processes it
started (`_serves`: the pid listening at an endpoint), and one demo at a time trains into a run
folder (`_demo_lock`).

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

from common.channel import ipc_listener
from common.config import Config, load_config
from common.exits import EXIT_OUT_DIR_IN_USE
from common.liveness import STOP_WITH_ENV, LockHeld, RoleLock
from common.metrics import RATE_WINDOW_S, human_duration
from drafter_trainer.checkpoint import OutDirInUse

from .ctl import audit_text, reported, target_summary, trainer_summary, try_status

REPO = Path(__file__).resolve().parents[1]
DEMO_CONFIG = REPO / "configs" / "demo.yaml"


def _spawn(role: str, config: str, overrides: list[str], log_path: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dfpipe", role, "-c", config, *(a for o in overrides for a in ("--set", o))]
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
        ax.set(xlabel="step", ylabel=ylabel, title=title)
        ax.legend(fontsize=8)
    ax3.plot(steps, [r["tokens_per_s"] for r in train], color="tab:green")
    ax3.set(xlabel="step", ylabel="tokens / s", title=f"trainer throughput (last {RATE_WINDOW_S:.0f} s)")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return True


def _fmt(value: Any, spec: str) -> str:
    return format(value, spec) if reported(value) else "-"


def _fmt_stages(stages: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v['seconds']:.1f}s" for k, v in sorted(stages.items(), key=lambda kv: -kv[1]["seconds"]))


PLAIN_EVERY_S = 20.0     # a status line this often when the console is a file (and at each change of state)
LIVE_EVERY_S = 0.5       # the refresh of the one status line on a terminal


class Progress:
    """The demo's console while it runs: on a terminal one line, redrawn in place; into a file or a
    pipe a plain line every PLAIN_EVERY_S and whenever a service's state changes (a log stays short)."""

    def __init__(self, t0: float, live: bool) -> None:
        self.t0, self.live = t0, live
        self.last_plain = -PLAIN_EVERY_S
        self.states: tuple[Any, Any] = (None, None)
        self.drawn = False

    @property
    def period_s(self) -> float:
        return LIVE_EVERY_S if self.live else 1.0

    def show(self, target: dict | None, trainer: dict | None) -> None:
        now = time.time()
        line = f"[{human_duration(now - self.t0):>6}] {trainer_summary(trainer)} | {target_summary(target)}"
        if self.live:
            width = shutil.get_terminal_size().columns - 1
            sys.stdout.write("\r" + line[:width] + "\x1b[K")
            sys.stdout.flush()
            self.drawn = True
            return
        states = tuple(s.get("state") if s else None for s in (target, trainer))
        if now - self.last_plain >= PLAIN_EVERY_S or states != self.states:
            print(f"  {line}", flush=True)
            self.last_plain, self.states = now, states

    def done(self) -> None:
        """End the redrawn line, so what is printed next starts on a line of its own."""
        if self.drawn:
            print(flush=True)
            self.drawn = False


def _serves(endpoint: str, proc: subprocess.Popen) -> bool:
    """Whether `proc` is the process listening at `endpoint`: the demo asks and stops only the
    services it started, never another run's that holds the same endpoint. Not ipc://: it cannot
    tell, and trusts the config."""
    if not endpoint.startswith("ipc://"):
        return True
    peer = ipc_listener(endpoint)
    return peer is not None and peer.pid == proc.pid


def _status(endpoint: str, proc: subprocess.Popen, timeout_s: float = 1.0) -> dict | None:
    """The status of the demo's own service at `endpoint`; None while another process (or nobody) listens there."""
    return try_status(endpoint, timeout_s=timeout_s) if _serves(endpoint, proc) else None


DEMO_LOCK_NAME = "run"   # the demo's lock: <out_dir>/run.demo.lock (RoleLock names it <name>.<role>.lock)
DEMO_LOCK_FILE = f"{DEMO_LOCK_NAME}.demo.lock"


def _demo_lock(out_dir: str) -> RoleLock:
    """One demo per run folder: `run.demo.lock` inside the folder itself, held while the demo runs
    and before anything in it is cleared. Inside, not beside it: every name that reaches the folder
    (a symbolic link, a bind mount, `..` in the path) opens the same file, so a second demo through
    another name meets the first one's lock instead of clearing the folder it trains into. The
    folder is made first when missing (`check_run_folder`: never under another user's folder)."""
    from drafter_trainer.checkpoint import check_run_folder
    check_run_folder(out_dir, create=True)
    return RoleLock(out_dir, DEMO_LOCK_NAME, "demo")


def run_demo(config: str | None = None, overrides: list[str] | None = None, fresh: bool = False) -> int:
    rerun = " ".join(["dfpipe demo", *(["-c", shlex.quote(config)] if config else []),
                      *(f"--set {shlex.quote(o)}" for o in overrides or [])])
    config = config or str(DEMO_CONFIG)
    overrides = overrides or []
    cfg = load_config(config, overrides)
    out_dir = cfg.resolve(cfg.train.out_dir)
    lock = _demo_lock(out_dir)
    try:
        lock.acquire()
    except LockHeld as e:
        print(f"dfpipe demo: another demo trains into {out_dir} ({e}): wait for it to end, or give this one "
              f"its own run folder (`{rerun} --set train.out_dir=PATH`)")
        return 1
    try:
        return _run(cfg, config, overrides, out_dir, rerun, fresh)
    except OutDirInUse as e:   # a trainer without a demo trains there: nothing of it was touched
        print(f"dfpipe demo: {e}")
        return EXIT_OUT_DIR_IN_USE
    finally:
        lock.release(unlink=True)


def _run(cfg: Config, config: str, overrides: list[str], out_dir: str, rerun: str, fresh: bool) -> int:
    resumed = _continue_or_clear(out_dir, fresh)
    os.makedirs(os.path.join(out_dir, "logs"), exist_ok=True)
    t0 = time.time()
    print(f"dfpipe demo: config {config}\n  logs in {out_dir}/logs\n  ring {cfg.ring.name}, endpoints "
          f"{cfg.service.target_endpoint} and {cfg.service.trainer_endpoint}", flush=True)
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
    progress = Progress(t0, live=sys.stdout.isatty())
    try:
        target = _spawn("target-server", config, overrides, logs["target"])
        trainer = _spawn("trainer", config, overrides, logs["trainer"])
        while True:
            t_status = _status(cfg.service.target_endpoint, target)
            r_status = _status(cfg.service.trainer_endpoint, trainer)
            target_status = t_status or target_status
            trainer_status = r_status or trainer_status
            progress.show(t_status, r_status)
            if trainer.poll() is not None:
                break
            if target.poll() is not None:
                failure = (f"the target server exited with {target.returncode}: {_reason(logs['target'])} "
                           f"(see {logs['target']})")
                break
            time.sleep(progress.period_s)
        progress.done()
        final_target = _status(cfg.service.target_endpoint, target, timeout_s=2.0) or target_status
        if target.poll() is None:
            if _serves(cfg.service.target_endpoint, target):
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
        progress.done()
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
    leftovers = sorted(glob.glob(os.path.join(cfg.ring.shm_dir, f"{cfg.ring.name}.*")))
    ts = trainer_status or {}
    # the trainer's last metrics record: the plot's last points (the status polled last may be a few steps older)
    last = ([r for r in rows if "loss" in r] or [None])[-1]
    print("\n== dfpipe demo summary ==")
    print(f"wall time            {human_duration(elapsed)} ({elapsed:.1f} s)")
    print(f"checkpoint           {ckpt or 'none'}")
    print(f"trained              {audit_text(info)}")
    plotted_step = ("" if last is None else  # a run shorter than train.log_every steps has no record to quote
                    f"; at step {last['step']} (the plot's last point): loss {_fmt(last.get('loss'), '.4f')}, "
                    f"{_fmt(last.get('tokens_per_s'), ',.0f')} tok/s (its last {RATE_WINDOW_S:.0f} s)")
    print(f"trainer              step {_fmt(info.get('step'), '.0f')}{plotted_step}")
    print(f"anchors per batch    {_fmt(ts.get('anchors_per_batch'), '.1f')} (up to drafter.max_anchors = "
          f"{cfg.drafter.max_anchors} per document)")
    if last is not None:
        print(f"implied acceptance   {_fmt(last.get('tau'), '.3f')} tokens per block "
              f"(random-weight target: a pipeline check, not a quality figure)")
    if ev := ts.get("eval"):
        print(f"held-out eval        step {ev['step']}: tau {ev['tau']:.3f}, loss {ev['loss']:.4f} "
              f"on {ev['batches']} held-out batches")
    if final_target:
        b = final_target.get("batches", {})
        print(f"target               {_fmt(b.get('produced'), ',.0f')} batches, {_fmt(final_target.get('tokens'), ',.0f')} "
              f"tokens, quarantined {_fmt(b.get('quarantined'), ',.0f')}")
        print(f"target stages        {_fmt_stages(final_target.get('stages', {}))}")
    if ts.get("stages"):
        print(f"trainer stages       {_fmt_stages(ts['stages'])}")
    print(f"export               {os.path.join(out_dir, 'export')}")
    print(f"plot                 {png if plotted else '(no metrics)'}")
    print(f"/dev/shm left over   {leftovers or 'none'}")
    return 1 if leftovers else 0


def _continue_or_clear(out_dir: str, fresh: bool) -> int | None:
    """The step of the checkpoint this run continues from; None when it starts afresh (asked to,
    or nothing to continue: no checkpoint, or the last run finished), with the run folder cleared."""
    step = None if fresh else _unfinished_step(out_dir)
    if step is None and os.path.isdir(out_dir):
        _clear(out_dir)
    return step


def _clear(out_dir: str) -> None:
    """Empty the run folder, whose demo lock the caller holds, but for that lock: first taking its
    trainer lock (`lock_out_dir`: a trainer started without a demo holds it), so nothing a live
    trainer writes is removed (OutDirInUse names the holder)."""
    from drafter_trainer.checkpoint import LOCK_NAME, lock_out_dir
    fd = lock_out_dir(out_dir)
    try:
        for entry in os.scandir(out_dir):
            if entry.name in (LOCK_NAME, DEMO_LOCK_FILE):
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
    finally:
        os.close(fd)


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
# the line a service writes as it stops when told to, naming who or what told it (a signal, a ctl shutdown)
_STOP_LINE = re.compile(r"^\S+ \S+ \S+ INFO (?P<message>(?:target server|trainer) stopping \(.*)$")


def _reason(log_path: str) -> str:
    """Why a service stopped: its log's line saying who or what told it to stop (and the last error
    after it, if any), else its last error line, else its last line."""
    try:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            lines = [line.rstrip() for line in f if line.strip()]
    except OSError:
        return "(no log)"
    stop = error = None
    for i, line in enumerate(lines):
        if m := _STOP_LINE.match(line):
            stop = (i, m["message"])
        elif m := _ERROR_LINE.match(line):
            error = (i, m["message"] or m["cli"])
    if stop and error and error[0] > stop[0]:
        return f"{stop[1]}; then: {error[1]}"
    if stop or error:
        return (stop or error)[1]
    return lines[-1] if lines else "(empty log)"
