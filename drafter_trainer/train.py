"""The drafter trainer: one process per rank (torchrun), each a ring consumer, in lockstep.

Read `train_loop` top to bottom: take a batch, agree with the other ranks, anchors -> blocks ->
DFlash loss -> backward -> all-reduce -> finite check -> clip -> step -> account -> checkpoint.
Everything else here is set-up around it.

Ranks and epochs. Each rank gets its own stream of batches from the target server. Every step
the ranks all-reduce a few flags (has a batch, stop, checkpoint, ...); a rank without a batch
this step contributes zero loss and zero gradient, so uneven epochs and slow deliveries never
deadlock. The loss is normalised by the weight sum over all ranks (so gradients are summed, not
averaged, across ranks). Training ends when every rank has seen EpochEnd for every epoch and no
rank holds a batch.

Exactly once. The model state after step s contains exactly the batches trained in steps <= s.
A checkpoint stores that set (`have`) and the sample ids per epoch; a restarted trainer sends
`have` in HELLO and the target server delivers every other seq. The learning-rate schedule is a
function of progress (batches held / batches planned), so it survives restarts and a change in
the number of ranks.

Hosts. With `cluster.num_hosts` > 1 the world spans several hosts, each with its own target
server serving its shard of every epoch (common/cluster.py); a rank reads only from its host's
server. The checkpoint (global rank 0) holds the union of every rank's batches, each host's first
rank commits its host's shard of it to its server, and a restarted rank says HELLO with its
host's shard. The schedule's progress and the end of training count the whole plan.

Held-out eval. With `train.eval_every` > 0, rank 0's feed also receives the target server's
held-out batches (never trained on, never counted in `trained`); every `eval_every` steps rank 0
runs the drafter over them in eval mode with fixed anchors and reports the implied acceptance
length (`evaluate`). It uses no collective, so the other ranks just wait at the next all-reduce.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import signal
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from common import stopping
from common.channel import ChannelError, CurveKeys
from common.cluster import accounting as cluster_accounting
from common.cluster import count_by_host
from common.cluster import restrict as restrict_to_host
from common.config import Config, ConfigError, default_gamma, default_layer_ids
from common.exits import (EXIT_BAD_STEPS, EXIT_CONFIG, EXIT_DISK_FULL, EXIT_FAILED, EXIT_NO_CHECKPOINT_VERIFIES,
                          EXIT_OK, EXIT_OUT_DIR_IN_USE, EXIT_PLAN_CHANGED, EXIT_UNTRUSTED, cannot_write, disk_error)
from common.liveness import process_age_s, signal_on_parent_death
from common.metrics import StageTimes, TokenRate, human_duration, start_metrics_server, time_left_s
from common.protocol import Welcome, new_session_secret
from common.seqset import SeqSet
from common.trust import Untrusted

from .blocks import anchor_seed, build_blocks, heldout_anchor_seed, sample_anchors
from .checkpoint import (AUDIT_KEYS, FINISHED, NoCheckpointVerifies, OutDirInUse, TrainerState, lock_out_dir,
                         plan_changes, resume_checkpoint, sample_stats, sweep_partial, trained_pairs)
from .control import TrainerControl, TrainerFlags
from .devices import use_device
from .export import ExportError, export_drafter
from .feed import EpochEndMarker, RingFeed
from .fp8 import resolve_precision
from .loss import dflash_loss, implied_acceptance_length
from .metrics_sink import MetricsSink
from .model import DFlashConfig, DFlashDraftModel
from .optim import build_adamw, preimport_dynamo
from .preflight import mask_token_id, preflight
from .step import Ranks, StepSettings, train_step
from .target_head import TargetHead, read_target_head, text_config
from .warmup import CompileBehind, compiling_in_background, needs_compiling

log = logging.getLogger(__name__)

REFUSED = "\0"   # rank 0's pick, broadcast: no checkpoint verifies (the message follows)


class PlanChanged(Exception):
    """The checkpoint's batches are of another data plan than the target server's (see `_new_plan`)."""


class StoppedWaiting(Exception):
    """Told to stop (SIGTERM, Ctrl-C, ctl shutdown) before the target server answered: nothing to save."""


# ---- small pieces ------------------------------------------------------------------------------
def lr_at(progress: float, cfg: Config) -> float:
    """Linear warm-up then cosine decay, as a function of the fraction of planned batches trained."""
    t = cfg.train
    if progress < t.warmup_ratio:
        return t.lr * max(progress, 1e-3) / t.warmup_ratio
    frac = min(1.0, (progress - t.warmup_ratio) / max(1e-9, 1 - t.warmup_ratio))
    floor = t.lr * t.min_lr_ratio
    return floor + (t.lr - floor) * 0.5 * (1 + math.cos(math.pi * frac))


def compute_dtype_for(cfg: Config, device: torch.device) -> torch.dtype:
    """The autocast dtype of the drafter's step (StepSettings)."""
    return StepSettings.from_config(cfg, device).compute_dtype


def drafter_gamma(cfg: Config) -> float:
    """The loss decay per block position: drafter.gamma, or the published default for the block size."""
    return cfg.drafter.gamma or default_gamma(cfg.drafter.block_size)


def build_drafter(cfg: Config, target: dict[str, Any], device: torch.device, times: dict[str, float] | None = None
                  ) -> tuple[DFlashDraftModel, CompileBehind | None]:
    """The drafter for `target` (WELCOME's target info: model_path, layer_ids), eager, and the
    background compile its first steps run beside (`CompileBehind`; None when nothing compiles);
    `times` gets the seconds of the build and of reading the target's embedding and head (which
    run side by side).

    The one start-up path: at the 27B shape and the published anchor density a restart's first
    step came 14 s after the process started this way, and 33 s when the first step compiled
    (docs/benchmarks.md).
    """
    target_dir = target["model_path"]
    with open(os.path.join(target_dir, "config.json"), encoding="utf-8") as f:
        target_config = json.load(f)
    dcfg = DFlashConfig.from_target(target_config, cfg.drafter, list(target["layer_ids"]),
                                    mask_token_id(cfg, target_dir))
    t0 = time.perf_counter()

    def read_head() -> tuple[TargetHead, float]:
        use_device(device)
        head = read_target_head(target_dir, device=device)
        return head, time.perf_counter() - t0

    behind = None
    # The head read (GBs from the page cache) starts first and runs beside the build.
    with ThreadPoolExecutor(1, thread_name_prefix="target-head") as pool:
        reading = pool.submit(read_head)
        # Built on the device: a 27B-wide drafter initialised on the CPU first costs most of a restart.
        with device:
            model = DFlashDraftModel(dcfg, split_fc=cfg.drafter.split_fc, attn_impl=cfg.drafter.attn,
                                     precision=resolve_precision(cfg.drafter.precision, device))
        if needs_compiling(cfg.drafter.compile, cfg.drafter.attn, device, dcfg.head_dim):
            behind = CompileBehind(model, device, cfg.drafter.compile, compute_dtype_for(cfg, device),
                                   cfg.data.token_budget, cfg.drafter.max_anchors, drafter_gamma(cfg))
        t1 = time.perf_counter()
        head, head_s = reading.result()   # re-raises the reader's error (a missing or mis-shaped head)
        model.set_target_head(head.embed_tokens, None if head.tied else head.lm_head)
    if times is not None:
        times["build_s"] = t1 - t0
        times["head_s"] = head_s
        times["build_and_head_s"] = time.perf_counter() - t0
    return model, behind


def expected_target(cfg: Config) -> dict[str, Any] | None:
    """The target info the server's WELCOME will carry, when the shared config alone tells: a local
    model folder (not a builtin target the server builds). Lets a restarting trainer build its
    drafter while the WELCOME is on its way; `same_target` decides whether that build is kept."""
    path = cfg.resolve(cfg.target.model)
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            layers = int(text_config(json.load(f))["num_hidden_layers"])
        ids = list(cfg.target.layer_ids) or default_layer_ids(layers, cfg.target.num_capture_layers)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return {"model_path": path, "layer_ids": ids}


def same_target(guess: dict[str, Any] | None, announced: dict[str, Any]) -> bool:
    if guess is None:
        return False
    try:
        return (os.path.realpath(guess["model_path"]) == os.path.realpath(announced["model_path"])
                and list(guess["layer_ids"]) == list(announced["layer_ids"]))
    except (KeyError, TypeError):
        return False


@dataclasses.dataclass(frozen=True)
class Agreement:
    """What the ranks agreed on at the top of a loop iteration (`Trainer._agree`)."""
    ranks_with_batch: int
    stop: bool
    checkpoint: bool         # requested (ctl checkpoint) or a drain
    everyone_ended: bool     # every rank has seen the end of every epoch
    trained_total: int       # batches held by all ranks together: the schedule's progress
    step_tokens: int         # tokens of this step's batches, all ranks together


WELCOME_GRACE_S = 0.5  # a warm target's WELCOME is in by the end of the drafter build; later means it is starting
PAUSED_POLL_S = 0.05   # a paused or drained trainer's loop period (flags, stop, the background compile)


# ---- the trainer -------------------------------------------------------------------------------
class Trainer:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        preflight(cfg)   # every config problem at once, before the ranks meet or anything waits
        self.ranks = Ranks(cfg.train.device, cfg.train.devices)
        self.device = self.ranks.device
        self.flags = TrainerFlags()
        self.stages = StageTimes()
        self.out_dir = cfg.resolve(cfg.train.out_dir)
        self.state = "starting"
        self.step = 0
        self.epoch = 0
        self.skipped_steps = 0
        self.bad_in_row = 0
        self.checkpoint_failures = 0                # all of this process's failed saves
        self.checkpoint_failures_in_row = 0
        self.last_checkpoint_error = ""
        self.stopped_by_checkpoint_failures = False
        self.trained = SeqSet()                     # seqs whose effect is in the weights
        self.resumed: TrainerState | None = None    # the checkpoint resumed, until _take_drafter restores it
        self.resumed_path = ""                      # its folder
        self.resumed_plan: dict[str, Any] = {}      # the data plan of the checkpoint's `have` ({}: none recorded)
        self.resumed_batches = 0
        self.trained_samples: dict[int, list[np.ndarray]] = {}   # per epoch: [D, 2] (sample id, document id)
        self.sample_seqs: dict[int, list[np.ndarray]] = {}       # the batch seq of each of them (-1: unattributed)
        self.unattributed = SeqSet()                # seqs of samples resumed from a checkpoint before seqs
        self.last_loss = float("nan")
        self.last_checkpoint = ""
        self.last_checkpoint_batches = 0             # batches the last good checkpoint holds
        self.last_checkpoint_holds: tuple[int, int, str] | None = None   # its (step, batches, plan id)
        self.acc_per_pos: list[float] = []
        self.tokens = 0                             # trained by all ranks together
        self.rate = TokenRate()                     # of `tokens`: status, metrics records, top, the demo
        self.anchors = 0                            # blocks supervised by this process's steps
        self.target_dir = ""                        # the target server's model folder (WELCOME)
        self.target_precision = ""                  # how the target runs (WELCOME): fp8-block, bf16, ...
        self.epoch_samples = 0                      # source rows of an epoch (WELCOME)
        self.epoch_documents = 0                    # and the documents they make
        self.total_batches = 1
        self.trained_total = 0                      # batches of the plan held by all ranks together (progress)
        self.batch_rate = TokenRate()               # of `trained_total`: the time left (status, the step log)
        self.epoch_sizes: list[int] = []            # batches of every planned epoch (WELCOME): the whole plan
        self.hosts = cfg.cluster.num_hosts
        self.resumed_by_host = [0] * self.hosts     # the checkpoint's batches in each host's shard
        self.trained_by_host = [0] * self.hosts     # all ranks' batches by host, as of the last agreement
        self.control: TrainerControl | None = None
        self.feed: RingFeed | None = None             # set up in setup(); the stream of this rank's batches
        self.metrics: MetricsSink | None = None     # rank 0's records (metrics.jsonl, TensorBoard, W&B)
        self.startup: dict[str, float | None] = {}   # seconds of each start-up phase, to the first step
        self.last_eval: dict[str, Any] | None = None  # the latest held-out eval (see evaluate)
        self.behind: CompileBehind | None = None       # the kernels compiling beside the first steps
        self.optimizer: torch.optim.AdamW | None = None
        self.compile_state: dict[str, Any] = {"state": "building"}   # -> eager | compiling -> compiled | failed

    # status is read by the control thread: only plain values
    def status(self) -> dict[str, Any]:
        stats = sample_stats(self._samples_by_epoch(), self.epoch, self.epoch_samples, self.epoch_documents)
        feed = self.feed
        return {"pid": os.getpid(), "state": self.state, "step": self.step, "epoch": self.epoch,
                **stats, "last_checkpoint": self.last_checkpoint, "loss": self.last_loss,
                "batches_trained": len(self.trained), "batches_planned": self.total_batches,
                **self._progress(),
                "cluster": {"host_rank": self.cfg.cluster.host_rank,
                            **cluster_accounting(self.trained_by_host, self.epoch_sizes)},
                "skipped_steps": self.skipped_steps, "checkpoint_failures": self.checkpoint_failures,
                "last_checkpoint_error": self.last_checkpoint_error,
                "metrics_lines_lost": self.metrics.lines_lost if self.metrics else 0, "tokens": self.tokens,
                "anchors_per_batch": round(self.anchors / max(1, len(self.trained) - self.resumed_batches), 1),
                "tokens_per_s": self.rate.per_s(time.monotonic()),
                "implied_acceptance_length": (implied_acceptance_length(torch.tensor(self.acc_per_pos))
                                              if self.acc_per_pos else None),
                "acceptance_per_position": [round(a, 4) for a in self.acc_per_pos],
                "feed": {"state": feed.state, **feed.counters,
                         **({"waiting_for": feed.waiting_for()} if feed.state != "streaming" else {})} if feed else None,
                "target_precision": self.target_precision,
                "world": self.ranks.world, "stages": self.stages.snapshot(),
                "startup": {k: round(v, 3) if v is not None else None for k, v in self.startup.items()},
                "eval": self.last_eval, "compile": dict(self.compile_state),
                # fa4 (FlashAttention 4), flash (FlashAttention 2), flex, split or sdpa: what the last step ran
                "attention": self.model.attention_ran if self.model is not None else None}

    def _progress(self) -> dict[str, float | None]:
        """How far through the whole plan (every epoch, every host) and the seconds left at the
        batch rate of the last RATE_WINDOW_S; None until the target server's WELCOME gives the plan
        (and the time left until two steps give a rate)."""
        if not self.epoch_sizes:
            return {"progress": None, "eta_s": None}
        done = max(self.trained_total, self.resumed_batches)   # a resumed run, before its first step here
        left = time_left_s(done, self.total_batches, self.batch_rate.exact_per_s(time.monotonic()))
        return {"progress": round(min(1.0, done / self.total_batches), 4),
                "eta_s": None if left is None else round(left, 1)}

    def _samples_by_epoch(self) -> dict[int, np.ndarray]:
        return {e: np.concatenate(v) if v else np.zeros((0, 2), np.int64) for e, v in self.trained_samples.items()}

    # ---- checkpoints -------------------------------------------------------------------------
    def _resume(self) -> SeqSet:
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
        path = pick
        r = self.resumed = r if r is not None else TrainerState.load(path)
        self.resumed_path = path
        self.step, self.epoch, self.skipped_steps = r.step, r.epoch, r.skipped_steps
        self.trained = r.have.copy()
        self.resumed_batches = len(self.trained)
        # on rank 0 only: a checkpoint gathers every rank's samples, so a copy on each rank would
        # count every resumed sample once per rank (duplicated)
        if self.ranks.rank == 0:
            self.trained_samples = {e: [trained_pairs(v)] for e, v in r.trained_samples.items()}
            self.sample_seqs = {e: [v] for e, v in (r.sample_seqs or {}).items()}
            self.unattributed = r.unattributed.copy()
        self.last_checkpoint, self.last_checkpoint_batches = path, len(self.trained)
        self.last_checkpoint_holds = (r.step, len(self.trained), str(r.plan.get("id", "")))
        self.resumed_plan = r.plan
        if r.config_hash != self.cfg.hash("drafter"):
            log.warning("resuming %s with a changed drafter config (was %s); architecture must still match",
                        path, r.config_hash)
        log.info("resuming from %s: step %d, %d batches held", path, self.step, len(self.trained))
        c = self.cfg.cluster
        if c.num_hosts == 1:
            return self.trained.copy()
        if r.epoch_sizes is None and self.trained:
            raise ValueError(f"{path} records no epoch sizes (written before cluster.num_hosts existed), so this "
                             f"host's shard of its batches is unknown: resume it with cluster.num_hosts 1 until its "
                             f"next checkpoint (which records them)")
        # this host's server delivers only its shard: HELLO says which of those the checkpoint holds
        return restrict_to_host(self.trained, r.epoch_sizes or [], c.num_hosts, c.host_rank)

    def checkpoint(self, reason: str) -> bool:
        """Save (rank 0) and commit; False when the save failed. A failed save costs nothing but
        the save: the target keeps every uncommitted seq, and training goes on to the next try."""
        with self.stages.time("checkpoint"):
            # every rank trained different batches: the saved set is their union
            parts = self.ranks.gather_objects((self.trained.to_wire(), {
                e: (np.concatenate(ids).tolist(), np.concatenate(self.sample_seqs[e]).tolist())
                for e, ids in self.trained_samples.items() if ids}))
            have = SeqSet()
            samples: dict[int, list[list[int]]] = {}   # per epoch, [sample id, document id] per document
            seqs: dict[int, list[int]] = {}
            for wire, by_epoch in parts:
                have.update(SeqSet.from_wire(wire, max_ranges=1 << 62))
                for e, (ids, of) in by_epoch.items():
                    samples.setdefault(int(e), []).extend(ids)
                    seqs.setdefault(int(e), []).extend(of)
            saved = self._save(reason, have, samples, seqs) if self.ranks.rank == 0 else False
            # every host's first rank tells its own host's server (the others only see their shard)
            saved = self.ranks.broadcast_str("saved" if saved else "") == "saved"
            if saved and self.ranks.local_rank == 0:
                c = self.cfg.cluster
                self.feed.commit(restrict_to_host(have, self.epoch_sizes, c.num_hosts, c.host_rank), self.step)
            return saved

    def _save(self, reason: str, have: SeqSet, samples: dict[int, list[list[int]]],
              seqs: dict[int, list[int]]) -> bool:
        """Rank 0: write the checkpoint of the union `have`; False when the save failed."""
        trainable = {k: v for k, v in self.model.state_dict().items() if k in self.trainable_names}
        state = TrainerState(
            step=self.step, epoch=self.epoch, have=have, skipped_steps=self.skipped_steps,
            trained_samples={e: np.asarray(v, dtype=np.int64) for e, v in samples.items()},
            sample_seqs={e: np.asarray(v, dtype=np.int64) for e, v in seqs.items()},
            unattributed=self.unattributed, plan=self.plan,
            epoch_sizes=self.epoch_sizes, config_hash=self.cfg.hash("drafter"), model=trainable,
            optimizer=self.optimizer.state_dict(), rng=torch.get_rng_state(),
            drafter_config=dataclasses.asdict(self.model.config), split_fc=self.cfg.drafter.split_fc,
            target_precision=self.target_precision)
        holds = (self.step, len(have), str(self.plan.get("id", "")))
        try:
            self.last_checkpoint, meta = state.save(self.out_dir, self.cfg.train.keep_checkpoints, reason,
                                                    self.epoch_samples, self.hosts, self.epoch_documents)
        except OSError as e:
            if holds == self.last_checkpoint_holds:
                return self._same_state_not_saved_again(reason, e)
            return self._checkpoint_failed(reason, e)
        self.checkpoint_failures_in_row = 0
        self.last_checkpoint_batches = len(have)
        self.last_checkpoint_holds = holds
        log.info("checkpoint %s (%s): %d batches, %s", self.last_checkpoint, reason, len(have),
                 {k: meta[k] for k in AUDIT_KEYS})
        return True

    def _same_state_not_saved_again(self, reason: str, error: OSError) -> bool:
        """A failed save of the state the last good checkpoint already holds (the same step, plan and
        batches: `have` only grows with steps), e.g. the end of training right after the last step's
        periodic checkpoint on a disk with no room for a second copy: nothing is lost, so it counts
        as saved (and never toward train.max_checkpoint_failures); the checkpoint stands as it is."""
        self.checkpoint_failures += 1
        self.last_checkpoint_error = f"step {self.step}: {error}"
        log.warning("checkpoint at step %d (%s) could not be written again: %s. Nothing is lost: %s holds this "
                    "same step and its %d batches, and stands", self.step, reason, error, self.last_checkpoint,
                    self.last_checkpoint_batches)
        return True

    def _checkpoint_failed(self, reason: str, error: OSError) -> bool:
        self.checkpoint_failures += 1
        self.checkpoint_failures_in_row += 1
        self.last_checkpoint_error = f"step {self.step}: {error}"
        limit = self.cfg.train.max_checkpoint_failures
        log.error("checkpoint at step %d (%s) failed: %s. Nothing is lost: the last good checkpoint is %s and the "
                  "target keeps every batch since. %d of %d failures in a row.", self.step, reason, error,
                  self.last_checkpoint or "(none)", self.checkpoint_failures_in_row, limit)
        if self.checkpoint_failures_in_row >= limit and not self.flags.stop:
            # training on without checkpoints would put ever more work at risk: stop, all ranks together
            self.flags.ask_to_stop(f"{self.checkpoint_failures_in_row} checkpoints in a row failed")
            self.stopped_by_checkpoint_failures = True
        return False

    # ---- set-up --------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        self.startup["process_to_setup_s"] = process_age_s()   # interpreter, imports, CUDA/NCCL init
        t0 = time.perf_counter()   # resume_and_endpoints_s: the checkpoint's load and checks count in it
        torch.manual_seed(cfg.train.seed)
        have = self._resume()
        job = self.ranks.broadcast_str(f"{uuid.uuid4().hex[:12]}-{os.getpid()}")
        # rank 0 draws the session secret and the ranks share it like the job: only they may join,
        # ack into, commit to or widen the session on the target server (never logged or shown)
        secret = self.ranks.broadcast_str(new_session_secret())
        if self.ranks.rank == 0:
            self.control = TrainerControl(cfg.service.trainer_endpoint, self.flags, self.status,
                                          cfg.service.max_message_bytes, CurveKeys.from_config(cfg),
                                          cfg.service.allowed_uids)
            self.control.start()
            start_metrics_server(cfg.service.trainer_metrics_port, "dfpipe_trainer", self.status)
        self.state = "waiting_for_target"
        self.feed = RingFeed(cfg, self.ranks.rank, self.ranks.world, job, have, self.device, cfg.train.epochs,
                             secret=secret, plan=str(self.resumed_plan.get("id", "")))
        t_connect = time.perf_counter()
        self.startup["resume_and_endpoints_s"] = t_connect - t0
        self.feed.launch()
        # The drafter is built while the feed connects: on a restart against a warm target the two
        # overlap, and the build is most of the time to the first step.
        guess = expected_target(cfg)
        built = build_drafter(cfg, guess, self.device, self.startup) if guess is not None else None
        if built is not None and built[1] is not None and not self.feed.welcomed.wait(WELCOME_GRACE_S):
            built[1].start()   # the target is still loading or warming up: compile while waiting for it
        welcome = self.feed.wait_welcome(timeout=None, stop=lambda: self.flags.stop)
        new_plan = self.feed.state == "plan_changed"
        if new_plan:
            self._new_plan(self.feed.refused_for_plan)   # PlanChanged unless train.new_plan
            welcome = self.feed.wait_welcome(timeout=None, stop=lambda: self.flags.stop)
        self.startup["welcome_s"] = time.perf_counter() - t_connect
        if self.feed.state == "failed":
            raise RuntimeError(f"feed failed: {self.feed.error}")
        if welcome is None:
            raise StoppedWaiting(self.flags.reason or "stop requested")
        self._accept_welcome(welcome, new_plan)
        self._take_drafter(built, guess, welcome.target)
        self.state = "training"

    def _accept_welcome(self, welcome: Welcome, new_plan: bool) -> None:
        """Take the plan, the target and the epochs the server's WELCOME carries."""
        cfg = self.cfg
        self.plan = dict(welcome.plan)   # recorded in every checkpoint
        if self.last_checkpoint and not self.resumed_plan and not new_plan:
            log.warning("%s records no data plan (written before plans were fingerprinted): resuming it as if it "
                        "were of the target's plan %s, which cannot be checked; its next checkpoints record it",
                        self.last_checkpoint, self.plan["id"])
        elif cfg.train.new_plan and self.resumed_plan and not new_plan:
            log.info("train.new_plan is set but the data plan is unchanged (%s): resuming its accounting",
                     self.plan["id"])
        self._check_host(welcome.target)
        self.epoch_sizes = list(welcome.epoch_sizes)
        self.total_batches = max(1, sum(welcome.epoch_sizes))   # the whole plan, every host's shard
        self.resumed_by_host = count_by_host(self.trained, self.epoch_sizes, self.hosts)
        self.trained_by_host = list(self.resumed_by_host)
        self.epoch_samples = int(welcome.target.get("epoch_samples", 0))
        self.epoch_documents = int(welcome.target.get("epoch_documents", 0))
        self.target_dir = str(welcome.target.get("model_path") or "")   # the export records which target
        self.target_precision = str(welcome.target.get("precision") or "")   # and what precision it ran in
        before = self.resumed.target_precision if self.resumed is not None else ""
        if before and before != self.target_precision:
            log.warning("%s was trained on a target in %s; the target server now runs %s: training goes on "
                        "from its features, and the next checkpoints record %s", self.last_checkpoint, before,
                        self.target_precision, self.target_precision)

    def _check_host(self, target: dict[str, Any]) -> None:
        """The server serves this host's shard (the same cluster.num_hosts and host_rank), and every
        rank's server serves the same plan and target. Otherwise a host would train another host's
        batches (twice) and leave its own untrained, or seq s would hold other documents on
        another host. The gather is collective: every rank calls this once, after its WELCOME."""
        c = self.cfg.cluster
        served = (int(target.get("num_hosts", 1)), int(target.get("host_rank", 0)))
        mine = {"plan": self.plan["id"], "layer_ids": list(target.get("layer_ids", [])),
                "precision": target.get("precision"),
                "hidden_size": target.get("hidden_size"), "vocab_size": target.get("vocab_size")}
        others = self.ranks.gather_objects((c.host_rank, mine))
        if served != (c.num_hosts, c.host_rank):
            raise PlanChanged(
                f"the target server at {self.cfg.service.target_endpoint} serves host {served[1]} of {served[0]}, "
                f"this trainer rank is on host {c.host_rank} of {c.num_hosts} (cluster.host_rank, cluster.num_hosts): "
                "give the server and the trainer ranks of a host the same cluster settings, and each host's "
                "ranks their own host's service.target_endpoint")
        differ = sorted({f"host {h}: {theirs}" for h, theirs in others if theirs != mine})
        if differ:
            raise PlanChanged(
                f"the hosts' target servers serve different data plans or targets (host {c.host_rank}: {mine}; "
                f"{'; '.join(differ)}): every host needs the same data, target folder and data settings")

    def _take_drafter(self, built: tuple[DFlashDraftModel, CompileBehind | None] | None,
                      guess: dict[str, Any] | None, target: dict[str, Any]) -> None:
        """The drafter built while connecting (or built now, for the target the server runs), with
        the checkpoint's weights, RNG and optimizer state restored, and rank 0's metrics sink."""
        cfg = self.cfg
        if built is None or not same_target(guess, target):
            if built is not None:
                log.info("the target server runs %s layers %s, not the configured %s layers %s: rebuilding the "
                         "drafter", target.get("model_path"), target.get("layer_ids"),
                         guess["model_path"], guess["layer_ids"])
                del built     # a background compile of it runs out on its own and is never switched to
            built = build_drafter(cfg, target, self.device, self.startup)
        t0 = time.perf_counter()
        self.model, self.behind = built
        self.compile_state = {"state": "compiling" if self.behind else "compiled" if self.model.compiled else "eager"}
        self.trainable_names = {n for n, p in self.model.named_parameters() if p.requires_grad}
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.resumed is not None:
            self.resumed.check_fits(self.model, self.resumed_path)
            self.resumed.restore_weights(self.model)
        self.optimizer = build_adamw(params, cfg.train, self.device, self.resumed.optimizer if self.resumed else None)
        self.resumed = None   # restored: its CPU copies of the weights and moments are not kept
        self.step_settings = StepSettings.from_config(cfg, self.device)
        self.gamma = drafter_gamma(cfg)
        self.mask_id = self.model.config.mask_token_id
        if self.ranks.rank == 0:
            self.metrics = MetricsSink(self.out_dir, cfg.train.tensorboard, cfg.train.wandb_project, cfg.to_dict())
        self.startup["optimizer_and_outputs_s"] = time.perf_counter() - t0

    def _new_plan(self, served: dict[str, Any]) -> None:
        """The target serves another data plan than the checkpoint's `have` counts batches of: the
        same seqs hold other documents, so resuming would train some samples twice and others never.
        Refuse (PlanChanged, naming what changed), or with train.new_plan start a new accounting on
        purpose: the weights (and optimizer, step) stay, `have` and the sample accounting restart
        empty for the new plan, and with them the learning-rate schedule (a function of progress)."""
        changes = "; ".join(plan_changes(self.resumed_plan, served))
        if not self.cfg.train.new_plan:
            raise PlanChanged(
                f"{self.last_checkpoint} was trained on data plan {self.resumed_plan.get('id')}, the target server "
                f"at {self.cfg.service.target_endpoint} serves data plan {served['id']}: {changes}. Resuming would "
                "train some samples twice and others never. Restore the target's settings, or start a new "
                "accounting on purpose with train.new_plan=true (the weights are kept); nothing was changed")
        log.warning("train.new_plan: leaving data plan %s for %s (%s) at step %d: the weights are kept, the "
                    "exactly-once accounting (%d batches held) restarts empty for the new plan",
                    self.resumed_plan.get("id"), served["id"], changes, self.step, len(self.trained))
        self.trained, self.resumed_batches, self.trained_samples, self.epoch = SeqSet(), 0, {}, 0
        self.sample_seqs, self.unattributed = {}, SeqSet()
        self.feed.restart_accounting()

    # ---- one step ------------------------------------------------------------------------------
    def _next_batch(self, ends_seen: set[int]):
        """This step's batch, or None (epoch markers are consumed here)."""
        if self.flags.drain or self.flags.paused:
            if self.state == "training":
                self.state = "paused"    # idle at a step boundary: what status reports (until a batch comes)
            time.sleep(PAUSED_POLL_S)    # not a hot loop: a paused trainer may idle for hours
            return None
        if self.state == "paused":
            self.state = "training"      # resumed
        deadline = time.monotonic() + (0.5 if self.ranks.world > 1 else 1.0)
        while time.monotonic() < deadline:
            item = self.feed.get(timeout=max(0.0, deadline - time.monotonic()))
            if isinstance(item, EpochEndMarker):
                ends_seen.add(item.epoch)
                continue
            return item
        return None

    def _blocks(self, batch, seed: int):
        """Anchors drawn with `seed` -> the batch's DFlash blocks (training and held-out eval alike)."""
        gen = torch.Generator().manual_seed(seed)
        anchors = sample_anchors(batch.loss_mask.cpu(), batch.doc_lens.cpu(), self.cfg.drafter.max_anchors, gen)
        return build_blocks(batch, anchors.to(self.device), self.cfg.drafter.block_size, self.mask_id, self.gamma)

    def _record(self, batch, out, lr: float, step_s: float, wait_s: float, step_tokens: int) -> None:
        self.trained.add(batch.seq)
        pairs = torch.stack([batch.sample_ids, batch.doc_ids], dim=1).cpu().numpy().astype(np.int64)
        self.trained_samples.setdefault(batch.epoch, []).append(pairs)
        self.sample_seqs.setdefault(batch.epoch, []).append(np.full(len(pairs), batch.seq, np.int64))
        self.epoch = max(self.epoch, batch.epoch)
        if out is None:
            return
        self.anchors += out.num_anchors
        acc = (out.correct_per_pos / out.count_per_pos.clamp_min(1)).tolist()
        self.acc_per_pos = acc[1:]  # position 0 is the anchor itself (no loss)
        self.last_loss = float(out.loss.detach()) if out.loss.numel() == 1 else float("nan")
        if self.ranks.rank == 0 and self.step % max(1, self.cfg.train.log_every) == 0:
            tau = implied_acceptance_length(torch.tensor(self.acc_per_pos))
            rec = {"step": self.step, "epoch": self.epoch, "loss": self.last_loss, "lr": lr, "tau": tau,
                   "tokens_per_s": self.rate.per_s(time.monotonic()), "step_tokens": step_tokens,
                   "anchors": out.num_anchors, "step_s": step_s, "wait_s": wait_s, "time": time.time()}
            progress = self._progress()
            left = "" if progress["eta_s"] is None else f", {human_duration(progress['eta_s'])} left"
            log.info("step %d epoch %d loss %.4f lr %.2e tau %.2f %s tok/s; %.1f%% of the plan%s", self.step,
                     self.epoch, self.last_loss, lr, tau, "-" if rec["tokens_per_s"] is None
                     else f"{rec['tokens_per_s']:.0f}", 100 * (progress["progress"] or 0.0), left)
            self.metrics.write(rec, self.step, {f"train/{k}": rec[k] for k in ("loss", "lr", "tau", "tokens_per_s")})

    def train_loop(self) -> int:
        """Until every rank has seen the last epoch end (or a stop): take a batch, agree with the
        other ranks, step, record, evaluate, checkpoint. Returns the process's exit status."""
        cfg = self.cfg
        ends_seen: set[int] = set()
        loop_start = time.perf_counter()
        while True:
            if self.behind is not None:
                self._switch_if_compiled()
            t0 = time.perf_counter()
            with self.stages.time("wait_batch"):
                batch = self._next_batch(ends_seen)
            batch_at = time.perf_counter()
            if batch is None:
                self._compile_now()          # idle (waiting for the target, paused)
            agreed = self._agree(batch, ends_seen)
            if agreed.ranks_with_batch == 0:
                rc = self._idle(agreed)
                if rc is not None:
                    return rc
                continue
            self.state = "training"
            if "first_step_s" not in self.startup:   # the rate counts from the first batch, not the start-up
                self.rate.mark(time.monotonic(), self.tokens)

            # anchors -> blocks -> the step (loss and backward chunk by chunk, all-reduce, clip, AdamW)
            blocks = (self._blocks(batch, anchor_seed(cfg.train.seed, batch.epoch, batch.seq))
                      if batch is not None else None)
            lr = lr_at(min(1.0, agreed.trained_total / self.total_batches), cfg)
            with self.stages.time("step"):
                result = train_step(self.model, self.optimizer, batch, blocks, lr, self.step_settings, self.ranks)
            self._count_finite(result.applied, batch)
            self.step += 1
            if "first_step_s" not in self.startup:
                self._first_step_done(loop_start, batch_at)
                self._compile_now()          # after the first step: it ran with no compile thread beside it
            self.tokens += agreed.step_tokens
            self.rate.mark(time.monotonic(), self.tokens)
            self.trained_total = agreed.trained_total + agreed.ranks_with_batch
            self.batch_rate.mark(time.monotonic(), self.trained_total)
            if batch is not None:
                self._record(batch, result.out, lr, time.perf_counter() - t0, batch_at - t0, agreed.step_tokens)
            if cfg.train.eval_every and self.step % cfg.train.eval_every == 0 and self.ranks.rank == 0:
                self._eval_and_report()
            rc = self._after_step(agreed)
            if rc is not None:
                return rc

    def _agree(self, batch: Any, ends_seen: set[int]) -> "Agreement":
        """One all-reduce of the loop's flags, so that every rank takes the same branch."""
        epochs = self.cfg.train.epochs
        all_ended = len({e for e in ends_seen if e < epochs}) >= epochs
        since = len(self.trained) - self.resumed_batches
        by_host = [0.0] * self.hosts   # this rank's batches, in its host's slot: per-host progress for status
        by_host[self.cfg.cluster.host_rank] = since
        sync = self.ranks.sum_(torch.tensor([batch is not None, self.flags.stop,
                                             self.flags.checkpoint or self.flags.drain, all_ended,
                                             since, batch.num_tokens if batch is not None else 0, *by_host],
                                            dtype=torch.float64))
        self.trained_by_host = [r + int(n) for r, n in zip(self.resumed_by_host, sync[6:].tolist())]
        return Agreement(ranks_with_batch=int(sync[0]), stop=bool(sync[1]), checkpoint=bool(sync[2]),
                         everyone_ended=int(sync[3]) == self.ranks.world,
                         trained_total=self.resumed_batches + int(sync[4]), step_tokens=int(sync[5]))

    def _idle(self, agreed: "Agreement") -> int | None:
        """No rank has a batch: finish, stop, checkpoint (drain) or wait; an exit status to end with."""
        if agreed.everyone_ended:
            self.state = "finished"
            return self._finish(FINISHED)
        if agreed.stop:
            return self._finish(self.flags.reason or "stop requested")
        if agreed.checkpoint:
            self.checkpoint("requested")
            self.flags.checkpoint = False
            if self.flags.drain:
                self.state, self.flags.paused = "drained", True
        if self.feed.state == "failed":
            raise RuntimeError(f"feed failed: {self.feed.error}")
        if self.state == "training" and self.feed.state != "streaming":
            self.state = self.feed.state
        return None

    def _count_finite(self, applied: bool, batch: Any) -> None:
        if applied:
            self.bad_in_row = 0
            return
        self.skipped_steps += 1
        self.bad_in_row += 1
        log.error("step %d skipped: non-finite loss or gradient (seq %s)", self.step,
                  batch.seq if batch is not None else "-")

    def _after_step(self, agreed: "Agreement") -> int | None:
        """Checkpoint when due; an exit status when the loop ends here (non-finite steps, a stop,
        max_steps)."""
        t = self.cfg.train
        if self.bad_in_row >= t.max_bad_steps:
            self.checkpoint("non-finite steps")
            log.error("%d non-finite steps in a row: checkpointed and stopping. Lower train.lr or inspect the "
                      "seqs logged above.", self.bad_in_row)
            return EXIT_BAD_STEPS
        if self.step % t.checkpoint_every == 0 or agreed.checkpoint:
            self.checkpoint("requested" if agreed.checkpoint else "periodic")
            self.flags.checkpoint = False
        if agreed.stop:
            return self._finish(self.flags.reason or "stop requested")
        if t.max_steps and self.step >= t.max_steps:
            return self._finish("max_steps reached")
        return None

    def _compile_now(self) -> None:
        """Let the background compile start (idempotent)."""
        if self.behind is not None:
            self.behind.start()

    # ---- held-out eval ---------------------------------------------------------------------------
    def evaluate(self) -> dict[str, Any] | None:
        """The drafter on the held-out batches: eval mode, no gradient, anchors fixed per held-out
        index (every eval scores the same blocks), accuracy pooled over all of them; None until all
        the server's held-out batches have arrived. Runs on one rank, without any collective."""
        cfg, model = self.cfg, self.model
        batches, expected = self.feed.heldout_batches(), self.feed.heldout_expected
        if not expected or len(batches) < expected:
            log.info("eval at step %d skipped: %d of %d held-out batches have arrived", self.step,
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
                    blocks = self._blocks(batch, heldout_anchor_seed(cfg.train.seed, batch.seq))
                    with self.step_settings.autocast(self.device):
                        out = dflash_loss(model, batch, blocks, cfg.drafter.loss_chunk,
                                          blocks_per_chunk=cfg.drafter.blocks_per_chunk)
                    correct += out.correct_per_pos.detach().double().cpu()
                    count += out.count_per_pos.detach().double().cpu()
                    ce_sum += float(out.ce_sum)
                    weight_sum += float(out.weight_sum)
        finally:
            model.train(was_training)
        acc = (correct / count.clamp_min(1)).tolist()[1:]   # position 0 is the anchor itself (no loss)
        return {"step": self.step, "tau": implied_acceptance_length(torch.tensor(acc)),
                "acceptance_per_position": [round(a, 4) for a in acc],
                "loss": ce_sum / weight_sum if weight_sum > 0 else float("nan"), "batches": len(batches)}

    def _eval_and_report(self) -> None:
        result = self.evaluate()
        if result is None:
            return
        self.last_eval = result
        log.info("eval step %d: tau %.3f loss %.4f on %d held-out batches", result["step"], result["tau"],
                 result["loss"], result["batches"])
        rec = {"step": self.step, "eval_tau": result["tau"], "eval_loss": result["loss"],
               "eval_batches": result["batches"], "eval_acceptance_per_position": result["acceptance_per_position"],
               "time": time.time()}
        self.metrics.write(rec, self.step, {"eval/tau": result["tau"], "eval/loss": result["loss"]})

    def _switch_if_compiled(self) -> None:
        """Between steps: run compiled from here on once the background compile is ready."""
        assert self.behind is not None
        if not self.behind.switch_if_ready():
            return
        b, self.behind = self.behind, None
        self.compile_state = {"state": b.state, "seconds": round(b.seconds or 0.0, 3), "at_step": self.step,
                              **({"error": b.error} if b.error else {})}

    def _first_step_done(self, loop_start: float, batch_at: float) -> None:
        self.startup["first_batch_wait_s"] = batch_at - loop_start
        self.startup["first_step_s"] = time.perf_counter() - batch_at
        self.startup["process_to_first_step_s"] = process_age_s()
        if self.ranks.rank == 0:
            log.info("first step %.1fs after the process started: %s", self.startup["process_to_first_step_s"] or -1,
                     ", ".join(f"{k} {v:.2f}s" for k, v in self.startup.items() if v is not None))

    def _finish(self, reason: str) -> int:
        saved = self.checkpoint(reason)
        if not saved or self.stopped_by_checkpoint_failures:
            # exit status 4: the deployments do not restart it into the same full disk
            log.error("trainer stopping (%s) at step %d, %s. It resumes from %s once there is room under %s.",
                      reason, self.step, "its final checkpoint saved" if saved else "without a final checkpoint",
                      self.last_checkpoint or "the start", self.out_dir)
            if not saved and self.ranks.rank == 0:
                log.error("%s", self._export_hint())
            return EXIT_DISK_FULL
        if self.ranks.rank == 0 and self.state == "finished":
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
                          "now: %s", self.last_checkpoint, cannot_write(full, self.out_dir), self._export_command())
                return EXIT_DISK_FULL
            log.info("exported drafter to %s", export_dir)
        log.info("trainer stopping (%s) at step %d", reason, self.step)
        return EXIT_OK

    def _export_hint(self) -> str:
        """The way to a drafter when the final checkpoint (and so, at the end of training, the
        export) could not be written: export the last good checkpoint now, or let a restart with
        room train what it lacks and export."""
        ended = "training finished, but its final checkpoint and export" if self.state == "finished" \
            else "its final checkpoint"
        if not self.last_checkpoint:
            return (f"{ended} could not be written and no checkpoint exists under {self.out_dir}: free space there "
                    "and start the trainer again (it trains from the start)")
        return (f"{ended} could not be written. The last good checkpoint is {self.last_checkpoint}. Its drafter "
                f"now: {self._export_command()}. The finished drafter: free space under {self.out_dir} and start the "
                f"trainer again; it resumes from that checkpoint, trains the "
                f"{self.total_batches - self.last_checkpoint_batches} batches it lacks and exports to "
                f"{os.path.join(self.out_dir, 'export')}")

    def _export_command(self) -> str:
        """The command that exports the last good checkpoint, in words."""
        config = f"-c {self.cfg.source} " if self.cfg.source else ""
        return f"`dfpipe export {config}--checkpoint {self.last_checkpoint} --out DIR` (DIR on a disk with room)"

    def close(self) -> None:
        if self.feed is not None:
            self.feed.close()
        if self.control is not None:
            self.control.close()
        if self.metrics is not None:
            self.metrics.close()
        self.ranks.close()


def main(cfg: Config) -> int:
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s trainer[{os.environ.get('RANK', '0')}] %(levelname)s %(message)s")
    preimport_dynamo()   # torch.optim needs it (seconds): imported beside the I/O of starting up
    trainer = Trainer(cfg)

    def _on_term(signum, _frame) -> None:
        trainer.flags.ask_to_stop(stopping.stop_signal_text(signum))
    signal.signal(signal.SIGTERM, _on_term)
    signal.signal(signal.SIGINT, _on_term)
    if "TORCHELASTIC_RUN_ID" in os.environ:   # a torchrun rank: stop (and checkpoint) if torchrun dies
        signal_on_parent_death(signal.SIGTERM)
    rc = EXIT_FAILED
    try:
        trainer.setup()
        rc = trainer.train_loop()
    except OutDirInUse as e:
        log.error("trainer refused: %s", e)
        rc = EXIT_OUT_DIR_IN_USE
    except PlanChanged as e:
        log.error("trainer refused: %s", e)
        rc = EXIT_PLAN_CHANGED
    except ConfigError as e:     # a setting this host cannot run (drafter.precision fp8 without FP8 matmuls)
        log.error("trainer refused: %s", e)
        rc = EXIT_CONFIG
    except NoCheckpointVerifies as e:
        log.error("trainer stopped: %s", e)
        rc = EXIT_NO_CHECKPOINT_VERIFIES
    except Untrusted as e:      # another user's endpoint, folder or file: the line names it, its owner and the fix
        log.error("trainer refused: %s", e)
        rc = EXIT_UNTRUSTED
    except ChannelError as e:   # e.g. an endpoint path too long: a setting to change, one line
        log.error("trainer refused: %s", e)
    except StoppedWaiting as e:
        log.info("trainer stopping (%s) while waiting for the target server: nothing trained since the last "
                 "checkpoint, nothing to save", e)
        rc = EXIT_OK
    except Exception as e:
        full = disk_error(e, trainer.out_dir)
        if full is None:
            log.exception("trainer failed: %s", e)
        else:   # at start (the lock file, metrics.jsonl, TensorBoard) or while training: not a crash
            log.error("trainer stopped: %s", cannot_write(full, trainer.out_dir))
            rc = EXIT_DISK_FULL
    finally:
        trainer.close()
    if compiling_in_background():
        # Stopped while the compile thread is still inside dynamo/inductor: interpreter shutdown
        # would tear down modules (and CUDA) under it, which can abort the process and turn a clean
        # stop into a crash exit. Everything of ours is closed and the checkpoint written.
        log.info("exiting while the background compile is still running (it is dropped)")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc
