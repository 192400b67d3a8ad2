"""What the trainer tells about its steps: the step log line, rank 0's metrics records
(metrics.jsonl, TensorBoard, W&B through `MetricsSink`), and the training numbers of the status
(loss, tokens and their rate, anchors, acceptance per position, the stages' times).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch

from common.config import Config
from common.metrics import StageTimes, TokenRate, human_duration

from .loss import implied_acceptance_length
from .metrics_sink import MetricsSink

log = logging.getLogger(__name__)


class Reporter:
    """The trainer's step numbers and where they go; rank 0 writes the records (`open`)."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.stages = StageTimes()
        self.sink: MetricsSink | None = None   # rank 0's records (metrics.jsonl, TensorBoard, W&B)
        self.last_loss = float("nan")
        self.acc_per_pos: list[float] = []
        self.tokens = 0                        # trained by all ranks together
        self.rate = TokenRate()                # of `tokens`: status, metrics records, top, the demo
        self.anchors = 0                       # blocks supervised by this process's steps

    def open(self, out_dir: str) -> None:
        """Rank 0: the metrics records under out_dir."""
        cfg = self.cfg
        self.sink = MetricsSink(out_dir, cfg.train.tensorboard, cfg.train.wandb_project, cfg.to_dict())

    def count_tokens(self, step_tokens: int) -> None:
        self.tokens += step_tokens
        self.rate.mark(time.monotonic(), self.tokens)

    def step(self, step: int, epoch: int, out: Any, lr: float, step_s: float, wait_s: float, step_tokens: int,
             progress: Callable[[], dict[str, float | None]]) -> None:
        """This rank's step's loss output `out`: the status's numbers, and every train.log_every steps
        rank 0's log line and metrics record (with the plan's `progress`)."""
        self.anchors += out.num_anchors
        self.acc_per_pos = (out.correct_per_pos / out.count_per_pos.clamp_min(1)).tolist()[1:]   # 0: the anchor
        self.last_loss = float(out.loss.detach()) if out.loss.numel() == 1 else float("nan")
        if self.sink is None or step % max(1, self.cfg.train.log_every) != 0:
            return
        tau = implied_acceptance_length(torch.tensor(self.acc_per_pos))
        rec = {"step": step, "epoch": epoch, "loss": self.last_loss, "lr": lr, "tau": tau,
               "tokens_per_s": self.rate.per_s(time.monotonic()), "step_tokens": step_tokens,
               "anchors": out.num_anchors, "step_s": step_s, "wait_s": wait_s, "time": time.time()}
        done = progress()
        left = "" if done["eta_s"] is None else f", {human_duration(done['eta_s'])} left"
        log.info("step %d epoch %d loss %.4f lr %.2e tau %.2f %s tok/s; %.1f%% of the plan%s", step,
                 epoch, self.last_loss, lr, tau, "-" if rec["tokens_per_s"] is None
                 else f"{rec['tokens_per_s']:.0f}", 100 * (done["progress"] or 0.0), left)
        self.sink.write(rec, step, {f"train/{k}": rec[k] for k in ("loss", "lr", "tau", "tokens_per_s")})

    def status(self, trained_here: int) -> dict[str, Any]:
        """The status's training numbers (`trained_here`: the batches this process trained)."""
        return {"metrics_lines_lost": self.sink.lines_lost if self.sink else 0, "tokens": self.tokens,
                "anchors_per_batch": round(self.anchors / max(1, trained_here), 1),
                "tokens_per_s": self.rate.per_s(time.monotonic()),
                "implied_acceptance_length": (implied_acceptance_length(torch.tensor(self.acc_per_pos))
                                              if self.acc_per_pos else None),
                "acceptance_per_position": [round(a, 4) for a in self.acc_per_pos]}

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()
