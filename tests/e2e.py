"""Helpers for end-to-end tests: real service processes on a tiny config, driven over ctl."""
from __future__ import annotations

import atexit
import contextlib
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, ClassVar

import yaml

from common.channel import CurveKeys, RequestTimeout, request
from common.protocol import Control, Reply, next_rid
from machine_speed import scaled

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "configs" / "demo"
CACHE = REPO / ".cache" / "dfpipe-tests"   # built-in tiny target, shared by tests and runs


SOCKET_DIRS: list[str] = []   # made by socket_dir() in this process, removed when it exits
RINGS: list[str] = []   # ring names of the configs written here: files of theirs in /dev/shm go at exit too


def remove_leftovers() -> None:
    """At exit, once every service of this process has stopped: its socket folders (the services
    remove their sockets, not the folder) and any ring file that a killed service left behind (the
    tests that check the clean-up itself assert on it before this runs)."""
    for path in SOCKET_DIRS:
        shutil.rmtree(path, ignore_errors=True)
    for ring in RINGS:
        for path in glob.glob(f"/dev/shm/{ring}.*"):
            with contextlib.suppress(OSError):
                os.unlink(path)


atexit.register(remove_leftovers)


def socket_dir() -> str:
    """A fresh folder for a config's ipc:// sockets: under /tmp, as a socket's path must stay
    within ~107 bytes (pytest's tmp_path does not), and a stranger's process may be let in. Removed
    at the end of the test session (tests/conftest.py) or when this process exits."""
    SOCKET_DIRS.append(tempfile.mkdtemp(prefix="dfpt-", dir="/tmp"))
    return SOCKET_DIRS[-1]


def write_config(tmp: Path, samples: int = 120, **sections: dict[str, Any]) -> Path:
    """A small config: the first `samples` demo chats, a tiny target, a 1-layer drafter."""
    tag = uuid.uuid4().hex[:8]
    lines = (DEMO / "chat.jsonl").read_text(encoding="utf-8").splitlines()[:samples]
    (tmp / "chat.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    sock = socket_dir()
    RINGS.append(f"dfpt-{tag}")
    cfg: dict[str, dict[str, Any]] = {
        "ring": {"name": f"dfpt-{tag}", "slots": 3},
        "data": {"train_path": str(tmp / "chat.jsonl"), "token_budget": 512, "max_len": 512, "seed": 0},
        "target": {"model": "builtin:tiny-qwen3.5", "tokenizer": str(DEMO / "tokenizer"),
                   "cache_dir": str(CACHE), "devices": ["cpu"], "audit_every": 10},
        "drafter": {"num_layers": 1, "block_size": 8, "max_anchors": 32},
        "train": {"out_dir": str(tmp / "run"), "epochs": 1, "lr": 1e-3, "checkpoint_every": 3,
                  "keep_checkpoints": 2, "log_every": 1, "tensorboard": False},
        "service": {"target_endpoint": f"ipc://{sock}/target.sock", "trainer_endpoint": f"ipc://{sock}/trainer.sock",
                    "heartbeat_s": 0.3, "lease_s": 3.0, "rescan_s": 0.1, "request_timeout_s": 1.0},
    }
    # The same end-to-end tests run on the GPU host with the services on CUDA devices.
    if os.environ.get("DFPIPE_TEST_TARGET_DEVICES"):
        cfg["target"]["devices"] = os.environ["DFPIPE_TEST_TARGET_DEVICES"].split(",")
    if os.environ.get("DFPIPE_TEST_TRAINER_DEVICE"):
        cfg["train"]["device"] = os.environ["DFPIPE_TEST_TRAINER_DEVICE"]
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def write_heldout(tmp: Path, samples: int = 40) -> Path:
    """Held-out chats for eval during training: demo rows far past any test's training rows."""
    lines = (DEMO / "chat.jsonl").read_text(encoding="utf-8").splitlines()[1000:1000 + samples]
    path = tmp / "heldout.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


class Forked:
    """A service process forked by tests/forkserver.py: what the tests use of subprocess.Popen."""

    def __init__(self, server: "ForkServer", pid: int, args: list[str]) -> None:
        self.server, self.pid, self.args = server, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.exits.get(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self.server.ended:
            if not self.server.ended.wait_for(lambda: self.poll() is not None, timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode


class ForkServer:
    """One tests/forkserver.py per test worker, started with the first service: each service is a
    fork of it (torch and transformers already imported) instead of a fresh interpreter."""

    _one: ClassVar["ForkServer | None"] = None

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("forkserver.py"))],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.exits: dict[int, int] = {}
        self.ended = threading.Condition()
        self.started: list[int] = []
        self.lock = threading.Lock()      # one spawn at a time: answers come in request order
        threading.Thread(target=self._read, daemon=True).start()

    @classmethod
    def get(cls) -> "ForkServer":
        if cls._one is None or cls._one.proc.poll() is not None:
            cls._one = cls()
            atexit.register(cls._one.close)
        return cls._one

    def close(self) -> None:
        """Stdin closed, the server exits; waited for, so that its CPU time (its services' included)
        counts in this worker's, as `time make test` reports it."""
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def _read(self) -> None:
        for line in self.proc.stdout:
            what, *rest = line.split()
            with self.ended:
                if what == "started":   # a pid used again: the exit status of its earlier process goes
                    self.exits.pop(int(rest[0]), None)
                    self.started.append(int(rest[0]))
                elif what == "exit":
                    self.exits[int(rest[0])] = int(rest[1])
                self.ended.notify_all()

    def spawn(self, args: list[str], env: dict[str, str], log_path: Path) -> Forked:
        """`python -m dfpipe ARGS` with `env`, in the current folder, stdout and stderr to log_path."""
        with self.lock, self.ended:
            self.proc.stdin.write(json.dumps({"argv": args, "env": env, "cwd": os.getcwd(),
                                              "log": str(log_path)}) + "\n")
            self.proc.stdin.flush()
            if not self.ended.wait_for(lambda: self.started, 60):
                raise RuntimeError(f"tests/forkserver.py did not fork (exit status {self.proc.poll()})")
            return Forked(self, self.started.pop(0), args)


class Service:
    """One `dfpipe <role>` process in its own process group, logging to a file. CPU services are
    forks of the test worker's ForkServer; services on CUDA devices (the GPU host's run of these
    tests) start as fresh interpreters, since CUDA does not survive a fork."""

    # the services started by the running test: conftest puts their logs in a failing test's report
    started: ClassVar[list["Service"]] = []

    def __init__(self, role: str, config: Path, log_dir: Path, env: dict[str, str] | None = None,
                 overrides: list[str] | None = None) -> None:
        self.role = role
        self.log_path = log_dir / f"{role}-{time.time_ns()}.log"
        args = [role, "-c", str(config)]
        for o in overrides or []:
            args += ["--set", o]
        full_env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | Forked
        if any(os.environ.get(k) for k in ("DFPIPE_TEST_TARGET_DEVICES", "DFPIPE_TEST_TRAINER_DEVICE")):
            self.proc = subprocess.Popen([sys.executable, "-m", "dfpipe", *args], stdout=open(self.log_path, "wb"),
                                         stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
        else:
            self.proc = ForkServer.get().spawn(args, full_env, self.log_path)
        Service.started.append(self)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill9(self) -> None:
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def wait(self, timeout: float) -> int:
        """Its exit code, waiting up to `timeout` s on the reference machine (scaled to this one)."""
        timeout = scaled(timeout)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.role} did not exit within {timeout}s; log:\n{self.log()}") from None

    def log(self, tail: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-tail:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.alive():
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(20)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                self.kill9()


def ctl(endpoint: str, cmd: str, timeout: float = 2.0, curve: CurveKeys | None = None) -> dict[str, Any] | None:
    try:
        reply = request(endpoint, Control(rid=next_rid(), cmd=cmd, args={}), timeout_s=timeout, retries=0,
                        curve=curve)
    except RequestTimeout:
        return None
    assert isinstance(reply, Reply)
    return reply.result if reply.ok else {"error": reply.error}


def serving(endpoint: str) -> dict[str, Any] | None:
    """The target server's status once it serves (for wait_for), else None."""
    s = ctl(endpoint, "status")
    return s if s and s.get("state") == "serving" else None


def wait_for(fn, timeout: float, what: str, interval: float = 0.2):
    """fn() until it answers truthy, for up to `timeout` s on the reference machine (scaled to this one)."""
    timeout = scaled(timeout)
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def inspect_run(config: Path, run: Path | None = None) -> dict[str, Any]:
    """`dfpipe inspect --json` of the config's run folder (or `run`): its newest checkpoint that verifies."""
    out = subprocess.run([sys.executable, "-m", "dfpipe", "inspect", *([str(run)] if run else []), "-c", str(config),
                          "--json"], capture_output=True, text=True, timeout=scaled(60))
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout)


def assert_exactly_once(config: Path, run: Path | None = None) -> dict[str, Any]:
    """The finished run's last checkpoint: every sample (source row) and every document of every
    epoch trained, none twice."""
    info = inspect_run(config, run)
    assert info["samples_trained"] == info["epoch_samples"] > 0, info
    assert info["documents_trained"] == info["epoch_documents"] >= info["epoch_samples"], info
    assert info["samples_duplicated"] == info["documents_duplicated"] == 0, info
    epochs = info["epochs"]
    assert sorted(epochs, key=int) == [str(e) for e in range(info["epoch"] + 1)], info
    for e, stats in epochs.items():
        assert stats == {"samples_trained": info["epoch_samples"], "samples_duplicated": 0,
                         "documents_trained": info["epoch_documents"], "documents_duplicated": 0}, (e, info)
    return info
