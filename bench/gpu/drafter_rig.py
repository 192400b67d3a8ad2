"""The drafter as the trainer runs it, without the feed: built for the benchmark's target shape,
stepped on synthetic or dataset batches. P5 (one GPU) and the rank-scaling run (torchrun, NCCL)
share it, so both time the trainer's own step, drafter_trainer.step.train_step: DFlash loss and
backward chunk by chunk, the flat gradient all-reduce, clip, finite check, AdamW. `compile_mode` is drafter.compile
(auto: compiled on CUDA, like the trainer); `model.compile_for` switches it between runs.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch

from bench.gpu import fixtures


class DrafterRig:
    def __init__(self, manifest: dict[str, Any], device: torch.device, layers: int, block: int, anchors: int,
                 loss_chunk: int, seed: int, attn: str = "auto", compile_mode: str = "auto",
                 blocks_per_chunk: int = 0, precision: str = "") -> None:
        """`precision`: drafter.precision ("": the trainer's default), resolved on `device`."""
        from common.config import DrafterConfig, TrainConfig, default_gamma
        from drafter_trainer.fp8 import resolve_precision
        from drafter_trainer.model import DFlashConfig, DFlashDraftModel
        from drafter_trainer.optim import build_adamw
        from drafter_trainer.step import Ranks, StepSettings

        self.manifest, self.device, self.block, self.anchors = manifest, device, block, anchors
        self.loss_chunk, self.seed = loss_chunk, seed
        self.cuda = device.type == "cuda"
        self.shape = fixtures.shape_of(manifest)
        with open(os.path.join(manifest["target_dir"], "config.json"), encoding="utf-8") as f:
            target_config = json.load(f)
        self.config = DFlashConfig.from_target(
            target_config, DrafterConfig(num_layers=layers, block_size=block, max_anchors=anchors,
                                         loss_chunk=loss_chunk),
            list(self.shape.capture_ids), self.shape.mask_token_id)
        torch.manual_seed(seed)
        with torch.device(device):  # initialised where it trains: a CPU init of ~2B parameters takes long
            self.model = DFlashDraftModel(self.config, attn_impl=attn,
                                          precision=resolve_precision(precision or DrafterConfig().precision, device))
        self.model.compile_for(device, compile_mode)      # as drafter_trainer.startup.build_drafter does
        self.hidden_dtype = torch.bfloat16 if self.cuda else torch.float32   # also the head's and the compute dtype
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.model.set_target_head(*(torch.randn(self.config.vocab_size, self.config.hidden_size, device=device,
                                                 dtype=self.hidden_dtype, generator=self.generator) * 0.02
                                     for _ in range(2)))
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        train_cfg = TrainConfig()
        self.lr = train_cfg.lr
        self.optimizer = build_adamw(self.params, train_cfg, device)   # the trainer's: torch's AdamW, fused on CUDA
        self.gamma = default_gamma(block)
        self.settings = StepSettings(loss_chunk=loss_chunk, blocks_per_chunk=blocks_per_chunk,
                                     grad_clip=train_cfg.grad_clip, compute_dtype=self.hidden_dtype)
        self.one_rank = Ranks(str(device))

    def blocks_for(self, batch: Any, seq: int) -> Any:
        from drafter_trainer.blocks import anchor_seed, build_blocks, sample_anchors

        gen = torch.Generator().manual_seed(anchor_seed(self.seed, batch.epoch, seq))
        anchors = sample_anchors(batch.loss_mask.cpu(), batch.doc_lens.cpu(), self.anchors, gen)
        return build_blocks(batch, anchors.to(self.device), self.block, self.config.mask_token_id, self.gamma)

    def dataset_work(self, seqs: list[int], lazy_hidden: bool = False) -> list[tuple[Any, Any]]:
        """(batch, blocks) of the prepared dataset's packed batches `seqs`, random captured planes.

        lazy_hidden: the planes are drawn on the device when the batch is stepped (`step`), so the
        work list holds none of them: like the trainer, which holds a batch or two (its credit),
        not every batch a benchmark cycles through (0.84 GB each at the 27B shape)."""
        from target_server.data import PreparedDataset
        from target_server.packer import Packer, build_packed

        dataset = PreparedDataset.open(self.manifest["data_dir"])
        packer = Packer(dataset.lengths, self.manifest["token_budget"], self.seed)
        work = []
        for seq in seqs:
            arrays = build_packed(dataset, packer.batch(seq))
            t = 0 if lazy_hidden else len(arrays["input_ids"])
            hidden = torch.randn(len(self.shape.capture_ids), t, self.shape.hidden, generator=self.generator,
                                 device=self.device, dtype=self.hidden_dtype)
            batch = fixtures.packed_batch(arrays, hidden, seq, self.device)
            work.append((batch, self.blocks_for(batch, seq)))
        return work

    def with_planes(self, batch: Any) -> Any:
        """The batch itself, or (lazy_hidden) a copy with its random planes drawn now."""
        if batch.hidden.shape[1] == batch.num_tokens:
            return batch
        hidden = torch.randn(batch.hidden.shape[0], batch.num_tokens, batch.hidden.shape[2], generator=self.generator,
                             device=self.device, dtype=self.hidden_dtype)
        return dataclasses.replace(batch, hidden=hidden)

    def step(self, batch: Any, blocks: Any, ranks: Any = None) -> None:
        """The trainer's step (drafter_trainer.step.train_step) for one rank."""
        from drafter_trainer.step import train_step

        train_step(self.model, self.optimizer, self.with_planes(batch), blocks, self.lr, self.settings,
                   ranks or self.one_rank)

    def gradients(self, batch: Any, blocks: Any) -> dict[str, torch.Tensor]:
        """Every trainable weight's gradient of one batch's loss (the step's forward and backward,
        no optimizer update), in fp32, by name. `batch` with its planes (`with_planes`), so that
        two calls see the same ones."""
        from drafter_trainer.loss import dflash_loss

        self.optimizer.zero_grad(set_to_none=True)
        weight = blocks.weights.sum().detach().float()
        with self.settings.autocast(self.device):
            dflash_loss(self.model, batch, blocks, self.settings.loss_chunk, weight_norm=weight,
                        blocks_per_chunk=self.settings.blocks_per_chunk, backward=True)
        grads = {n: p.grad.detach().float().clone() for n, p in self.model.named_parameters() if p.grad is not None}
        self.optimizer.zero_grad(set_to_none=True)
        return grads

    def timed(self, work: list[tuple[Any, Any]], warmup: int, steps: int, ranks: Any = None) -> list[float]:
        """Seconds of each of `steps` steps after `warmup` untimed ones (peak memory reset between)."""
        for i in range(warmup):
            self.step(*work[i % len(work)], ranks=ranks)
        fixtures.synchronize(self.device)
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        times = []
        for i in range(steps):
            timer = fixtures.RegionTimer(self.device).start()
            self.step(*work[i % len(work)], ranks=ranks)
            times.append(timer.stop().seconds())
        return times
