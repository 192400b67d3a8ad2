"""The trainer's exactly-once accounting: which batches and samples the weights hold, the plan they
are batches of, and how far through it all ranks together are (the schedule's progress).

The model state after step s contains exactly the batches trained in steps <= s (`trained`); a
checkpoint stores their union over the ranks and the sample ids per epoch (`gather`), a resumed
trainer takes them back (`restore`). Every step the ranks agree on a few flags and counts in one
all-reduce (`agree`), so that every rank takes the same branch of the loop.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import numpy as np
import torch

from common.cluster import accounting as cluster_accounting
from common.cluster import count_by_host
from common.cluster import restrict as restrict_to_host
from common.config import Config
from common.metrics import TokenRate, time_left_s
from common.protocol import Welcome
from common.seqset import SeqSet

from .checkpoint import TrainerState, sample_stats, trained_pairs
from .control import TrainerFlags
from .step import Ranks

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Agreement:
    """What the ranks agreed on at the top of a loop iteration (`Accounting.agree`)."""
    ranks_with_batch: int
    stop: bool
    checkpoint: bool         # requested (ctl checkpoint) or a drain
    everyone_ended: bool     # every rank has seen the end of every epoch
    trained_total: int       # batches held by all ranks together: the schedule's progress
    step_tokens: int         # tokens of this step's batches, all ranks together


class Accounting:
    """Step, epoch and the batches and samples in the weights; the plan (WELCOME) and the progress
    through it, every host's shard counted."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.step = 0
        self.epoch = 0
        self.skipped_steps = 0
        self.bad_in_row = 0
        self.trained = SeqSet()                     # seqs whose effect is in the weights
        self.resumed_plan: dict[str, Any] = {}      # the data plan of the checkpoint's `have` ({}: none recorded)
        self.resumed_batches = 0
        self.trained_samples: dict[int, list[np.ndarray]] = {}   # per epoch: [D, 2] (sample id, document id)
        self.sample_seqs: dict[int, list[np.ndarray]] = {}       # the batch seq of each of them (-1: unattributed)
        self.unattributed = SeqSet()                # seqs of samples resumed from a checkpoint before seqs
        self.plan: dict[str, Any] = {}              # the target's data plan (WELCOME), recorded in every checkpoint
        self.epoch_samples = 0                      # source rows of an epoch (WELCOME)
        self.epoch_documents = 0                    # and the documents they make
        self.total_batches = 1
        self.trained_total = 0                      # batches of the plan held by all ranks together (progress)
        self.batch_rate = TokenRate()               # of `trained_total`: the time left (status, the step log)
        self.epoch_sizes: list[int] = []            # batches of every planned epoch (WELCOME): the whole plan
        self.hosts = cfg.cluster.num_hosts
        self.resumed_by_host = [0] * self.hosts     # the checkpoint's batches in each host's shard
        self.trained_by_host = [0] * self.hosts     # all ranks' batches by host, as of the last agreement

    # ---- resume, plan --------------------------------------------------------------------------
    def restore(self, r: TrainerState, rank: int) -> None:
        """Take a checkpoint's accounting."""
        self.step, self.epoch, self.skipped_steps = r.step, r.epoch, r.skipped_steps
        self.trained = r.have.copy()
        self.resumed_batches = len(self.trained)
        # on rank 0 only: a checkpoint gathers every rank's samples, so a copy on each rank would
        # count every resumed sample once per rank (duplicated)
        if rank == 0:
            self.trained_samples = {e: [trained_pairs(v)] for e, v in r.trained_samples.items()}
            self.sample_seqs = {e: [v] for e, v in (r.sample_seqs or {}).items()}
            self.unattributed = r.unattributed.copy()
        self.resumed_plan = r.plan

    def hello_have(self, r: TrainerState, path: str) -> SeqSet:
        """This host's shard of the resumed checkpoint's (`r`, at `path`) batches, for HELLO."""
        c = self.cfg.cluster
        if c.num_hosts == 1:
            return self.trained.copy()
        if r.epoch_sizes is None and self.trained:
            raise ValueError(f"{path} records no epoch sizes (written before cluster.num_hosts existed), so this "
                             f"host's shard of its batches is unknown: resume it with cluster.num_hosts 1 until its "
                             f"next checkpoint (which records them)")
        # this host's server delivers only its shard: HELLO says which of those the checkpoint holds
        return restrict_to_host(self.trained, r.epoch_sizes or [], c.num_hosts, c.host_rank)

    def restart(self) -> None:
        """A new data plan on purpose (train.new_plan): the accounting restarts empty."""
        self.trained, self.resumed_batches, self.trained_samples, self.epoch = SeqSet(), 0, {}, 0
        self.sample_seqs, self.unattributed = {}, SeqSet()

    def take_plan(self, welcome: Welcome) -> None:
        """The epochs of the plan the server's WELCOME carries (every host's shard)."""
        self.epoch_sizes = list(welcome.epoch_sizes)
        self.total_batches = max(1, sum(welcome.epoch_sizes))   # the whole plan, every host's shard
        self.resumed_by_host = count_by_host(self.trained, self.epoch_sizes, self.hosts)
        self.trained_by_host = list(self.resumed_by_host)
        self.epoch_samples = int(welcome.target.get("epoch_samples", 0))
        self.epoch_documents = int(welcome.target.get("epoch_documents", 0))

    # ---- every step ------------------------------------------------------------------------------
    def agree(self, ranks: Ranks, flags: TrainerFlags, batch: Any, ends_seen: set[int]) -> Agreement:
        """One all-reduce of the loop's flags, so that every rank takes the same branch."""
        epochs = self.cfg.train.epochs
        all_ended = len({e for e in ends_seen if e < epochs}) >= epochs
        since = len(self.trained) - self.resumed_batches
        by_host = [0.0] * self.hosts   # this rank's batches, in its host's slot: per-host progress for status
        by_host[self.cfg.cluster.host_rank] = since
        sync = ranks.sum_(torch.tensor([batch is not None, flags.stop, flags.checkpoint or flags.drain, all_ended,
                                        since, batch.num_tokens if batch is not None else 0, *by_host],
                                       dtype=torch.float64))
        self.trained_by_host = [r + int(n) for r, n in zip(self.resumed_by_host, sync[6:].tolist())]
        return Agreement(ranks_with_batch=int(sync[0]), stop=bool(sync[1]), checkpoint=bool(sync[2]),
                         everyone_ended=int(sync[3]) == ranks.world,
                         trained_total=self.resumed_batches + int(sync[4]), step_tokens=int(sync[5]))

    def stepped(self, agreed: Agreement) -> None:
        """One more step, and the batches every rank now holds."""
        self.step += 1
        self.trained_total = agreed.trained_total + agreed.ranks_with_batch
        self.batch_rate.mark(time.monotonic(), self.trained_total)

    def count_finite(self, applied: bool, batch: Any) -> None:
        if applied:
            self.bad_in_row = 0
            return
        self.skipped_steps += 1
        self.bad_in_row += 1
        log.error("step %d skipped: non-finite loss or gradient (seq %s)", self.step,
                  batch.seq if batch is not None else "-")

    def record(self, batch: Any) -> None:
        """`batch` is in the weights now."""
        self.trained.add(batch.seq)
        pairs = torch.stack([batch.sample_ids, batch.doc_ids], dim=1).cpu().numpy().astype(np.int64)
        self.trained_samples.setdefault(batch.epoch, []).append(pairs)
        self.sample_seqs.setdefault(batch.epoch, []).append(np.full(len(pairs), batch.seq, np.int64))
        self.epoch = max(self.epoch, batch.epoch)

    # ---- checkpoint, status ----------------------------------------------------------------------
    def gather(self, ranks: Ranks) -> tuple[SeqSet, dict[int, list[list[int]]], dict[int, list[int]]]:
        """Every rank trained different batches: the union of their seqs, and of their samples
        ([sample id, document id] per document) and the seq of each, per epoch."""
        parts = ranks.gather_objects((self.trained.to_wire(), {
            e: (np.concatenate(ids).tolist(), np.concatenate(self.sample_seqs[e]).tolist())
            for e, ids in self.trained_samples.items() if ids}))
        have = SeqSet()
        samples: dict[int, list[list[int]]] = {}
        seqs: dict[int, list[int]] = {}
        for wire, by_epoch in parts:
            have.update(SeqSet.from_wire(wire, max_ranges=1 << 62))
            for e, (ids, of) in by_epoch.items():
                samples.setdefault(int(e), []).extend(ids)
                seqs.setdefault(int(e), []).extend(of)
        return have, samples, seqs

    def progress(self) -> dict[str, float | None]:
        """How far through the whole plan (every epoch, every host) and the seconds left at the
        batch rate of the last RATE_WINDOW_S; None until the target server's WELCOME gives the plan
        (and the time left until two steps give a rate)."""
        if not self.epoch_sizes:
            return {"progress": None, "eta_s": None}
        done = max(self.trained_total, self.resumed_batches)   # a resumed run, before its first step here
        left = time_left_s(done, self.total_batches, self.batch_rate.exact_per_s(time.monotonic()))
        return {"progress": round(min(1.0, done / self.total_batches), 4),
                "eta_s": None if left is None else round(left, 1)}

    def sample_stats(self) -> dict[str, Any]:
        by_epoch = {e: np.concatenate(v) if v else np.zeros((0, 2), np.int64) for e, v in self.trained_samples.items()}
        return sample_stats(by_epoch, self.epoch, self.epoch_samples, self.epoch_documents)

    def cluster(self) -> dict[str, Any]:
        return {"host_rank": self.cfg.cluster.host_rank, **cluster_accounting(self.trained_by_host, self.epoch_sizes)}

    @property
    def trained_here(self) -> int:
        """Batches this process trained (not resumed)."""
        return len(self.trained) - self.resumed_batches
