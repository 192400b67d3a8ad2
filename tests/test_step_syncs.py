"""Host syncs of the training step on CUDA (torch.cuda.set_sync_debug_mode): a fixed few per step
(the weight sum all ranks share, the input checks, the loss rows and chunk bounds read once per
batch, the finite check), none per chunk of blocks. A sync per chunk would stall the device while
the host prepares every next chunk, and at the published density a batch has dozens of chunks."""
from __future__ import annotations

import os
import warnings

import pytest
import torch

from drafter_trainer.blocks import build_blocks, sample_anchors
from drafter_trainer.optim import build_adamw
from drafter_trainer.step import Ranks, StepSettings, train_step
from common.config import TrainConfig
from test_drafter_model import MASK, make_batch, make_model, tiny_config

# weight sum (.cpu), check_context (any), check_token_ids (aminmax), loss rows (nonzero, then
# their chunk bounds), the chunks' anchors (BlockBatch.chunks), anchor count, finite check
# (grad norm and loss together)
SYNCS_PER_STEP = 8


def count_syncs(per_chunk: int) -> tuple[list[str], int]:
    """Where one step syncs (file:line per sync, after a step that compiled), and its chunk count."""
    torch.manual_seed(0)
    model = make_model(tiny_config(block_size=16), attn_impl="auto").cuda()
    batch = make_batch([120, 200, 90, 250], seed=1).to("cuda")
    anchors = sample_anchors(batch.loss_mask.cpu(), batch.doc_lens.cpu(), 512, torch.Generator().manual_seed(0))
    blocks = build_blocks(batch, anchors.cuda(), model.config.block_size, MASK, 7.0)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = build_adamw(params, TrainConfig(), torch.device("cuda"))
    settings = StepSettings(loss_chunk=64, blocks_per_chunk=per_chunk, compute_dtype=torch.bfloat16)
    ranks = Ranks("cuda")
    train_step(model, opt, batch, blocks, 1e-4, settings, ranks)     # compiles flex: not counted
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = train_step(model, opt, batch, blocks, 1e-4, settings, ranks)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert result.applied
    # On the H200 (torch 2.11) the first counted step of a process also reported one sync from
    # torch/cuda/__init__.py, before the step's first line and never again in that process: torch's
    # own, once, not the step's.
    syncs = [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)
             and not w.filename.replace(os.sep, "/").endswith("torch/cuda/__init__.py")]
    chunks = -(-blocks.num_blocks // per_chunk)
    return syncs, chunks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: host syncs are a device matter")
def test_cuda_step_syncs_a_fixed_few_times_none_per_chunk():
    few, few_chunks = count_syncs(per_chunk=32)
    many, many_chunks = count_syncs(per_chunk=8)
    assert many_chunks >= 3 * few_chunks > 4
    assert len(many) <= len(few), f"syncs grow with the chunks: {few_chunks} chunks {few}, {many_chunks} chunks {many}"
    assert len(few) <= SYNCS_PER_STEP, few
