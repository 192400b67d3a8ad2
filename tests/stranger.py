"""Another user on the host, for tests: a process whose kernel credentials are uid/gid 65534
(`nobody`), no supplementary groups.

It is forked from the test process and drops to that user there (setgroups, setresgid,
setresuid: what `setpriv --reuid=65534 --regid=65534 --clear-groups` does), then runs a function
of this module's caller. Forked rather than exec'd: the stranger may not be allowed to read this
interpreter (a virtualenv under root's private home), and it needs no interpreter of its own.
The function must not log or touch the parent's ZeroMQ context (other threads' locks do not
survive a fork): it opens its own.

Only root can become another user: `need_root` skips a test otherwise, saying why.
"""
from __future__ import annotations

import json
import os
import select
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest

UID = GID = 65534


def need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("a real second user (uid 65534) needs root to switch to it")


class Stranger:
    """`fn(stopping, *args)` run as uid 65534 in a forked child; `stopping()` turns true once
    `stop()` is called. `stop()` returns what fn returned (JSON), or {"error": ...}."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        need_root()
        stop_r, stop_w = os.pipe()
        out_r, out_w = os.pipe()
        pid = os.fork()
        if pid == 0:   # the stranger
            code = 0
            try:
                os.close(stop_w)
                os.close(out_r)
                os.setgroups([])
                os.setresgid(GID, GID, GID)
                os.setresuid(UID, UID, UID)
                result = fn(lambda: bool(select.select([stop_r], [], [], 0)[0]), *args)
            except BaseException as e:  # reported to the test, never raised into pytest's copy
                result, code = {"error": repr(e)}, 1
            try:
                data = json.dumps(result).encode()
                while data:
                    data = data[os.write(out_w, data):]
            finally:
                os._exit(code)
        os.close(stop_r)
        os.close(out_w)
        self.pid, self._stop_w, self._out_r = pid, stop_w, out_r
        self.result: Any = None
        self._stopped = False

    def stop(self, timeout: float = 30) -> Any:
        if self._stopped:
            return self.result
        self._stopped = True
        os.close(self._stop_w)
        chunks, deadline = [], time.monotonic() + timeout
        while time.monotonic() < deadline:
            if select.select([self._out_r], [], [], 0.1)[0]:
                chunk = os.read(self._out_r, 1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
        else:
            os.kill(self.pid, signal.SIGKILL)
        os.close(self._out_r)
        os.waitpid(self.pid, 0)
        self.result = json.loads(b"".join(chunks) or b"null")
        return self.result

    def __enter__(self) -> "Stranger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(timeout=5)


def as_stranger(fn: Callable[..., Any], *args: Any) -> Any:
    """Run `fn(*args)` once as the stranger and return its result."""
    return Stranger(lambda stopping, *a: fn(*a), *args).stop()


def bind_router(stopping: Callable[[], bool], endpoint: str, answer: bytes | None = None) -> dict:
    """As the stranger: bind a ROUTER at `endpoint` and count the messages that reach it until
    stopped, answering each with `answer` when given. Closing it removes its socket file."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    messages = 0
    while not stopping():
        if sock.poll(50):
            peer, *_ = sock.recv_multipart()
            messages += 1
            if answer is not None:
                sock.send_multipart([peer, answer])
    sock.close()
    ctx.term()
    return {"frames": messages}

