"""Anchors, blocks, labels, weights and the attention rule, checked against the design's own words."""
from __future__ import annotations

import math

import pytest
import torch

from drafter_trainer.blocks import (IGNORE_INDEX, AttentionLayout, BlockError, anchor_seed, build_blocks,
                                    sample_anchors)
from test_drafter_model import MASK, make_batch
from tolerances import approx

pytestmark = pytest.mark.numerics   # run again under ATEN_CPU_CAPABILITY=default (make test-numerics)

DOCS = [9, 14, 11]          # starts 0, 9, 23


def _loss_mask(t: int, off: list[int]) -> torch.Tensor:
    mask = torch.ones(t, dtype=torch.uint8)
    mask[off] = 0
    return mask


def _doc_of(doc_lens: list[int]) -> list[int]:
    return [d for d, n in enumerate(doc_lens) for _ in range(n)]


def test_anchor_candidates_are_loss_tokens_followed_by_a_loss_token_of_the_same_document():
    mask = _loss_mask(34, [0, 4, 5, 17, 30])
    doc = _doc_of(DOCS)
    want = [p for p in range(33) if mask[p] and mask[p + 1] and doc[p] == doc[p + 1]]
    got = sample_anchors(mask, torch.tensor(DOCS), 1000, torch.Generator().manual_seed(0))
    assert got.tolist() == want
    assert 8 not in want and 22 not in want          # last token of a document: p+1 is another document


def test_anchors_are_capped_per_document_sorted_distinct_and_drawn_uniformly():
    # candidates: doc 0 -> 0..7 (8), doc 1 -> 9..21 (13), doc 2 -> 23..32 (10); the cap is per document
    mask = torch.ones(34, dtype=torch.uint8)
    doc = _doc_of(DOCS)
    by_doc = {0: list(range(0, 8)), 1: list(range(9, 22)), 2: list(range(23, 33))}
    counts = torch.zeros(34)
    for seed in range(400):
        got = sample_anchors(mask, torch.tensor(DOCS), 5, torch.Generator().manual_seed(seed))
        assert got.numel() == 15 and got.unique().numel() == 15 and torch.equal(got, got.sort().values)
        assert [sum(doc[p] == d for p in got.tolist()) for d in range(3)] == [5, 5, 5]
        counts[got] += 1
    assert counts[[8, 22, 33]].sum() == 0
    for candidates in by_doc.values():
        expected = 400 * 5 / len(candidates)          # 250, ~154 and 200 draws per candidate
        assert counts[candidates].min() > 0.75 * expected and counts[candidates].max() < 1.25 * expected


def test_each_document_gets_min_of_the_cap_and_its_candidates():
    # doc 0: 3 candidates (0, 1, 2; token 4 is off, so 3 is not one); doc 1: 13; doc 2: none (loss off)
    mask = torch.ones(34, dtype=torch.uint8)
    mask[4] = 0
    mask[4:9] = 0
    mask[23:] = 0
    doc = _doc_of(DOCS)
    for cap, want in ((1, [1, 1, 0]), (3, [3, 3, 0]), (4, [3, 4, 0]), (13, [3, 13, 0]), (100, [3, 13, 0])):
        got = sample_anchors(mask, torch.tensor(DOCS), cap, torch.Generator().manual_seed(cap)).tolist()
        assert [sum(doc[p] == d for p in got) for d in range(3)] == want, cap
        assert all(mask[p] and mask[p + 1] and doc[p] == doc[p + 1] for p in got)
    assert sample_anchors(mask, torch.tensor(DOCS), 0, torch.Generator()).numel() == 0


def test_anchor_seed_is_a_pure_function_of_seed_epoch_and_seq():
    # A re-delivered batch must get the same anchors in another process, on any rank.
    assert anchor_seed(0, 0, 0) == 3887372258184587331      # pinned: no salted hash()
    assert anchor_seed(3, 1, 7) == anchor_seed(3, 1, 7)
    assert len({anchor_seed(0, 0, 0), anchor_seed(1, 0, 0), anchor_seed(0, 1, 0), anchor_seed(0, 0, 1)}) == 4
    mask = torch.ones(34, dtype=torch.uint8)
    draws = [sample_anchors(mask, torch.tensor(DOCS), 6, torch.Generator().manual_seed(anchor_seed(5, 2, 11)))
             for _ in range(2)]
    assert torch.equal(*draws)


def test_block_weights_decay_and_stop_at_the_document_end_and_outside_the_loss_mask():
    batch = make_batch(DOCS, loss_mask=_loss_mask(34, [21]))
    gamma = 2.0
    blocks = build_blocks(batch, torch.tensor([19]), 4, MASK, gamma)   # doc 1 = tokens 9..22
    decay = [math.exp(-(k - 1) / gamma) for k in range(4)]
    # k=0 anchor: no loss; k=1 token 20; k=2 token 21 outside the loss mask; k=3 token 22 (last of doc 1)
    # one fp32 exp each against Python's float64 one
    assert blocks.weights[0].tolist() == approx([0.0, decay[1], 0.0, decay[3]], dtype=torch.float32)
    blocks = build_blocks(batch, torch.tensor([21]), 4, MASK, gamma)
    # k=1 token 22 is the last of doc 1; k=2, 3 would be tokens 23, 24 of doc 2
    assert blocks.weights[0].tolist() == approx([0.0, decay[1], 0.0, 0.0], dtype=torch.float32)
    assert blocks.labels[0].tolist() == [IGNORE_INDEX, int(batch.input_ids[22]), IGNORE_INDEX, IGNORE_INDEX]


def test_block_positions_continue_the_anchor_position_within_its_document():
    batch = make_batch(DOCS)
    blocks = build_blocks(batch, torch.tensor([2, 9, 30]), 4, MASK, 7.0)
    assert blocks.block_positions.tolist() == [[2, 3, 4, 5], [0, 1, 2, 3], [7, 8, 9, 10]]
    assert blocks.anchor_doc.tolist() == [0, 1, 2]


def test_a_batch_without_anchors_gets_one_weightless_padding_block():
    batch = make_batch(DOCS)
    blocks = build_blocks(batch, torch.zeros(0, dtype=torch.int64), 4, MASK, 7.0)
    assert blocks.num_blocks == 1 and not blocks.valid.any() and not blocks.weights.any()
    assert blocks.anchor_doc.tolist() == [-1] and (blocks.block_input_ids == MASK).all()
    padded = build_blocks(batch, torch.tensor([3, 12]), 4, MASK, 7.0, pad_to=5)
    assert padded.num_blocks == 5 and padded.valid.tolist() == [True, True, False, False, False]
    assert not padded.weights[2:].any()


@pytest.mark.parametrize("anchors, kwargs, match", [
    ([34], {}, "outside"),
    ([-1], {}, "outside"),
    ([3], {"mask_token_id": -1}, "mask_token_id"),
    ([3], {"gamma": 0.0}, "gamma"),
    ([3], {"block_size": 1}, "block_size"),
])
def test_build_blocks_rejects_impossible_blocks(anchors, kwargs, match):
    args = {"block_size": 4, "mask_token_id": MASK, "gamma": 7.0, **kwargs}
    with pytest.raises(BlockError, match=match):
        build_blocks(make_batch(DOCS), torch.tensor(anchors), **args)


def _design_rule(doc: list[int], anchors: list[int], b: int, window: int | None) -> torch.Tensor:
    """The mask rule of docs/architecture.md ("The DFlash drafter") in packed-index terms, one (query,
    key) pair at a time."""
    t, n = len(doc), len(anchors)
    mask = torch.zeros(n * b, t + n * b, dtype=torch.bool)
    for blk, a in enumerate(anchors):
        for i in range(b):
            for kv in range(t):
                ok = kv < a and doc[kv] == doc[a]
                if window is not None:
                    ok = ok and kv >= a + i - (window - 1)
                mask[blk * b + i, kv] = ok
            for j in range(b):
                mask[blk * b + i, t + blk * b + j] = window is None or (j <= i and i - j < window)
    return mask


@pytest.mark.parametrize("window", [None, 3, 6])
def test_attention_mask_is_the_design_rule(window):
    anchors = [0, 3, 5, 7, 9, 11, 12, 20, 23, 26, 31]
    batch = make_batch(DOCS)
    blocks = build_blocks(batch, torch.tensor(anchors), 4, MASK, 7.0)
    layout = AttentionLayout.from_blocks(blocks)
    assert torch.equal(layout.dense_mask(window), _design_rule(_doc_of(DOCS), anchors, 4, window))


@pytest.mark.parametrize("window", [None, 3, 6])
@pytest.mark.parametrize("segment_rows", [4, 12, 256])
def test_split_segments_hold_every_visible_key(segment_rows, window):
    anchors = [0, 3, 5, 7, 9, 11, 12, 20, 23, 26, 31]
    blocks = build_blocks(make_batch(DOCS), torch.tensor(anchors), 4, MASK, 7.0, pad_to=13)
    layout = AttentionLayout.from_blocks(blocks, segment_rows=segment_rows)
    dense = layout.dense_mask(window)
    t = layout.num_context
    covered = torch.zeros_like(dense)
    seen_rows = 0
    for (q0, q1, k0, k1), mask in zip(layout.window_segments(window), layout.split_masks(window)):
        assert q0 == seen_rows and (q1 - q0) <= max(4, segment_rows)
        seen_rows = q1
        covered[q0:q1, k0:k1] = mask[:, : k1 - k0]
        for r in range(q0, q1):
            own = t + (r // 4) * 4
            covered[r, own:own + 4] = mask[r - q0, k1 - k0:]
    assert seen_rows == layout.num_queries
    assert torch.equal(covered, dense)


def test_a_sliding_window_layer_scores_a_long_documents_context_only_within_reach():
    # one 600-token document, 40 anchors spread over it; segments of 4 blocks: a full-attention
    # layer's segment scores the document from its start, a sliding-window one only the window
    # before its first anchor and the run of its anchors
    window, b = 8, 4
    anchors = list(range(10, 590, 15))[:40]
    blocks = build_blocks(make_batch([600]), torch.tensor(anchors), b, MASK, 7.0)
    layout = AttentionLayout.from_blocks(blocks, segment_rows=4 * b)
    full = layout.window_segments(None)
    assert max(k1 - k0 for _, _, k0, k1 in full) > 500
    for (q0, q1, k0, k1), mask in zip(layout.window_segments(window), layout.split_masks(window)):
        run = anchors[q0 // b:q1 // b]
        assert k1 - k0 <= window - 1 + run[-1] - run[0]
        assert mask.shape == (q1 - q0, k1 - k0 + b)
