"""The drafter trainer: one process per rank (torchrun), each a ring consumer, in lockstep.

Read `Trainer.train_loop` top to bottom: take a batch, agree with the other ranks, anchors -> blocks
-> DFlash loss -> backward -> all-reduce -> finite check -> clip -> step -> account -> checkpoint.
The rest is components that own their state, each a module of its own: `Startup` (startup.py),
`Accounting` (accounting.py), `Checkpointer` (checkpointer.py), `Validator` (validator.py: the
held-out eval) and `Reporter` (reporting.py).

Ranks and epochs. Each rank gets its own stream of batches from the target server; every step
the ranks agree on a few flags (`Accounting.agree`), and a rank without a batch takes part with
zero loss and gradient (step.py), so uneven epochs and slow deliveries never deadlock. Training
ends when every rank has seen EpochEnd for every epoch and no rank holds a batch.

Exactly once (accounting.py). A restarted trainer sends the checkpoint's `have` in HELLO and the
target server delivers every other seq. The learning-rate schedule is a function of progress
(batches held / batches planned), so it survives restarts and a change in the number of ranks.

Hosts. With `cluster.num_hosts` > 1 each host has its own target server serving its shard of every
epoch (common/cluster.py); a rank reads only from its host's server. The checkpoint holds every
rank's batches; each host's first rank commits its host's shard to its server, and a restarted
rank says HELLO with its host's shard. The schedule's progress and the end of training count the
whole plan.
"""
from __future__ import annotations

import logging
import math
import os
import signal
import sys
import time
import uuid
from typing import Any

import torch

from common import stopping
from common.channel import ChannelError, CurveKeys
from common.config import Config, ConfigError
from common.exits import (EXIT_BAD_STEPS, EXIT_CONFIG, EXIT_DISK_FULL, EXIT_FAILED, EXIT_NO_CHECKPOINT_VERIFIES,
                          EXIT_OK, EXIT_OUT_DIR_IN_USE, EXIT_PLAN_CHANGED, EXIT_UNTRUSTED, cannot_write, disk_error)
from common.liveness import process_age_s, signal_on_parent_death
from common.metrics import start_metrics_server
from common.protocol import new_session_secret
from common.trust import Untrusted

from .accounting import Accounting, Agreement
from .blocks import BlockDrawer, anchor_seed
from .checkpoint import FINISHED, NoCheckpointVerifies, OutDirInUse
from .checkpointer import Checkpointer
from .control import TrainerControl, TrainerFlags
from .feed import EpochEndMarker, RingFeed
from .model import DFlashDraftModel
from .optim import build_adamw, preimport_dynamo
from .preflight import preflight
from .reporting import Reporter
from .startup import PlanChanged, Startup, StoppedWaiting, drafter_gamma
from .step import Ranks, StepSettings, train_step
from .validator import Validator
from .warmup import compiling_in_background

log = logging.getLogger(__name__)

PAUSED_POLL_S = 0.05   # a paused or drained trainer's loop period (flags, stop, the background compile)
# What a refusal exits with, the first that matches (an UntrustedConfig is a ConfigError): ConfigError
# is also a setting this host cannot run (fp8 without FP8 matmuls), Untrusted another user's endpoint,
# folder or file, ChannelError e.g. an endpoint path too long.
REFUSALS = ((OutDirInUse, EXIT_OUT_DIR_IN_USE), (PlanChanged, EXIT_PLAN_CHANGED), (ConfigError, EXIT_CONFIG),
            (Untrusted, EXIT_UNTRUSTED), (ChannelError, EXIT_FAILED))


def lr_at(progress: float, cfg: Config) -> float:
    """Linear warm-up then cosine decay, as a function of the fraction of planned batches trained."""
    t = cfg.train
    if progress < t.warmup_ratio:
        return t.lr * max(progress, 1e-3) / t.warmup_ratio
    frac = min(1.0, (progress - t.warmup_ratio) / max(1e-9, 1 - t.warmup_ratio))
    floor = t.lr * t.min_lr_ratio
    return floor + (t.lr - floor) * 0.5 * (1 + math.cos(math.pi * frac))


class Trainer:
    """One rank: set up (`setup`), then `train_loop`; the components hold the state."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        preflight(cfg)   # every config problem at once, before the ranks meet or anything waits
        self.ranks = Ranks(cfg.train.device, cfg.train.devices)
        self.device = self.ranks.device
        self.flags = TrainerFlags()
        self.out_dir = cfg.resolve(cfg.train.out_dir)
        self.state = "starting"
        self.accounting = Accounting(cfg)
        self.reporter = Reporter(cfg)
        self.checkpointer = Checkpointer(cfg, self.ranks, self.flags, self.reporter.stages, self.accounting)
        self.startup = Startup(cfg, self.ranks, self.flags)
        self.validator = Validator(cfg, self.reporter.stages)
        self.control: TrainerControl | None = None
        self.feed: RingFeed | None = None             # set up in setup(); the stream of this rank's batches
        self.model: DFlashDraftModel | None = None
        self.optimizer: torch.optim.AdamW | None = None

    # status is read by the control thread: only plain values
    def status(self) -> dict[str, Any]:
        a, ck, feed = self.accounting, self.checkpointer, self.feed
        return {"pid": os.getpid(), "state": self.state, "step": a.step, "epoch": a.epoch,
                **a.sample_stats(), "last_checkpoint": ck.last, "loss": self.reporter.last_loss,
                "batches_trained": len(a.trained), "batches_planned": a.total_batches,
                **a.progress(), "cluster": a.cluster(),
                "skipped_steps": a.skipped_steps, "checkpoint_failures": ck.failures,
                "last_checkpoint_error": ck.last_error, **self.reporter.status(a.trained_here),
                "feed": {"state": feed.state, **feed.counters,
                         **({"waiting_for": feed.waiting_for()} if feed.state != "streaming" else {})} if feed else None,
                "target_precision": ck.target_precision,
                "world": self.ranks.world, "stages": self.reporter.stages.snapshot(),
                "startup": self.startup.status(), "eval": self.validator.last,
                "compile": dict(self.startup.compile_state),
                # fa4 (FlashAttention 4), flash (FlashAttention 2), flex, split or sdpa: what the last step ran
                "attention": self.model.attention_ran if self.model is not None else None}

    def setup(self) -> None:
        """Resume, meet the other ranks, connect to the target server and take its hand-over; then
        the optimizer (with the checkpoint's state) and rank 0's metrics records."""
        cfg, ranks, times = self.cfg, self.ranks, self.startup.times
        times["process_to_setup_s"] = process_age_s()   # interpreter, imports, CUDA/NCCL init
        t0 = time.perf_counter()   # resume_and_endpoints_s: the checkpoint's load and checks count in it
        torch.manual_seed(cfg.train.seed)
        have = self.checkpointer.resume()
        job = ranks.broadcast_str(f"{uuid.uuid4().hex[:12]}-{os.getpid()}")
        # rank 0 draws the session secret and the ranks share it like the job: only they may join,
        # ack into, commit to or widen the session on the target server (never logged or shown)
        secret = ranks.broadcast_str(new_session_secret())
        if ranks.rank == 0:
            self.control = TrainerControl(cfg.service.trainer_endpoint, self.flags, self.status,
                                          cfg.service.max_message_bytes, CurveKeys.from_config(cfg),
                                          cfg.service.allowed_uids)
            self.control.start()
            start_metrics_server(cfg.service.trainer_metrics_port, "dfpipe_trainer", self.status)
        self.state = "waiting_for_target"
        self.feed = RingFeed(cfg, ranks.rank, ranks.world, job, have, self.device, cfg.train.epochs,
                             secret=secret, plan=str(self.accounting.resumed_plan.get("id", "")))
        times["resume_and_endpoints_s"] = time.perf_counter() - t0
        self.model = model = self.startup.hand_over(self.feed, self.accounting, self.checkpointer)
        t0 = time.perf_counter()
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = build_adamw(params, cfg.train, self.device, self.checkpointer.restore(model))
        self.checkpointer.attach(model, self.optimizer, self.feed)
        self.step_settings = StepSettings.from_config(cfg, self.device)
        self.blocks_of = BlockDrawer(cfg.drafter.max_anchors, cfg.drafter.block_size, model.config.mask_token_id,
                                     drafter_gamma(cfg), self.device)
        if ranks.rank == 0:
            self.reporter.open(self.out_dir)
        times["optimizer_and_outputs_s"] = time.perf_counter() - t0
        self.state = "training"

    def train_loop(self) -> int:
        """Until every rank has seen the last epoch end (or a stop): take a batch, agree with the
        other ranks, step, record, evaluate, checkpoint. Returns the process's exit status."""
        cfg, acc, start, stages = self.cfg, self.accounting, self.startup, self.reporter.stages
        ends_seen: set[int] = set()
        loop_start = time.perf_counter()
        while True:
            start.switch_if_compiled(acc.step)
            t0 = time.perf_counter()
            with stages.time("wait_batch"):
                batch = self._next_batch(ends_seen)
            batch_at = time.perf_counter()
            if batch is None:
                start.compile_now()          # idle (waiting for the target, paused)
            agreed = acc.agree(self.ranks, self.flags, batch, ends_seen)
            if agreed.ranks_with_batch == 0:
                rc = self._idle(agreed)
                if rc is not None:
                    return rc
                continue
            self.state = "training"
            if not start.first_step_taken:   # the rate counts from the first batch, not the start-up
                self.reporter.rate.mark(time.monotonic(), self.reporter.tokens)

            # anchors -> blocks -> the step (loss and backward chunk by chunk, all-reduce, clip, AdamW)
            blocks = (self.blocks_of(batch, anchor_seed(cfg.train.seed, batch.epoch, batch.seq))
                      if batch is not None else None)
            lr = lr_at(min(1.0, agreed.trained_total / acc.total_batches), cfg)
            with stages.time("step"):
                result = train_step(self.model, self.optimizer, batch, blocks, lr, self.step_settings, self.ranks)
            acc.count_finite(result.applied, batch)
            acc.stepped(agreed)
            if not start.first_step_taken:
                start.first_step_done(loop_start, batch_at)
                start.compile_now()          # after the first step: it ran with no compile thread beside it
            self.reporter.count_tokens(agreed.step_tokens)
            if batch is not None:
                acc.record(batch)
                if result.out is not None:
                    self.reporter.step(acc.step, acc.epoch, result.out, lr, time.perf_counter() - t0, batch_at - t0,
                                       agreed.step_tokens, acc.progress)
            if self.validator.due(acc.step, self.ranks.rank):
                self.validator.run(self.model, self.feed, self.blocks_of, self.step_settings, acc.step,
                                   self.reporter.sink)
            rc = self._after_step(agreed)
            if rc is not None:
                return rc

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

    def _idle(self, agreed: Agreement) -> int | None:
        """No rank has a batch: finish, stop, checkpoint (drain) or wait; an exit status to end with."""
        if agreed.everyone_ended:
            self.state = "finished"
            return self._finish(FINISHED)
        if agreed.stop:
            return self._finish(self.flags.reason or "stop requested")
        if agreed.checkpoint:
            self.checkpointer.save("requested")
            self.flags.checkpoint = False
            if self.flags.drain:
                self.state, self.flags.paused = "drained", True
        if self.feed.state == "failed":
            raise RuntimeError(f"feed failed: {self.feed.error}")
        if self.state == "training" and self.feed.state != "streaming":
            self.state = self.feed.state
        return None

    def _after_step(self, agreed: Agreement) -> int | None:
        """Checkpoint when due; an exit status when the loop ends here (non-finite steps, a stop,
        max_steps)."""
        t, step = self.cfg.train, self.accounting.step
        if self.accounting.bad_in_row >= t.max_bad_steps:
            self.checkpointer.save("non-finite steps")
            log.error("%d non-finite steps in a row: checkpointed and stopping. Lower train.lr or inspect the "
                      "seqs logged above.", self.accounting.bad_in_row)
            return EXIT_BAD_STEPS
        if step % t.checkpoint_every == 0 or agreed.checkpoint:
            self.checkpointer.save("requested" if agreed.checkpoint else "periodic")
            self.flags.checkpoint = False
        if agreed.stop:
            return self._finish(self.flags.reason or "stop requested")
        if t.max_steps and step >= t.max_steps:
            return self._finish("max_steps reached")
        return None

    def _finish(self, reason: str) -> int:
        """The final checkpoint, and at the end of training the export: the exit status."""
        ck, step = self.checkpointer, self.accounting.step
        saved = ck.save(reason)
        if not saved or ck.stopped_by_failures:
            # exit status 4: the deployments do not restart it into the same full disk
            log.error("trainer stopping (%s) at step %d, %s. It resumes from %s once there is room under %s.",
                      reason, step, "its final checkpoint saved" if saved else "without a final checkpoint",
                      ck.last or "the start", self.out_dir)
            if not saved and self.ranks.rank == 0:
                log.error("%s", ck.export_hint(self.state == "finished"))
            return EXIT_DISK_FULL
        if self.ranks.rank == 0 and self.state == "finished" and not ck.export():
            return EXIT_DISK_FULL
        log.info("trainer stopping (%s) at step %d", reason, step)
        return EXIT_OK

    def close(self) -> None:
        if self.feed is not None:
            self.feed.close()
        if self.control is not None:
            self.control.close()
        self.reporter.close()
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
    except (OutDirInUse, PlanChanged, ConfigError, Untrusted, ChannelError) as e:
        log.error("trainer refused: %s", e)   # one line: it names what to change
        rc = next(code for kind, code in REFUSALS if isinstance(e, kind))
    except NoCheckpointVerifies as e:
        log.error("trainer stopped: %s", e)
        rc = EXIT_NO_CHECKPOINT_VERIFIES
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
