"""One training step of the drafter, on every rank together: the only place that runs its
backward pass and optimizer update.

    blocks -> DFlash loss, forward + backward chunk by chunk (loss.dflash_loss) -> gradients summed
    over the ranks -> clip -> finite on every rank? -> AdamW at the step's learning rate

The trainer's loop and the benchmarks (bench/gpu/drafter_rig.py, bench/trainer_bench.py) call
`train_step`: what is measured and tested is the step users run (toy-target drafters too are
trained by the trainer itself). A rank without a batch this step passes `blocks=None` and
contributes zero loss and gradient to the collectives, so uneven epochs never deadlock; the loss
is normalised by the weight sum over all ranks, so gradients are summed, not averaged: every
rank's tokens weigh as in one big batch.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from common.batch import PackedBatch
from common.config import Config
from common.faults import fault_hit

from .blocks import BlockBatch
from .loss import LossOutput, dflash_loss
from .model import DFlashDraftModel
from .optim import set_lr


def rank_device(device_pref: str = "auto", devices: list[str] | None = None, local_rank: int = 0) -> torch.device:
    """The device of local rank `local_rank`: devices[local_rank] (train.devices, the placement), else
    train.device, where auto (and plain cuda) is cuda:<local rank> when CUDA is there, else the CPU."""
    if devices:   # placement from config (train.devices): this node's ranks, one device each
        if local_rank >= len(devices):
            raise ValueError(f"local rank {local_rank} has no device: train.devices lists {len(devices)} "
                             f"({devices}); start as many ranks per node as it lists")
        device_pref = devices[local_rank]
    if device_pref not in ("auto", "cpu", "cuda"):
        return torch.device(device_pref)
    use_cuda = torch.cuda.is_available() and device_pref != "cpu"
    return torch.device(f"cuda:{local_rank}") if use_cuda else torch.device("cpu")


class Ranks:
    """torch.distributed when launched by torchrun with WORLD_SIZE > 1; no-ops otherwise."""

    def __init__(self, device_pref: str = "auto", devices: list[str] | None = None) -> None:
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = rank_device(device_pref, devices, self.local_rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if self.world > 1 and not dist.is_initialized():
            # The lockstep flags and weight sums are small CPU tensors: gloo carries those, NCCL the
            # gradients (NCCL alone has no CPU backend: "No backend type associated with device type cpu").
            dist.init_process_group("cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo")

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def broadcast_str(self, value: str) -> str:
        if self.world == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather_objects(self, obj: Any) -> list[Any]:
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def close(self) -> None:
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def allreduce_grads(ranks: Ranks, params: list[torch.nn.Parameter]) -> None:
    """Sum every gradient over the ranks in one flat collective; a rank without a batch this step
    contributes zeros (the DDP wrapper assumes every rank ran the same forward)."""
    if ranks.world == 1:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    ranks.sum_(flat)
    for p, g in zip(params, flat.split([p.numel() for p in params])):   # views of the one summed buffer
        p.grad = g.view_as(p)


@dataclass(frozen=True)
class StepSettings:
    """The step's knobs (drafter.loss_chunk, drafter.blocks_per_chunk, train.grad_clip) and its
    autocast dtype (bf16 on CUDA unless train.compute_dtype says fp32; elsewhere fp32 unless it
    says bf16, to run the GPU's dtypes on a CPU)."""

    loss_chunk: int = 1024
    blocks_per_chunk: int = 0
    grad_clip: float = 1.0
    compute_dtype: torch.dtype = torch.float32

    @classmethod
    def from_config(cls, cfg: Config, device: torch.device) -> "StepSettings":
        wanted = cfg.train.compute_dtype
        bf16 = wanted == "bf16" or (device.type == "cuda" and wanted != "fp32")
        return cls(loss_chunk=cfg.drafter.loss_chunk, blocks_per_chunk=cfg.drafter.blocks_per_chunk,
                   grad_clip=cfg.train.grad_clip, compute_dtype=torch.bfloat16 if bf16 else torch.float32)

    def autocast(self, device: torch.device) -> torch.autocast:
        return torch.autocast(device.type, dtype=self.compute_dtype, enabled=self.compute_dtype != torch.float32)


@dataclass
class StepResult:
    out: LossOutput | None   # this rank's loss and accuracy; None when it had no batch (or no rank had weight)
    applied: bool            # every rank's loss and gradient were finite: the optimizer stepped


def train_step(model: DFlashDraftModel, optimizer: Any, batch: PackedBatch | None, blocks: BlockBatch | None,
               lr: float, settings: StepSettings, ranks: Ranks) -> StepResult:
    """One optimizer step of `optimizer` (torch's AdamW over the trainable weights, optim.build_adamw).
    A non-finite loss or gradient on any rank skips the update on every rank (applied=False), the
    weights left as they were; the caller counts it."""
    device = next(model.parameters()).device
    local_w = blocks.weights.sum().detach().double().reshape(1).cpu() if blocks is not None \
        else torch.zeros(1, dtype=torch.float64)
    global_w = ranks.sum_(local_w)
    out = None
    if blocks is not None and float(global_w) > 0:
        with settings.autocast(device):
            # filled on the device from the host value: a copy of the CPU tensor would be a sync
            out = dflash_loss(model, batch, blocks, settings.loss_chunk,
                              weight_norm=torch.full((), float(global_w), device=device, dtype=torch.float32),
                              blocks_per_chunk=settings.blocks_per_chunk, backward=True)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    allreduce_grads(ranks, params)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, settings.grad_clip) if params else torch.zeros((), device=device)
    if fault_hit("step.nonfinite"):         # the restart tests' stand-in for a gradient that overflowed
        grad_norm = grad_norm * float("nan")
    checked = grad_norm.detach().float().reshape(1) if out is None else \
        torch.stack([grad_norm.detach().float(), out.loss.detach().float()])
    ok = bool(torch.isfinite(checked).all())    # one device read for both
    applied = float(ranks.sum_(torch.tensor([float(ok)]))) == ranks.world
    if applied:
        set_lr(optimizer, lr)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(out=out, applied=applied)
