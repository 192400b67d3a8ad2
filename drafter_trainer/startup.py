"""Start-up and the target hand-over: the drafter built while the feed connects (on a restart
against a warm target the two overlap, and the build is most of the time to the first step), the
server's WELCOME taken (its plan, target and epochs, checked against the checkpoint's and every
other host's), and the kernels compiling behind the first steps. `Startup.times` holds the seconds
of each phase, to the first step (status "startup").
"""
from __future__ import annotations

import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from common.config import Config, default_gamma, default_layer_ids
from common.liveness import process_age_s
from common.protocol import Welcome

from .accounting import Accounting
from .checkpoint import plan_changes
from .checkpointer import Checkpointer
from .control import TrainerFlags
from .devices import use_device
from .feed import RingFeed
from .fp8 import resolve_precision
from .model import DFlashConfig, DFlashDraftModel
from .preflight import mask_token_id
from .step import Ranks, StepSettings
from .target_head import TargetHead, read_target_head, text_config
from .warmup import CompileBehind, needs_compiling

log = logging.getLogger(__name__)

WELCOME_GRACE_S = 0.5  # a warm target's WELCOME is in by the end of the drafter build; later means it is starting


class PlanChanged(Exception):
    """The checkpoint's batches are of another data plan than the target server's (see `Startup._new_plan`)."""


class StoppedWaiting(Exception):
    """Told to stop (SIGTERM, Ctrl-C, ctl shutdown) before the target server answered: nothing to save."""


def drafter_gamma(cfg: Config) -> float:
    """The loss decay per block position: drafter.gamma, or the published default for the block size."""
    return cfg.drafter.gamma or default_gamma(cfg.drafter.block_size)


def build_drafter(cfg: Config, target: dict[str, Any], device: torch.device, times: dict[str, float] | None = None
                  ) -> tuple[DFlashDraftModel, CompileBehind | None]:
    """The drafter for `target` (WELCOME's target info: model_path, layer_ids), eager, and the
    background compile its first steps run beside (`CompileBehind`; None when nothing compiles);
    `times` gets the seconds of the build and of the target head's read beside it. At the 27B shape
    a restart's first step came 14 s after the process started this way, 33 s when the first step
    compiled (docs/benchmarks.md)."""
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
            behind = CompileBehind(model, device, cfg.drafter.compile,
                                   StepSettings.from_config(cfg, device).compute_dtype, cfg.data.token_budget,
                                   cfg.drafter.max_anchors, drafter_gamma(cfg))
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


def check_host(cfg: Config, ranks: Ranks, plan_id: str, target: dict[str, Any]) -> None:
    """The server serves this host's shard (the same cluster.num_hosts and host_rank), and every
    rank's server serves the same plan and target. Otherwise a host would train another host's
    batches (twice) and leave its own untrained, or seq s would hold other documents on
    another host. The gather is collective: every rank calls this once, after its WELCOME."""
    c = cfg.cluster
    served = (int(target.get("num_hosts", 1)), int(target.get("host_rank", 0)))
    mine = {"plan": plan_id, "layer_ids": list(target.get("layer_ids", [])),
            "precision": target.get("precision"),
            "hidden_size": target.get("hidden_size"), "vocab_size": target.get("vocab_size")}
    others = ranks.gather_objects((c.host_rank, mine))
    if served != (c.num_hosts, c.host_rank):
        raise PlanChanged(
            f"the target server at {cfg.service.target_endpoint} serves host {served[1]} of {served[0]}, "
            f"this trainer rank is on host {c.host_rank} of {c.num_hosts} (cluster.host_rank, cluster.num_hosts): "
            "give the server and the trainer ranks of a host the same cluster settings, and each host's "
            "ranks their own host's service.target_endpoint")
    differ = sorted({f"host {h}: {theirs}" for h, theirs in others if theirs != mine})
    if differ:
        raise PlanChanged(
            f"the hosts' target servers serve different data plans or targets (host {c.host_rank}: {mine}; "
            f"{'; '.join(differ)}): every host needs the same data, target folder and data settings")


class Startup:
    """From the resumed checkpoint to the first step: the hand-over (`hand_over`), the phases'
    seconds (`times`) and the background compile until the drafter switches to it."""

    def __init__(self, cfg: Config, ranks: Ranks, flags: TrainerFlags) -> None:
        self.cfg, self.ranks, self.flags = cfg, ranks, flags
        self.times: dict[str, float | None] = {}       # seconds of each start-up phase, to the first step
        self.behind: CompileBehind | None = None       # the kernels compiling beside the first steps
        self.compile_state: dict[str, Any] = {"state": "building"}   # -> eager | compiling -> compiled | failed

    def hand_over(self, feed: RingFeed, accounting: Accounting, checkpointer: Checkpointer) -> DFlashDraftModel:
        """Connect, build the drafter meanwhile, take the server's WELCOME: the drafter for the
        target the server runs (the checkpoint's weights not yet in it)."""
        cfg, t_connect = self.cfg, time.perf_counter()
        feed.launch()
        guess = expected_target(cfg)
        built = build_drafter(cfg, guess, self.ranks.device, self.times) if guess is not None else None
        if built is not None and built[1] is not None and not feed.welcomed.wait(WELCOME_GRACE_S):
            built[1].start()   # the target is still loading or warming up: compile while waiting for it
        welcome = feed.wait_welcome(lambda: self.flags.stop)
        new_plan = feed.state == "plan_changed"
        if new_plan:
            self._new_plan(feed.refused_for_plan, feed, accounting, checkpointer)   # PlanChanged unless train.new_plan
            welcome = feed.wait_welcome(lambda: self.flags.stop)
        self.times["welcome_s"] = time.perf_counter() - t_connect
        if feed.state == "failed":
            raise RuntimeError(f"feed failed: {feed.error}")
        if welcome is None:
            raise StoppedWaiting(self.flags.reason or "stop requested")
        self._accept_welcome(welcome, new_plan, accounting, checkpointer)
        return self._take_drafter(built, guess, welcome.target)

    def _accept_welcome(self, welcome: Welcome, new_plan: bool, accounting: Accounting,
                        checkpointer: Checkpointer) -> None:
        """Take the plan, the target and the epochs the server's WELCOME carries."""
        accounting.plan = plan = dict(welcome.plan)   # recorded in every checkpoint
        if checkpointer.last and not accounting.resumed_plan and not new_plan:
            log.warning("%s records no data plan (written before plans were fingerprinted): resuming it as if it "
                        "were of the target's plan %s, which cannot be checked; its next checkpoints record it",
                        checkpointer.last, plan["id"])
        elif self.cfg.train.new_plan and accounting.resumed_plan and not new_plan:
            log.info("train.new_plan is set but the data plan is unchanged (%s): resuming its accounting",
                     plan["id"])
        check_host(self.cfg, self.ranks, plan["id"], welcome.target)
        accounting.take_plan(welcome)
        checkpointer.take_target(welcome.target)

    def _new_plan(self, served: dict[str, Any], feed: RingFeed, accounting: Accounting,
                  checkpointer: Checkpointer) -> None:
        """The target serves another data plan than the checkpoint's `have` counts batches of: the
        same seqs hold other documents, so resuming would train some samples twice and others never.
        Refuse (PlanChanged, naming what changed), or with train.new_plan start a new accounting on
        purpose: the weights (and optimizer, step) stay, `have` and the sample accounting restart
        empty for the new plan, and with them the learning-rate schedule (a function of progress)."""
        before = accounting.resumed_plan
        changes = "; ".join(plan_changes(before, served))
        if not self.cfg.train.new_plan:
            raise PlanChanged(
                f"{checkpointer.last} was trained on data plan {before.get('id')}, the target server "
                f"at {self.cfg.service.target_endpoint} serves data plan {served['id']}: {changes}. Resuming would "
                "train some samples twice and others never. Restore the target's settings, or start a new "
                "accounting on purpose with train.new_plan=true (the weights are kept); nothing was changed")
        log.warning("train.new_plan: leaving data plan %s for %s (%s) at step %d: the weights are kept, the "
                    "exactly-once accounting (%d batches held) restarts empty for the new plan",
                    before.get("id"), served["id"], changes, accounting.step, len(accounting.trained))
        accounting.restart()
        feed.restart_accounting()

    def _take_drafter(self, built: tuple[DFlashDraftModel, CompileBehind | None] | None,
                      guess: dict[str, Any] | None, target: dict[str, Any]) -> DFlashDraftModel:
        """The drafter built while connecting, or built now for the target the server runs."""
        if built is None or not same_target(guess, target):
            if built is not None:
                log.info("the target server runs %s layers %s, not the configured %s layers %s: rebuilding the "
                         "drafter", target.get("model_path"), target.get("layer_ids"),
                         guess["model_path"], guess["layer_ids"])
                del built     # a background compile of it runs out on its own and is never switched to
            built = build_drafter(self.cfg, target, self.ranks.device, self.times)
        model, self.behind = built
        self.compile_state = {"state": "compiling" if self.behind else "compiled" if model.compiled else "eager"}
        return model

    # ---- to the first step and beyond ------------------------------------------------------------
    @property
    def first_step_taken(self) -> bool:
        return "first_step_s" in self.times

    def first_step_done(self, loop_start: float, batch_at: float) -> None:
        self.times["first_batch_wait_s"] = batch_at - loop_start
        self.times["first_step_s"] = time.perf_counter() - batch_at
        self.times["process_to_first_step_s"] = process_age_s()
        if self.ranks.rank == 0:
            log.info("first step %.1fs after the process started: %s", self.times["process_to_first_step_s"] or -1,
                     ", ".join(f"{k} {v:.2f}s" for k, v in self.times.items() if v is not None))

    def compile_now(self) -> None:
        """Let the background compile start (idempotent)."""
        if self.behind is not None:
            self.behind.start()

    def switch_if_compiled(self, step: int) -> None:
        """Between steps: run compiled from here on once the background compile is ready."""
        if self.behind is None or not self.behind.switch_if_ready():
            return
        b, self.behind = self.behind, None
        self.compile_state = {"state": b.state, "seconds": round(b.seconds or 0.0, 3), "at_step": step,
                              **({"error": b.error} if b.error else {})}

    def status(self) -> dict[str, Any]:
        return {k: round(v, 3) if v is not None else None for k, v in self.times.items()}
