"""The trainer's checkpointing: resume (rank 0 locks out_dir and picks the newest checkpoint that
verifies), save (the union of every rank's batches, then each host's server told what it may
forget), and the export of the finished drafter. The format on disk is checkpoint.py's.

A failed save costs nothing but the save: the target keeps every uncommitted seq, and training
goes on to the next try; train.max_checkpoint_failures in a row stop the trainer (exit 4).
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import numpy as np
import torch

from common.cluster import restrict as restrict_to_host
from common.config import Config
from common.exits import cannot_write, disk_error
from common.metrics import StageTimes
from common.seqset import SeqSet

from .accounting import Accounting
from .checkpoint import AUDIT_KEYS, NoCheckpointVerifies, TrainerState, lock_out_dir, resume_checkpoint, sweep_partial
from .control import TrainerFlags
from .export import ExportError, export_drafter
from .feed import RingFeed
from .model import DFlashDraftModel
from .step import Ranks

log = logging.getLogger(__name__)

REFUSED = "\0"   # rank 0's pick, broadcast: no checkpoint verifies (the message follows)


class Checkpointer:
    """Owns out_dir's checkpoints for one trainer process: the one resumed (until its weights are
    restored), the last good one, and the failures since."""

    def __init__(self, cfg: Config, ranks: Ranks, flags: TrainerFlags, stages: StageTimes,
                 accounting: Accounting) -> None:
        self.cfg, self.ranks, self.flags, self.stages, self.accounting = cfg, ranks, flags, stages, accounting
        self.out_dir = cfg.resolve(cfg.train.out_dir)
        self.failures = 0                           # all of this process's failed saves
        self.failures_in_row = 0
        self.last_error = ""
        self.stopped_by_failures = False
        self.resumed: TrainerState | None = None    # the checkpoint resumed, until `restore` puts it in the drafter
        self.resumed_path = ""                      # its folder
        self.last = ""                              # the last good checkpoint
        self.last_batches = 0                       # batches it holds
        self.last_holds: tuple[int, int, str] | None = None   # its (step, batches, plan id)
        self.target_dir = ""                        # the target server's model folder (WELCOME): the export's
        self.target_precision = ""                  # how the target runs (WELCOME): fp8-block, bf16, ...
        self.model: DFlashDraftModel | None = None  # what a save writes (`attach`)
        self.optimizer: torch.optim.Optimizer | None = None
        self.feed: RingFeed | None = None
        self.trainable_names: set[str] = set()

    # ---- resume --------------------------------------------------------------------------------
    def resume(self) -> SeqSet:
        """Rank 0 locks out_dir and finds the newest checkpoint that verifies (moving each newer one
        that does not aside); every rank takes its accounting (the weights wait in `resumed` for
        the drafter); this host's shard of its batches, for HELLO."""
        pick, r = "", None
        if self.ranks.rank == 0:
            self.out_dir_lock = lock_out_dir(self.out_dir)   # before anything in out_dir is touched
            sweep_partial(self.out_dir)
            try:
                found = resume_checkpoint(self.out_dir)
            except NoCheckpointVerifies as e:
                pick = REFUSED + str(e)
            else:
                pick, r = found if found is not None else ("", None)
        # rank 0's pick, on every rank: on another host out_dir is a shared filesystem whose listing
        # may lag behind; every rank must start from the same checkpoint
        pick = self.ranks.broadcast_str(pick)
        if pick.startswith(REFUSED):
            raise NoCheckpointVerifies(pick[len(REFUSED):])
        if not pick:
            return SeqSet()
        path, acc = pick, self.accounting
        r = self.resumed = r if r is not None else TrainerState.load(path)
        self.resumed_path = path
        acc.restore(r, self.ranks.rank)
        self.last, self.last_batches = path, len(acc.trained)
        self.last_holds = (r.step, len(acc.trained), str(r.plan.get("id", "")))
        if r.config_hash != self.cfg.hash("drafter"):
            log.warning("resuming %s with a changed drafter config (was %s); architecture must still match",
                        path, r.config_hash)
        log.info("resuming from %s: step %d, %d batches held", path, acc.step, len(acc.trained))
        return acc.hello_have(r, path)

    def take_target(self, target: dict[str, Any]) -> None:
        """The target the server runs (WELCOME): the export records which, checkpoints its precision."""
        self.target_dir = str(target.get("model_path") or "")
        self.target_precision = str(target.get("precision") or "")
        before = self.resumed.target_precision if self.resumed is not None else ""
        if before and before != self.target_precision:
            log.warning("%s was trained on a target in %s; the target server now runs %s: training goes on "
                        "from its features, and the next checkpoints record %s", self.last, before,
                        self.target_precision, self.target_precision)

    def restore(self, model: DFlashDraftModel) -> dict[str, Any] | None:
        """The resumed checkpoint's weights into `model`; its optimizer state (None without a
        checkpoint). Its CPU copies of the weights and moments are not kept."""
        r, self.resumed = self.resumed, None
        if r is None:
            return None
        r.check_fits(model, self.resumed_path)
        r.restore_weights(model)
        return r.optimizer

    def attach(self, model: DFlashDraftModel, optimizer: torch.optim.Optimizer, feed: RingFeed) -> None:
        """What every save writes (the drafter's trainable weights, the optimizer) and commits to."""
        self.model, self.optimizer, self.feed = model, optimizer, feed
        self.trainable_names = {n for n, p in model.named_parameters() if p.requires_grad}

    # ---- save ----------------------------------------------------------------------------------
    def save(self, reason: str) -> bool:
        """Save (rank 0) and commit; False when the save failed (what that costs: the module docstring)."""
        with self.stages.time("checkpoint"):
            have, samples, seqs = self.accounting.gather(self.ranks)
            saved = self._save(reason, have, samples, seqs) if self.ranks.rank == 0 else False
            # every host's first rank tells its own host's server (the others only see their shard)
            saved = self.ranks.broadcast_str("saved" if saved else "") == "saved"
            if saved and self.ranks.local_rank == 0:
                c = self.cfg.cluster
                self.feed.commit(restrict_to_host(have, self.accounting.epoch_sizes, c.num_hosts, c.host_rank),
                                 self.accounting.step)
            return saved

    def _save(self, reason: str, have: SeqSet, samples: dict[int, list[list[int]]],
              seqs: dict[int, list[int]]) -> bool:
        """Rank 0: write the checkpoint of the union `have`; False when the save failed."""
        acc = self.accounting
        trainable = {k: v for k, v in self.model.state_dict().items() if k in self.trainable_names}
        state = TrainerState(
            step=acc.step, epoch=acc.epoch, have=have, skipped_steps=acc.skipped_steps,
            trained_samples={e: np.asarray(v, dtype=np.int64) for e, v in samples.items()},
            sample_seqs={e: np.asarray(v, dtype=np.int64) for e, v in seqs.items()},
            unattributed=acc.unattributed, plan=acc.plan,
            epoch_sizes=acc.epoch_sizes, config_hash=self.cfg.hash("drafter"), model=trainable,
            optimizer=self.optimizer.state_dict(), rng=torch.get_rng_state(),
            drafter_config=dataclasses.asdict(self.model.config), split_fc=self.cfg.drafter.split_fc,
            target_precision=self.target_precision)
        holds = (acc.step, len(have), str(acc.plan.get("id", "")))
        try:
            self.last, meta = state.save(self.out_dir, self.cfg.train.keep_checkpoints, reason,
                                         acc.epoch_samples, acc.hosts, acc.epoch_documents)
        except OSError as e:
            self.failures += 1
            self.last_error = f"step {acc.step}: {e}"
            if holds == self.last_holds:
                return self._same_state_not_saved_again(reason, e)
            return self._failed(reason, e)
        self.failures_in_row = 0
        self.last_batches = len(have)
        self.last_holds = holds
        log.info("checkpoint %s (%s): %d batches, %s", self.last, reason, len(have),
                 {k: meta[k] for k in AUDIT_KEYS})
        return True

    def _same_state_not_saved_again(self, reason: str, error: OSError) -> bool:
        """A failed save of the state the last good checkpoint already holds (the same step, plan and
        batches: `have` only grows with steps), e.g. the end of training right after the last step's
        periodic checkpoint on a disk with no room for a second copy: nothing is lost, so it counts
        as saved (and never toward train.max_checkpoint_failures); the checkpoint stands as it is."""
        step = self.accounting.step
        log.warning("checkpoint at step %d (%s) could not be written again: %s. Nothing is lost: %s holds this "
                    "same step and its %d batches, and stands", step, reason, error, self.last, self.last_batches)
        return True

    def _failed(self, reason: str, error: OSError) -> bool:
        step = self.accounting.step
        self.failures_in_row += 1
        limit = self.cfg.train.max_checkpoint_failures
        log.error("checkpoint at step %d (%s) failed: %s. Nothing is lost: the last good checkpoint is %s and the "
                  "target keeps every batch since. %d of %d failures in a row.", step, reason, error,
                  self.last or "(none)", self.failures_in_row, limit)
        if self.failures_in_row >= limit and not self.flags.stop:
            # training on without checkpoints would put ever more work at risk: stop, all ranks together
            self.flags.ask_to_stop(f"{self.failures_in_row} checkpoints in a row failed")
            self.stopped_by_failures = True
        return False

    # ---- export --------------------------------------------------------------------------------
    def export(self) -> bool:
        """Rank 0, training finished: the drafter to out_dir/export; False when the disk had no room."""
        export_dir = os.path.join(self.out_dir, "export")
        try:
            try:
                export_drafter(self.model, export_dir, target_dir=self.target_dir or None,
                               target_precision=self.target_precision)
            except ExportError as e:   # the target's folder unreadable now: the weights still go out
                log.warning("the export records no target (%s); `dfpipe export --target` adds it", e)
                export_drafter(self.model, export_dir, target_precision=self.target_precision)
        except OSError as e:
            full = disk_error(e, self.out_dir)
            if full is None:
                raise
            log.error("training finished and %s holds it, but the export could not be written: %s. Its drafter "
                      "now: %s", self.last, cannot_write(full, self.out_dir), self.export_command())
            return False
        log.info("exported drafter to %s", export_dir)
        return True

    def export_hint(self, finished: bool) -> str:
        """The way to a drafter when the final checkpoint (and so, at the end of training, the
        export) could not be written: export the last good checkpoint now, or let a restart with
        room train what it lacks and export."""
        ended = "training finished, but its final checkpoint and export" if finished else "its final checkpoint"
        if not self.last:
            return (f"{ended} could not be written and no checkpoint exists under {self.out_dir}: free space there "
                    "and start the trainer again (it trains from the start)")
        return (f"{ended} could not be written. The last good checkpoint is {self.last}. Its drafter "
                f"now: {self.export_command()}. The finished drafter: free space under {self.out_dir} and start the "
                f"trainer again; it resumes from that checkpoint, trains the "
                f"{self.accounting.total_batches - self.last_batches} batches it lacks and exports to "
                f"{os.path.join(self.out_dir, 'export')}")

    def export_command(self) -> str:
        """The command that exports the last good checkpoint, in words."""
        config = f"-c {self.cfg.source} " if self.cfg.source else ""
        return f"`dfpipe export {config}--checkpoint {self.last} --out DIR` (DIR on a disk with room)"
