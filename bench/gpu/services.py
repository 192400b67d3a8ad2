"""P4 (trainer restart against a warm target) and P6 (both services on one GPU) with the real
`python -m dfpipe target-server` and `python -m dfpipe trainer` processes.

Timeline of one run (one target-server lifetime):

    t0  start target server (Triton cache empty: a cold host)  +  start trainer A
        trainer A's first optimizer step (metrics.jsonl record 1)        -> cold = its time - t0
        trainer A trains next to the server for --p6-seconds              -> together tok/s (P6)
        SIGKILL trainer A (a crash; SIGTERM would write a 20 GB final checkpoint)
    t1  start trainer B (fresh out_dir, nothing to resume): eager first steps, compiling behind
        trainer B's first optimizer step                                  -> warm = its time - t1
        its switch to the compiled step, then 6 compiled steps          -> against trainer A's
        SIGKILL trainer B
        SIGTERM the server (it unlinks its ring)

Trainer A steps eagerly until its background compile is ready: the P6 window starts after its
switch (status `compile.at_step`) and p6_skip_steps more. Step times compared across trainers
are medians without the wait for a batch (metrics `step_s - wait_s`).

First-step times come from the trainer's own metrics.jsonl (`time` of the step-1 record, wall
clock), tokens per step from its `step_tokens`. Children run in their own sessions so a
timeout signal to this part reaches them only through its handlers; their pids go to a pid file
that run_all.sh's cleanup reads.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml

from common.config import load_config
from dfpipe.ctl import try_status

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PIDFILE = "service-pids.txt"


@dataclass
class ServicePlan:
    workdir: str
    manifest: dict[str, Any]
    args: argparse.Namespace     # gpu_bench.py's flags: the drafter's sizes, ring_slots, p6_seconds, step_timeout, ...
    device: str                  # "cuda:0" or "cpu"
    ring_name: str
    shm_dir: str
    cold_triton: str             # "fresh": empty TRITON_CACHE_DIR for the cold start; "shared": the run's
    attn: str = "auto"           # drafter.attn (P5's fastest path)
    blocks_per_chunk: int = 0    # drafter.blocks_per_chunk (0: auto); part_services sizes it to the card
    target_devices: list[str] | None = None    # placement; None: [device]
    trainer_devices: list[str] | None = None   # one rank per entry (torchrun when more than one)


def write_config(plan: ServicePlan) -> tuple[str, Any]:
    m = plan.manifest
    cuda = plan.device.startswith("cuda")
    cfg = {
        "ring": {"name": plan.ring_name, "shm_dir": plan.shm_dir, "slots": plan.args.ring_slots,
                 "cuda_register": "require" if cuda else "off"},
        "data": {"train_path": m["data_dir"], "token_budget": m["token_budget"], "max_len": m["max_len"], "seed": 0},
        "target": {"model": m["target_dir"], "cache_dir": os.path.join(plan.workdir, "cache"),
                   "layer_ids": list(m["shape"]["capture_ids"]), "devices": plan.target_devices or [plan.device],
                   "warmup": True, "audit_every": plan.args.audit_every},
        "drafter": {"num_layers": plan.args.drafter_layers, "block_size": plan.args.block,
                    "mask_token_id": m["shape"]["mask_token_id"], "max_anchors": plan.args.anchors,
                    "loss_chunk": plan.args.loss_chunk, "attn": plan.attn, "blocks_per_chunk": plan.blocks_per_chunk},
        # no periodic checkpoint (a 27B-wide drafter's state is ~20 GB), one metrics record per step
        "train": {"out_dir": os.path.join(plan.workdir, "run-unused"), "epochs": 3, "checkpoint_every": 10 ** 9,
                  "log_every": 1, "tensorboard": False, "device": plan.device,
                  "devices": plan.trainer_devices or []},
        "service": {"target_endpoint": f"ipc://{plan.workdir}/target.sock",
                    "trainer_endpoint": f"ipc://{plan.workdir}/trainer.sock"},
    }
    path = os.path.join(plan.workdir, "services.yaml")
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(cfg, f, sort_keys=False)
    # the services would refuse a bad one anyway; fail here with the config's own message
    return path, load_config(path)


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children, grandchildren, ...), from /proc."""
    from common.liveness import parent_pid

    parent_of = {int(e): parent_pid(int(e)) for e in os.listdir("/proc") if e.isdigit()}
    found, frontier = [], [pid]
    while frontier:
        kids = [c for c, p in parent_of.items() if p in frontier]
        found += kids
        frontier = kids
    return found


class Children:
    """The service processes this part started, by pid; killed on any exit path."""

    def __init__(self, workdir: str) -> None:
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, str] = {}
        self.pidfile = os.path.join(workdir, PIDFILE)
        self.logdir = os.path.join(workdir, "service-logs")
        os.makedirs(self.logdir, exist_ok=True)

    def spawn(self, name: str, args: list[str], env: dict[str, str], ranks: int = 1) -> subprocess.Popen:
        """`python -m dfpipe args` in its own session; with ranks > 1 under torchrun (--standalone)."""
        log_path = os.path.join(self.logdir, f"{name}.log")
        launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)] if ranks > 1 else []
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([sys.executable, *launcher, "-m", "dfpipe", *args], cwd=REPO, stdout=log,
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
            # torchrun starts every rank in a session of its own: kill the ranks by ancestry
            # (first, so none is re-parented before it is found), then the launcher's session.
            for pid in descendants(proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
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
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.pidfile)


def read_metrics(path: str) -> list[dict[str, Any]]:
    if not os.path.isfile(path):
        return []
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                break  # a line being written
            if "step_s" in row:   # training steps only (held-out eval writes its own records)
                rows.append(row)
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


class ProductionSampler(threading.Thread):
    """The target's produced-token counter over time (status polls). A window's end-to-end rate is
    the lesser of what the trainer trained and what the target produced in it: at the window's
    start up to slots + the trainer's queue of batches may already be waiting (the target ran
    ahead while the trainer started), and a trainer draining them trains faster than anything is
    produced; a target refilling its ring produces more than is trained."""

    def __init__(self, endpoint: str, interval_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.endpoint, self.interval_s = endpoint, interval_s
        self.samples: list[tuple[float, int]] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            status = try_status(self.endpoint, timeout_s=2.0)
            if status and "tokens" in status:
                self.samples.append((time.time(), int(status["tokens"])))
            self._halt.wait(self.interval_s)

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive():
            self.join(timeout=5)

    def rate(self, t0: float, t1: float) -> float | None:
        """Produced tokens per second between the samples nearest inside [t0, t1]."""
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(inside) < 2 or inside[-1][0] - inside[0][0] < 0.5 * (t1 - t0):
            return None
        (a, ta), (b, tb) = inside[0], inside[-1]
        return (tb - ta) / (b - a)


def end_to_end(rows: list[dict[str, Any]], skip: int, sampler: ProductionSampler) -> dict[str, Any]:
    """Trained and produced rates over the window after `skip` steps, between the records'
    wall-clock stamps; together = the lesser."""
    if len(rows) < skip + 2:
        raise ValueError(f"need at least {skip + 2} metrics records, got {len(rows)}")
    window, seconds = rows[skip + 1:], rows[-1]["time"] - rows[skip]["time"]
    tokens = sum(float(r["step_tokens"]) for r in window)
    trained, produced = tokens / seconds, sampler.rate(rows[skip]["time"], rows[-1]["time"])
    return {"together_tok_s": min(trained, produced) if produced else trained, "trained_tok_s": trained,
            "produced_tok_s": produced, "together_seconds": seconds, "together_steps": len(window),
            "together_mean_step_s": sum(r["step_s"] for r in window) / len(window),
            # what the window's own batches hold: the ideal is priced per batch (see part_services)
            "together_tokens": tokens, "together_anchors": sum(int(r.get("anchors", 0)) for r in window)}


def wait_compiled(children: Children, name: str, endpoint: str, timeout_s: float) -> tuple[dict[str, Any], float]:
    """The trainer's status `compile` once its background compile is over (or there is none), and
    the wall-clock time it was first seen so (0.2 s polls). Still compiling at the timeout: the
    last state with `timed_out_s` added (the caller measures on eager steps and says so)."""
    deadline = time.monotonic() + timeout_s
    state: dict[str, Any] = {}
    while True:
        state = ((try_status(endpoint, timeout_s=2.0) or {}).get("compile") or state)
        if state.get("state") not in (None, "building", "compiling"):
            return state, time.time()
        children.check_alive(name)
        if time.monotonic() > deadline:
            print(f"{name}: still compiling after {timeout_s:.0f}s ({state}); measuring on", flush=True)
            return {**state, "timed_out_s": timeout_s}, time.time()
        time.sleep(0.2)


def steps_after(compile_state: dict[str, Any], skip: int) -> int:
    """Metrics records to skip so that a window holds compiled steps only (one record per step,
    record i is step i + 1): the eager steps before the switch, then `skip` more."""
    return int(compile_state.get("at_step") or 0) + skip


def median_step_s(rows: list[dict[str, Any]], first: int) -> float:
    """The median step after the first `first` records, without its wait for a batch."""
    values = sorted(float(r["step_s"]) - float(r.get("wait_s", 0.0)) for r in rows[first:])
    return values[len(values) // 2]


def wind_up(children: Children, sampler: ProductionSampler, label: str, tail_bytes: int) -> None:
    """Stop sampling, end every service process, print the tail of each one's log."""
    sampler.stop()
    children.close()
    for who in children.logs:
        print(f"\n===== {label}{who} log (tail) =====\n{children.tail(who, tail_bytes)}", flush=True)


def window_done(skip: int, seconds: float) -> Callable[[list[dict[str, Any]]], bool]:
    """enough(rows) for wait_metrics: `seconds` of steps after the first `skip`."""
    return lambda r: len(r) >= skip + 2 and r[-1]["time"] - r[skip]["time"] >= seconds


def run_placement(plan: ServicePlan, name: str, budget_s: float, figures: dict[str, Any]) -> dict[str, Any]:
    """Both services placed on plan.target_devices / plan.trainer_devices (issue 8): the target
    warms up alone, then the trainer (torchrun ranks over NCCL when several) trains for
    plan.args.p6_seconds; end-to-end tokens/s from its metrics, as P6 measures it."""
    cfg_path, cfg = write_config(plan)
    children = Children(plan.workdir)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), REPO])),
           "NCCL_NVLS_ENABLE": "0"}
    deadline = time.monotonic() + budget_s
    run_dir = os.path.join(plan.workdir, f"run-{name}")
    shutil.rmtree(run_dir, ignore_errors=True)
    figures.update(target_devices=plan.target_devices, trainer_devices=plan.trainer_devices)
    sampler = ProductionSampler(cfg.service.target_endpoint)
    try:
        t0 = time.time()
        children.spawn("target", ["target-server", "-c", cfg_path], env)
        while (try_status(cfg.service.target_endpoint, timeout_s=2.0) or {}).get("state") != "serving":
            children.check_alive("target")
            if time.monotonic() > deadline:
                raise TimeoutError(f"target not serving after {budget_s:.0f}s:\n{children.tail('target', 2000)}")
            time.sleep(0.5)
        figures["target_ready_s"] = time.time() - t0
        ranks = len(plan.trainer_devices or [plan.device])
        sampler.start()
        children.spawn("trainer", ["trainer", "-c", cfg_path, "--set", f"train.out_dir={run_dir}"], env, ranks=ranks)
        rows = wait_metrics(children, "trainer", os.path.join(run_dir, "metrics.jsonl"),
                            window_done(plan.args.p6_skip_steps, plan.args.p6_seconds),
                            max(1.0, deadline - time.monotonic()), also_alive=("target",))
        figures.update(end_to_end(rows, plan.args.p6_skip_steps, sampler))
        status = try_status(cfg.service.target_endpoint, timeout_s=5.0) or {}
        figures["target_stages"] = status.get("stages", {})
        print(f"placement {name}: {figures['together_tok_s']:,.0f} tok/s (trained {figures['trained_tok_s']:,.0f}, "
              f"produced {figures['produced_tok_s'] or 0:,.0f}) over {figures['together_steps']} steps "
              f"({figures['together_seconds']:.1f}s)", flush=True)
        return figures
    finally:
        wind_up(children, sampler, f"{name} ", 20_000)


# the warm trainer's switch to its compiled step and 6 compiled steps after it, at the 27B shape
WARM_COMPILED_NEEDS_S = 100.0


def run_services(plan: ServicePlan, budget_s: float, figures: dict[str, Any]) -> dict[str, Any]:
    """Cold start, together, warm restart (see the module docstring), filling `figures` as it goes
    so that the caller keeps what was measured when a later step fails."""
    cfg_path, cfg = write_config(plan)
    children = Children(plan.workdir)
    base_env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), REPO]))}
    if not plan.device.startswith("cuda"):
        base_env["OMP_NUM_THREADS"] = "1"   # two services on a small CPU box
    cold_env = dict(base_env)
    # The trainer's compile caches as production keeps them (a volume that outlives the process):
    # the warm restart finds what the cold trainer compiled, and only that. "fresh": both start
    # empty, as on a new host.
    trainer_env = dict(base_env)
    if plan.cold_triton == "fresh":
        cold_env["TRITON_CACHE_DIR"] = os.path.join(plan.workdir, f"triton-cold-{os.getpid()}")
        caches = os.path.join(plan.workdir, f"trainer-cache-{os.getpid()}")
        trainer_env.update(TRITON_CACHE_DIR=os.path.join(caches, "triton"),
                           TORCHINDUCTOR_CACHE_DIR=os.path.join(caches, "inductor"))
    deadline = time.monotonic() + budget_s
    figures.update({"device": plan.device, "cold_triton_cache": plan.cold_triton,
                    "token_budget": plan.manifest["token_budget"]})

    def left() -> float:
        return max(1.0, deadline - time.monotonic())

    def trainer_args(run: str) -> list[str]:
        return ["trainer", "-c", cfg_path, "--set", f"train.out_dir={os.path.join(plan.workdir, run)}"]

    sampler = ProductionSampler(cfg.service.target_endpoint)
    endpoint = cfg.service.trainer_endpoint
    try:
        for run in ("run-cold", "run-warm"):
            shutil.rmtree(os.path.join(plan.workdir, run), ignore_errors=True)
        t0 = time.time()
        sampler.start()
        children.spawn("target", ["target-server", "-c", cfg_path], cold_env)
        children.spawn("trainer-cold", trainer_args("run-cold"), trainer_env)
        cold_metrics = os.path.join(plan.workdir, "run-cold", "metrics.jsonl")
        rows = wait_metrics(children, "trainer-cold", cold_metrics, lambda r: True,
                            min(plan.args.step_timeout, left()), also_alive=("target",))
        figures["cold_first_step_s"] = rows[0]["time"] - t0
        print(f"cold start: first optimizer step {figures['cold_first_step_s']:.1f}s after both started", flush=True)

        # P6 on compiled steps only: the trainer steps eagerly until its background compile is ready
        cold_compile, _ = wait_compiled(children, "trainer-cold", endpoint, min(plan.args.step_timeout, left() / 3))
        figures["cold_compile"] = cold_compile
        skip = (steps_after(cold_compile, plan.args.p6_skip_steps) if "timed_out_s" not in cold_compile
                else len(read_metrics(cold_metrics)) + plan.args.p6_skip_steps)   # eager steps: figures say so
        rows = wait_metrics(children, "trainer-cold", cold_metrics, window_done(skip, plan.args.p6_seconds),
                            min(plan.args.p6_seconds * 4 + 60, left()), also_alive=("target",))
        figures.update(end_to_end(rows, skip, sampler))
        sampler.stop()
        print(f"together: {figures['together_tok_s']:,.0f} tok/s (trained {figures['trained_tok_s']:,.0f}, produced "
              f"{figures['produced_tok_s'] or 0:,.0f}) over {figures['together_steps']} steps", flush=True)
        target_status = try_status(cfg.service.target_endpoint, timeout_s=5.0) or {}
        trainer_status = try_status(cfg.service.trainer_endpoint, timeout_s=5.0) or {}
        stages = target_status.get("stages", {})
        figures.update(target_stages=stages, trainer_stages=trainer_status.get("stages", {}),
                       target_load_s=stages.get("load", {}).get("seconds"),
                       target_warmup_s=stages.get("warmup", {}).get("seconds"),
                       target_batches_produced=target_status.get("batches", {}).get("produced"))

        figures["cold_compiled_median_step_s"] = cold_step_s = median_step_s(rows, skip)
        children.kill("trainer-cold")
        # a trainer restart against the warm target
        name, run = "trainer-warm", "run-warm"
        metrics = os.path.join(plan.workdir, run, "metrics.jsonl")
        t1 = time.time()
        children.spawn(name, trainer_args(run), trainer_env)
        rows = wait_metrics(children, name, metrics, lambda r: True, min(plan.args.step_timeout, left()),
                            also_alive=("target",))
        first = rows[0]["time"] - t1
        warm = {"first_step_s": first, "over_cold_first_step": first / figures["cold_first_step_s"],
                "startup": (try_status(endpoint, timeout_s=5.0) or {}).get("startup")}
        print(f"warm restart: first optimizer step {first:.1f}s after the trainer started", flush=True)
        figures["warm"] = warm
        if left() < WARM_COMPILED_NEEDS_S:    # P4 is measured; the compiled comparison needs time the run lacks
            print(f"warm restart: {left():.0f}s left, its compiled steps not compared", flush=True)
            children.kill(name)
            return figures
        # then: when it runs compiled, and whether its compiled steps are as fast as the cold trainer's
        state, seen = wait_compiled(children, name, endpoint, min(120.0, left()))
        warm.update(compile=state, compiled_after_s=seen - t1 if state.get("state") == "compiled" else None)
        skip = steps_after(state, 2) if "timed_out_s" not in state else len(read_metrics(metrics)) + 2
        rows = wait_metrics(children, name, metrics, lambda r: len(r) >= skip + 6, min(60.0, left()),
                            also_alive=("target",))
        warm["compiled_median_step_s"] = median_step_s(rows, skip)
        warm["compiled_step_over_cold"] = warm["compiled_median_step_s"] / cold_step_s
        warm["eager_steps"] = int(state.get("at_step") or 0)
        children.kill(name)
        print(f"warm restart: compiled after {warm['compiled_after_s'] or float('nan'):.1f}s; compiled "
              f"steps {warm['compiled_median_step_s']:.3f}s vs {cold_step_s:.3f}s cold", flush=True)
        return figures
    finally:
        wind_up(children, sampler, "", 60_000)
        leftovers = [f for f in os.listdir(plan.shm_dir) if f.startswith(plan.ring_name)] \
            if os.path.isdir(plan.shm_dir) else []
        figures["shm_leftovers"] = leftovers
