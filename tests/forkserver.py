"""Fork server for the end-to-end tests' services: `python forkserver.py` imports torch, torch._dynamo
and transformers' model code once, then forks each `python -m dfpipe ARGS` it is asked for.

A service started afresh spends ~3-5 CPU-s importing those (the target server's model loading pulls
in transformers and, through it, torch._dynamo; every torch optimizer step imports torch._dynamo):
over a third of the suite's CPU went to the same imports, a hundred times over. A fork of this
process skips them and is otherwise the command users run: its own session, environment, working
folder and log, and `runpy` runs `dfpipe` as `-m` does. None of the project's modules is imported
here, so each service imports them afresh under its own environment (DFPIPE_FAULT, ...).

Protocol, one JSON object or line at a time: stdin takes {"argv", "env", "cwd", "log"}; stdout
answers `started PID` for each, and `exit PID RETURNCODE` (negative: killed by that signal, as
subprocess reports it) when a service ends. It exits when stdin closes (its test worker is gone).
"""
from __future__ import annotations

import json
import os
import random
import runpy
import select
import sys
import tempfile

import torch  # noqa: F401  (imported for the services)
import torch._dynamo  # noqa: F401
import transformers.modeling_utils  # noqa: F401


def _run_service(request: dict) -> None:
    """In the forked child: become `python -m dfpipe ARGV`; returns only by raising SystemExit."""
    os.setsid()
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None   # as a fresh interpreter: found again from this environment's TMPDIR
    os.chdir(request["cwd"])
    sys.path[0] = request["cwd"]   # as `python -m` has it (this script's folder was there)
    sys.argv = ["dfpipe", *request["argv"]]
    random.seed()   # a fresh interpreter seeds it from the OS; a fork would repeat this server's sequence
    runpy.run_module("dfpipe", run_name="__main__", alter_sys=True)
    sys.exit(0)


def _reap(out) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        out.write(f"exit {pid} {os.waitstatus_to_exitcode(status)}\n")
        out.flush()


def main() -> None:
    out = sys.stdout
    stdin = sys.stdin.fileno()
    pending = b""
    while True:
        ready, _, _ = select.select([stdin], [], [], 0.05)
        _reap(out)
        if not ready:
            continue
        chunk = os.read(stdin, 65536)
        if not chunk:
            return
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            out.flush()
            pid = os.fork()
            if pid == 0:
                _run_service(request)   # never returns: its SystemExit ends the child as `python -m` would
            out.write(f"started {pid}\n")
            out.flush()


if __name__ == "__main__":
    main()
