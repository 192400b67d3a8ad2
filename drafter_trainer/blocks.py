"""Anchors, blocks, labels and the attention mask of one DFlash training batch.

A packed batch holds T real tokens of D documents. The drafter learns, from the target's hidden
states of the tokens *before* an anchor, to fill a block of B tokens starting at the anchor:

    document:   ... t[a-2]  t[a-1] | t[a]   t[a+1] t[a+2] ... t[a+B-1] | ...
    context:    ... visible visible| hidden (kv < anchor: the anchor's own state is never seen)
    block in:                      | t[a]   MASK   MASK   ... MASK
    position:                      | p      p+1    p+2    ... p+B-1        (p = a's position in its document)
    label:                         | -      t[a+1] t[a+2] ... t[a+B-1]     (block position k predicts t[a+k])
    weight:                        | 0      w1     w2     ... w(B-1)       wk = in_doc * loss_mask[a+k] * exp(-(k-1)/gamma)

Everything here is a pure function of the batch and the anchors, so a re-delivered batch
(same seed, epoch, seq) yields the same blocks on any rank.
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from common.batch import PackedBatch

IGNORE_INDEX = -100   # label of positions without loss (the anchor itself, past the document end)


class BlockError(ValueError):
    """Anchors or block parameters that cannot describe valid blocks of this batch."""


def anchor_seed(seed: int, epoch: int, seq: int) -> int:
    """Deterministic 63-bit seed for the anchors of batch `seq` in `epoch` (so resampled every epoch).
    Independent of the rank on purpose: after a restart a batch may be re-delivered to another rank
    and must get the same anchors there (the saved model holds each batch's gradient exactly once,
    computed from one fixed set of blocks)."""
    digest = hashlib.blake2b(f"dfpipe-anchors:{seed}:{epoch}:{seq}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def heldout_anchor_seed(seed: int, index: int) -> int:
    """Deterministic 63-bit seed for the anchors of held-out batch `index`: the same at every
    eval (no epoch in it), so evals at different steps score the drafter on the same blocks."""
    digest = hashlib.blake2b(f"dfpipe-heldout-anchors:{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def document_ids(doc_lens: torch.Tensor) -> torch.Tensor:
    """[T] index of the document each token belongs to (int64)."""
    lens = doc_lens.to(torch.int64)
    return torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens)


def sample_anchors(loss_mask: torch.Tensor, doc_lens: torch.Tensor, max_anchors: int,
                   generator: torch.Generator) -> torch.Tensor:
    """Anchor positions, sorted (int64, on loss_mask's device): p with loss_mask[p] and loss_mask[p+1]
    set and p+1 in p's document. `max_anchors` caps anchors per *document*, as the DFlash recipe
    does (every document gets min(max_anchors, its candidates), uniformly without replacement): a
    per-batch cap would supervise a 30-document batch like one document and throw away most of the
    target's hidden states. The draw runs on the generator's device: a CPU generator seeded with
    `anchor_seed` gives the same anchors on CPU and GPU."""
    if max_anchors < 0:
        raise BlockError(f"max_anchors must be >= 0, got {max_anchors}")
    mask = loss_mask.to(torch.bool)
    t = mask.numel()
    lens = doc_lens.to(torch.int64).to(mask.device)
    if int(lens.sum()) != t:
        raise BlockError(f"doc_lens sum to {int(lens.sum())}, loss_mask has {t} tokens")
    last_of_doc = torch.zeros(t, dtype=torch.bool, device=mask.device)
    last_of_doc[torch.cumsum(lens, 0) - 1] = True
    ok = mask[:-1] & mask[1:] & ~last_of_doc[:-1]
    candidates = ok.nonzero().squeeze(1)
    doc = document_ids(lens)[candidates]                     # ascending, like the candidates
    per_doc = torch.bincount(doc, minlength=lens.numel())
    if per_doc.numel() == 0 or int(per_doc.max()) <= max_anchors:
        return candidates
    # A random key per candidate; the max_anchors smallest keys of a document are a uniform
    # sample of it without replacement. Sort by key, then stably by document: each document's
    # candidates in key order, so the rank inside the document says which to keep.
    keys = torch.rand(candidates.numel(), generator=generator, device=generator.device).to(candidates.device)
    order = torch.argsort(keys)
    order = order[torch.argsort(doc[order], stable=True)]
    first_of_doc = torch.cumsum(per_doc, 0) - per_doc
    rank = torch.arange(order.numel(), device=order.device) - first_of_doc[doc[order]]
    return candidates[order[rank < max_anchors]].sort().values


@dataclass
class BlockBatch:
    """N blocks of B tokens cut from one packed batch, plus what their attention mask needs.

    block_input_ids   [N, B] int64  t[anchor], MASK x (B-1)
    block_positions   [N, B] int64  anchor's position in its document + 0..B-1
    labels            [N, B] int64  t[anchor+k]; IGNORE_INDEX at k=0 and past the document end
    weights           [N, B] fp32   loss weight; 0 wherever labels is IGNORE_INDEX or loss_mask is 0
    anchors           [N]    int64  anchor's index in the packed row (0 for padding blocks)
    anchor_doc        [N]    int64  anchor's document (-1 for padding blocks)
    valid             [N]    bool   False for padding blocks (they see no data and carry no weight)
    context_doc       [T]    int64  document of each packed token
    context_positions [T]    int64  position of each packed token in its document

    `host`: the blocks' anchors, documents and document starts (context indices) as host lists once
    `chunks` has read them, so the host-side mask builders read nothing from the device.
    """

    block_input_ids: torch.Tensor
    block_positions: torch.Tensor
    labels: torch.Tensor
    weights: torch.Tensor
    anchors: torch.Tensor
    anchor_doc: torch.Tensor
    valid: torch.Tensor
    context_doc: torch.Tensor
    context_positions: torch.Tensor
    host: tuple[list[int], list[int], list[int]] | None = None

    @property
    def num_blocks(self) -> int:
        return int(self.block_input_ids.shape[0])

    @property
    def block_size(self) -> int:
        return int(self.block_input_ids.shape[1])

    @property
    def num_context(self) -> int:
        return int(self.context_doc.shape[0])

    def doc_starts(self) -> torch.Tensor:
        """[N] the context index of each block's document's first token, on the blocks' device
        (for padding blocks a meaningless index: callers mask them by `valid` or document -1)."""
        return torch.searchsorted(self.context_doc, self.anchor_doc.clamp_min(0))

    def host_index(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per block: its anchor, its document (-1: padding) and its document's first context
        index, as host arrays (`host`, or one read of the device)."""
        if self.host is None:
            self.host = tuple(torch.stack([self.anchors, self.anchor_doc, self.doc_starts()]).tolist())
        return tuple(np.asarray(x, dtype=np.int64) for x in self.host)

    def chunks(self, blocks_per_chunk: int) -> list[tuple["BlockBatch", int, int]]:
        """The blocks in runs of at most `blocks_per_chunk`, each as (chunk, first, end): `chunk` holds
        blocks [i, i + blocks_per_chunk) and only the batch's context tokens [first, end), from its
        first block's document start to its last anchor (context is visible strictly before an
        anchor, in its document; anchors are sorted, so the run's documents all start in that
        range), its anchors re-based to the slice; a chunk of padding blocks has no context. One
        host read of the anchors per batch (the bounds are host integers), none for a single chunk."""
        n = self.num_blocks
        bounds = chunk_bounds(n, blocks_per_chunk, self.block_size)
        if len(bounds) == 1:
            return [(self, 0, self.num_context)]
        anchors, docs, starts = self.host_index()
        out = []
        for a, e in bounds:
            rows = slice(a, e)
            real = docs[rows] >= 0
            first = int(starts[rows][real][0]) if real.any() else 0
            end = int(anchors[rows][real].max()) if real.any() else 0
            valid = self.valid[rows]
            host = (np.where(real, anchors[rows] - first, 0).tolist(), docs[rows].tolist(),
                    np.where(real, starts[rows] - first, 0).tolist())
            out.append((BlockBatch(
                block_input_ids=self.block_input_ids[rows], block_positions=self.block_positions[rows],
                labels=self.labels[rows], weights=self.weights[rows],
                anchors=torch.where(valid, self.anchors[rows] - first, 0), anchor_doc=self.anchor_doc[rows],
                valid=valid, context_doc=self.context_doc[first:end],
                context_positions=self.context_positions[first:end], host=host), first, end))
        return out


def build_blocks(batch: PackedBatch, anchors: torch.Tensor, block_size: int, mask_token_id: int,
                 gamma: float, pad_to: int | None = None) -> BlockBatch:
    """Cut one block per anchor (the module docstring's alignment). A batch without anchors still
    gets one padding block, so every trainable parameter takes part in the backward pass (DDP ranks
    must all reduce the same parameters); `pad_to` pads to a fixed block count (fixed shapes for
    compiled kernels). Padding blocks belong to no document: they see no context and no other
    block, and weigh 0."""
    if block_size < 2:
        raise BlockError(f"block_size must be >= 2, got {block_size}")
    if mask_token_id < 0:
        raise BlockError(f"mask_token_id must be a real token id, got {mask_token_id}")
    if gamma <= 0:
        raise BlockError(f"gamma must be positive, got {gamma}")
    device = batch.input_ids.device
    t = batch.num_tokens
    anchors = anchors.to(device=device, dtype=torch.int64)
    if anchors.dim() != 1:
        raise BlockError(f"anchors must be 1-d, got shape {tuple(anchors.shape)}")
    if anchors.numel() and (int(anchors.min()) < 0 or int(anchors.max()) >= t):
        raise BlockError(f"anchors outside [0, {t}): min {int(anchors.min())}, max {int(anchors.max())}")
    n_real = anchors.numel()
    n = max(n_real, 1, pad_to or 0)

    doc_lens = batch.doc_lens.to(device=device, dtype=torch.int64)
    context_doc = document_ids(doc_lens)
    context_positions = batch.position_ids.to(torch.int64)
    doc_end = torch.cumsum(doc_lens, 0)                      # exclusive end of each document

    valid = torch.arange(n, device=device) < n_real
    anchor_idx = torch.cat([anchors, anchors.new_zeros(n - n_real)])
    anchor_doc = torch.where(valid, context_doc[anchor_idx], -1)
    anchor_pos = torch.where(valid, context_positions[anchor_idx], 0)

    offsets = torch.arange(block_size, device=device)
    target = anchor_idx[:, None] + offsets                   # [N, B] packed index of t[anchor+k]
    in_doc = valid[:, None] & (target < doc_end[anchor_doc.clamp_min(0)][:, None])
    target = target.clamp_max(t - 1)
    has_label = in_doc & (offsets > 0)

    labels = torch.where(has_label, batch.input_ids.to(torch.int64)[target], IGNORE_INDEX)
    decay = torch.exp(-(offsets.to(torch.float32) - 1) / gamma)
    weights = has_label * batch.loss_mask[target].to(torch.float32) * decay

    block_input_ids = torch.full((n, block_size), mask_token_id, dtype=torch.int64, device=device)
    block_input_ids[:, 0] = torch.where(valid, batch.input_ids.to(torch.int64)[anchor_idx], mask_token_id)
    return BlockBatch(
        block_input_ids=block_input_ids,
        block_positions=anchor_pos[:, None] + offsets,
        labels=labels,
        weights=weights,
        anchors=anchor_idx,
        anchor_doc=anchor_doc,
        valid=valid,
        context_doc=context_doc,
        context_positions=context_positions,
    )


@dataclass
class AttentionLayout:
    """Queries and keys of one batched DFlash forward, and the one rule for who sees whom.

    All blocks attend in a single call. Queries are the N*B block tokens; keys are the T context
    tokens followed by the same N*B block tokens:

        queries:  [ blk0: 0..B-1 | blk1: 0..B-1 | ... ]                              N*B rows
        keys:     [ ctx 0 .. T-1 | blk0: 0..B-1 | blk1: 0..B-1 | ... ]               T + N*B columns

        query (block n, offset i) sees key j when
          context j:  same document  and  pos[j] < anchor_pos[n]             (strictly before the anchor)
          block key:  j belongs to block n                                   (bidirectional in the block)
        and on sliding-window layers additionally
                      pos[j] <= pos(q)  and  pos(q) - pos[j] < window       (causal in the block; window
                                                                             = kv >= anchor+i-(window-1))

    Positions are within-document, so for the same document position differences are packed
    index differences. Blocks never see each other (block ids differ); padding blocks have
    document -1 and so see only their own MASK tokens: a finite softmax over no data.

    `visible` is the only definition of the rule: the mask builders below evaluate it on all
    T + N*B keys (dense) or per segment (split); block_mask.py restates it as two key ranges per
    query row (flex, fa4; tests compare them). A segment is a run of at most `segment_rows` query
    rows of consecutive blocks of one document, with the context keys [document start, last anchor
    of the run): every context key its queries may see, and few others (blocks are in anchor
    order). The split path scores a segment's queries against those and each query's own B block
    keys only: the keys left out are provably invisible. On a sliding-window layer the range starts
    at most window - 1 keys before the run's first anchor (`window_segments`).
    """

    block_size: int
    query_doc: torch.Tensor         # [N*B]
    query_pos: torch.Tensor         # [N*B]  RoPE position of each query
    query_anchor_pos: torch.Tensor  # [N*B]
    query_block: torch.Tensor       # [N*B]
    key_doc: torch.Tensor           # [T+N*B]
    key_pos: torch.Tensor           # [T+N*B] RoPE position of each key
    key_block: torch.Tensor         # [T+N*B] -1 for context keys
    blocks: BlockBatch
    segment_rows: int

    @functools.cached_property
    def segments(self) -> list[tuple[int, int, int, int]]:
        """(first query, end query, first ctx key, end ctx key) per segment: host integers, so
        reading the anchors waits for the device; only the split path asks for them."""
        return _segments(self.blocks, max(1, self.segment_rows // self.block_size))

    def window_segments(self, sliding_window: int | None) -> list[tuple[int, int, int, int]]:
        """`segments` with each context range cut to what a window lets the run's queries see: a
        query at offset i of the block anchored at a sees context keys from a + i - window + 1 on,
        so no query of the run sees one before (its first anchor) - window + 1."""
        if sliding_window is None:
            return self.segments
        anchors = self.blocks.host_index()[0]
        b = self.block_size
        return [(q0, q1, min(k1, max(k0, int(anchors[q0 // b]) - sliding_window + 1)), k1)
                for q0, q1, k0, k1 in self.segments]

    @classmethod
    def from_blocks(cls, blocks: BlockBatch, segment_rows: int = 256) -> "AttentionLayout":
        n, b = blocks.num_blocks, blocks.block_size
        device = blocks.block_positions.device
        block_of_query = torch.arange(n, device=device).repeat_interleave(b)
        query_doc = blocks.anchor_doc.repeat_interleave(b)
        query_pos = blocks.block_positions.reshape(-1)
        ctx_block = torch.full((blocks.num_context,), -1, dtype=torch.int64, device=device)
        return cls(
            block_size=b,
            query_doc=query_doc,
            query_pos=query_pos,
            query_anchor_pos=blocks.block_positions[:, 0].repeat_interleave(b),
            query_block=block_of_query,
            key_doc=torch.cat([blocks.context_doc, query_doc]),
            key_pos=torch.cat([blocks.context_positions, query_pos]),
            key_block=torch.cat([ctx_block, block_of_query]),
            blocks=blocks,
            segment_rows=segment_rows,
        )

    @property
    def num_queries(self) -> int:
        return int(self.query_pos.shape[0])

    @property
    def num_keys(self) -> int:
        return int(self.key_pos.shape[0])

    @property
    def num_context(self) -> int:
        return self.num_keys - self.num_queries

    def visible(self, q: torch.Tensor, kv: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
        """True where query index q may attend to key index kv (broadcasting)."""
        context = (self.key_block[kv] < 0) & (self.key_doc[kv] == self.query_doc[q]) \
            & (self.key_pos[kv] < self.query_anchor_pos[q])
        own_block = self.key_block[kv] == self.query_block[q]
        seen = context | own_block
        if sliding_window is not None:
            distance = self.query_pos[q] - self.key_pos[kv]
            seen = seen & (distance >= 0) & (distance < sliding_window)
        return seen

    def dense_mask(self, sliding_window: int | None) -> torch.Tensor:
        """[N*B, T+N*B] bool over all keys (scaled_dot_product_attention)."""
        device = self.query_pos.device
        q = torch.arange(self.num_queries, device=device)[:, None]
        kv = torch.arange(self.num_keys, device=device)[None, :]
        return self.visible(q, kv, sliding_window)

    def split_masks(self, sliding_window: int | None) -> list[torch.Tensor]:
        """Per segment of `window_segments`: [rows, ctx keys + B] bool over its context keys, then
        each query's own block."""
        device = self.query_pos.device
        masks = []
        for q0, q1, k0, k1 in self.window_segments(sliding_window):
            q = torch.arange(q0, q1, device=device)[:, None]
            own_keys = self.num_context + self.query_block[q0:q1, None] * self.block_size \
                + torch.arange(self.block_size, device=device)[None, :]
            kv = torch.cat([torch.arange(k0, k1, device=device)[None, :].expand(q1 - q0, -1), own_keys], dim=1)
            masks.append(self.visible(q, kv, sliding_window))
        return masks


MIN_LAST_CHUNK_QUERIES = 256   # two of flex attention's 128-row query tiles


def chunk_bounds(n: int, blocks_per_chunk: int, block_size: int) -> list[tuple[int, int]]:
    """[first, end) block rows of each chunk: `blocks_per_chunk` at a time, except that a last
    chunk of fewer than MIN_LAST_CHUNK_QUERIES block tokens joins the one before it. Dynamo
    specialises a size of 1: a last chunk of one query tile would compile the layers once more for
    every such batch (on the H200 the trainer reached dynamo's recompile limit)."""
    if blocks_per_chunk < 1:
        raise BlockError(f"blocks_per_chunk must be >= 1, got {blocks_per_chunk}")
    bounds = [(i, min(n, i + blocks_per_chunk)) for i in range(0, max(n, 1), blocks_per_chunk)]
    if len(bounds) > 1 and (bounds[-1][1] - bounds[-1][0]) * block_size < MIN_LAST_CHUNK_QUERIES:
        bounds[-2:] = [(bounds[-2][0], bounds[-1][1])]
    return bounds


def segment_firsts(docs: np.ndarray, blocks_per_segment: int) -> np.ndarray:
    """The first block of each segment: runs of consecutive blocks of one document (padding
    blocks, document -1, form runs too), cut every `blocks_per_segment` blocks."""
    n = len(docs)
    change = np.ones(n, dtype=bool)
    change[1:] = docs[1:] != docs[:-1]
    run_start = np.maximum.accumulate(np.where(change, np.arange(n), 0))
    return np.flatnonzero(change | ((np.arange(n) - run_start) % max(1, blocks_per_segment) == 0))


def _segments(blocks: BlockBatch, blocks_per_segment: int) -> list[tuple[int, int, int, int]]:
    """Runs of consecutive same-document blocks and the context range they can see (see AttentionLayout)."""
    b = blocks.block_size
    anchors, docs, doc_start = blocks.host_index()
    firsts = segment_firsts(docs, blocks_per_segment)
    segments: list[tuple[int, int, int, int]] = []
    for first, end in zip(firsts.tolist(), np.append(firsts[1:], len(docs)).tolist()):
        real = docs[first] >= 0
        segments.append((first * b, end * b, int(doc_start[first]) if real else 0,
                         int(anchors[first:end].max()) if real else 0))
    return segments


@dataclass(frozen=True)
class BlockDrawer:
    """Anchors drawn with a seed -> a batch's DFlash blocks on `device` (training and held-out
    eval alike)."""
    max_anchors: int
    block_size: int
    mask_token_id: int
    gamma: float
    device: torch.device

    def __call__(self, batch: PackedBatch, seed: int) -> BlockBatch:
        gen = torch.Generator().manual_seed(seed)
        anchors = sample_anchors(batch.loss_mask.cpu(), batch.doc_lens.cpu(), self.max_anchors, gen)
        return build_blocks(batch, anchors.to(self.device), self.block_size, self.mask_token_id, self.gamma)
