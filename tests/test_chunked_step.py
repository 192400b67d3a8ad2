"""The drafter step over its blocks in chunks: the same loss and gradients as one pass over all
blocks, with activations that grow with the chunk, not with the number of anchors.

The per-document anchor cap puts thousands of blocks in a 16K-token batch; `dflash_loss(...,
backward=True)` computes the context side once and runs forward + backward one chunk of blocks at
a time (see its docstring). Tolerances: fp32 throughout; the chunked and the unchunked step add
the same terms in another order (per-chunk partial sums of the loss, of each weight's gradient
and of the context keys' gradient), so they differ by tolerances.py's bound over the drafter's
path (`drafter_terms`).
"""
from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from drafter_trainer.blocks import BlockBatch, build_blocks, sample_anchors
from drafter_trainer.loss import dflash_loss
from test_drafter_model import MASK, drafter_terms, make_batch, make_model, tiny_config
from tolerances import assert_close

pytestmark = pytest.mark.numerics   # run again under ATEN_CPU_CAPABILITY=default (make test-numerics)

DOCS = [9, 30, 1, 17, 23]          # a one-token document: no anchor, but its tokens are context


def _blocks(batch, cap: int, pad_to: int | None = None) -> BlockBatch:
    anchors = sample_anchors(batch.loss_mask, batch.doc_lens, cap, torch.Generator().manual_seed(3))
    return build_blocks(batch, anchors, 4, MASK, 3.0, pad_to=pad_to)


def _cfg(sliding: bool):
    if sliding:
        return tiny_config(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention",
                                                             "sliding_attention"], sliding_window=5)
    return tiny_config(num_hidden_layers=2)


def test_chunks_cover_every_block_once_with_the_context_its_blocks_can_see():
    batch = make_batch(DOCS)
    blocks = _blocks(batch, 100, pad_to=80)
    n = blocks.num_blocks
    seen = []
    for part, first, end in blocks.chunks(7):
        seen.extend(range(len(seen), len(seen) + part.num_blocks))
        real = part.valid
        if real.any():
            anchors = part.anchors[real] + first                  # back to packed indices
            docs = part.anchor_doc[real]
            starts = torch.cumsum(batch.doc_lens, 0) - batch.doc_lens
            assert first == int(starts[docs.min()]) and end == int(anchors.max())
            assert torch.equal(part.context_doc, blocks.context_doc[first:end])
        else:
            assert first == end == 0 and part.num_context == 0
    assert seen == list(range(n))


@pytest.mark.parametrize("sliding", [False, True])
@pytest.mark.parametrize("impl", ["split", "sdpa", "flash"])
@pytest.mark.parametrize("per_chunk", [1, 5, 16])
def test_chunked_backward_gives_the_unchunked_loss_and_gradients(impl, per_chunk, sliding):
    cfg = _cfg(sliding)
    model = make_model(cfg, std=0.05, attn_impl=impl)
    mask = torch.ones(sum(DOCS), dtype=torch.uint8)
    mask[[2, 10, 11, 25, 50]] = 0
    batch = make_batch(DOCS, loss_mask=mask)
    blocks = _blocks(batch, 6, pad_to=40)                         # 6 per document, then padding
    params = [p for p in model.parameters() if p.requires_grad]

    want = dflash_loss(model, batch, blocks, chunk=7, blocks_per_chunk=10_000)
    want_grads = torch.autograd.grad(want.loss, params)
    got = dflash_loss(model, batch, blocks, chunk=7, blocks_per_chunk=per_chunk, backward=True)
    assert not got.loss.requires_grad
    rows = blocks.labels.numel()
    assert_close(got.loss, want.loss.detach(), n=drafter_terms(cfg, sum(DOCS), rows))
    assert torch.equal(got.correct_per_pos, want.correct_per_pos)
    assert torch.equal(got.count_per_pos, want.count_per_pos)
    for (name, p), w in zip(((n, p) for n, p in model.named_parameters() if p.requires_grad), want_grads):
        assert p.grad is not None, name
        assert_close(p.grad, w, n=drafter_terms(cfg, sum(DOCS), rows, backward=True), msg=name)
    # the context side (fc, hidden_norm) got its gradient through the accumulated context keys
    assert model.fc.weight.grad.abs().max() > 0 and model.hidden_norm.weight.grad.abs().max() > 0


# One long document (a thinking trace, at the test's scale): 1,200 tokens, its first 100 a prompt.
LONG_DOC = 1200


@pytest.mark.parametrize("sliding", [False, True])
@pytest.mark.parametrize("impl", ["split", "sdpa", "flash"])
def test_a_document_spanning_many_chunks_gives_the_unchunked_loss_and_gradients(impl, sliding, monkeypatch):
    # 60 anchors over the document, 4 blocks a chunk (15 chunks, each seeing the document from its
    # start to its last anchor), 2 blocks a segment (split and flash cut each chunk again), and
    # flash's calls capped at 64 keys, so its parts run as several calls too
    from drafter_trainer import block_flash

    monkeypatch.setattr(block_flash, "MAX_CALL_KEYS", 64)
    model = make_model(_cfg(sliding), std=0.05, attn_impl=impl)
    model.segment_rows = 2 * model.config.block_size
    mask = torch.ones(LONG_DOC, dtype=torch.uint8)
    mask[:100] = 0
    batch = make_batch([LONG_DOC, 30], loss_mask=torch.cat([mask, torch.ones(30, dtype=torch.uint8)]))
    blocks = _blocks(batch, 60)
    chunks = blocks.chunks(4)
    assert blocks.num_blocks == 60 + 29 and len(chunks) > 10 and max(end - first for _, first, end in chunks) > 1000
    params = [p for p in model.parameters() if p.requires_grad]

    want = dflash_loss(model, batch, blocks, chunk=7, blocks_per_chunk=10_000)
    want_grads = torch.autograd.grad(want.loss, params)
    got = dflash_loss(model, batch, blocks, chunk=7, blocks_per_chunk=4, backward=True)
    rows = int((blocks.weights > 0).sum())
    assert_close(got.loss, want.loss.detach(), n=drafter_terms(model.config, batch.num_tokens, rows))
    assert torch.equal(got.correct_per_pos, want.correct_per_pos)
    n = drafter_terms(model.config, batch.num_tokens, rows, backward=True)
    for (name, p), w in zip(((n, p) for n, p in model.named_parameters() if p.requires_grad), want_grads):
        assert_close(p.grad, w, n=n, msg=name)


class BatchLengthTensors(TorchDispatchMode):
    """Counts the tensors every op (forward and backward) makes whose first dimension is the batch's
    length; views do not count."""

    VIEWS = {torch.ops.aten.detach.default, torch.ops.aten.view.default, torch.ops.aten.slice.Tensor,
             torch.ops.aten._unsafe_view.default, torch.ops.aten.alias.default}

    def __init__(self, tokens: int) -> None:
        super().__init__()
        self.tokens, self.count = tokens, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func not in self.VIEWS:
            self.count += sum(1 for x in tree_flatten(out)[0]
                              if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == self.tokens)
        return out


def test_a_chunks_backward_makes_nothing_as_long_as_the_batch():
    # a long document without a single anchor, then a short one holding them all: every chunk sees
    # only the short document, so what the step makes at the batch's length (the context side, its
    # backward) must not grow with the number of chunks
    model = make_model(tiny_config(num_hidden_layers=1), std=0.05)
    docs = [997, 40]
    mask = torch.zeros(sum(docs), dtype=torch.uint8)
    mask[docs[0]:] = 1
    batch = make_batch(docs, loss_mask=mask)
    blocks = _blocks(batch, 32)
    counts = {}
    for per_chunk in (4, 8):
        meter = BatchLengthTensors(batch.num_tokens)
        with meter:
            dflash_loss(model, batch, blocks, chunk=16, blocks_per_chunk=per_chunk, backward=True)
        model.zero_grad(set_to_none=True)
        counts[len(blocks.chunks(per_chunk))] = meter.count
    assert len(counts) == 2 and len(set(counts.values())) == 1, f"batch-length tensors by chunk count: {counts}"


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_chunked_eval_equals_unchunked_on_the_flex_path():
    # flex has no eager backward on the CPU: its forward is compared (its gradients on CUDA)
    cfg = _cfg(True)
    model = make_model(cfg, std=0.05, attn_impl="flex")
    batch = make_batch(DOCS)
    blocks = _blocks(batch, 6)
    with torch.no_grad():
        want = dflash_loss(model, batch, blocks, chunk=7, blocks_per_chunk=10_000)
        got = dflash_loss(model, batch, blocks, chunk=7, blocks_per_chunk=3)
    assert_close(got.loss, want.loss, n=drafter_terms(cfg, sum(DOCS), blocks.labels.numel()))
    assert torch.equal(got.correct_per_pos, want.correct_per_pos)


def test_a_chunk_without_context_or_loss_still_gives_every_weight_a_gradient():
    # anchors at document starts see no context; a padding-only chunk has none either
    model = make_model(std=0.05)
    batch = make_batch([6, 6])
    blocks = build_blocks(batch, torch.tensor([0, 6]), 4, MASK, 3.0, pad_to=4)
    dflash_loss(model, batch, blocks, chunk=7, blocks_per_chunk=1, backward=True)
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and torch.isfinite(p.grad).all(), name


class SavedActivations:
    """Peak bytes of the tensors autograd holds for backward (weights excluded), over a region.

    Every tensor saved for backward passes through the pack hook; its holder is freed when the
    graph that saved it is freed (after its backward), so the live set is exactly the activation
    memory a step keeps. Storages are counted once however many views of them are saved.
    """

    def __init__(self, exclude: list[torch.Tensor]) -> None:
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.live: dict[int, tuple[int, int]] = {}    # storage ptr -> (bytes, holders)
        self.current = self.peak = 0

    def pack(self, t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.exclude:
            return t
        holder = _Holder(t)
        size, count = self.live.get(ptr, (t.untyped_storage().nbytes(), 0))
        if count == 0:
            self.current += size
            self.peak = max(self.peak, self.current)
        self.live[ptr] = (size, count + 1)
        weakref.finalize(holder, self._release, ptr)
        return holder

    def _release(self, ptr: int) -> None:
        size, count = self.live[ptr]
        if count == 1:
            del self.live[ptr]
            self.current -= size
        else:
            self.live[ptr] = (size, count - 1)

    @staticmethod
    def unpack(x):
        return x.tensor if isinstance(x, _Holder) else x


class _Holder:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _peak_saved_bytes(model, batch, blocks, per_chunk: int, backward: bool) -> int:
    meter = SavedActivations([p for p in model.parameters()] + [batch.hidden])
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        out = dflash_loss(model, batch, blocks, chunk=64, blocks_per_chunk=per_chunk, backward=backward)
        if not backward:
            out.loss.backward()
            del out
    model.zero_grad(set_to_none=True)
    return meter.peak


def test_step_activations_grow_with_the_chunk_not_with_the_anchor_count():
    # One batch of 1,088 tokens; N = 1x, 4x and 16x a chunk of 64 blocks drawn from it (the cap is
    # per document: 64 documents of 17 tokens, 1, 4 or 16 anchors each).
    model = make_model(std=0.05)
    batch = make_batch([17] * 64)
    chunk = 64
    peaks, unchunked = {}, {}
    for per_doc in (1, 4, 16):
        blocks = _blocks(batch, per_doc)
        assert blocks.num_blocks == 64 * per_doc
        peaks[per_doc] = _peak_saved_bytes(model, batch, blocks, chunk, backward=True)
        unchunked[per_doc] = _peak_saved_bytes(model, batch, blocks, 10_000, backward=False)
    print("peak saved bytes, chunked:", peaks, "unchunked:", unchunked)
    # Unchunked, the block activations scale with N; chunked, 16x the anchors cost at most what
    # the context side and one more chunk cost (the context side is the same batch every time).
    assert unchunked[16] > 8 * unchunked[1]
    assert peaks[16] < 1.25 * peaks[1]
    assert peaks[16] < unchunked[16] / 4


@pytest.mark.parametrize("split_fc", [False, True])
def test_while_the_chunks_run_the_context_side_holds_only_fcs_input(split_fc, monkeypatch):
    # the blocks all in a short first document, a second one of 300 or 900 tokens without anchors:
    # what autograd holds when a chunk's forward is done, beyond the chunk itself, is the context
    # side's. Per context token that is fc's input (the concatenated planes, fp32 on the CPU; with
    # split_fc views of the planes, which are the batch's own), nothing of hidden_norm or of the
    # layers' context keys and values.
    from drafter_trainer import loss

    model = make_model(tiny_config(num_hidden_layers=2), std=0.05, split_fc=split_fc)
    held: dict[int, list[int]] = {}
    chunk_ce = loss._chunk_ce

    def recording(*args, **kwargs):
        out = chunk_ce(*args, **kwargs)
        held[long].append(meter.current)          # after the chunk's forward, before its backward
        return out
    monkeypatch.setattr(loss, "_chunk_ce", recording)
    for long in (300, 900):
        held[long] = []
        mask = torch.zeros(40 + long, dtype=torch.uint8)
        mask[:40] = 1
        batch = make_batch([40, long], loss_mask=mask)
        meter = SavedActivations([p for p in model.parameters()] + [batch.hidden])
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            dflash_loss(model, batch, _blocks(batch, 32), chunk=64, blocks_per_chunk=8, backward=True)
        model.zero_grad(set_to_none=True)
    assert len(held[300]) == len(held[900]) == 3
    per_token = (held[900][0] - held[300][0]) / 600
    fc_input = 0 if split_fc else len(model.config.target_layer_ids) * model.config.hidden_size * 4
    assert fc_input <= per_token <= fc_input + 8, (per_token, fc_input)


def test_a_short_last_chunk_joins_the_one_before_it():
    """Dynamo specialises a size of 1: a last chunk of a single 128-query flex tile would compile
    the layers again for every such batch, so it never stands alone (a single chunk may be short)."""
    from drafter_trainer.blocks import MIN_LAST_CHUNK_QUERIES, chunk_bounds

    assert chunk_bounds(1030, 512, 16) == [(0, 512), (512, 1030)]          # 6 blocks left: joined
    assert chunk_bounds(1040, 512, 16) == [(0, 512), (512, 1024), (1024, 1040)]   # 16 blocks: 256 queries
    assert chunk_bounds(5, 512, 16) == [(0, 5)]
    for n, per, b in [(1, 1, 16), (37, 4, 4), (600, 32, 16), (1000, 7, 16)]:
        bounds = chunk_bounds(n, per, b)
        assert [a for a, _ in bounds][0] == 0 and bounds[-1][1] == n
        assert all(e == a2 for (_, e), (a2, _) in zip(bounds, bounds[1:]))
        assert len(bounds) == 1 or (bounds[-1][1] - bounds[-1][0]) * b >= min(MIN_LAST_CHUNK_QUERIES, per * b)


def test_the_loss_pieces_sum_what_one_piece_does():
    from drafter_trainer.loss import _ChunkedLinearCrossEntropy

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(9, 8, generator=g, requires_grad=True)
    weight, labels, w = torch.randn(11, 8, generator=g), torch.randint(0, 11, (9,), generator=g), torch.rand(9, generator=g)
    head = weight
    whole, hits = _ChunkedLinearCrossEntropy.apply(hidden, head, labels, w, 9, True)
    pieces, hits4 = _ChunkedLinearCrossEntropy.apply(hidden, head, labels, w, 4, True)   # 4 + 4 + 1
    # per row: logits over 8 terms, a softmax over 11, then the weighted sum over the 9 rows;
    # the hidden gradient sums (p - onehot) * W over the vocabulary after the same forward
    assert_close(pieces, whole, n=8 + 11 + 9)
    assert torch.equal(hits, hits4)
    (grad_whole,) = torch.autograd.grad(whole, hidden)
    (grad_pieces,) = torch.autograd.grad(pieces, hidden)
    assert_close(grad_pieces, grad_whole, n=2 * 8 + 11)
