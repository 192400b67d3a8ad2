"""The drafter's attention as one masked call a layer and chunk (the `fa4` and `flex` paths).

Keys are what the layer concatenates, the chunk's context followed by every block's own keys;
queries come folded (`block_flash.fold_queries`: the g query heads of a key head are rows of
it, row t*g + j for token t), so no key or value is copied or expanded to the query heads. Each
folded row sees two runs of keys, and nothing else (`AttentionLayout.visible`, restated as ranges;
the tests compare the two):

    context   [lo_ctx, hi_ctx)   its document's first context key .. its block's anchor (exclusive);
                                 on a sliding layer from anchor + i - (window - 1) on (i: offset in the block)
    own block [lo_own, hi_own)   its block's B keys; on a sliding layer causal and inside the window
                                 (padding blocks: their own keys only)

    keys:     [ ctx 0 ..... T-1 | blk0 keys | blk1 keys | ... ]
    row of blk1, offset i:   [lo_ctx ... hi_ctx)    [lo_own, hi_own)

`flex_attention` takes the rule as `mask_mod` and a `BlockMask` that lists, per 128-row query tile,
the 64-key tiles some row sees (partial: the mask is applied) and those every row sees in full. The
block mask is computed from the ranges at tile granularity (difference arrays over the tiles), not
by evaluating the mask on every (row, key) pair as `create_block_mask` does: at 32K tokens and 512
anchors that is 73,728 folded rows by 40,960 keys a chunk.

On an SM90 GPU with flash-attn-4 installed the `fa4` path runs flex's FLASH backend: FlashAttention
4's CuTe-DSL kernels, forward and backward, from this block mask (docs/benchmarks.md: one masked
call a layer replaces FlashAttention 2's key copies, their gathers and the fp32 sums of their
gradients). Two of its conditions shape this module:
- The KV tile is 64 keys: at head size 256 its SM90 kernels take a sparse KV block equal to their
  tile (a 128-key block fails to compile).
- The mask captures tensors of a fixed size, marked static (`static=True`): a captured tensor of a
  symbolic size brings its size symbol into the mask's graph, which the FLASH lowering refuses
  under a dynamic-shape compile ("NYI: score_mod or mask_mod captures a dynamic scalar"). So the
  ranges are padded (empty ranges) to MIN_STATIC_ROWS or the next power of two of rows: a layer
  compiled with dynamic shapes compiles once for every chunk up to the default size and again
  only for a chunk past it, never per batch.
`flex` runs the same call on flex's Triton kernels (any CUDA GPU; eager on the CPU, forward only).
"""
from __future__ import annotations

import functools
import logging
import threading
from typing import Any

import torch

from drafter_trainer.blocks import BlockBatch

Q_TILE, KV_TILE = 128, 64          # the block mask's tiles (KV: FA4's SM90 tile at head size 256)
# The static ranges' least capacity: every chunk up to it shares one compiled graph (the default
# chunk, 768 blocks of 16 with 6 query heads a key head, is 73,728 rows; 2 MB of ranges). Each
# capacity is a graph of its own, and dynamo runs a layer eager after 8.
MIN_STATIC_ROWS = 1 << 17
# A chunk of under 128 queries (a batch's last, a test's) would otherwise take inductor's
# flex-decoding kernel, meant for a few queries over a long cache: on the H200 it found no kernel
# configuration for head size 16 and failed to compile. Block queries are never decoding.
FLEX_KERNEL_OPTIONS = {"FORCE_USE_FLEX_ATTENTION": True}
FA4_KERNEL_OPTIONS = {"BACKEND": "FLASH"}

log = logging.getLogger("dfpipe.trainer")


def row_ranges(blocks: BlockBatch, groups: int, window: int | None) -> torch.Tensor:
    """[4, N*B*groups] int32: (lo_ctx, hi_ctx, lo_own, hi_own) of every folded query row of `blocks`
    (module docstring), indices into [context ; block keys]. Computed on the blocks' device."""
    n, b, t = blocks.num_blocks, blocks.block_size, blocks.num_context
    device = blocks.anchors.device
    valid = blocks.anchor_doc >= 0
    # a block sees its document's context from the document's first token of the chunk on
    lo_ctx = torch.where(valid, blocks.doc_starts(), 0)[:, None].expand(n, b)
    hi_ctx = torch.where(valid, blocks.anchors, 0)[:, None].expand(n, b)
    own = (t + torch.arange(n, device=device) * b)[:, None]
    offset = torch.arange(b, device=device)[None, :]
    lo_own, hi_own = own.expand(n, b), (own + b).expand(n, b)
    if window is not None:
        lo_ctx = torch.maximum(lo_ctx, hi_ctx + offset - (window - 1))
        lo_own, hi_own = own + (offset - (window - 1)).clamp_min(0), own + offset + 1
    ranges = torch.stack([lo_ctx, hi_ctx, lo_own, hi_own]).reshape(4, n * b)
    return ranges.repeat_interleave(groups, dim=1).to(torch.int32)


def _tiles_of(lo: torch.Tensor, hi: torch.Tensor, row_tile: torch.Tensor, q_tiles: int, kv_tiles: int,
              inner: bool) -> torch.Tensor:
    """[q_tiles, kv_tiles] int32: per query tile, how many of its rows' ranges [lo, hi) touch (or,
    `inner`, contain) each KV tile, by a difference array over the tiles."""
    if inner:
        first, end = (lo + KV_TILE - 1) // KV_TILE, hi // KV_TILE
    else:
        first, end = lo // KV_TILE, (hi + KV_TILE - 1) // KV_TILE
    live = ((lo < hi) & (first < end)).to(torch.int32)     # an empty range (lo >= hi) counts nowhere
    diff = torch.zeros(q_tiles, kv_tiles + 1, dtype=torch.int32, device=lo.device)
    diff.index_put_((row_tile, first.clamp_max(kv_tiles).long()), live, accumulate=True)
    diff.index_put_((row_tile, end.clamp_max(kv_tiles).long()), -live, accumulate=True)
    return diff.cumsum(1, dtype=torch.int32)[:, :kv_tiles]


def _listed(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A BlockMask's (num_blocks, indices) for the True tiles of [q_tiles, kv_tiles]: per query
    tile the count and the tile indices, listed ones first in ascending order."""
    order = torch.sort((~tiles).to(torch.int8), dim=1, stable=True).indices
    return tiles.sum(1, dtype=torch.int32)[None, None], order.to(torch.int32)[None, None]


def interval_mask_mod(lo_ctx: torch.Tensor, hi_ctx: torch.Tensor, lo_own: torch.Tensor, hi_own: torch.Tensor):
    """The rule as flex's mask_mod: the key is in the row's context range or its own block's."""
    def mask_mod(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return ((kv >= lo_ctx[q]) & (kv < hi_ctx[q])) | ((kv >= lo_own[q]) & (kv < hi_own[q]))
    return mask_mod


def block_mask_of(ranges: torch.Tensor, num_keys: int, static: bool = False) -> Any:
    """A flex BlockMask over `num_keys` keys for the folded rows whose ranges `row_ranges` gave: a KV
    tile is partial for a query tile when some row's range touches it, full when every row's range
    contains it (a row's two ranges never meet: hi_ctx <= anchor < T <= lo_own). `static`: the
    captured ranges padded and marked static, for a compiled layer (module docstring)."""
    from torch.nn.attention.flex_attention import BlockMask

    rows = ranges.shape[1]
    q_tiles, kv_tiles = -(-rows // Q_TILE), -(-num_keys // KV_TILE)
    row_tile = torch.arange(rows, device=ranges.device) // Q_TILE
    lo_ctx, hi_ctx, lo_own, hi_own = ranges
    touched = _tiles_of(lo_ctx, hi_ctx, row_tile, q_tiles, kv_tiles, False) \
        + _tiles_of(lo_own, hi_own, row_tile, q_tiles, kv_tiles, False)
    covered = _tiles_of(lo_ctx, hi_ctx, row_tile, q_tiles, kv_tiles, True) \
        + _tiles_of(lo_own, hi_own, row_tile, q_tiles, kv_tiles, True)
    rows_in_tile = (rows - torch.arange(q_tiles, device=ranges.device) * Q_TILE).clamp_max(Q_TILE)
    full = covered == rows_in_tile[:, None].to(torch.int32)
    partial = (touched > 0) & ~full
    captured = ranges
    if static:
        captured = torch.zeros(4, max(MIN_STATIC_ROWS, 1 << (rows - 1).bit_length()), dtype=ranges.dtype,
                               device=ranges.device)
        captured[:, :rows] = ranges
    # four tensors of their own: the FLASH lowering indexes a captured tensor from its start
    parts = [x.clone() for x in captured.unbind(0)]
    if static:
        from torch._dynamo import mark_static

        for x in parts:
            mark_static(x)
    return BlockMask.from_kv_blocks(*_listed(partial), *_listed(full), BLOCK_SIZE=(Q_TILE, KV_TILE),
                                    mask_mod=interval_mask_mod(*parts), seq_lengths=(rows, num_keys))


def block_mask_of_blocks(blocks: BlockBatch, groups: int, window: int | None, static: bool = False) -> Any:
    """The BlockMask of one chunk's folded rows over [context ; block keys]."""
    return block_mask_of(row_ranges(blocks, groups, window), blocks.num_context + blocks.num_blocks * blocks.block_size,
                         static)


_compiled_flex = None


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any, fa4: bool) -> torch.Tensor:
    """q [R, h_kv, d] folded rows, k / v [T + N*B, h_kv, d] -> [R, h_kv, d]: one flex call, on FA4's
    kernels (`fa4`) or flex's Triton ones. Inside a compiled layer flex is called as it is (the
    layer's graph lowers it); called eagerly on CUDA it is compiled once, with dynamic shapes."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention as flex

    options = FA4_KERNEL_OPTIONS if fa4 else FLEX_KERNEL_OPTIONS
    args = [x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)]      # [1, h_kv, L, d] views
    if q.device.type != "cuda" or torch.compiler.is_compiling():
        out = flex(*args, block_mask=block_mask, kernel_options=options)
    else:
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex, dynamic=True)
        out = _compiled_flex(*args, block_mask=block_mask, kernel_options=options)
    return out.squeeze(0).transpose(0, 1).contiguous()   # a view when flex kept q's layout


# -- FA4's availability ---------------------------------------------------------------------------
_probe_lock = threading.Lock()


def fa4_missing(device: torch.device) -> str | None:
    """What the `fa4` path lacks on `device` before any probe (None: nothing): a CUDA SM90 GPU,
    flash-attn-4, torch's flex FLASH backend. Cheap: the trainer's preflight asks it for an explicit
    `drafter.attn: fa4`."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return "FlashAttention 4 runs on CUDA GPUs only"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        return f"FlashAttention 4's Hopper kernels run on SM90 GPUs (H100, H200); {device} is sm_{major}{minor}"
    try:
        import flash_attn.cute  # noqa: F401
        from torch._inductor.kernel.flex.flex_flash_attention import ensure_flash_available
    except ImportError as e:
        return f"flash-attn-4 or torch's flex FLASH backend is missing ({e}): pip install -r requirements/gpu-fa4.txt"
    if not ensure_flash_available():
        return "torch's flex FLASH backend cannot load flash-attn-4"
    return None


@functools.lru_cache(maxsize=None)
def _fa4_problem(head_dim: int, device_index: int) -> str | None:
    device = torch.device("cuda", device_index)
    missing = fa4_missing(device)
    if missing is not None:
        return missing
    if head_dim % 8 or head_dim > 256:
        return f"head size {head_dim}: FA4's SM90 kernels take multiples of 8 up to 256"
    try:
        err = probe_fa4(head_dim, device)
    except Exception as e:   # noqa: BLE001 - any failure of the probe means: not here
        return f"its start-up probe failed: {type(e).__name__}: {str(e)[:300]}"
    if err > PROBE_MAX_REL_ERR:
        return f"its start-up probe disagrees with FlashAttention 2 (relative error {err:.3g} > {PROBE_MAX_REL_ERR})"
    log.info("drafter attention: FlashAttention 4 (fa4); its start-up probe agrees with FlashAttention 2 "
             "(relative error %.3g)", err)
    return None


def fa4_problem(head_dim: int) -> str | None:
    """Why the `fa4` path cannot run on the current CUDA device (None: it can): `fa4_missing`, a head
    size its kernels lack, or the start-up probe (`probe_fa4`) failing or disagreeing. Probed once
    per process, device and head size; the first caller waits for it (a compile of a few seconds)."""
    if not torch.cuda.is_available():
        return "FlashAttention 4 runs on CUDA GPUs only"
    with _probe_lock:
        return _fa4_problem(head_dim, torch.cuda.current_device())


# bf16 outputs and gradients of two kernels over <= 1K keys: a few bf16 steps (eps 2^-7) apart
PROBE_MAX_REL_ERR = 0.03


def probe_fa4(head_dim: int, device: torch.device) -> float:
    """A small forward and backward of the fa4 path (compiled with dynamic shapes, as a layer runs
    it) against FlashAttention 2's (`block_flash`) on random bf16 inputs with the DFlash mask: two
    documents, 24 anchors, 2 key heads of 3 query heads. Returns the largest relative error of the
    output and the three gradients (max |a - b| / max |b|)."""
    from drafter_trainer.block_flash import block_flash_attention, plan_of_blocks
    from drafter_trainer.blocks import build_blocks
    from common.batch import PackedBatch

    gen = torch.Generator(device).manual_seed(0)
    lens = torch.tensor([300, 212], device=device)
    t = int(lens.sum())
    batch = PackedBatch(hidden=torch.empty(1, t, 1, device=device), input_ids=torch.zeros(t, dtype=torch.int64, device=device),
                        loss_mask=torch.ones(t, dtype=torch.int64, device=device),
                        position_ids=torch.cat([torch.arange(int(n), device=device) for n in lens]), doc_lens=lens,
                        sample_ids=torch.arange(2, device=device), doc_ids=torch.arange(2, device=device))
    anchors = torch.cat([torch.arange(5, 290, 24), 300 + torch.arange(3, 200, 17)]).to(device)
    blocks = build_blocks(batch, anchors, 16, 0, 7.0)
    h_kv, groups = 2, 3
    rows, keys = blocks.num_blocks * 16 * groups, t + blocks.num_blocks * 16
    q, k, v = (torch.randn(n, h_kv, head_dim, device=device, generator=gen, dtype=torch.bfloat16)
               for n in (rows, keys, keys))
    dout = torch.randn(rows, h_kv, head_dim, device=device, generator=gen, dtype=torch.bfloat16)
    results = []
    for fa4 in (True, False):
        leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
        out = (masked_attention(*leaves, block_mask_of_blocks(blocks, groups, None, static=True), fa4=True) if fa4
               else block_flash_attention(*leaves, plan_of_blocks(blocks, 8, groups)))
        out.backward(dout)
        results.append([out.detach().float()] + [x.grad.float() for x in leaves])
    return max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-6)) for a, b in zip(*results))
