"""The trainer's optimizer: torch's AdamW over the drafter's trainable weights, fused on CUDA.

Fused: one launch updates every weight (the foreach form cost ~35 ms a step at 1.8B parameters on
the H200). Constructing any torch.optim optimizer imports dynamo (seconds); the trainer starts
that import in a thread when its process starts (`preimport_dynamo`), beside the I/O of connecting
and reading the target's head, so that neither the optimizer's construction nor an eager step
waits for it.
"""
from __future__ import annotations

import importlib
import threading
from collections.abc import Sequence
from typing import Any

import torch

from common.config import TrainConfig


class OptimizerStateError(ValueError):
    """A checkpoint's optimizer state does not fit the drafter's trainable weights."""


def build_adamw(params: Sequence[torch.nn.Parameter], t: TrainConfig, device: torch.device,
                saved: dict[str, Any] | None = None) -> torch.optim.AdamW:
    """AdamW from `train.*`, with a saved state_dict's moments and step counts when resuming, not its
    hyper-parameters (`load_state_dict` takes them): a restart with a new weight decay or betas
    trains with the new ones."""
    opt = torch.optim.AdamW(list(params), lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay,
                            fused=device.type == "cuda")
    if saved is not None:
        fresh = [dict(g) for g in opt.param_groups]
        _check_fits(saved, opt.param_groups[0]["params"])
        opt.load_state_dict(saved)
        for group, new in zip(opt.param_groups, fresh):
            group.update({k: v for k, v in new.items() if k != "params"})
    return opt


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr


def _check_fits(saved: dict[str, Any], params: list[torch.nn.Parameter]) -> None:
    """A clear error for a state that is not a one-group AdamW state of these weights
    (torch's load_state_dict checks the counts, not the moments' shapes)."""
    groups = saved.get("param_groups")
    if not isinstance(groups, list) or len(groups) != 1 or not isinstance(saved.get("state"), dict):
        raise OptimizerStateError("the checkpoint's optimizer state is not a one-group AdamW state_dict")
    ids = list(groups[0].get("params", []))
    if len(ids) != len(params):
        raise OptimizerStateError(f"the checkpoint's optimizer holds {len(ids)} weights, the drafter trains "
                                  f"{len(params)}")
    if groups[0].get("amsgrad") or groups[0].get("maximize"):
        raise OptimizerStateError("the checkpoint's optimizer uses amsgrad or maximize: not the trainer's AdamW")
    for pid, p in zip(ids, params):
        for key in ("exp_avg", "exp_avg_sq"):
            moment = saved["state"].get(pid, {}).get(key)
            if moment is not None and tuple(moment.shape) != tuple(p.shape):
                raise OptimizerStateError(f"the checkpoint's optimizer state {pid}.{key} does not fit a weight of "
                                          f"shape {tuple(p.shape)}")


def preimport_dynamo() -> threading.Thread:
    """Import torch._dynamo in a daemon thread (torch.optim and torch.compile need it)."""
    thread = threading.Thread(target=importlib.import_module, args=("torch._dynamo",), name="import-dynamo",
                              daemon=True)
    thread.start()
    return thread
