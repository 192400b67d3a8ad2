"""The flash attention path (drafter_trainer/block_flash.py): its key runs, the merge of its two
parts and their backward, against the split path; on CUDA its FlashAttention kernels against the
plain reference the CPU runs."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from drafter_trainer.block_flash import (MAX_CALL_KEYS, block_flash_attention, call_bounds, flash_plan,
                                         fold_queries, group_major, plan_of_blocks, unfold_queries)
from drafter_trainer.blocks import AttentionLayout, build_blocks
from drafter_trainer.model import split_attention
from test_drafter_model import MASK, make_batch
from tolerances import assert_close

pytestmark = pytest.mark.numerics   # run again under ATEN_CPU_CAPABILITY=default (make test-numerics)


def test_plan_cuts_each_blocks_visible_keys_into_a_segment_run_and_a_block_run():
    # documents of 6 and 10 tokens (context 0-5, 6-15); blocks of 2 at anchors 0, 2, 3 | 6, 7, 9, 12;
    # segments of at most 2 blocks: [0, 1] [2] | [3, 4] [5, 6]; block n's own keys: 16 + 2n, 17 + 2n
    # one query head per key head (no folding) here: a block is its 2 rows
    plan = flash_plan([0, 2, 3, 6, 7, 9, 12], [0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 6, 6, 6, 6], 16, 2, 2, 1,
                      torch.device("cpu"))
    (a,), (b,) = plan.parts      # each part one kernel call: few keys
    assert (a.q0, a.q1, b.q0, b.q1) == (0, 14, 0, 14)
    # part A, per segment: its document's start to the segment's first anchor (empty for two)
    assert a.key_index.tolist() == [0, 1, 2, 6, 7, 8]
    assert a.cu_q.tolist() == [0, 4, 6, 10, 14] and a.cu_k.tolist() == [0, 0, 3, 3, 6]
    assert (a.max_q, a.max_k) == (4, 3)
    assert a.rows.tolist() == [False] * 4 + [True] * 2 + [False] * 4 + [True] * 4
    # part B, per block: the segment's first anchor to its own anchor, then its own keys
    assert b.key_index.tolist() == [16, 17, 0, 1, 18, 19, 20, 21, 22, 23, 6, 24, 25, 26, 27, 9, 10, 11, 28, 29]
    assert b.cu_q.tolist() == list(range(0, 16, 2)) and b.cu_k.tolist() == [0, 2, 6, 8, 10, 13, 15, 20]
    assert (b.max_k, b.rows) == (5, None)
    # three query heads per key head: the same keys, three times the rows per sequence
    folded = flash_plan([0, 2, 3, 6, 7, 9, 12], [0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 6, 6, 6, 6], 16, 2, 2, 3,
                        torch.device("cpu"))
    (fa,), (fb,) = folded.parts
    assert fa.cu_q.tolist() == [0, 12, 18, 30, 42]
    assert fb.cu_q.tolist() == list(range(0, 48, 6))
    assert torch.equal(fb.key_index, b.key_index) and fa.rows.sum() == 3 * a.rows.sum()
    # together, block 6 (anchor 12 in the document starting at 6) sees context 6..11 and itself
    runs = [a.key_index[a.cu_k[3]:a.cu_k[4]], b.key_index[b.cu_k[6]:b.cu_k[7]]]
    assert sorted(torch.cat(runs).tolist()) == [6, 7, 8, 9, 10, 11, 28, 29]


def test_a_padding_block_sees_only_itself_and_a_plan_without_context_has_one_part():
    plan = flash_plan([0, 0], [-1, -1], [0, 0], 0, 4, 8, 1, torch.device("cpu"))
    ((only,),) = plan.parts
    assert only.key_index.tolist() == list(range(8)) and only.cu_k.tolist() == [0, 4, 8]


def test_the_plan_of_a_chunk_reads_the_host_values_its_chunking_read():
    batch = make_batch([30, 9, 17])
    blocks = build_blocks(batch, torch.tensor([1, 4, 6, 10, 20, 31, 33, 40, 44, 50]), 4, MASK, 7.0)
    for chunk, _first, _end in blocks.chunks(4):
        assert chunk.host is not None
        fresh = type(chunk)(**{**chunk.__dict__, "host": None})
        got, want = plan_of_blocks(chunk, 2, 1), plan_of_blocks(fresh, 2, 1)   # the second reads the device
        for p, q in zip(got.parts, want.parts):
            assert len(p) == len(q) == 1
            assert torch.equal(p[0].key_index, q[0].key_index) and torch.equal(p[0].cu_k, q[0].cu_k)


def test_folding_group_major_query_heads_into_rows_is_a_view():
    g, b, n, h_kv, d = 3, 4, 5, 2, 8
    x = torch.randn(n * b, h_kv * g, d)          # checkpoint order: head c*g + j
    gm = group_major(x.flatten(1), h_kv, g, dim=1).view(n * b, h_kv * g, d)
    folded = fold_queries(gm, g)
    assert folded.data_ptr() == gm.data_ptr() and folded.is_contiguous()
    # token 7 (block 1, row 3), query head 2 of key head 1 (head 1 * 3 + 2 = 5): folded row 7*g + 2
    assert torch.equal(folded[7 * g + 2, 1], x[7, 5])
    # each block's rows are contiguous: block 1 is rows [b*g, 2*b*g)
    assert torch.equal(folded[b * g:2 * b * g].sort(0).values,
                       x[b:2 * b].view(b, h_kv, g, d).transpose(1, 2).reshape(b * g, h_kv, d).sort(0).values)
    flat = unfold_queries(folded, g)
    assert flat.data_ptr() == gm.data_ptr() and flat.shape == (n * b, g * h_kv * d)
    assert torch.equal(group_major(flat, g, h_kv, dim=1), x.flatten(1))   # the inverse: the grid transposed


def test_group_major_weights_give_the_checkpoint_order_projections():
    """q from the reordered q_proj rows is q from the checkpoint's, heads reordered; the reordered
    o_proj columns undo it on the output side."""
    g, h_kv, d, hidden = 3, 2, 4, 10
    torch.manual_seed(0)
    x, wq, wo = torch.randn(6, hidden), torch.randn(h_kv * g * d, hidden), torch.randn(hidden, h_kv * g * d)
    q = (x @ wq.t()).view(6, h_kv * g, d)
    q_gm = (x @ group_major(wq, h_kv, g, dim=0).t()).view(6, h_kv * g, d)
    assert torch.equal(q_gm[:, 1 * h_kv + 0], q[:, 0 * g + 1])      # group 1 of key head 0
    heads = torch.randn(6, h_kv * g * d)                               # per-head outputs, checkpoint order
    # the same h_kv * g * d products, summed in another order
    assert_close(group_major(heads, h_kv, g, dim=1) @ group_major(wo, h_kv, g, dim=1).t(), heads @ wo.t(),
                 n=h_kv * g * d)


def _attention_case(docs: list[int], anchors: list[int], block: int, heads: int, kv_heads: int, d: int,
                    pad_to: int | None = None, seed: int = 0):
    """Blocks of a batch and random fp32 queries [Q, h, d], keys and values [T + Q, h_kv, d], output gradient."""
    batch = make_batch(docs, seed=seed)
    blocks = build_blocks(batch, torch.tensor(anchors), block, MASK, 7.0, pad_to=pad_to)
    t, nq = batch.num_tokens, blocks.num_blocks * block
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, h, d, generator=g).requires_grad_()
               for n, h in ((nq, heads), (t + nq, kv_heads), (t + nq, kv_heads)))
    return batch, blocks, q, k, v, torch.randn(nq, heads, d, generator=g)


def _with_grads(out: torch.Tensor, inputs: tuple[torch.Tensor, ...], grad: torch.Tensor) -> list[torch.Tensor]:
    return [out.detach(), *torch.autograd.grad(out, inputs, grad)]


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan, block: int) -> torch.Tensor:
    """The model's use: query heads group-major and folded, attention, unfolded; returned in the
    checkpoint's head order."""
    rows, heads, d = q.shape
    h_kv = k.shape[1]
    g = heads // h_kv
    folded = fold_queries(group_major(q.flatten(1), h_kv, g, dim=1).view(rows, heads, d), g)
    out = unfold_queries(block_flash_attention(folded, k, v, plan), g)
    return group_major(out, g, h_kv, dim=1).view(rows, heads, d)


def _split_reference(blocks, q, k, v, grad):
    layout = AttentionLayout.from_blocks(blocks, 8 * blocks.block_size)
    as_heads = lambda x: x.transpose(0, 1).unsqueeze(0)  # noqa: E731
    out = split_attention(as_heads(q), as_heads(k), as_heads(v), layout.segments, layout.split_masks(None),
                          blocks.block_size)[0].transpose(0, 1)
    return _with_grads(out, (q, k, v), grad)


def test_a_part_runs_as_calls_of_consecutive_sequences_each_gathering_at_most_the_cap():
    assert call_bounds(np.array([3, 2, 4, 9, 1, 0, 2]), 5) == [(0, 2), (2, 3), (3, 4), (4, 7)]   # 9 > 5 alone
    assert call_bounds(np.array([3, 2]), MAX_CALL_KEYS) == [(0, 2)]
    # the plan of the first test with calls of at most 4 keys: same keys, same rows, in pieces
    args = ([0, 2, 3, 6, 7, 9, 12], [0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 6, 6, 6, 6], 16, 2, 2, 1, torch.device("cpu"))
    whole, cut = flash_plan(*args), flash_plan(*args, max_call_keys=4)
    for (part,), calls in zip(whole.parts, cut.parts):
        assert len(calls) > 1 and calls[0].q0 == 0 and calls[-1].q1 == part.q1
        assert all(a.q1 == b.q0 for a, b in zip(calls, calls[1:]))
        assert torch.equal(torch.cat([c.key_index for c in calls]), part.key_index)
        for c in calls:
            keys, seqs = int(c.cu_k[-1]), len(c.cu_k) - 1
            assert keys <= 4 or seqs == 1, (keys, seqs)
            assert int(c.cu_q[-1]) == c.q1 - c.q0 and c.max_k == int(torch.diff(c.cu_k).max())


@pytest.mark.parametrize("segment_blocks,max_call_keys", [(1, MAX_CALL_KEYS), (2, MAX_CALL_KEYS),
                                                          (3, MAX_CALL_KEYS), (64, MAX_CALL_KEYS), (2, 7), (64, 7)])
def test_flash_attention_equals_split_attention_with_gradients(segment_blocks, max_call_keys):
    # anchors at a document start (an empty segment run), adjacent ones, a block past its
    # document's end, padding blocks; 4 query heads over 2 key heads; with a cap of 7 keys each
    # part runs as several calls (its longer sequences one each)
    _batch, blocks, q, k, v, grad = _attention_case([9, 14, 11], [0, 3, 5, 7, 9, 11, 12, 20, 23, 26, 31], 4, 4,
                                                    2, 8, pad_to=13)
    want = _split_reference(blocks, q, k, v, grad)
    plan = plan_of_blocks(blocks, segment_blocks, 2, max_call_keys)
    assert max_call_keys == MAX_CALL_KEYS or any(len(calls) > 1 for calls in plan.parts)
    got = _with_grads(_flash(q, k, v, plan, 4), (q, k, v), grad)
    for name, x, y in zip(("out", "dq", "dk", "dv"), got, want):
        # fp32; the longest sum: a key's gradient over the up to 44 query rows x 2 query heads seeing it
        assert_close(x, y, n=8 + 2 * 44 * 2, msg=name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("max_call_keys", [None, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_flash_kernels_equal_the_reference_the_cpu_runs(dtype, max_call_keys):
    # the 27B drafter's heads (24 over 4, size 256), blocks of 16, 120 anchors over 4 documents;
    # with calls of at most 300 keys each part runs as several kernel calls
    anchors = sorted(np.random.default_rng(0).choice(np.arange(470), 120, replace=False).tolist())
    batch, blocks, q, k, v, grad = _attention_case([200, 37, 150, 90], anchors, 16, 24, 4, 256, seed=1)
    # the same half-precision values on both sides: only the kernels' own rounding differs
    q, k, v = (x.detach().to(dtype).float().requires_grad_() for x in (q, k, v))
    want = _with_grads(_flash(q, k, v, plan_of_blocks(blocks, 8, 6), 16), (q, k, v), grad)
    cuda_blocks = build_blocks(batch.to("cuda"), torch.tensor(anchors, device="cuda"), 16, MASK, 7.0)
    qc, kc, vc = (x.detach().to("cuda", dtype).requires_grad_() for x in (q, k, v))
    plan = plan_of_blocks(cuda_blocks, 8, 6, max_call_keys)
    assert max_call_keys is None or all(len(calls) > 1 for calls in plan.parts)
    got = _with_grads(_flash(qc, kc, vc, plan, 16), (qc, kc, vc), grad.to("cuda", dtype))
    for name, x, y in zip(("out", "dq", "dk", "dv"), got, want):
        # the kernels round P before P @ V and dS before dS @ K to the half type, and return half
        # results: a relative error of a few of its eps in norm (errors of many terms average out)
        err = float((x.float().cpu() - y).norm() / y.norm())
        assert err < 4 * torch.finfo(dtype).eps, f"{name}: {err}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_flash_refuses_fp32_compute_with_a_clear_error():
    from drafter_trainer.model import DrafterConfigError
    from test_drafter_model import make_model, tiny_config

    model = make_model(tiny_config(), attn_impl="flash").cuda()
    batch = make_batch([20, 12]).to("cuda")
    blocks = build_blocks(batch, torch.tensor([1, 5, 22], device="cuda"), 4, MASK, 7.0)
    with pytest.raises(DrafterConfigError, match="bf16 or fp16"):
        model(batch.hidden, blocks.block_input_ids, blocks)
