"""Where rank 0's training and eval records go: one sink that fans out to metrics.jsonl, TensorBoard
and Weights & Biases.

metrics.jsonl is opened unbuffered: a line the disk refuses (a full disk) is lost at once and
counted (`lines_lost`, in the trainer's status), never retried by every later flush, and it never
stops training; nor does a TensorBoard record lost the same way (`tensorboard_lost`, logged). A
TensorBoard folder that cannot be written at start is an OSError naming it (the trainer exits 4).
TensorBoard and W&B get the record's scalars under the names `write` is given.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any

log = logging.getLogger(__name__)


class MetricsSink:
    def __init__(self, out_dir: str, tensorboard: bool = False, wandb_project: str = "",
                 run_config: dict[str, Any] | None = None) -> None:
        os.makedirs(out_dir, exist_ok=True)
        self._jsonl = open(os.path.join(out_dir, "metrics.jsonl"), "ab", buffering=0)
        self.lines_lost = 0
        self.tensorboard_lost = 0
        self._tensorboard = None
        self._wandb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            folder = os.path.join(out_dir, "tensorboard")
            _check_writable(folder)
            self._tensorboard = SummaryWriter(folder)
        if wandb_project:
            try:
                import wandb
            except ImportError:
                log.warning("train.wandb_project is set but wandb is not installed; logging without it")
            else:
                self._wandb = wandb.init(project=wandb_project, config=run_config or {}, resume="allow")

    def write(self, record: dict[str, Any], step: int, scalars: dict[str, float]) -> None:
        """One record: its JSON line, and `scalars` ({name: value}) to TensorBoard and W&B."""
        try:
            self._jsonl.write((json.dumps(record) + "\n").encode())
        except OSError as e:
            self.lines_lost += 1
            if self.lines_lost in (1, 10) or self.lines_lost % 1000 == 0:
                log.error("metrics.jsonl: %d line(s) lost so far: %s", self.lines_lost, e)
        if self._tensorboard is not None:
            try:
                for name, value in scalars.items():
                    self._tensorboard.add_scalar(name, value, step)
            except OSError as e:   # its writer thread died on a full disk: from now on every call says so
                self.tensorboard_lost += 1
                if self.tensorboard_lost in (1, 10) or self.tensorboard_lost % 1000 == 0:
                    log.error("TensorBoard: %d record(s) lost so far: %s", self.tensorboard_lost, e)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        self._jsonl.close()
        if self._tensorboard is not None:
            try:
                self._tensorboard.close()
            except OSError as e:
                log.error("TensorBoard: its last records were lost: %s", e)
        if self._wandb is not None:
            self._wandb.finish()


def _check_writable(folder: str) -> None:
    """Make `folder` and write a byte into it, or raise OSError naming it (ENOSPC on a full disk).
    TensorBoard writes its event file from a thread of its own, which on a full disk dies with a
    traceback and leaves the error to whichever call comes next: said here first, in one line."""
    probe = os.path.join(folder, f".probe-{os.getpid()}")
    try:
        os.makedirs(folder, exist_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"\0")
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        raise OSError(e.errno, e.strerror, folder) from None
