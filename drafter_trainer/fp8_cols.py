"""Column-wise e4m3 quantization with a transposed output, as one Triton kernel (CUDA).

`fp8.quantize_cols(x)` quantizes the columns of x [R, C] (one scale per column, over all R rows)
and writes the result transposed, [C, R] row-major: the layout cuBLAS's FP8 matmul reads for a
contraction over R (the weight gradient's tokens; the input gradient's output features). Inside a
compiled layer inductor fused this into one reduction kernel whose reads (or writes) cross rows:
on the H200 at the 27B widths it ran at about 65 GB/s, 6.6 ms for one [12288, 17408] gradient
(docs/benchmarks.md), where a tiled kernel moves the same bytes in well under a millisecond.

Two passes, each over [BLOCK_R, BLOCK_C] tiles of x (rows contiguous), one program a tile so
every SM has work (one program per column strip walking all R rows left most of the H200 idle:
723 ms of a 3.9 s FP8 step in run CA): pass 1 writes each tile's column maxima to a small [tiles
along R, C] buffer, which torch reduces to one maximum per column; pass 2 scales, casts and stores
its tile transposed (through shared memory: the stores are contiguous along R). x is read twice
and the e4m3 result written once.

It is a torch custom op (`dfpipe::fp8_quantize_cols`): opaque to inductor, which calls it where
the graph needs it instead of fusing it into the kernels around it. Rows of a tensor are
quantized by inductor's own fused kernels (a reduction along contiguous memory).
"""
from __future__ import annotations

import torch

try:        # Triton comes with CUDA builds of torch; CPU installs have none
    import triton
    import triton.language as tl
except ImportError:
    triton = None

E4M3 = torch.float8_e4m3fn
BLOCK_R, BLOCK_C = 128, 64


# Known at import: quantize_cols asks inside compiled layers, where dynamo would trace a cache wrapper.
AVAILABLE = triton is not None and torch.cuda.is_available()


if triton is not None:
    @triton.jit
    def _column_maxima(x_ptr, stride_r, part_ptr, R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        """part[i, c] = the largest |x| of column c in row tile i; NaN if the tile's column holds one."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        inside = (rows[:, None] < R) & (cols[None, :] < C)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_r + cols[None, :], mask=inside, other=0.0)
        x = x.to(tl.float32)
        amax = tl.max(tl.abs(x), axis=0)
        nan = tl.max((x != x).to(tl.int32), axis=0)       # max may drop a NaN: carry it apart
        tl.store(part_ptr + tl.program_id(0) * C + cols, tl.where(nan > 0, float("nan"), amax), mask=cols < C)

    @triton.jit
    def _quantize_cols(x_ptr, stride_r, amax_ptr, out_ptr, scale_ptr, R, C, FP8_MAX: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        col_in = cols < C
        amax = tl.load(amax_ptr + cols, mask=col_in, other=0.0)
        # all-zero columns: scale 1 (zeros either way). A NaN makes its column's scale NaN, so the
        # matmul's result is NaN and the step's finite check skips the step (max and clamp may
        # drop a NaN, the scale keeps it).
        scale = tl.where(amax > 0, amax / FP8_MAX, 1.0)
        scale = tl.where(amax != amax, float("nan"), scale)
        if tl.program_id(0) == 0:
            tl.store(scale_ptr + cols, scale, mask=col_in)
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        inside = (rows[:, None] < R) & col_in[None, :]
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_r + cols[None, :], mask=inside, other=0.0)
        q = tl.minimum(tl.maximum(x.to(tl.float32) / scale[None, :], -FP8_MAX), FP8_MAX)
        q_t = tl.trans(q.to(out_ptr.dtype.element_ty))                       # [BLOCK_C, BLOCK_R]
        tl.store(out_ptr + cols[:, None].to(tl.int64) * R + rows[None, :], q_t,
                 mask=col_in[:, None] & (rows[None, :] < R))


def quantize_cols_kernel(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] (rows contiguous) -> (e4m3 [C, R] row-major, fp32 scale [C, 1]): column c of x is
    q[c] * scale[c]."""
    r, c = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((c, r), dtype=E4M3, device=x.device)
    scale = torch.empty((c, 1), dtype=torch.float32, device=x.device)
    if r and c:
        tiles_r = triton.cdiv(r, BLOCK_R)
        grid = (tiles_r, triton.cdiv(c, BLOCK_C))
        part = torch.empty((tiles_r, c), dtype=torch.float32, device=x.device)
        _column_maxima[grid](x, x.stride(0), part, r, c, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C)
        amax = part.amax(dim=0)     # a NaN propagates (torch's max keeps it)
        _quantize_cols[grid](x, x.stride(0), amax, out, scale, r, c, FP8_MAX=float(torch.finfo(E4M3).max),
                             BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C)
    return out, scale


@torch.library.custom_op("dfpipe::fp8_quantize_cols", mutates_args=())
def quantize_cols_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_cols_kernel(x)


@quantize_cols_op.register_fake
def _(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r, c = x.shape
    return x.new_empty((c, r), dtype=E4M3), x.new_empty((c, 1), dtype=torch.float32)
