"""The trainer's control endpoint (rank 0): `dfpipe ctl trainer ...` lands here.

Commands only set flags; the training loop reads them at step boundaries (and shares them with
the other ranks), so a command never interrupts a step half-way.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from common.channel import CurveKeys, RouterChannel
from common.protocol import Control, Ping, Pong, Reply
from common.stopping import sender_text

log = logging.getLogger(__name__)


class TrainerFlags:
    def __init__(self) -> None:
        self.stop = False          # finish the step, checkpoint, exit 0 (SIGTERM, ctl shutdown)
        self.checkpoint = False    # checkpoint at the next step boundary
        self.paused = False
        self.drain = False         # stop taking batches; train what is in hand; checkpoint; pause
        self.reason = ""           # who or what asked it to stop (the first to ask): the trainer's stop log line

    def ask_to_stop(self, reason: str) -> None:
        if not self.stop:
            self.reason = reason
        self.stop = True


class TrainerControl(threading.Thread):
    def __init__(self, endpoint: str, flags: TrainerFlags, status: Callable[[], dict[str, Any]],
                 max_bytes: int, curve: CurveKeys | None = None, allowed_uids: Iterable[int] = ()) -> None:
        super().__init__(name="trainer-control", daemon=True)
        self.flags = flags
        self.status = status
        self.channel = RouterChannel(endpoint, hwm=64, max_bytes=max_bytes, curve=curve, allowed_uids=allowed_uids)
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            for peer, msg in self.channel.poll(0.2):
                if isinstance(msg, Ping):
                    self.channel.send(peer, Pong(rid=msg.rid, t=msg.t))
                elif isinstance(msg, Control):
                    self.channel.send(peer, self._handle(peer, msg))
        self.channel.close()

    def _handle(self, peer: bytes, msg: Control) -> Reply:
        f = self.flags
        try:
            if msg.cmd == "status":
                return Reply(rid=msg.rid, ok=True, result=self.status(), error="")
            if msg.cmd == "pause":
                f.paused = True
            elif msg.cmd == "resume":
                f.paused, f.drain = False, False
            elif msg.cmd == "drain":
                f.drain = True
            elif msg.cmd == "shutdown":
                f.ask_to_stop(f"ctl shutdown from {sender_text(self.channel.sender(peer))}")
            elif msg.cmd == "checkpoint":
                f.checkpoint = True
            return Reply(rid=msg.rid, ok=True, result={"accepted": msg.cmd}, error="")
        except Exception as e:  # a status bug must not kill the control thread
            log.exception("control command %s failed", msg.cmd)
            return Reply(rid=msg.rid, ok=False, result={}, error=repr(e))

    def close(self) -> None:
        self._halt.set()
        self.join(timeout=2)
