"""The held-out eval: with `train.eval_every` > 0, rank 0's feed also receives the target server's
held-out batches (never trained on, never counted in `trained`); every `eval_every` steps rank 0
runs the drafter over them in eval mode with fixed anchors and reports the implied acceptance
length. It uses no collective, so the other ranks just wait at the next all-reduce.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import torch

from common.config import Config
from common.metrics import StageTimes

from .blocks import BlockDrawer, heldout_anchor_seed
from .feed import RingFeed
from .loss import dflash_loss, implied_acceptance_length
from .metrics_sink import MetricsSink
from .model import DFlashDraftModel
from .step import StepSettings

log = logging.getLogger(__name__)


class Validator:
    """Scores the drafter on the held-out batches; keeps the latest result (status's "eval")."""

    def __init__(self, cfg: Config, stages: StageTimes) -> None:
        self.cfg, self.stages = cfg, stages
        self.last: dict[str, Any] | None = None   # the latest held-out eval (see evaluate)

    def due(self, step: int, rank: int) -> bool:
        every = self.cfg.train.eval_every
        return bool(every) and step % every == 0 and rank == 0

    def evaluate(self, model: DFlashDraftModel, feed: RingFeed, blocks_of: BlockDrawer, settings: StepSettings,
                 step: int) -> dict[str, Any] | None:
        """The drafter on the held-out batches: eval mode, no gradient, anchors fixed per held-out
        index (every eval scores the same blocks), accuracy pooled over all of them; None until all
        the server's held-out batches have arrived. Runs on one rank, without any collective."""
        cfg = self.cfg
        batches, expected = feed.heldout_batches(), feed.heldout_expected
        if not expected or len(batches) < expected:
            log.info("eval at step %d skipped: %d of %d held-out batches have arrived", step,
                     len(batches), expected)
            return None
        b = cfg.drafter.block_size
        correct = torch.zeros(b, dtype=torch.float64)
        count = torch.zeros(b, dtype=torch.float64)
        ce_sum = weight_sum = 0.0
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), self.stages.time("eval"), model.as_served():
                for batch in batches:
                    blocks = blocks_of(batch, heldout_anchor_seed(cfg.train.seed, batch.seq))
                    with settings.autocast(blocks_of.device):
                        out = dflash_loss(model, batch, blocks, cfg.drafter.loss_chunk,
                                          blocks_per_chunk=cfg.drafter.blocks_per_chunk)
                    correct += out.correct_per_pos.detach().double().cpu()
                    count += out.count_per_pos.detach().double().cpu()
                    ce_sum += float(out.ce_sum)
                    weight_sum += float(out.weight_sum)
        finally:
            model.train(was_training)
        acc = (correct / count.clamp_min(1)).tolist()[1:]   # position 0 is the anchor itself (no loss)
        return {"step": step, "tau": implied_acceptance_length(torch.tensor(acc)),
                "acceptance_per_position": [round(a, 4) for a in acc],
                "loss": ce_sum / weight_sum if weight_sum > 0 else float("nan"), "batches": len(batches)}

    def run(self, model: DFlashDraftModel, feed: RingFeed, blocks_of: BlockDrawer, settings: StepSettings,
            step: int, sink: MetricsSink) -> None:
        """Evaluate, then log and record the result (nothing while held-out batches are missing)."""
        result = self.evaluate(model, feed, blocks_of, settings, step)
        if result is None:
            return
        self.last = result
        log.info("eval step %d: tau %.3f loss %.4f on %d held-out batches", result["step"], result["tau"],
                 result["loss"], result["batches"])
        rec = {"step": step, "eval_tau": result["tau"], "eval_loss": result["loss"],
               "eval_batches": result["batches"], "eval_acceptance_per_position": result["acceptance_per_position"],
               "time": time.time()}
        sink.write(rec, step, {"eval/tau": result["tau"], "eval/loss": result["loss"]})
