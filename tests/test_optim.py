"""TrainerAdamW: steps before the hand-over to torch's AdamW give bitwise the weights torch's AdamW
alone gives; a resumed state steps as torch's load_state_dict would; the early steps import no
torch._dynamo; a state that does not fit is a clear error."""
from __future__ import annotations

import copy
import os
import subprocess
import sys
import threading

import pytest
import torch

from drafter_trainer.optim import OptimizerStateError, TrainerAdamW

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LRS = [1e-2, 3e-3, 5e-3, 2e-3, 1e-3, 4e-3, 6e-3]
HYPER = dict(betas=(0.9, 0.95), weight_decay=0.1)


class GatedAdamW(TrainerAdamW):
    """Its torch AdamW is built only once `gate` is set: the early steps last as long as a test wants."""

    def __init__(self, *args, gate: threading.Event, **kwargs) -> None:
        self.gate = gate
        super().__init__(*args, **kwargs)

    def _build(self) -> torch.optim.AdamW:
        self.gate.wait()
        return super()._build()


def make_params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*shape, generator=g)) for shape in ((7, 5), (5,), (3, 4, 2))]


def grads_for(step: int, params: list[torch.nn.Parameter]) -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(100 + step)
    out: list[torch.Tensor | None] = [torch.randn(p.shape, generator=g).to(p.device) for p in params]
    if step % 3 == 1:
        out[1] = None     # a weight without a gradient this step: no update, its state untouched
    return out


def run_torch(params: list[torch.nn.Parameter], steps: range, opt: torch.optim.AdamW) -> None:
    for i in steps:
        for p, grad in zip(params, grads_for(i, params)):
            p.grad = grad
        for g in opt.param_groups:
            g["lr"] = LRS[i]
        opt.step()
        opt.zero_grad(set_to_none=True)


def run_trainer(params: list[torch.nn.Parameter], steps: range, opt: TrainerAdamW,
                gate: threading.Event | None = None, open_after: int | None = None) -> None:
    for n, i in enumerate(steps):
        if gate is not None and n == open_after:
            gate.set()
            opt._future.result()     # built: the next step hands over
        for p, grad in zip(params, grads_for(i, params)):
            p.grad = grad
        opt.step(LRS[i])
        opt.zero_grad()


def assert_same_state(ours: dict, theirs: dict) -> None:
    assert ours["state"].keys() == theirs["state"].keys()
    for k, st in theirs["state"].items():
        for name, t in st.items():
            assert torch.equal(ours["state"][k][name], t), (k, name)
            assert ours["state"][k][name].dtype == t.dtype and ours["state"][k][name].device == t.device
    for key in ("lr", "betas", "eps", "weight_decay", "fused", "foreach", "amsgrad", "maximize"):
        assert ours["param_groups"][0][key] == theirs["param_groups"][0][key], key


@pytest.mark.parametrize("early", [0, 1, 4, 6])
def test_steps_before_and_after_the_hand_over_equal_torch_adamw_bit_for_bit(early):
    reference = make_params()
    run_torch(reference, range(6), torch.optim.AdamW(reference, lr=1.0, fused=False, **HYPER))

    params = make_params()
    gate = threading.Event()
    opt = GatedAdamW(params, lr=1.0, fused=False, gate=gate, **HYPER)
    run_trainer(params, range(6), opt, gate, open_after=early)
    assert opt.early_steps == early
    for p, r in zip(params, reference):
        assert torch.equal(p, r)
    gate.set()
    ref_opt = torch.optim.AdamW(make_params(), lr=1.0, fused=False, **HYPER)   # the same run's state, rebuilt
    run_torch(ref_opt.param_groups[0]["params"], range(6), ref_opt)
    assert_same_state(opt.state_dict(), ref_opt.state_dict())
    assert opt.handed_over


def test_a_resumed_state_steps_as_torch_load_state_dict_and_the_checkpoint_round_trips():
    first = make_params()
    opt0 = torch.optim.AdamW(first, lr=1.0, fused=False, **HYPER)
    run_torch(first, range(3), opt0)
    saved = copy.deepcopy(opt0.state_dict())

    reference = [torch.nn.Parameter(p.detach().clone()) for p in first]
    ref_opt = torch.optim.AdamW(reference, lr=1.0, fused=False, **HYPER)
    ref_opt.load_state_dict(copy.deepcopy(saved))
    run_torch(reference, range(3, 7), ref_opt)

    params = [torch.nn.Parameter(p.detach().clone()) for p in first]
    gate = threading.Event()
    opt = GatedAdamW(params, lr=1.0, fused=False, saved=copy.deepcopy(saved), gate=gate, **HYPER)
    run_trainer(params, range(3, 7), opt, gate, open_after=2)
    assert opt.early_steps == 2
    for p, r in zip(params, reference):
        assert torch.equal(p, r)
    assert_same_state(opt.state_dict(), ref_opt.state_dict())


def test_a_restart_with_new_hyper_parameters_trains_with_them():
    params = make_params()
    opt0 = torch.optim.AdamW(params, lr=1.0, fused=False, **HYPER)
    run_torch(params, range(2), opt0)
    opt = TrainerAdamW(params, lr=1.0, betas=(0.8, 0.99), weight_decay=0.0, fused=False,
                       saved=opt0.state_dict(), build_in_background=False)
    run_trainer(params, range(2, 3), opt)
    group = opt.state_dict()["param_groups"][0]
    assert (group["betas"], group["weight_decay"]) == ((0.8, 0.99), 0.0)
    assert opt.state_dict()["state"][0]["step"].item() == 3.0     # the moments and counts were resumed


def test_a_deferred_build_waits_for_its_start_and_no_step_waits_for_it():
    reference = make_params()
    run_torch(reference, range(5), torch.optim.AdamW(reference, lr=1.0, fused=False, **HYPER))
    params = make_params()
    opt = TrainerAdamW(params, lr=1.0, fused=False, defer_build=True, **HYPER)
    run_trainer(params, range(3), opt)
    assert opt.early_steps == 3 and not opt._future.done()    # nothing built, nothing imported for it
    opt.start_building()
    opt._future.result(timeout=120)
    run_trainer(params, range(3, 5), opt)
    assert opt.handed_over and opt.early_steps == 3
    assert all(torch.equal(p, r) for p, r in zip(params, reference))
    # a checkpoint of a trainer that never started the build starts it itself (it would hang otherwise)
    assert TrainerAdamW(make_params(), lr=1.0, fused=False, defer_build=True, **HYPER).state_dict()["state"] == {}


@pytest.mark.parametrize("damage", ["fewer weights", "wrong shape", "two groups", "amsgrad"])
def test_a_saved_state_that_does_not_fit_is_a_clear_error_at_the_first_step(damage):
    params = make_params()
    opt0 = torch.optim.AdamW(params, lr=1.0, fused=False, **HYPER)
    run_torch(params, range(1), opt0)
    saved = opt0.state_dict()
    if damage == "fewer weights":
        saved["param_groups"][0]["params"] = saved["param_groups"][0]["params"][:2]
    elif damage == "wrong shape":
        saved["state"][0]["exp_avg"] = torch.zeros(2, 2)
    elif damage == "two groups":
        saved["param_groups"] = saved["param_groups"] * 2
    else:
        saved["param_groups"][0]["amsgrad"] = True
    opt = TrainerAdamW(params, lr=1.0, fused=False, saved=saved, **HYPER)
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.raises(OptimizerStateError):
        opt.step(1e-3)
    with pytest.raises(OptimizerStateError):
        opt.state_dict()


EARLY_STEPS_SCRIPT = r"""
import sys, threading
sys.modules["fla"] = None
sys.modules["causal_conv1d"] = None
sys.path.insert(0, sys.argv[1])
import torch
from test_optim import GatedAdamW
from test_drafter_model import make_batch, make_model
from drafter_trainer.blocks import build_blocks
from drafter_trainer.loss import dflash_loss

model = make_model()
params = [p for p in model.parameters() if p.requires_grad]
gate = threading.Event()
opt = GatedAdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, fused=False, gate=gate)
batch = make_batch([9, 14], seed=3)
for step in range(2):   # the trainer's step: loss, backward, clip, update
    blocks = build_blocks(batch, torch.tensor([1, 10, 15]), model.config.block_size, 96, 7.0)
    dflash_loss(model, batch, blocks, 8).loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step(1e-3)
    opt.zero_grad()
assert opt.early_steps == 2, opt.early_steps
print("dynamo imported:", "torch._dynamo" in sys.modules)
"""


def test_the_first_training_steps_import_no_dynamo():
    """What makes the hand-over worth having: with torch's AdamW not yet built, a whole training
    step (the drafter's loss, backward, clipping, the update) runs without torch._dynamo."""
    out = subprocess.run([sys.executable, "-c", EARLY_STEPS_SCRIPT, os.path.join(REPO, "tests")], cwd=REPO,
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "dynamo imported: False" in out.stdout, out.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the fused AdamW kernel")
@pytest.mark.parametrize("early", [0, 3])
def test_cuda_fused_steps_before_and_after_the_hand_over_equal_torch_adamw(early):
    """The trainer's CUDA optimizer: fused, its step counts on the device."""
    reference = [torch.nn.Parameter(p.detach().cuda()) for p in make_params()]
    opt_ref = torch.optim.AdamW(reference, lr=1.0, fused=True, **HYPER)
    run_torch(reference, range(6), opt_ref)

    params = [torch.nn.Parameter(p.detach().cuda()) for p in make_params()]
    gate = threading.Event()
    opt = GatedAdamW(params, lr=1.0, fused=True, gate=gate, device=torch.device("cuda"), **HYPER)
    run_trainer(params, range(6), opt, gate, open_after=early)
    assert opt.early_steps == early
    for p, r in zip(params, reference):
        assert torch.equal(p, r)
    assert_same_state(opt.state_dict(), opt_ref.state_dict())
