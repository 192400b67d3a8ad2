"""Where rank 0's training and eval records go: one sink that fans out to metrics.jsonl, TensorBoard
and Weights & Biases.

metrics.jsonl is opened unbuffered: a line the disk refuses (a full disk) is lost at once and
counted (`lines_lost`, in the trainer's status), never retried by every later flush, and it never
stops training. TensorBoard and W&B get the record's scalars under the names `write` is given.
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
        self._tensorboard = None
        self._wandb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self._tensorboard = SummaryWriter(os.path.join(out_dir, "tensorboard"))
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
            for name, value in scalars.items():
                self._tensorboard.add_scalar(name, value, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        self._jsonl.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()
