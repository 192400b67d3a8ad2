"""P4 (trainer restart against a warm target) and P6 (both services on one GPU) with the real
`python -m dfpipe target-server` and `python -m dfpipe trainer` processes.

Timeline of one run (one target-server lifetime):

    t0  start target server (Triton cache empty: a cold host)  +  start trainer A
        trainer A's first optimizer step (metrics.jsonl record 1)        -> cold = its time - t0
        trainer A trains next to the server for --p6-seconds              -> together tok/s (P6)
        SIGKILL trainer A (a crash; SIGTERM would write a 20 GB final checkpoint)
    t1  start trainer B (fresh out_dir, nothing to resume)
        trainer B's first optimizer step                                  -> warm = its time - t1
        SIGKILL trainer B; SIGTERM the server (it unlinks its ring)

First-step times come from the trainer's own metrics.jsonl (`time` of the step-1 record, wall
clock), tokens per step from its `tokens_per_s * step_s`. Children run in their own sessions so a
timeout signal to this part reaches them only through its handlers; their pids go to a pid file
that run_all.sh's cleanup reads.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml

from common.config import load_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PIDFILE = "service-pids.txt"


@dataclass
class ServicePlan:
    workdir: str
    manifest: dict[str, Any]
    device: str                  # "cuda:0" or "cpu"
    ring_name: str
    shm_dir: str
    slots: int
    anchors: int
    block: int
    drafter_layers: int
    loss_chunk: int
    audit_every: int
    p6_seconds: float
    p6_skip_steps: int
    cold_triton: str             # "fresh": empty TRITON_CACHE_DIR for the cold start; "shared": the run's
    step_timeout_s: float


def write_config(plan: ServicePlan) -> str:
    m = plan.manifest
    cuda = plan.device.startswith("cuda")
    cfg = {
        "ring": {"name": plan.ring_name, "shm_dir": plan.shm_dir, "slots": plan.slots,
                 "cuda_register": "require" if cuda else "off"},
        "data": {"train_path": m["data_dir"], "token_budget": m["token_budget"], "max_len": m["max_len"], "seed": 0},
        "target": {"model": m["target_dir"], "cache_dir": os.path.join(plan.workdir, "cache"),
                   "layer_ids": list(m["shape"]["capture_ids"]), "devices": [plan.device], "warmup": True,
                   "audit_every": plan.audit_every},
        "drafter": {"num_layers": plan.drafter_layers, "block_size": plan.block,
                    "mask_token_id": m["shape"]["mask_token_id"], "max_anchors": plan.anchors,
                    "loss_chunk": plan.loss_chunk},
        # no periodic checkpoint (a 27B-wide drafter's state is ~20 GB), one metrics record per step
        "train": {"out_dir": os.path.join(plan.workdir, "run-unused"), "epochs": 1, "checkpoint_every": 10 ** 9,
                  "log_every": 1, "tensorboard": False, "device": plan.device},
        "service": {"target_endpoint": f"ipc://{plan.workdir}/target.sock",
                    "trainer_endpoint": f"ipc://{plan.workdir}/trainer.sock"},
    }
    path = os.path.join(plan.workdir, "services.yaml")
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(cfg, f, sort_keys=False)
    load_config(path)  # the services would refuse it anyway; fail here with the config's own message
    return path


class Children:
    """The service processes this part started, by pid; killed on any exit path."""

    def __init__(self, workdir: str) -> None:
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, str] = {}
        self.pidfile = os.path.join(workdir, PIDFILE)
        self.logdir = os.path.join(workdir, "service-logs")
        os.makedirs(self.logdir, exist_ok=True)

    def spawn(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen:
        log_path = os.path.join(self.logdir, f"{name}.log")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "dfpipe", *args], cwd=REPO, stdout=log,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.procs[name], self.logs[name] = proc, log_path
        with open(self.pidfile, "a", encoding="utf-8") as f:
            f.write(f"{proc.pid} {name}\n")
        return proc

    def kill(self, name: str) -> int | None:
        proc = self.procs.get(name)
        if proc is None:
            return None
        if proc.poll() is None:
            proc.kill()
        return proc.wait()

    def stop(self, name: str, timeout: float = 30.0) -> int | None:
        """SIGTERM (clean shutdown), SIGKILL after `timeout`."""
        proc = self.procs.get(name)
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                return proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
        return proc.wait()

    def check_alive(self, *names: str) -> None:
        for name in names:
            rc = self.procs[name].poll()
            if rc is not None:
                raise RuntimeError(f"{name} exited with code {rc} early; last log lines:\n{self.tail(name, 3000)}")

    def tail(self, name: str, nbytes: int) -> str:
        try:
            with open(self.logs[name], "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - nbytes))
                return f.read().decode("utf-8", "replace")
        except (OSError, KeyError):
            return ""

    def close(self) -> None:
        for name in list(self.procs):
            if name.startswith("trainer"):
                self.kill(name)   # never SIGTERM a trainer here: it would write a final checkpoint
        for name in list(self.procs):
            self.stop(name)
        try:
            os.unlink(self.pidfile)
        except FileNotFoundError:
            pass


def read_metrics(path: str) -> list[dict[str, Any]]:
    if not os.path.isfile(path):
        return []
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line being written
    return rows


def wait_metrics(children: Children, name: str, path: str, enough: Callable[[list[dict[str, Any]]], bool],
                 timeout_s: float, also_alive: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Poll the trainer's metrics.jsonl until `enough(rows)`; errors if a service dies first."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = read_metrics(path)
        if rows and enough(rows):
            return rows
        children.check_alive(name, *also_alive)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name}: {len(rows)} metrics records after {timeout_s:.0f}s; log tail:\n"
                               f"{children.tail(name, 2000)}")
        time.sleep(0.2)


def step_tokens(row: dict[str, Any]) -> float:
    return float(row["tokens_per_s"]) * float(row["step_s"])


def together_rate(rows: list[dict[str, Any]], skip: int) -> tuple[float, float, int]:
    """(tokens/s, seconds, steps) over the records after the first `skip`, by their wall-clock stamps."""
    window = rows[skip:]
    if len(window) < 2:
        raise ValueError(f"need at least {skip + 2} metrics records, got {len(rows)}")
    seconds = window[-1]["time"] - window[0]["time"]
    return sum(step_tokens(r) for r in window[1:]) / seconds, seconds, len(window) - 1


def run_services(plan: ServicePlan, budget_s: float, figures: dict[str, Any]) -> dict[str, Any]:
    """Cold start, together, warm restart (see the module docstring), filling `figures` as it goes
    so that the caller keeps what was measured when a later step fails."""
    from dfpipe.ctl import try_status

    cfg_path = write_config(plan)
    cfg = load_config(cfg_path)
    children = Children(plan.workdir)
    base_env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), REPO]))}
    if not plan.device.startswith("cuda"):
        base_env["OMP_NUM_THREADS"] = "1"   # two services on a small CPU box
    cold_env = dict(base_env)
    if plan.cold_triton == "fresh":
        cold_env["TRITON_CACHE_DIR"] = os.path.join(plan.workdir, f"triton-cold-{os.getpid()}")
    deadline = time.monotonic() + budget_s
    figures.update({"device": plan.device, "cold_triton_cache": plan.cold_triton,
                    "token_budget": plan.manifest["token_budget"]})

    def left() -> float:
        return max(1.0, deadline - time.monotonic())

    def trainer_args(run: str) -> list[str]:
        return ["trainer", "-c", cfg_path, "--set", f"train.out_dir={os.path.join(plan.workdir, run)}"]

    try:
        for run in ("run-cold", "run-warm"):
            shutil.rmtree(os.path.join(plan.workdir, run), ignore_errors=True)
        t0 = time.time()
        children.spawn("target", ["target-server", "-c", cfg_path], cold_env)
        children.spawn("trainer-cold", trainer_args("run-cold"), cold_env)
        cold_metrics = os.path.join(plan.workdir, "run-cold", "metrics.jsonl")
        rows = wait_metrics(children, "trainer-cold", cold_metrics, lambda r: True,
                            min(plan.step_timeout_s, left()), also_alive=("target",))
        figures["cold_first_step_s"] = rows[0]["time"] - t0
        print(f"cold start: first optimizer step {figures['cold_first_step_s']:.1f}s after both started", flush=True)

        skip = plan.p6_skip_steps

        def window_done(r: list[dict[str, Any]]) -> bool:
            return len(r) >= skip + 2 and r[-1]["time"] - r[skip]["time"] >= plan.p6_seconds

        rows = wait_metrics(children, "trainer-cold", cold_metrics, window_done,
                            min(plan.p6_seconds * 4 + 60, left()), also_alive=("target",))
        rate, seconds, steps = together_rate(rows, skip)
        figures.update({"together_tok_s": rate, "together_seconds": seconds, "together_steps": steps,
                        "together_mean_step_s": sum(r["step_s"] for r in rows[skip + 1:]) / steps})
        print(f"together: {rate:,.0f} tok/s over {steps} steps ({seconds:.1f}s)", flush=True)
        target_status = try_status(cfg.service.target_endpoint, timeout_s=5.0) or {}
        trainer_status = try_status(cfg.service.trainer_endpoint, timeout_s=5.0) or {}
        stages = target_status.get("stages", {})
        figures["target_stages"] = stages
        figures["trainer_stages"] = trainer_status.get("stages", {})
        figures["target_load_s"] = stages.get("load", {}).get("seconds")
        figures["target_warmup_s"] = stages.get("warmup", {}).get("seconds")
        figures["target_batches_produced"] = target_status.get("batches", {}).get("produced")

        children.kill("trainer-cold")
        t1 = time.time()
        children.spawn("trainer-warm", trainer_args("run-warm"), base_env)
        rows = wait_metrics(children, "trainer-warm", os.path.join(plan.workdir, "run-warm", "metrics.jsonl"),
                            lambda r: True, min(plan.step_timeout_s, left()), also_alive=("target",))
        figures["warm_first_step_s"] = rows[0]["time"] - t1
        print(f"warm restart: first optimizer step {figures['warm_first_step_s']:.1f}s after the trainer started",
              flush=True)
        figures["warm_over_cold_first_step"] = figures["warm_first_step_s"] / figures["cold_first_step_s"]
        return figures
    finally:
        children.close()
        for name in children.logs:
            print(f"\n===== {name} log (tail) =====\n{children.tail(name, 60_000)}", flush=True)
        leftovers = [f for f in os.listdir(plan.shm_dir) if f.startswith(plan.ring_name)] \
            if os.path.isdir(plan.shm_dir) else []
        figures["shm_leftovers"] = leftovers
