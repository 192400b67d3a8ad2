"""The one masked call (drafter_trainer/block_mask.py, the flex and fa4 paths): its two key ranges
per folded query row are AttentionLayout's rule, its block mask lists exactly the tiles that rule
touches, and on CUDA the FA4 call agrees with FlashAttention 2 and an fp32 reference."""
from __future__ import annotations

import pytest
import torch

from drafter_trainer.block_mask import (KV_TILE, MIN_STATIC_ROWS, Q_TILE, block_mask_of, block_mask_of_blocks, fa4_problem,
                                        masked_attention, row_ranges)
from drafter_trainer.blocks import AttentionLayout, build_blocks
from test_drafter_model import MASK, make_batch

pytestmark = pytest.mark.numerics   # run again under ATEN_CPU_CAPABILITY=default (make test-numerics)

# documents of 30, 9, 70 and 1 tokens; anchors close together (blocks overlap), at a document's
# start and end, and in the one-token document's neighbour; 3 padding blocks after them
DOCS = [30, 9, 70, 1]
ANCHORS = [0, 1, 2, 7, 28, 30, 37, 39, 40, 41, 42, 60, 100, 107]


def blocks_of(block_size: int = 4, pad_to: int = 17):
    return build_blocks(make_batch(DOCS), torch.tensor(ANCHORS), block_size, MASK, 7.0, pad_to=pad_to)


def dense_from_ranges(ranges: torch.Tensor, keys: int) -> torch.Tensor:
    kv = torch.arange(keys)[None, :]
    lo_ctx, hi_ctx, lo_own, hi_own = (x[:, None].long() for x in ranges)
    return ((kv >= lo_ctx) & (kv < hi_ctx)) | ((kv >= lo_own) & (kv < hi_own))


def dense_rule(blocks, groups: int, window: int | None) -> torch.Tensor:
    """AttentionLayout.visible over every key, each query row repeated for its g folded heads."""
    layout = AttentionLayout.from_blocks(blocks)
    return layout.dense_mask(window).repeat_interleave(groups, dim=0)


@pytest.mark.parametrize("window", [None, 3, 6, 40])
@pytest.mark.parametrize("groups", [1, 3])
def test_each_folded_rows_two_key_ranges_are_the_layouts_rule(window, groups):
    blocks = blocks_of()
    ranges = row_ranges(blocks, groups, window)
    keys = blocks.num_context + blocks.num_blocks * blocks.block_size
    assert ranges.shape == (4, blocks.num_blocks * blocks.block_size * groups) and ranges.dtype == torch.int32
    assert torch.equal(dense_from_ranges(ranges, keys), dense_rule(blocks, groups, window))


def test_the_ranges_of_each_chunk_are_the_rule_on_its_slice_of_the_context():
    blocks = blocks_of(pad_to=0)
    for chunk, _first, _end in blocks.chunks(4):
        keys = chunk.num_context + chunk.num_blocks * chunk.block_size
        assert torch.equal(dense_from_ranges(row_ranges(chunk, 2, None), keys), dense_rule(chunk, 2, None))


def tile_truth(visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per (query tile, key tile): any visible, all visible, and whether the tile lies inside the keys."""
    rows, keys = visible.shape
    qt, kt = -(-rows // Q_TILE), -(-keys // KV_TILE)
    padded = torch.zeros(qt * Q_TILE, kt * KV_TILE, dtype=torch.bool)
    padded[:rows, :keys] = visible
    real = torch.zeros_like(padded)
    real[:rows, :keys] = True
    tiles = padded.view(qt, Q_TILE, kt, KV_TILE)
    any_seen = tiles.any(3).any(1)
    all_seen = (tiles | ~real.view(qt, Q_TILE, kt, KV_TILE)).all(3).all(1)
    inside = (torch.arange(kt) + 1) * KV_TILE <= keys
    return any_seen, all_seen, inside[None, :].expand(qt, kt)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("static", [False, True])
def test_the_block_mask_lists_the_tiles_the_rule_touches_and_the_full_ones_as_full(window, static):
    # many rows and keys: several 128-row and 64-key tiles, partial and full ones
    batch = make_batch([300, 47, 410])
    anchors = torch.tensor([3, 40, 41, 150, 298, 301, 320, 348, 360, 500, 700, 755])
    blocks = build_blocks(batch, anchors, 16, MASK, 7.0, pad_to=14)
    groups = 3
    mask = block_mask_of_blocks(blocks, groups, window, static=static)
    visible = dense_rule(blocks, groups, window)
    any_seen, all_seen, inside = tile_truth(visible)
    kv_num, kv_idx, full_num, full_idx = (x[0, 0] for x in (mask.kv_num_blocks, mask.kv_indices,
                                                           mask.full_kv_num_blocks, mask.full_kv_indices))
    qt, kt = any_seen.shape
    partial = torch.zeros(qt, kt, dtype=torch.bool)
    full = torch.zeros(qt, kt, dtype=torch.bool)
    for i in range(qt):
        partial[i, kv_idx[i, :kv_num[i]].long()] = True
        full[i, full_idx[i, :full_num[i]].long()] = True
        assert kv_idx[i, :kv_num[i]].tolist() == sorted(kv_idx[i, :kv_num[i]].tolist())
    assert not (partial & full).any()
    assert torch.equal(partial | full, any_seen)            # every touched tile listed, no other
    assert not (full & ~all_seen).any()                      # a full tile is seen whole
    assert torch.equal(full, all_seen & inside & any_seen)   # and every tile seen whole inside the keys is full
    assert mask.seq_lengths == visible.shape
    # the mask_mod: the rule on every real row and key; nothing on padded rows
    rows, keys = visible.shape
    q, kv = torch.arange(rows)[:, None], torch.arange(keys)[None, :]
    assert torch.equal(mask.mask_mod(0, 0, q, kv), visible)
    captured = [cell.cell_contents for cell in mask.mask_mod.__closure__]
    assert len(captured) == 4 and all(x.storage_offset() == 0 for x in captured)
    if static:   # padded to a power of two of rows, empty ranges past the real ones
        assert {x.numel() for x in captured} == {max(MIN_STATIC_ROWS, 1 << (rows - 1).bit_length())}
        far = torch.arange(rows, captured[0].numel())[:, None]
        assert not mask.mask_mod(0, 0, far, kv).any()


def test_a_chunk_of_padding_blocks_alone_sees_only_its_own_blocks():
    blocks = build_blocks(make_batch([5]), torch.tensor([], dtype=torch.int64), 4, MASK, 7.0, pad_to=3)
    ranges = row_ranges(blocks, 1, None)
    assert torch.equal(dense_from_ranges(ranges, blocks.num_context + 12), dense_rule(blocks, 1, None))
    mask = block_mask_of(ranges, blocks.num_context + 12)
    assert mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum() == 1


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_the_masked_call_equals_the_dense_softmax_over_the_rule():
    g = torch.Generator().manual_seed(0)
    blocks = blocks_of()
    groups, h_kv, d = 2, 2, 16
    rows, keys = blocks.num_blocks * blocks.block_size * groups, blocks.num_context + blocks.num_blocks * blocks.block_size
    q, k, v = (torch.randn(n, h_kv, d, generator=g) for n in (rows, keys, keys))
    out = masked_attention(q, k, v, block_mask_of_blocks(blocks, groups, None), fa4=False)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * d ** -0.5
    scores = scores.masked_fill(~dense_rule(blocks, groups, None), float("-inf"))
    reference = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v.double())
    assert out.shape == (rows, h_kv, d) and out.is_contiguous()
    # fp32 softmax over <= 110 keys: a few ulps of the largest value
    torch.testing.assert_close(out.double(), reference, rtol=0, atol=64 * torch.finfo(torch.float32).eps)


def test_fa4_is_refused_with_a_reason_where_no_device_runs_it():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the reason would be another")
    assert "CUDA" in fa4_problem(256)


# -- CUDA -----------------------------------------------------------------------------------------
def _fa4_or_skip() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    problem = fa4_problem(256)
    if problem and ("SM90" in problem or "missing" in problem):
        pytest.skip(f"FA4 cannot run here: {problem}")
    assert problem is None, problem          # installed on a Hopper GPU: its probe must agree


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 100])
def test_fa4_agrees_with_flash_attention_2_and_an_fp32_reference_on_the_dflash_mask(window):
    """Output and the three gradients of one long document cut across two chunks' worth of blocks:
    FA4 (bf16) and the FA2 path (bf16) against fp32 math on the same bf16 inputs."""
    _fa4_or_skip()
    from common.batch import PackedBatch
    from drafter_trainer.block_flash import block_flash_attention, plan_of_blocks

    dev = torch.device("cuda")
    g = torch.Generator(dev).manual_seed(0)
    lens = torch.tensor([3000, 700, 900], device=dev)
    t = int(lens.sum())
    batch = PackedBatch(hidden=torch.empty(1, t, 1, device=dev), input_ids=torch.zeros(t, dtype=torch.int64, device=dev),
                        loss_mask=torch.ones(t, dtype=torch.int64, device=dev),
                        position_ids=torch.cat([torch.arange(int(n), device=dev) for n in lens]), doc_lens=lens,
                        sample_ids=torch.arange(3, device=dev), doc_ids=torch.arange(3, device=dev))
    anchors = torch.sort(torch.randperm(t - 1, generator=torch.Generator().manual_seed(1))[:160]).values.to(dev)
    blocks = build_blocks(batch, anchors, 16, 0, 7.0)
    h_kv, groups, d = 4, 6, 256
    rows, keys = blocks.num_blocks * 16 * groups, t + blocks.num_blocks * 16
    q, k, v, dout = (torch.randn(n, h_kv, d, device=dev, generator=g, dtype=torch.bfloat16)
                     for n in (rows, keys, keys, rows))

    def run(fn):
        leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
        out = fn(*leaves)
        out.backward(dout)
        return [out.float()] + [x.grad.float() for x in leaves]

    fa4 = run(lambda a, b, c: masked_attention(a, b, c, block_mask_of_blocks(blocks, groups, window, static=True),
                                               fa4=True))
    visible = dense_rule(blocks, groups, window).to(dev)

    def reference(a, b, c):
        s = torch.einsum("qhd,khd->hqk", a.float(), b.float()) * d ** -0.5
        return torch.einsum("hqk,khd->qhd", torch.softmax(s.masked_fill(~visible, float("-inf")), -1), c.float())
    exact = run(reference)
    # bf16 outputs and gradients of fp32-accumulated kernels: within a few bf16 steps (2^-7) of the
    # largest value, whatever the key count
    for name, a, b in zip(("out", "dq", "dk", "dv"), fa4, exact):
        err = float((a - b).abs().max() / b.abs().max())
        assert err < 4 * 2 ** -7, (name, err)
    if window is None:
        fa2 = run(lambda a, b, c: block_flash_attention(a, b, c, plan_of_blocks(blocks, 48, groups)))
        for name, a, b in zip(("out", "dq", "dk", "dv"), fa4, fa2):
            err = float((a - b).abs().max() / b.abs().max())
            assert err < 4 * 2 ** -7, (name, err)


@pytest.mark.gpu
def test_a_cuda_training_step_on_fa4_has_flash_attention_2s_loss_and_gradients():
    """A compiled drafter's whole step (bf16 autocast, documents cut across chunks of 6 blocks) on
    the fa4 path against the same weights on the flash path."""
    _fa4_or_skip()
    from drafter_trainer.loss import dflash_loss
    from test_drafter_model import make_model, tiny_config

    dev = torch.device("cuda")
    cfg = tiny_config(num_attention_heads=6, num_key_value_heads=2, head_dim=256, block_size=16)   # the 27B head
    batch = make_batch([700, 90, 400], k=3)
    batch = batch.to(dev)
    anchors = torch.tensor([3, 40, 41, 300, 650, 690, 705, 760, 800, 1000, 1150]).to(dev)
    blocks = build_blocks(batch, anchors, 16, MASK, 7.0)
    results = []
    for impl in ("fa4", "flash"):
        model = make_model(cfg, std=0.05, attn_impl=impl).to(dev)
        model.compile_for(dev, "on")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = dflash_loss(model, batch, blocks, chunk=64, blocks_per_chunk=6, backward=True)
        assert model.attention_ran == impl
        results.append((float(out.loss), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    # two bf16 paths through 2 layers: the loss within a few bf16 steps, each gradient's direction kept
    assert abs(loss_a / loss_b - 1) < 4 * 2 ** -7, (loss_a, loss_b)
    for name, g in grads_a.items():
        cos = float(torch.nn.functional.cosine_similarity(g.flatten(), grads_b[name].flatten(), dim=0))
        assert cos > 0.99, (name, cos)
