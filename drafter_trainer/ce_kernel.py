"""The loss head's elementwise half as one Triton kernel (CUDA): `loss.softmax_cross_entropy`'s
contract, over a [rows, V] chunk of bf16 / fp16 logits.

One program per row, two passes over it:
    1. the online softmax over the row in BLOCK-wide tiles: running max, running sum of
       exponentials rescaled when the max moves, the first index of the max (argmax), then the
       row's log-sum-exp and the label's logit -> w * CE of the row, argmax;
    2. (with a gradient) w * (exp(x - lse) - onehot) written over the logits in their dtype.

So a logit is read twice and written once: about 6 bytes per bf16 logit, the least a two-pass
softmax gradient can move. Inductor's compile of the torch spelling ran as a reduction kernel at
about 1 TB/s and a pointwise one at about 2 on the H200: 191 ms of a 4.9 s step at the 27B shape,
against this kernel's 114 ms for the same 176 chunks (docs/benchmarks.md, runs AA6 and AA8). And
the first step needs no compile for it, only Triton's JIT, cached on disk.

The math is the reference's, in fp32 from the half-precision logits: ties of the max go to the
first index (torch.argmax), a NaN logit makes the row's CE and gradient NaN (the step then skips
on its finite check), the label's logit is read from the row itself.
"""
from __future__ import annotations

import functools

import torch

try:        # Triton comes with CUDA builds of torch; CPU installs have none
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# Tile width and warps: 8 fp32 values per thread; a 248K vocabulary is 31 tiles a pass.
BLOCK = 8192
NUM_WARPS = 32


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether the kernel can run here: Triton importable and a CUDA device present."""
    return triton is not None and torch.cuda.is_available()


if triton is not None:
    @triton.jit
    def _softmax_ce_rows(logits_ptr, stride, labels_ptr, weights_ptr, ce_ptr, argmax_ptr, V,
                         NEED_GRAD: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
        label = tl.load(labels_ptr + row)
        w = tl.load(weights_ptr + row).to(tl.float32)
        m = float("-inf")
        s = 0.0
        best = 0
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            tile_max = tl.max(x, axis=0)
            tile_arg = tl.argmax(x, axis=0)
            new_m = tl.maximum(m, tile_max)
            s = s * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), axis=0)
            best = tl.where(tile_max > m, start + tile_arg, best)   # strict: an earlier tile keeps a tie
            m = new_m
        lse = m + tl.log(s)
        target = tl.load(base + label).to(tl.float32)
        tl.store(ce_ptr + row, (lse - target) * w)
        tl.store(argmax_ptr + row, best)
        if NEED_GRAD:
            for start in range(0, V, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                inside = cols < V
                x = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32)
                grad = (tl.exp(x - lse) - (cols == label).to(tl.float32)) * w
                tl.store(base + cols, grad.to(logits_ptr.dtype.element_ty), mask=inside)


def softmax_cross_entropy_kernel(logits: torch.Tensor, labels: torch.Tensor, row_weights: torch.Tensor,
                                 need_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """loss.softmax_cross_entropy on CUDA: (sum_r w_r * CE_r in fp32, [R] argmax == label, and with
    need_grad the gradient written over `logits` and returned)."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("the logits' rows must be contiguous")
    ce = torch.empty(rows, dtype=torch.float32, device=logits.device)
    argmax = torch.empty(rows, dtype=torch.int32, device=logits.device)
    if rows:
        _softmax_ce_rows[(rows,)](logits, logits.stride(0), labels.contiguous(), row_weights.contiguous(), ce, argmax,
                                  vocab, NEED_GRAD=need_grad, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return ce.sum(), argmax == labels, logits if need_grad else None
