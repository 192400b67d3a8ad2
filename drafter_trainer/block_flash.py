"""The drafter's attention through FlashAttention's variable-length kernels (the `flash` path).

Who sees whom is AttentionLayout's rule: a block's queries see their document's context strictly
before the block's anchor, and their own block. No FlashAttention mask says that, but the keys
split into two parts that need none:

    part A, per segment (a run of at most `segment_blocks` consecutive blocks of one document):
        the context from the document's start to the segment's first anchor. Every query of
        the segment sees all of it: one varlen sequence, no mask.
    part B, per block: the context from the segment's first anchor to the block's own anchor
        (the keys the segment's blocks see a different amount of), then the block's own keys.
        Every query of the block sees all of them: one varlen sequence per block, no mask.

Each part's keys are gathered into the contiguous runs varlen attention reads (a context key is
copied once per segment that sees it in A, and once per block in B), the two partial softmaxes
are merged by their log-sum-exps, and the backward runs each part's kernel against the merged
output and log-sum-exp (exactly the gradient of the whole softmax) and sums the copies' key
gradients back in fp32.

The copies grow with the document, not with the chunk: in a long document with few anchors a
segment spans thousands of tokens and each of its blocks copies the run from the segment's first
anchor to its own in part B (at 32K tokens and 512 anchors, about 2,000 keys per block: 1.5M
copied keys for a chunk of 768 blocks, 3 GB per gathered K or V at the 27B shape). So a part runs
as several kernel calls, each over consecutive sequences gathering at most `MAX_CALL_KEYS` keys
(one call whenever the part fits, as it always does for chat-length documents): what a call
copies is freed before the next one gathers.

Queries come folded (`fold_queries`): the g query heads that share a key head are rows of it, so
a block is B * g rows of h_kv heads that all see the same keys, and the kernels' 64-128-row query
tiles are mostly full in part B (B = 16 rows alone would leave them mostly idle). Folding is a
view when the query heads are group-major: the model reorders q_proj's rows and o_proj's columns
so (`group_major`; the checkpoint keeps its order), fused into autocast's bf16 cast of the
weights: slower than a plain cast (0.09 s of a 4.9 s step on the H200), but permuting q and the
output took 0.17 s (docs/benchmarks.md, runs AA5 and AA6).

Why: at the published density a chunk's few context keys serve thousands of block queries. Flex
attention's backward gives each key tile one program that walks every query tile seeing it; at
head size 256 that backward ran at about a tenth of its forward's rate on the H200. Here the work
per program is bounded by the segment.

On CUDA the kernels are torch's FlashAttention (`torch.ops.aten._flash_attention_forward` /
`_backward`); elsewhere a plain reference of the same contract, so the CPU tests check the
decomposition, the merge and the gradients against the other paths.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from drafter_trainer.blocks import BlockBatch, segment_firsts


# Keys one varlen call gathers at most (K and V copies of 512 MB each at 4 key heads x 256, bf16).
MAX_CALL_KEYS = 1 << 18


@dataclass
class VarlenPart:
    """One varlen attention call over the query rows [q0, q1) of the folded queries: its rows cut
    at `cu_q`, keys gathered by `key_index` and cut at `cu_k` (int32 boundaries from the call's own
    first row and key, as the kernels take them). `rows`: its queries whose sequence has a key,
    None when all have (a query without keys takes no part in this part's softmax)."""

    key_index: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    rows: torch.Tensor | None
    q0: int = 0
    q1: int = 0


def group_major(t: torch.Tensor, kv_heads: int, groups: int, dim: int) -> torch.Tensor:
    """`t` with h_kv * g heads of d entries along `dim`, in the checkpoint's order (head c*g + j is
    query head j of key head c), reordered group-major (head j*h_kv + c). A copy. The inverse is
    group_major(t, groups, kv_heads, dim): the same transpose of the [g, h_kv] grid."""
    dim = dim % t.dim()
    return t.unflatten(dim, (kv_heads, groups, -1)).transpose(dim, dim + 1).flatten(dim, dim + 2)


def fold_queries(q: torch.Tensor, groups: int) -> torch.Tensor:
    """[L, g*h_kv, d] queries with their heads group-major (`group_major`) -> [L*g, h_kv, d]: query
    head j of key head c at token t becomes row t*g + j of head c. A view: no copy."""
    rows, heads, d = q.shape
    return q.view(rows * groups, heads // groups, d)


def unfold_queries(x: torch.Tensor, groups: int) -> torch.Tensor:
    """fold_queries inverted, flattened for the output projection: [L*g, h_kv, d] -> [L, g*h_kv*d],
    heads group-major. A view."""
    rows, h_kv, d = x.shape
    return x.view(rows // groups, groups * h_kv * d)


class FlashPlan:
    """The two parts of one chunk's attention, each the kernel calls that cover all its query rows
    in order. A plain object: opaque to torch.compile (a compiled layer hands it to the eager
    attention without guarding on what is inside)."""

    __slots__ = ("parts",)

    def __init__(self, parts: list[list[VarlenPart]]) -> None:
        self.parts = parts


def concat_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """[starts[0], starts[0]+lengths[0]) ++ [starts[1], ...) ... as one int64 array."""
    lengths = lengths.astype(np.int64)
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(starts.astype(np.int64) - offsets, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)


def _boundaries(lengths: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def flash_plan(anchors: Sequence[int], docs: Sequence[int], doc_starts: Sequence[int], num_context: int,
               block_size: int, segment_blocks: int, groups: int, device: torch.device,
               max_call_keys: int | None = None) -> FlashPlan:
    """The plan of one chunk from host values: per block its anchor (index into the chunk's
    context), its document (-1: padding) and its document's first context index; `groups` query
    heads per key head (a block's folded rows: groups * block_size); a part's calls gather at most
    `max_call_keys` (None: MAX_CALL_KEYS) keys each (a single sequence with more is a call of its own).
    Blocks are in anchor order (build_blocks), so a segment's first anchor is its least and the
    part-B ranges are never negative. Padding blocks see only their own block."""
    max_call_keys = MAX_CALL_KEYS if max_call_keys is None else max_call_keys
    anchors = np.asarray(anchors, dtype=np.int64)
    docs = np.asarray(docs, dtype=np.int64)
    starts = np.asarray(doc_starts, dtype=np.int64)
    n, b = len(anchors), block_size
    valid = docs >= 0
    seg_first = segment_firsts(docs, segment_blocks)
    seg_blocks = np.diff(np.append(seg_first, n))
    seg_of_block = np.repeat(np.arange(len(seg_first)), seg_blocks)
    first_anchor = np.where(valid[seg_first], anchors[seg_first], 0)

    a_len = np.where(valid[seg_first], first_anchor - starts[seg_first], 0)
    part_a = _part(concat_ranges(starts[seg_first], a_len), seg_blocks * b * groups, a_len, device, max_call_keys)

    stair = np.where(valid, anchors - first_anchor[seg_of_block], 0)
    own = num_context + np.arange(n, dtype=np.int64) * b
    # per block: [first anchor of its segment, its anchor) then its own B keys
    key_starts = np.stack([first_anchor[seg_of_block], own], axis=1).reshape(-1)
    key_lens = np.stack([stair, np.full(n, b)], axis=1).reshape(-1)
    part_b = _part(concat_ranges(key_starts, key_lens), np.full(n, b * groups), stair + b, device, max_call_keys)
    return FlashPlan([p for p in (part_a, part_b) if p])


def call_bounds(k_lens: np.ndarray, max_call_keys: int) -> list[tuple[int, int]]:
    """[first, end) sequences of each call: consecutive sequences, at most `max_call_keys` keys
    together (a longer sequence alone)."""
    bounds, first, keys = [], 0, 0
    for i, n in enumerate(k_lens.tolist()):
        if i > first and keys + n > max_call_keys:
            bounds.append((first, i))
            first, keys = i, 0
        keys += n
    return [*bounds, (first, len(k_lens))]


def _part(key_index: np.ndarray, q_lens: np.ndarray, k_lens: np.ndarray, device: torch.device,
          max_call_keys: int) -> list[VarlenPart]:
    if not len(key_index):
        return []
    pinned = device.type == "cuda"

    def up(a: np.ndarray) -> torch.Tensor:   # pinned, asynchronous: no wait for the device per chunk
        t = torch.from_numpy(a)
        return (t.pin_memory() if pinned else t).to(device, non_blocking=True)
    cu_q, cu_k = _boundaries(q_lens).astype(np.int64), _boundaries(k_lens).astype(np.int64)
    calls = []
    for s0, s1 in call_bounds(k_lens, max_call_keys):
        ql, kl = q_lens[s0:s1], k_lens[s0:s1]
        rows = up(np.repeat(kl > 0, ql)) if (kl == 0).any() else None
        calls.append(VarlenPart(key_index=up(key_index[cu_k[s0]:cu_k[s1]]), cu_q=up(_boundaries(ql)),
                                cu_k=up(_boundaries(kl)), max_q=int(ql.max()), max_k=int(kl.max()), rows=rows,
                                q0=int(cu_q[s0]), q1=int(cu_q[s1])))
    return calls


# -- kernels ------------------------------------------------------------------------------------
def _flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: VarlenPart, scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, p.cu_q, p.cu_k, p.max_q, p.max_k, 0.0, False, False, scale=scale)
    return out, lse, (rng, unused)


def _flash_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, p: VarlenPart, scale: float, rng: tuple[torch.Tensor, torch.Tensor]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse, p.cu_q, p.cu_k, p.max_q, p.max_k, 0.0, False, rng[0], rng[1], scale=scale)


def _reference_scores(q: torch.Tensor, k: torch.Tensor, p: VarlenPart, scale: float):
    """Per sequence: (query rows, key rows, fp32 scores [h, rows, keys]). Queries come folded, so
    query and key heads are the same heads."""
    cu_q, cu_k = p.cu_q.tolist(), p.cu_k.tolist()
    for i in range(len(cu_q) - 1):
        rq, rk = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        yield rq, rk, torch.einsum("qhd,khd->hqk", q[rq].float(), k[rk].float()) * scale


def _reference_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: VarlenPart, scale: float
                       ) -> tuple[torch.Tensor, torch.Tensor, None]:
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), device=q.device)
    for rq, rk, s in _reference_scores(q, k, p, scale):
        if s.shape[-1]:
            lse[:, rq] = torch.logsumexp(s, dim=-1)
            out[rq] = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v[rk].float())
    return out.to(q.dtype), lse, None


def _reference_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, p: VarlenPart, scale: float, rng: Any
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attention backward of one part against the merged output and log-sum-exp."""
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    delta = (dout.float() * out.float()).sum(-1).t()                           # [h, Q]
    for rq, rk, s in _reference_scores(q, k, p, scale):
        prob = torch.exp(s - lse[:, rq, None])                                  # [h, q, k]
        do = dout[rq].float()
        dv[rk] += torch.einsum("hqk,qhd->khd", prob, do)
        ds = prob * (torch.einsum("qhd,khd->hqk", do, v[rk].float()) - delta[:, rq, None]) * scale
        dq[rq] += torch.einsum("hqk,khd->qhd", ds, k[rk].float())
        dk[rk] += torch.einsum("hqk,qhd->khd", ds, q[rq].float())
    return dq, dk, dv


def _part_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, calls: list[VarlenPart], scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor, list[Any]]:
    """One part's output [R, h_kv, d] and log-sum-exp [h_kv, R] over all query rows, call by call."""
    fwd = _flash_forward if q.is_cuda else _reference_forward
    out = lse = None
    if len(calls) > 1:
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    rngs = []
    for c in calls:
        o, lse_c, rng = fwd(q[c.q0:c.q1], k.index_select(0, c.key_index), v.index_select(0, c.key_index), c, scale)
        if c.rows is not None:       # queries without a key here: no share of this part
            lse_c = lse_c.masked_fill(~c.rows, float("-inf"))
            o = o.masked_fill(~c.rows[:, None, None], 0)
        rngs.append(rng)
        if out is None:
            out, lse = o, lse_c
        else:
            out[c.q0:c.q1] = o
            lse[:, c.q0:c.q1] = lse_c
    return out, lse, rngs


class _BlockFlash(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: FlashPlan, scale: float
                ) -> torch.Tensor:
        outs, lses, rngs = zip(*(_part_forward(q, k, v, calls, scale) for calls in plan.parts))
        if len(outs) == 1:
            out, lse = outs[0], lses[0]
        else:
            # the two partial softmaxes weighed by their shares of the whole: wA + wB = 1, so
            # out = oA + wB (oB - oA), one pass
            lse = torch.logaddexp(lses[0], lses[1])                                 # [h_kv, R]
            share_b = torch.exp(lses[1] - lse).t().unsqueeze(-1).to(q.dtype)
            out = torch.lerp(outs[0], outs[1], share_b)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.rngs, ctx.scale = plan, rngs, scale
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        bwd = _flash_backward if q.is_cuda else _reference_backward
        dout = dout.contiguous()
        dq = None
        # a context key has a copy per segment and per block that sees it: fp32 sums of the copies
        dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
        for calls, rngs in zip(ctx.plan.parts, ctx.rngs):
            dq_part = None
            for c, rng in zip(calls, rngs):
                rows = slice(c.q0, c.q1)
                dq_c, dk_c, dv_c = bwd(dout[rows], q[rows], k.index_select(0, c.key_index),
                                       v.index_select(0, c.key_index), out[rows], lse[:, rows].contiguous(), c,
                                       ctx.scale, rng)
                if c.rows is not None:
                    dq_c = dq_c.masked_fill(~c.rows[:, None, None], 0)
                if len(calls) == 1:
                    dq_part = dq_c
                else:
                    if dq_part is None:
                        dq_part = dq_c.new_empty(q.shape)
                    dq_part[rows] = dq_c
                dk.index_add_(0, c.key_index, dk_c.float())
                dv.index_add_(0, c.key_index, dv_c.float())
            dq = dq_part if dq is None else dq + dq_part
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def block_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: FlashPlan) -> torch.Tensor:
    """q [R, h_kv, d] (the blocks' queries, `fold_queries`: each block's B * g rows together),
    k / v [T + N*B, h_kv, d] ([context ; block keys]) -> [R, h_kv, d] in q's row order. Scaled
    by 1 / sqrt(d)."""
    return _BlockFlash.apply(q, k, v, plan, q.shape[-1] ** -0.5)


def plan_of_blocks(blocks: BlockBatch, segment_blocks: int, groups: int,
                   max_call_keys: int | None = None) -> FlashPlan:
    """The plan of a BlockBatch (from the host values its chunking read, or one read of them)."""
    anchors, docs, starts = blocks.host_index()
    return flash_plan(anchors, docs, starts, blocks.num_context, blocks.block_size, segment_blocks, groups,
                      blocks.anchors.device, max_call_keys)
