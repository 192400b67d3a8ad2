"""One test per bug that shipped in public DFlash trainers and silently collapsed acceptance
(the semantics in docs/architecture.md, "The DFlash drafter").

Every perturbation test also perturbs something that *must* matter, so it cannot pass by the
model ignoring its input altogether.
"""
from __future__ import annotations

import pytest
import torch

from common.batch import PackedBatch
from common.config import DrafterConfig
from drafter_trainer.blocks import build_blocks
from drafter_trainer.export import export_drafter, load_drafter
from drafter_trainer.loss import dflash_loss
from drafter_trainer.model import ContextError, DFlashConfig
from test_drafter_model import MASK, drafter_terms, forward, make_batch, make_model, tiny_config
from tolerances import assert_close, differs

pytestmark = pytest.mark.numerics   # run again under ATEN_CPU_CAPABILITY=default (make test-numerics)

DOCS = [9, 14, 11]          # starts 0, 9, 23


IMPLS = ["split", "sdpa"]    # the two attention paths with a CPU backward (flex: see test_drafter_model)


def _changed(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Farther apart than two evaluations of the same drafter forward can round (tolerances.py)."""
    return differs(a, b, n=drafter_terms(tiny_config(), sum(DOCS)))


def test_block_position_k_learns_the_token_at_anchor_plus_k():
    """Labels shifted by one: the block starts with the anchor token and position k predicts t[a+k]."""
    batch = make_batch(DOCS)
    anchors = torch.tensor([2, 10, 24])
    blocks = build_blocks(batch, anchors, 4, MASK, 7.0)
    ids = batch.input_ids.long()
    assert blocks.block_input_ids[:, 0].tolist() == ids[anchors].tolist()
    assert (blocks.block_input_ids[:, 1:] == MASK).all()
    for n, a in enumerate(anchors.tolist()):
        assert blocks.labels[n, 1:].tolist() == ids[a + 1:a + 4].tolist()
        assert blocks.weights[n, 0] == 0 and (blocks.weights[n, 1:] > 0).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_context_at_and_after_the_anchor_is_invisible(impl):
    """kv <= anchor: the target state *at* the anchor already encodes t[a+1]; seeing it is cheating."""
    model = make_model(attn_impl=impl)
    batch = make_batch(DOCS)
    anchor = 15
    with torch.no_grad():
        base = forward(model, batch, [anchor])
        for perturbed, must_change in ((anchor, False), (anchor + 3, False), (anchor - 1, True), (9, True)):
            hidden = batch.hidden.clone()
            hidden[:, perturbed] += 5.0
            out = forward(model, PackedBatch(**{**batch.tensors(), "hidden": hidden}), [anchor])
            assert _changed(out, base) == must_change, perturbed


@pytest.mark.parametrize("impl", IMPLS)
def test_blocks_closer_than_the_block_size_never_see_each_other(impl):
    model = make_model(attn_impl=impl)
    batch = make_batch(DOCS)
    anchors = [11, 12, 14]                         # overlapping spans in one document
    blocks = build_blocks(batch, torch.tensor(anchors), 4, MASK, 7.0)
    with torch.no_grad():
        base = model(batch.hidden, blocks.block_input_ids, blocks)
        ids = blocks.block_input_ids.clone()
        ids[1] = (ids[1] + 1) % MASK                # every token of the middle block
        out = model(batch.hidden, ids, blocks)
    assert not _changed(out[0], base[0]) and not _changed(out[2], base[2])
    assert _changed(out[1], base[1])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layer_type, later_reaches_earlier", [("full_attention", True),
                                                              ("sliding_attention", False)])
def test_attention_inside_a_block_is_bidirectional_on_full_layers_and_causal_on_sliding(layer_type,
                                                                                      later_reaches_earlier, impl):
    cfg = tiny_config(layer_types=[layer_type] * 2, sliding_window=8)
    model = make_model(cfg, attn_impl=impl)
    batch = make_batch(DOCS)
    blocks = build_blocks(batch, torch.tensor([12]), 4, MASK, 7.0)
    with torch.no_grad():
        base = model(batch.hidden, blocks.block_input_ids, blocks)
        ids = blocks.block_input_ids.clone()
        ids[0, 3] = 5                                  # the last block position
        out = model(batch.hidden, ids, blocks)
    assert _changed(out[0, :3], base[0, :3]) == later_reaches_earlier
    assert _changed(out[0, 3], base[0, 3])


def test_captured_layer_ids_are_the_drafters_and_survive_export(tmp_path):
    """Layer-id off by one between capture and serving: ids travel with the weights, order is checked."""
    capture_ids = [1, 4, 6]
    target = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 8, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 97, "rms_norm_eps": 1e-6}
    cfg = DFlashConfig.from_target(target, DrafterConfig(num_layers=1, block_size=4), capture_ids, MASK)
    model = make_model(cfg)
    export_drafter(model, str(tmp_path / "export"))
    assert load_drafter(str(tmp_path / "export"), None).config.target_layer_ids == capture_ids

    batch = make_batch(DOCS)
    blocks = build_blocks(batch, torch.tensor([5, 12]), 4, MASK, 7.0)
    dflash_loss(model, batch, blocks, chunk=8, layer_ids=capture_ids)
    for wrong in ([i + 1 for i in capture_ids], [i - 1 for i in capture_ids], [4, 1, 6], [1, 4]):
        with pytest.raises(ContextError, match="target_layer_ids"):
            dflash_loss(model, batch, blocks, chunk=8, layer_ids=wrong)
    with pytest.raises(ContextError, match=r"expected \[3, T, 64\]"):
        dflash_loss(model, PackedBatch(**{**batch.tensors(), "hidden": batch.hidden[:2]}), blocks, chunk=8)


@pytest.mark.parametrize("damage", ["zero plane", "zero token row", "nan"])
def test_all_zero_or_non_finite_captured_states_are_rejected(damage):
    model = make_model()
    batch = make_batch(DOCS)
    hidden = batch.hidden.clone()
    if damage == "zero plane":
        hidden[2] = 0.0
    elif damage == "zero token row":
        hidden[1, 17] = 0.0
    else:
        hidden[0, 3, 5] = float("nan")
    blocks = build_blocks(batch, torch.tensor([5, 12]), 4, MASK, 7.0)
    with pytest.raises(ContextError, match="all-zero|non-finite"):
        dflash_loss(model, PackedBatch(**{**batch.tensors(), "hidden": hidden}), blocks, chunk=8)


def _slice_batch(batch: PackedBatch, start: int, length: int) -> PackedBatch:
    t = slice(start, start + length)
    return PackedBatch(hidden=batch.hidden[:, t], input_ids=batch.input_ids[t], loss_mask=batch.loss_mask[t],
                       position_ids=batch.position_ids[t], doc_lens=torch.tensor([length], dtype=torch.int32),
                       sample_ids=batch.sample_ids[:1], doc_ids=batch.doc_ids[:1])


@pytest.mark.parametrize("impl", IMPLS)
def test_two_packed_documents_train_exactly_like_two_batches_of_one(impl):
    """Wrong hidden states with batch size > 1: packing must not change any block or its loss."""
    model = make_model(std=0.05, attn_impl=impl)
    packed = make_batch([13, 17], loss_mask=(torch.arange(30) % 5 != 0).to(torch.uint8))
    anchors_a, anchors_b = [1, 2, 6, 11], [3, 4, 9, 15]          # doc B's local positions
    blocks = build_blocks(packed, torch.tensor(anchors_a + [13 + a for a in anchors_b]), 4, MASK, 7.0)
    both = dflash_loss(model, packed, blocks, chunk=5)
    with torch.no_grad():
        out_packed = model(packed.hidden, blocks.block_input_ids, blocks)
    alone_ce = 0.0
    for start, length, anchors, rows in ((0, 13, anchors_a, slice(0, 4)), (13, 17, anchors_b, slice(4, 8))):
        single = _slice_batch(packed, start, length)
        b = build_blocks(single, torch.tensor(anchors), 4, MASK, 7.0)
        with torch.no_grad():
            assert_close(model(single.hidden, b.block_input_ids, b), out_packed[rows],
                         n=drafter_terms(model.config, packed.hidden.shape[1]))
        alone_ce += dflash_loss(model, single, b, chunk=5).ce_sum.item()
    assert_close(torch.tensor(alone_ce), both.ce_sum.detach(),
                 n=drafter_terms(model.config, packed.hidden.shape[1], loss_rows=blocks.labels.numel()))
