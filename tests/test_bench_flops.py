"""The benchmarks' FLOP count (bench/trainer_bench.step_flops): the visible keys it counts without a
mask are the keys the one mask rule (AttentionLayout.visible) lets the queries see."""
from __future__ import annotations

import pytest
import torch

from bench.trainer_bench import step_flops, visible_keys
from drafter_trainer.blocks import AttentionLayout, build_blocks, sample_anchors
from test_drafter_model import MASK, make_batch, tiny_config


@pytest.mark.parametrize("window", [None, 1, 3, 5, 50])
def test_visible_keys_counted_without_a_mask_equal_the_mask_rules(window):
    # a long document among short ones, a one-token one, padding blocks; block size 4
    batch = make_batch([9, 30, 1, 17, 23, 200])
    anchors = sample_anchors(batch.loss_mask, batch.doc_lens, 12, torch.Generator().manual_seed(3))
    blocks = build_blocks(batch, anchors, 4, MASK, 3.0, pad_to=len(anchors) + 3)
    whole = int(AttentionLayout.from_blocks(blocks).dense_mask(window).sum())
    by_chunk = sum(int(AttentionLayout.from_blocks(part).dense_mask(window).sum()) for part, _, _ in blocks.chunks(5))
    assert visible_keys(blocks, window) == whole == by_chunk


def test_flash_computes_exactly_the_visible_keys_and_split_more():
    cfg = tiny_config(num_hidden_layers=2)
    batch = make_batch([300, 40])
    anchors = sample_anchors(batch.loss_mask, batch.doc_lens, 24, torch.Generator().manual_seed(1))
    blocks = build_blocks(batch, anchors, 4, MASK, 3.0)
    flash = step_flops(cfg, batch, blocks, "flash", blocks_per_chunk=8)
    split = step_flops(cfg, batch, blocks, "split", blocks_per_chunk=8)
    assert flash["attn_computed"] == flash["attn_visible"] == split["attn_visible"]
    assert split["attn_computed"] > split["attn_visible"]      # split scores its segment's whole context range
    q_dim = cfg.num_attention_heads * cfg.head_dim
    assert flash["attn_visible"] == 3 * 4.0 * q_dim * 2 * visible_keys(blocks, None)


def test_the_masked_call_computes_its_listed_tiles_at_least_the_visible_keys():
    cfg = tiny_config(num_hidden_layers=2)
    batch = make_batch([300, 40])
    anchors = sample_anchors(batch.loss_mask, batch.doc_lens, 24, torch.Generator().manual_seed(1))
    blocks = build_blocks(batch, anchors, 4, MASK, 3.0)
    flex, fa4 = (step_flops(cfg, batch, blocks, impl, blocks_per_chunk=8) for impl in ("flex", "fa4"))
    assert flex == fa4 and fa4["attn_visible"] < fa4["attn_computed"]
    # whole 128-row, 64-key tiles of folded rows: a multiple of that, per layer and query token
    groups = cfg.num_attention_heads // cfg.num_key_value_heads
    per_pair = 3 * 4.0 * cfg.num_attention_heads * cfg.head_dim
    assert (fa4["attn_computed"] / per_pair * groups) % (128 * 64) == 0
