"""The trainer's AdamW (optim.build_adamw): a resumed run steps bitwise as the uninterrupted one,
the configured hyper-parameters win over the saved ones, and a state that does not fit is a clear
error when the trainer starts, not a crash at its first step."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from common.config import TrainConfig
from drafter_trainer.optim import OptimizerStateError, build_adamw, set_lr

LRS = [1e-2, 3e-3, 5e-3, 2e-3, 1e-3, 4e-3, 6e-3]
TRAIN = dataclasses.replace(TrainConfig(), betas=[0.9, 0.95], weight_decay=0.1)


def make_params(seed: int = 0, device: str = "cpu") -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*shape, generator=g).to(device)) for shape in ((7, 5), (5,), (3, 4, 2))]


def run(params: list[torch.nn.Parameter], steps: range, opt: torch.optim.AdamW) -> None:
    """The trainer's update: gradients in, the step's learning rate set, step, gradients dropped."""
    for i in steps:
        g = torch.Generator().manual_seed(100 + i)
        for j, p in enumerate(params):   # a weight without a gradient some steps: no update, state untouched
            p.grad = None if (i % 3 == 1 and j == 1) else torch.randn(p.shape, generator=g).to(p.device)
        set_lr(opt, LRS[i])
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: the fused AdamW kernel"))])
def test_a_resumed_optimizer_steps_bitwise_as_the_uninterrupted_one(device):
    reference = make_params(device=device)
    run(reference, range(7), build_adamw(reference, TRAIN, torch.device(device)))

    first = make_params(device=device)
    opt = build_adamw(first, TRAIN, torch.device(device))
    run(first, range(4), opt)
    saved = {k: v for k, v in opt.state_dict().items()}
    assert opt.param_groups[0]["fused"] == (device == "cuda")
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    run(resumed, range(4, 7), build_adamw(resumed, TRAIN, torch.device(device), saved))
    assert all(torch.equal(p, r) for p, r in zip(resumed, reference))


def test_the_configured_hyper_parameters_win_over_the_saved_ones():
    params = make_params()
    opt = build_adamw(params, TRAIN, torch.device("cpu"))
    run(params, range(2), opt)
    changed = dataclasses.replace(TRAIN, betas=[0.8, 0.99], weight_decay=0.0)
    resumed = build_adamw(params, changed, torch.device("cpu"), opt.state_dict())
    group = resumed.param_groups[0]
    assert group["betas"] == (0.8, 0.99) and group["weight_decay"] == 0.0
    assert int(resumed.state[params[0]]["step"]) == 2     # the moments and step counts are the saved ones
    assert torch.equal(resumed.state[params[0]]["exp_avg"], opt.state[params[0]]["exp_avg"])


@pytest.mark.parametrize("damage", ["fewer weights", "wrong shape", "two groups", "amsgrad"])
def test_a_saved_state_that_does_not_fit_is_a_clear_error(damage):
    params = make_params()
    opt = build_adamw(params, TRAIN, torch.device("cpu"))
    run(params, range(1), opt)
    saved = opt.state_dict()
    if damage == "fewer weights":
        saved["param_groups"][0]["params"] = saved["param_groups"][0]["params"][:2]
    elif damage == "wrong shape":
        saved["state"][0]["exp_avg"] = torch.zeros(2, 2)
    elif damage == "two groups":
        saved["param_groups"] = saved["param_groups"] * 2
    else:
        saved["param_groups"][0]["amsgrad"] = True
    with pytest.raises(OptimizerStateError):
        build_adamw(params, TRAIN, torch.device("cpu"), saved)
