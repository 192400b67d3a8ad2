"""Chaos soak: both services on CPU for --minutes while the trainer is killed, stopped, hung and
restarted and the target is killed and restarted, at random. Then the run is audited from its
last checkpoint (every finished epoch trained exactly once, the current one without a
duplicate), the services must stop cleanly and leave no ring file behind, and the long-lived
target's memory, threads and file descriptors must stay flat over each of its lifetimes.

    python bench/soak.py --minutes 30                        # by hand: figures go to docs/benchmarks.md
    python bench/soak.py --minutes 1 --samples 60 --seed 3   # the smoke run (tests/test_soak_smoke.py)

Everything a day-long job meets, compressed: what it does not reach is the GPU path (bench/gpu/)
and several trainer ranks (tests/test_e2e_trainer.py). Exit status 0 only when every check held.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import yaml  # noqa: E402

from bench.gpu.services import Children  # noqa: E402
from dfpipe.ctl import control, try_status  # noqa: E402

DEMO = os.path.join(REPO, "configs", "demo")
# (weight, action) drawn at random: trainer faults dominate, since the trainer is what users
# restart all day. The target is killed on a schedule instead (--target-lifetimes), so each of
# its lives is long enough to show a leak.
ACTIONS: list[tuple[int, str]] = [(4, "trainer_kill9"), (2, "trainer_sigterm_new_lr"), (1, "trainer_dies_in_checkpoint"),
                                  (1, "trainer_hung"), (1, "target_pause"), (1, "trainer_pause"),
                                  (1, "trainer_checkpoint_now")]
TARGET_KILL = "target_kill9"
SETTLE_S = 60.0        # a target's first minute (load, warm-up, first allocations) is not a leak
SAMPLE_EVERY_S = 2.0


class SoakFailure(AssertionError):
    pass


@dataclass
class Soak:
    workdir: str
    config: str
    cfg: dict[str, Any]
    rng: random.Random
    children: Children
    trainer_name: str = ""
    trainers_started: int = 0
    targets_started: int = 0
    actions: dict[str, int] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)
    stop_sampling: threading.Event = field(default_factory=threading.Event)
    ending: set[str] = field(default_factory=set)   # processes this soak itself stops or kills

    # ---- the two services --------------------------------------------------------------------
    @property
    def ep_target(self) -> str:
        return self.cfg["service"]["target_endpoint"]

    @property
    def ep_trainer(self) -> str:
        return self.cfg["service"]["trainer_endpoint"]

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        # one thread each: two services share this machine's cores with the soak itself
        return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, **(extra or {})}

    def start_target(self) -> None:
        self.targets_started += 1
        self.children.spawn(f"target-{self.targets_started}", ["target-server", "-c", self.config], self.env())
        self.wait(lambda: (s := try_status(self.ep_target)) and s.get("state") == "serving", 300, "target serving")

    @property
    def target_name(self) -> str:
        return f"target-{self.targets_started}"

    def start_trainer(self, overrides: list[str] | None = None, extra_env: dict[str, str] | None = None) -> None:
        self.trainers_started += 1
        self.trainer_name = f"trainer-{self.trainers_started}"
        args = ["trainer", "-c", self.config]
        for o in overrides or []:
            args += ["--set", o]
        self.children.spawn(self.trainer_name, args, self.env(extra_env))

    def trainer_pid(self) -> int:
        return self.children.procs[self.trainer_name].pid

    def trained(self) -> int | None:
        s = try_status(self.ep_trainer)
        return s.get("batches_trained") if s and s.get("pid") == self.trainer_pid() else None

    def progress(self, batches: int, timeout_s: float = 180.0) -> None:
        """The current trainer trains `batches` more batches than it holds now (or than it resumed)."""
        first = self.wait(lambda: (n := self.trained()) is not None and [n], 120,
                          f"{self.trainer_name} answering status")[0]
        self.wait(lambda: (n := self.trained()) is not None and n >= first + batches, timeout_s,
                  f"{self.trainer_name} training {batches} more batches")

    def wait(self, fn: Callable[[], Any], timeout_s: float, what: str) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, proc in self.children.procs.items():
                if name in (self.target_name, self.trainer_name) and proc.poll() is not None \
                        and name not in self.ending:
                    raise SoakFailure(f"{name} exited with {proc.returncode} while waiting for {what}:\n"
                                      f"{self.children.tail(name, 4000)}")
            got = fn()
            if got:
                return got
            time.sleep(0.1)
        raise SoakFailure(f"timed out after {timeout_s:.0f}s waiting for {what}; logs:\n"
                          f"{self.children.tail(self.target_name, 3000)}\n---\n{self.children.tail(self.trainer_name, 3000)}")

    def expect_exit(self, name: str, timeout_s: float) -> int:
        proc = self.children.procs[name]
        self.ending.add(name)
        try:
            return proc.wait(timeout_s)
        except Exception:
            raise SoakFailure(f"{name} did not exit within {timeout_s}s:\n{self.children.tail(name, 4000)}") from None

    def kill(self, name: str) -> None:
        self.ending.add(name)
        self.children.kill(name)

    # ---- chaos ---------------------------------------------------------------------------------
    def act(self, action: str) -> None:
        self.actions[action] = self.actions.get(action, 0) + 1
        if action == "trainer_kill9":
            time.sleep(self.rng.uniform(0.0, 0.5))   # land anywhere in a step, a read or a checkpoint
            self.kill(self.trainer_name)
            self.start_trainer()
        elif action == "trainer_sigterm_new_lr":
            name = self.trainer_name
            self.children.procs[name].send_signal(signal.SIGTERM)
            rc = self.expect_exit(name, 180)
            if rc != 0:
                raise SoakFailure(f"{name}: SIGTERM gave exit status {rc}, not 0:\n{self.children.tail(name, 4000)}")
            self.start_trainer([f"train.lr={self.rng.choice([3e-4, 6e-4, 1e-3])}"])
        elif action == "trainer_dies_in_checkpoint":
            self.kill(self.trainer_name)
            self.start_trainer(extra_env={"DFPIPE_FAULT": "checkpoint.before_rename"})
            rc = self.expect_exit(self.trainer_name, 300)
            if rc != -signal.SIGKILL:
                raise SoakFailure(f"{self.trainer_name} should have died in its first checkpoint, exit status {rc}")
            self.start_trainer()
        elif action == "trainer_hung":
            fenced = self.wait(lambda: try_status(self.ep_target), 30, "target status")["fenced"]
            os.kill(self.trainer_pid(), signal.SIGSTOP)
            try:
                self.wait(lambda: (s := try_status(self.ep_target)) and s["fenced"] > fenced, 60,
                          "the target to fence a stopped trainer")
            finally:
                os.kill(self.trainer_pid(), signal.SIGCONT)
        elif action == "target_kill9":
            old = self.target_name
            self.kill(old)
            self.wait(lambda: (s := try_status(self.ep_trainer)) and s.get("state") == "waiting_for_target", 60,
                      "the trainer to wait for the target")
            self.start_target()
        elif action in ("target_pause", "trainer_pause"):
            service = action.split("_")[0]
            endpoint = self.ep_target if service == "target" else self.ep_trainer
            self.ctl(endpoint, service, "pause")
            time.sleep(self.rng.uniform(0.5, 3.0))
            self.ctl(endpoint, service, "resume")
        elif action == "trainer_checkpoint_now":
            self.ctl(self.ep_trainer, "trainer", "checkpoint")
        else:
            raise ValueError(f"unknown action {action!r}")

    def ctl(self, endpoint: str, service: str, command: str) -> None:
        try:
            control(endpoint, service, command, timeout_s=5.0)
        except SystemExit as e:   # dfpipe ctl's own clear error, for its command line
            raise SoakFailure(str(e)) from None

    # ---- what the long-lived process does over time -------------------------------------------
    def sample_forever(self) -> None:
        ring_glob = os.path.join(self.cfg["ring"]["shm_dir"], self.cfg["ring"]["name"] + ".*")
        while not self.stop_sampling.wait(SAMPLE_EVERY_S):
            proc = self.children.procs.get(self.target_name)
            if proc is None or proc.poll() is not None:
                continue
            status = try_status(self.ep_target) or {}
            row = {"t": time.time(), "target": self.target_name, "pid": proc.pid, **proc_figures(proc.pid),
                   "ring_files": len(glob.glob(ring_glob)), "batches": (status.get("batches") or {}).get("produced")}
            if row.get("rss_mb") is not None:
                self.samples.append(row)


def proc_figures(pid: int) -> dict[str, Any]:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
        return {"rss_mb": int(status["VmRSS"].split()[0]) / 1024, "threads": int(status["Threads"]),
                "fds": len(os.listdir(f"/proc/{pid}/fd"))}
    except (OSError, KeyError, ValueError):
        return {"rss_mb": None}


def slope_per_s(ts: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over ts."""
    t_mean, y_mean = sum(ts) / len(ts), sum(ys) / len(ys)
    var = sum((t - t_mean) ** 2 for t in ts)
    return sum((t - t_mean) * (y - y_mean) for t, y in zip(ts, ys)) / var if var else 0.0


def lifetime_trends(samples: list[dict[str, Any]], settle_s: float) -> list[dict[str, Any]]:
    """Per target process: RSS slope (least squares, MB/hour) and the spread of threads and fds,
    over its samples after `settle_s` of life."""
    out = []
    for name in dict.fromkeys(s["target"] for s in samples):
        rows = [s for s in samples if s["target"] == name]
        born = rows[0]["t"]
        rows = [s for s in rows if s["t"] - born >= settle_s]
        if len(rows) < 5:
            continue
        ts = [s["t"] for s in rows]
        rss = [s["rss_mb"] for s in rows]
        late = len(rows) // 2
        out.append({"target": name, "seconds": round(ts[-1] - ts[0], 1), "samples": len(rows),
                    "rss_mb_first": round(rss[0], 1), "rss_mb_last": round(rss[-1], 1), "rss_mb_max": round(max(rss), 1),
                    "rss_mb_per_hour": round(slope_per_s(ts, rss) * 3600, 2),
                    # the allocator settles for a while; a leak keeps its pace to the end
                    "rss_mb_per_hour_late": round(slope_per_s(ts[late:], rss[late:]) * 3600, 2),
                    **{k: [min(s[k] for s in rows), max(s[k] for s in rows)]
                       for k in ("threads", "fds", "ring_files")}})
    return out


def audit_epochs(info: dict[str, Any]) -> list[str]:
    """What is wrong with a run's accounting (empty: nothing): every epoch before the current one
    trained whole, exactly once; the current one without a duplicate."""
    problems = []
    epochs = info.get("epochs")
    if not epochs:
        return [f"the checkpoint carries no per-epoch accounting: {sorted(info)}"]
    current = int(info["epoch"])
    for e in range(current + 1):
        stats = epochs.get(str(e))
        if stats is None:
            problems.append(f"epoch {e}: nothing trained")
            continue
        # samples (source rows) and the documents they make; a checkpoint from before documents
        # were counted has no documents to audit
        for kind in ("samples", "documents"):
            size, trained = info.get(f"epoch_{kind}"), stats.get(f"{kind}_trained")
            if stats.get(f"{kind}_duplicated"):
                problems.append(f"epoch {e}: {stats[f'{kind}_duplicated']} {kind} trained twice")
            if e < current and trained is not None and size and trained != size:
                problems.append(f"epoch {e}: {trained} of {size} {kind} trained")
    return problems


def write_config(workdir: str, samples: int, cache_dir: str, seed: int) -> tuple[str, dict[str, Any]]:
    with open(os.path.join(DEMO, "chat.jsonl"), encoding="utf-8") as f:
        lines = f.read().splitlines()[:samples]
    data = os.path.join(workdir, "chat.jsonl")
    with open(data, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    tag = os.path.basename(workdir.rstrip("/")).split("-", 1)[-1]
    cfg: dict[str, Any] = {
        "ring": {"name": f"dfpsoak-{tag}", "slots": 3},
        "data": {"train_path": data, "token_budget": 512, "max_len": 512, "seed": seed},
        "target": {"model": "builtin:tiny-qwen3.5", "tokenizer": os.path.join(DEMO, "tokenizer"),
                   "cache_dir": cache_dir, "devices": ["cpu"], "audit_every": 10},
        "drafter": {"num_layers": 1, "block_size": 8, "max_anchors": 32},
        # as many epochs as the soak lasts: it ends with a graceful stop, mid-epoch
        "train": {"out_dir": os.path.join(workdir, "run"), "epochs": 4096, "lr": 6e-4, "checkpoint_every": 3,
                  "keep_checkpoints": 2, "log_every": 5, "tensorboard": False},
        "service": {"target_endpoint": f"ipc://{workdir}/target.sock", "trainer_endpoint": f"ipc://{workdir}/trainer.sock",
                    "heartbeat_s": 0.3, "lease_s": 3.0, "rescan_s": 0.1, "request_timeout_s": 1.0},
    }
    path = os.path.join(workdir, "config.yaml")
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(cfg, f, sort_keys=False)
    from common.config import load_config
    loaded = load_config(path)
    cfg["ring"]["shm_dir"] = loaded.ring.shm_dir
    return path, cfg


def run(args: argparse.Namespace) -> dict[str, Any]:
    from drafter_trainer.checkpoint import inspect_run

    os.makedirs(args.workdir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="soak-", dir=args.workdir)
    config, cfg = write_config(workdir, args.samples, args.cache_dir, args.seed)
    soak = Soak(workdir, config, cfg, random.Random(args.seed), Children(workdir))
    chosen = [(w, n) for w, n in ACTIONS if args.actions == "all" or n in args.actions.split(",")]
    weights, names = zip(*chosen) if chosen else ((), ())
    result: dict[str, Any] = {"workdir": workdir, "minutes": args.minutes, "samples": args.samples, "seed": args.seed,
                              "failures": []}
    sampler = threading.Thread(target=soak.sample_forever, daemon=True)
    t0 = time.monotonic()
    try:
        soak.start_target()
        result["target_start_s"] = round(time.monotonic() - t0, 1)
        sampler.start()
        soak.start_trainer()
        deadline = t0 + args.minutes * 60
        target_kills = [t0 + args.minutes * 60 * i / args.target_lifetimes for i in range(1, args.target_lifetimes)]
        order = [*names, TARGET_KILL] if args.every_action_first else []   # the smoke run meets each action once
        while time.monotonic() < deadline or order:
            soak.progress(soak.rng.randint(1, 4))
            if order:
                action = order.pop(0)
            elif target_kills and time.monotonic() >= target_kills[0]:
                del target_kills[0]
                action = TARGET_KILL
            else:
                if not names:   # --actions none: steady training, the baseline of the leak trends
                    continue
                action = soak.rng.choices(names, weights)[0]
            print(f"[{time.monotonic() - t0:7.1f}s] {action}", flush=True)
            soak.act(action)
        # the last trainer must still make progress on slots the chaos has cycled many times
        soak.progress(3 * cfg["ring"]["slots"])
        name = soak.trainer_name
        soak.children.procs[name].send_signal(signal.SIGTERM)
        result["final_trainer_exit"] = soak.expect_exit(name, 180)
        if result["final_trainer_exit"] != 0:
            result["failures"].append(f"final trainer: exit status {result['final_trainer_exit']}")
        target = try_status(soak.ep_target) or {}
        result["target_final"] = {k: target.get(k) for k in ("model_loads", "sessions", "fenced", "batches",
                                                            "bad_messages", "ring")}
        if (target.get("batches") or {}).get("quarantined"):
            result["failures"].append(f"target quarantined batches: {target['batches']}")
        info = inspect_run(os.path.join(workdir, "run"))
        info.pop("have", None)
        result["checkpoint"] = info
        result["failures"] += audit_epochs(info)
        # a kill, wherever it lands in a save, never leaves a checkpoint that fails verification
        result["failures"] += [f"checkpoint {c['name']}: {c['verified']}" for c in info["checkpoints"]
                               if not c["verified"].startswith("ok")]
        soak.stop_sampling.set()   # a process shutting down is no trend
        soak.children.procs[soak.target_name].send_signal(signal.SIGTERM)
        result["final_target_exit"] = soak.expect_exit(soak.target_name, 60)
        if result["final_target_exit"] != 0:
            result["failures"].append(f"final target: exit status {result['final_target_exit']}")
        left = glob.glob(os.path.join(cfg["ring"]["shm_dir"], cfg["ring"]["name"] + ".*"))
        if left:
            result["failures"].append(f"ring files left behind: {left}")
    except SoakFailure as e:
        result["failures"].append(str(e))
    finally:
        soak.stop_sampling.set()
        soak.children.close()
        result.update(seconds=round(time.monotonic() - t0, 1), actions=soak.actions,
                      trainers_started=soak.trainers_started, targets_started=soak.targets_started,
                      target_lifetimes=lifetime_trends(soak.samples, args.settle_s))
        # the raw series, for a closer look: [seconds since start, target, rss MB, threads, fds, ring files,
        # batches the target has produced]
        result["series"] = [[round(r["t"] - soak.samples[0]["t"], 1), r["target"], round(r["rss_mb"], 2), r["threads"],
                             r["fds"], r["ring_files"], r["batches"]] for r in soak.samples] if soak.samples else []
    for life in result["target_lifetimes"]:
        # a leak of one page a batch shows as a steady climb; allocator noise does not
        if life["seconds"] >= 600 and life["rss_mb_per_hour_late"] > args.max_rss_mb_per_hour:
            result["failures"].append(f"{life['target']}: RSS still grows {life['rss_mb_per_hour_late']} MB/hour "
                                      f"over the second half of its life")
        if life["fds"][1] - life["fds"][0] > args.max_fd_spread:
            result["failures"].append(f"{life['target']}: file descriptors ranged {life['fds']}")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0, help="how long the chaos lasts")
    p.add_argument("--samples", type=int, default=300, help="demo chats in the epoch (300: ~40 batches)")
    p.add_argument("--seed", type=int, default=0, help="the chaos and the packer")
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "dfpipe-soak"))
    p.add_argument("--cache-dir", default=os.path.join(REPO, ".cache", "dfpipe-tests"), help="the built-in target")
    p.add_argument("--target-lifetimes", type=int, default=2, help="kill -9 the target this many times minus one, evenly")
    p.add_argument("--actions", default="all",
                   help=f"the random actions: all, none (steady training), or some of {','.join(n for _, n in ACTIONS)}")
    p.add_argument("--every-action-first", action="store_true", help="take each action once, in order, first")
    p.add_argument("--settle-s", type=float, default=SETTLE_S, help="a target's first seconds left out of the trends")
    p.add_argument("--max-rss-mb-per-hour", type=float, default=20.0,
                   help="fail a target lifetime of 10+ minutes whose RSS still climbs faster over its second half")
    p.add_argument("--max-fd-spread", type=int, default=8, help="fail a target whose open fds range wider")
    p.add_argument("--out", default="", help="write the result JSON here too")
    args = p.parse_args(argv)
    result = run(args)
    text = json.dumps(result, indent=1, default=str)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    print("soak: PASS" if not result["failures"] else f"soak: FAIL ({len(result['failures'])} problems)")
    return 0 if not result["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
