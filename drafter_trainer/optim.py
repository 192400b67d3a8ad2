"""The trainer's AdamW, whose first steps need not wait for torch's compiler stack.

Every `torch.optim.Optimizer` method (its constructor included) imports `torch._dynamo` on first
use, and that import cost seconds of a restart on the H200 host: the first optimizer step of a
warm restart waited for it. The update itself needs none of it: `torch.optim.adam.adam` is the
very function `AdamW.step` calls, and it imports nothing while nothing is being compiled.

So `TrainerAdamW` steps through that function with state tensors of its own, built exactly as
`Adam._init_group` builds them, until a background thread has constructed the `torch.optim.AdamW`
(and with it imported dynamo; the trainer lets it start after the first step). At the first step after that thread is through, the same tensors
are handed to it and every later step is torch's own. Steps before and after the hand-over run
the same kernels on the same tensors: the weights are bitwise what torch's AdamW alone gives
(tests/test_optim.py). A checkpoint waits for the hand-over and saves torch's state_dict, so the
checkpoint format is torch's.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch
from torch.optim.adam import adam as adam_update

from common.config import TrainConfig

from .devices import use_device

log = logging.getLogger(__name__)


class OptimizerStateError(ValueError):
    """A checkpoint's optimizer state does not fit the drafter's trainable weights."""


class TrainerAdamW:
    """AdamW over `params` (one group): fused on CUDA, torch's default elsewhere.

    `saved`: a torch AdamW state_dict to resume from: its moments and step counts. Its
    hyper-parameters are not taken (`load_state_dict` would take them): a trainer restarted with a
    new weight decay or betas trains with the new ones. `build_in_background`: False builds the
    torch optimizer now; the trainer builds it in a thread. `defer_build`: the thread loads the
    saved state at once but builds torch's optimizer (imports dynamo) only after `start_building`:
    an import beside the first step slows it (it holds the GIL between every two eager ops).
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], *, lr: float, betas: tuple[float, float],
                 weight_decay: float, fused: bool, saved: dict[str, Any] | None = None,
                 device: torch.device | None = None, build_in_background: bool = True,
                 defer_build: bool = False) -> None:
        self.params = list(params)
        self.group: dict[str, Any] = {"lr": lr, "betas": tuple(betas), "eps": 1e-8, "weight_decay": weight_decay,
                                      "fused": fused}
        self.state: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
        self.early_steps = 0                     # steps taken before the hand-over
        self._torch: torch.optim.AdamW | None = None
        self._loaded: Future[None] = Future()    # the saved state is on the device
        self._future: Future[torch.optim.AdamW] = Future()
        self._go = threading.Event()
        if not (defer_build and build_in_background):
            self._go.set()
        if build_in_background:   # loading a saved state copies GBs: beside the first forward and backward
            threading.Thread(target=self._prepare, args=(saved, device), name="optimizer", daemon=True).start()
        else:
            self._prepare(saved, device)

    # -- the torch optimizer ---------------------------------------------------------------------
    def _prepare(self, saved: dict[str, Any] | None, device: torch.device | None) -> None:
        """Load the saved state, then build torch's AdamW; an error reaches the training thread."""
        try:
            if device is not None:
                use_device(device)
            if saved is not None:
                self._load(saved)
            self._loaded.set_result(None)
        except BaseException as e:
            self._loaded.set_exception(e)
            self._future.set_exception(e)
            return
        self._go.wait()
        try:
            self._future.set_result(self._build())
        except BaseException as e:
            self._future.set_exception(e)

    def _build(self) -> torch.optim.AdamW:
        g = self.group
        return torch.optim.AdamW(self.params, lr=g["lr"], betas=g["betas"], eps=g["eps"],
                                 weight_decay=g["weight_decay"], fused=g["fused"])

    def start_building(self) -> None:
        """Let a deferred build of torch's optimizer begin (idempotent)."""
        self._go.set()

    @property
    def handed_over(self) -> bool:
        return self._torch is not None

    def torch_optimizer(self) -> torch.optim.AdamW:
        """torch's AdamW holding the state of every step so far (waits for its builder)."""
        if self._torch is None:
            self._loaded.result()
            self.start_building()
            opt = self._future.result()
            for p, st in self.state.items():
                opt.state[p] = st
            self._torch = opt
            self.state = {}
            log.info("optimizer: torch's AdamW took over after %d early step(s)", self.early_steps)
        return self._torch

    # -- the steps -------------------------------------------------------------------------------
    def step(self, lr: float) -> None:
        """One AdamW update of every parameter with a gradient, at learning rate `lr`."""
        self.group["lr"] = lr
        if self._torch is None:
            self._loaded.result()
            if self._future.done():
                self.torch_optimizer()
        if self._torch is not None:
            for g in self._torch.param_groups:
                g["lr"] = lr
            self._torch.step()
            return
        with torch.no_grad():
            self._early_step()
        self.early_steps += 1

    def _early_step(self) -> None:
        g = self.group
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in self.params:
            if p.grad is None:
                continue
            st = self.state.get(p)
            if st is None:   # as Adam._init_group: a device step for the fused kernel, a CPU one otherwise
                step = (torch.zeros((), dtype=torch.float32, device=p.device) if g["fused"]
                        else torch.tensor(0.0, dtype=_scalar_dtype()))
                st = self.state[p] = {"step": step,
                                      "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                      "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(st["exp_avg"])
            exp_avg_sqs.append(st["exp_avg_sq"])
            steps.append(st["step"])
        if not params:
            return
        beta1, beta2 = g["betas"]
        adam_update(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=None, capturable=False,
                    differentiable=False, fused=g["fused"], grad_scale=None, found_inf=None, has_complex=False,
                    decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=g["lr"],
                    weight_decay=g["weight_decay"], eps=g["eps"], maximize=False)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict[str, Any]:
        """torch's AdamW state_dict (waits for the hand-over)."""
        return self.torch_optimizer().state_dict()

    # -- resuming --------------------------------------------------------------------------------
    def _load(self, saved: dict[str, Any]) -> None:
        """Take a saved torch AdamW state_dict's state, cast as `Optimizer.load_state_dict` casts it."""
        groups = saved.get("param_groups")
        if not isinstance(groups, list) or len(groups) != 1 or not isinstance(saved.get("state"), dict):
            raise OptimizerStateError("the checkpoint's optimizer state is not a one-group AdamW state_dict")
        saved_group = groups[0]
        ids = list(saved_group.get("params", []))
        if len(ids) != len(self.params):
            raise OptimizerStateError(f"the checkpoint's optimizer holds {len(ids)} weights, the drafter trains "
                                      f"{len(self.params)}")
        if saved_group.get("amsgrad") or saved_group.get("maximize"):
            raise OptimizerStateError("the checkpoint's optimizer uses amsgrad or maximize: not the trainer's AdamW")
        fused = self.group["fused"]
        for pid, p in zip(ids, self.params):
            st = saved["state"].get(pid)
            if not st:
                continue
            for key in ("exp_avg", "exp_avg_sq"):
                if key not in st or tuple(st[key].shape) != tuple(p.shape):
                    raise OptimizerStateError(f"the checkpoint's optimizer state {pid}.{key} does not fit a weight "
                                              f"of shape {tuple(p.shape)}")
            self.state[p] = {
                "step": st["step"].to(dtype=torch.float32, device=p.device) if fused else st["step"],
                "exp_avg": st["exp_avg"].to(dtype=p.dtype, device=p.device),
                "exp_avg_sq": st["exp_avg_sq"].to(dtype=p.dtype, device=p.device),
            }


def trainer_adamw(params: Sequence[torch.nn.Parameter], t: TrainConfig, device: torch.device,
                  saved: dict[str, Any] | None = None, build_in_background: bool = True,
                  defer_build: bool = False) -> TrainerAdamW:
    """The trainer's AdamW from `train.*`: fused on CUDA (one launch for every weight: the foreach
    form cost ~35 ms a step at 1.8B parameters on the H200)."""
    return TrainerAdamW(params, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay,
                        fused=device.type == "cuda", saved=saved, device=device,
                        build_in_background=build_in_background, defer_build=defer_build)


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
