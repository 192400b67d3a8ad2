"""Atomic, resumable checkpoints that say exactly which batches (and samples) they contain.

    <out_dir>/checkpoints/step-00000120/       a complete checkpoint (only ever appears by rename)
        state.pt     weights (trainable only), optimizer, schedule, RNG, step
        meta.json    step, epoch, have (batch seqs, as ranges), sample accounting, config hash,
                     plan (the target server's data plan `have` counts batches of: its components and id)
    <out_dir>/checkpoints/.tmp-step-00000120-<pid>/   being written; ignored and swept on start
    <out_dir>/trainer.lock                      held (flock) by the one trainer using out_dir

A `kill -9` at any moment leaves either the previous complete checkpoint or the new one, never a
half-written one that `latest_checkpoint` would pick. One trainer at a time: `lock_out_dir` comes
before anything in out_dir is read or swept, so a second trainer (another config, another
endpoint) never sweeps the first one's checkpoint in progress or overwrites its checkpoints.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import dataclasses
import time
from typing import Any

import numpy as np
import torch

from common.cluster import accounting as cluster_accounting
from common.cluster import count_by_host
from common.faults import fault_error, fault_point
from common.protocol import ProtocolError, check_plan
from common.seqset import SeqSet

PREFIX = "step-"


LOCK_NAME = "trainer.lock"


class OutDirInUse(RuntimeError):
    """Another live process holds out_dir's lock."""


def lock_out_dir(out_dir: str) -> int:
    """Take out_dir's trainer lock (flock on out_dir/trainer.lock) or raise OutDirInUse naming the
    holder. Returns the fd: the lock lasts as long as it is open, i.e. until the process ends,
    however it ends (the kernel drops a dead process's flock, so a stale file never blocks)."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, LOCK_NAME)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise
        raise OutDirInUse(f"{out_dir} is in use by another trainer (pid {holder}, holding {path}); "
                          "one trainer per train.out_dir: stop it first or use another out_dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def fsync_path(path: str) -> None:
    """fsync a file or a folder by path (a folder: so a rename into it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_root(out_dir: str) -> str:
    return os.path.join(out_dir, "checkpoints")


# The exactly-once audit as every place shows it (status, inspect, the demo summary, top).
AUDIT_KEYS = ("samples_trained", "samples_duplicated", "epoch_samples",
              "documents_trained", "documents_duplicated", "epoch_documents")


def trained_pairs(trained: np.ndarray) -> np.ndarray:
    """[n, 2] (sample id, document id), one row per document an epoch trained. A checkpoint written
    before documents were counted holds sample ids alone: their document ids read as -1 (unknown)."""
    trained = np.asarray(trained, dtype=np.int64)
    if trained.ndim == 2:
        return trained
    return np.stack([trained, np.full_like(trained, -1)], axis=1)


def sample_stats(trained_samples: dict[int, np.ndarray], epoch: int, epoch_samples: int,
                 epoch_documents: int = 0) -> dict[str, int]:
    """Exactly-once accounting for one epoch, of samples (source rows) and of documents (what the
    target computes: a template that re-renders earlier turns, or a split, makes several of one
    row). A document trained more than once is duplicated, and so is its sample; a sample's several
    documents trained once each are not. Documents of unknown id (-1, see `trained_pairs`) count
    as trained, never as duplicated."""
    pairs = trained_pairs(trained_samples.get(epoch, np.zeros((0, 2), dtype=np.int64)))
    known = pairs[pairs[:, 1] >= 0]
    docs, counts = np.unique(known[:, 1], return_counts=True)
    twice = docs[counts > 1]
    return {"samples_trained": len(np.unique(pairs[:, 0])),
            "samples_duplicated": len(np.unique(known[np.isin(known[:, 1], twice), 0])),
            "epoch_samples": epoch_samples,
            "documents_trained": len(docs) + int((pairs[:, 1] < 0).sum()),
            "documents_duplicated": len(twice),
            "epoch_documents": epoch_documents}


def epoch_stats(trained_samples: dict[int, np.ndarray]) -> dict[str, dict[str, int]]:
    """The same accounting for every epoch the run has trained from, so a run of many epochs (and
    restarts) can be audited from its last checkpoint alone. String keys: it goes into JSON."""
    return {str(e): {k: v for k, v in sample_stats(trained_samples, e, 0).items() if not k.startswith("epoch_")}
            for e in sorted(trained_samples)}


def _write_error(error: BaseException) -> OSError | None:
    """The OSError a failed write raised inside `error`'s chain of exceptions, if any."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, OSError):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


def _save_state(state: dict[str, Any], f: Any) -> None:
    """torch.save into an open file; a failed write (a full disk) raises OSError, as any other write.

    torch's zip writer lets the write's OSError (ENOSPC) out of the record it was writing, then
    closing the archive raises RuntimeError("unexpected pos ...") over it: that RuntimeError is a
    write failure and becomes an OSError. A RuntimeError with no failed write under it (a bug, a
    device error while copying a tensor out) is not one and stays what it is."""
    try:
        torch.save(state, f)
    except RuntimeError as e:
        failed = _write_error(e)
        if failed is None:
            raise
        raise OSError(failed.errno, f"writing {getattr(f, 'name', 'state.pt')}: {failed.strerror or failed}") from e


def save_checkpoint(out_dir: str, step: int, state: dict[str, Any], meta: dict[str, Any], keep: int) -> str:
    root = checkpoint_root(out_dir)
    os.makedirs(root, exist_ok=True)
    final = os.path.join(root, f"{PREFIX}{step:08d}")
    tmp = os.path.join(root, f".tmp-{PREFIX}{step:08d}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        fault_error("checkpoint.write")
        with open(os.path.join(tmp, "state.pt"), "wb") as f:
            _save_state(state, f)
            f.flush()
            os.fsync(f.fileno())
        with open(os.path.join(tmp, "meta.json"), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(tmp)
    except BaseException:
        # a full disk must not fill up further with every retry
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fault_point("checkpoint.before_rename")
    if os.path.exists(final):  # same step saved twice (e.g. SIGTERM right after a periodic save)
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_path(root)
    for old in list_checkpoints(out_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(out_dir: str) -> list[str]:
    root = checkpoint_root(out_dir)
    if not os.path.isdir(root):
        return []
    names = sorted(n for n in os.listdir(root) if n.startswith(PREFIX)
                   and os.path.isfile(os.path.join(root, n, "meta.json")))
    return [os.path.join(root, n) for n in names]


def sweep_partial(out_dir: str) -> int:
    """Remove checkpoints a killed process left half-written."""
    root = checkpoint_root(out_dir)
    if not os.path.isdir(root):
        return 0
    gone = 0
    for n in os.listdir(root):
        if n.startswith(".tmp-"):
            shutil.rmtree(os.path.join(root, n), ignore_errors=True)
            gone += 1
    return gone


def latest_checkpoint(out_dir: str) -> str | None:
    found = list_checkpoints(out_dir)
    return found[-1] if found else None


def load_checkpoint(path: str, map_location: str | torch.device = "cpu") -> tuple[dict[str, Any], dict[str, Any]]:
    with open(os.path.join(path, "meta.json"), encoding="utf-8") as f:
        meta = json.load(f)
    state = torch.load(os.path.join(path, "state.pt"), map_location=map_location, weights_only=False)
    return state, meta


@dataclasses.dataclass
class TrainerState:
    """What a checkpoint holds, written (`save`) and read (`load`) here only. The trainer builds
    one from itself to save, and restores from the one `load` gives: its accounting at start-up
    (before it says HELLO), the weights, RNG and optimizer once the drafter is built
    (`restore_weights`, and `optimizer` to optim.build_adamw)."""

    step: int
    epoch: int
    have: SeqSet                                  # batch seqs whose effect is in the weights (every host's)
    trained_samples: dict[int, np.ndarray]        # per epoch, (sample id, document id) per document trained
    skipped_steps: int = 0
    plan: dict[str, Any] = dataclasses.field(default_factory=dict)   # the data plan of `have` ({}: not recorded)
    epoch_sizes: list[int] | None = None          # batches of every planned epoch (None: not recorded)
    config_hash: str = ""                         # of the drafter config section
    model: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)   # the trainable weights
    optimizer: dict[str, Any] | None = None       # torch AdamW state_dict
    rng: torch.Tensor | None = None               # torch's CPU generator state
    drafter_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    split_fc: bool = False

    def save(self, out_dir: str, keep: int, reason: str, epoch_samples: int, num_hosts: int = 1,
             epoch_documents: int = 0) -> tuple[str, dict]:
        """Write it atomically (save_checkpoint); its path and meta. OSError when the write fails."""
        state = {"model": self.model, "optimizer": self.optimizer, "step": self.step,
                 "drafter_config": self.drafter_config, "split_fc": self.split_fc, "rng": {"torch": self.rng},
                 "trained_samples": self.trained_samples}
        sizes = self.epoch_sizes or []
        meta = {"step": self.step, "epoch": self.epoch, "have": self.have.to_wire(), "reason": reason,
                "plan": self.plan, "config_hash": self.config_hash, "skipped_steps": self.skipped_steps,
                "time": time.time(), **sample_stats(self.trained_samples, self.epoch, epoch_samples, epoch_documents),
                "epochs": epoch_stats(self.trained_samples), "epoch_sizes": sizes,
                "cluster": cluster_accounting(count_by_host(self.have, sizes, num_hosts), sizes)}
        return save_checkpoint(out_dir, self.step, state, meta, keep), meta

    @classmethod
    def load(cls, path: str) -> "TrainerState":
        state, meta = load_checkpoint(path)
        plan = {}
        if meta.get("plan"):
            try:
                plan = check_plan(meta["plan"], "meta.json plan")
            except ProtocolError as e:
                raise ValueError(f"{path}: {e}; the checkpoint's data plan is unreadable (restore its meta.json, "
                                 "or remove its 'plan' to resume it unchecked)") from None
        return cls(step=meta["step"], epoch=meta["epoch"], have=SeqSet.from_wire(meta["have"]),
                   trained_samples={int(e): np.asarray(v, dtype=np.int64) for e, v in state["trained_samples"].items()},
                   skipped_steps=meta.get("skipped_steps", 0), plan=plan, epoch_sizes=meta.get("epoch_sizes"),
                   config_hash=meta.get("config_hash", ""), model=state["model"], optimizer=state.get("optimizer"),
                   rng=state.get("rng", {}).get("torch"), drafter_config=state.get("drafter_config", {}),
                   split_fc=state.get("split_fc", False))

    def restore_weights(self, model: torch.nn.Module) -> None:
        """The checkpoint's trainable weights into `model` (its frozen target head stays), and its RNG."""
        result = model.load_state_dict(self.model, strict=False)
        if result.unexpected_keys:
            raise ValueError(f"checkpoint has unknown weights {result.unexpected_keys[:4]}")
        if self.rng is not None:
            torch.set_rng_state(self.rng)


def read_meta(path: str) -> dict[str, Any]:
    with open(os.path.join(path, "meta.json"), encoding="utf-8") as f:
        return json.load(f)


def plan_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between two data plans, one "setting: old -> new" per changed component."""
    keys = [k for k in sorted(set(old) | set(new)) if k != "id"]
    changed = [f"{k}: {old.get(k, '(absent)')} -> {new.get(k, '(absent)')}" for k in keys if old.get(k) != new.get(k)]
    return changed or [f"plan id: {old.get('id')} -> {new.get('id')}"]


def inspect(path: str) -> dict[str, Any]:
    """What `dfpipe inspect` prints: the meta, the accounting of the current epoch and (from
    checkpoints that carry it) of every epoch before it and of each host's shard (`cluster`)."""
    meta = read_meta(path)
    have = SeqSet.from_wire(meta["have"])
    out = {k: meta[k] for k in ("step", "epoch", *AUDIT_KEYS, "epochs", "cluster", "config_hash", "skipped_steps",
                                "time") if k in meta}
    # the data plan its batches are of (None: written before plans were fingerprinted)
    out.update({"path": os.path.abspath(path), "batches": len(have), "have": meta["have"],
                "plan": meta.get("plan")})
    return out
