"""FP8 matmuls for the drafter's step (`drafter.precision: fp8`): scaled e4m3, one scale per row.

A linear layer y = x W^T is three matmuls, and each multiplies two operands along a shared
(contraction) dimension. Every operand is quantized to e4m3 with one fp32 scale per slice along
that dimension ("row-wise": per token, per output feature, per input feature), so an outlier in
one row costs precision in that row only:

    matmul            a (rows scaled)          b (rows scaled)          contraction
    forward  y  = x W^T     x   [M, K]              W    [N, K]                K  (features in)
    grad x   gx = gy W      gy  [M, N]              W^T  [K, N]                N  (features out)
    grad W   gW = gy^T x    gy^T [N, M]             x^T  [K, M]                M  (tokens)

Hence each of x, gy and W is quantized twice, along each of its two axes. A row's scale is its
largest magnitude over 448 (e4m3's largest finite value), so the row fills the format's range
(an all-zero row: 1); a NaN or Inf makes its row NaN, and the step's finite check skips the step
as in bf16. Master weights stay fp32 and are quantized straight from fp32 in every call (no bf16
copy between); activations from the compute dtype (bf16), what autograd saves for the backward,
as for a bf16 linear. Inside a compiled layer inductor fuses each quantization (amax, scale,
cast, transpose) into the kernels around it; eager steps run it as separate kernels.

Three ways to run a scaled matmul:
- "fp8": `torch._scaled_mm` on a GPU with FP8 tensor cores (compute capability 8.9 or newer):
  e4m3 x e4m3 with fp32 accumulation, bf16 out. cuBLAS needs the two non-token dimensions to be
  multiples of 16; the token dimension is padded with zero rows where it is contracted (grad W).
- "fp8-emulated": the same e4m3 values and scales, then the dequantized operands' product in
  fp32, rounded to the compute dtype. Any device: it checks FP8 rounding's effect on training
  (the CPU's fidelity check, dfpipe.toy_target), not its speed.
- anything else: the plain matmul in the compute dtype (the bf16 path).

The frozen target head's two matmuls in the loss (the logits h W^T and the input gradient g W) stay
in the compute dtype in every precision (`loss._ChunkedLinearCrossEntropy`). In e4m3 they lost the
gradient once a drafter's predictions sharpen: g = softmax - onehot shrinks to a few entries, g W
becomes a difference of nearly equal rows of W, and e4m3's 3 mantissa bits of W then decide its
direction; e4m3 logits raise the loss of a sharp drafter by more than 0.5% (docs/benchmarks.md,
"FP8 gradient fidelity along training"; finer scales did not help: the loss is in the mantissa).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from common.config import ConfigError
from drafter_trainer import fp8_cols

PRECISIONS = ("auto", "bf16", "fp8", "fp8-emulated")
E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)      # 448 (for callers: quantize_rows reads finfo itself)
ALIGN = 16                                   # cuBLAS FP8: both non-contracted dims and K multiples of 16


class PrecisionError(ConfigError):
    """drafter.precision asks for FP8 matmuls where none can run."""


@functools.lru_cache(maxsize=None)
def fp8_supported(device_index: int = 0) -> bool:
    """Whether `torch._scaled_mm` runs row-wise scaled e4m3 here: a CUDA GPU of compute capability
    8.9 (Ada) or 9.0+ (Hopper and newer)."""
    if not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def resolve_precision(precision: str, device: torch.device) -> str:
    """The matmul precision the drafter runs, `precision` checked against `device`: auto is fp8
    where FP8 matmuls run (Hopper / Ada), else bf16; fp8 elsewhere is an error saying what to set;
    fp8-emulated runs anywhere. bf16 means the compute dtype (on a CPU fp32, unless
    train.compute_dtype says otherwise)."""
    if precision not in PRECISIONS:
        raise PrecisionError(f"drafter.precision must be one of {PRECISIONS}, got {precision!r}")
    native = device.type == "cuda" and fp8_supported(device.index or 0)
    if precision == "auto":
        return "fp8" if native else "bf16"
    if precision == "fp8" and not native:
        where = "a CPU" if device.type != "cuda" else f"a GPU of compute capability {torch.cuda.get_device_capability(device)}"
        raise PrecisionError(f"drafter.precision fp8 needs FP8 tensor cores (compute capability 8.9 or newer: Ada, "
                             f"Hopper); this is {where}. Set drafter.precision: bf16 (or auto), or fp8-emulated to "
                             "check FP8 rounding's effect on training at bf16 speed or slower")
    return precision


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] -> (e4m3 [R, C], fp32 scale [R, 1]) with x ~= q * scale, one scale per row."""
    # torch.finfo here, not the module's float: dynamo traces a global float as a graph input
    # (floats are not specialised), and a second such function call in one compiled layer then fails
    top = torch.finfo(E4M3).max
    amax = x.abs().amax(dim=1, keepdim=True).float()
    # all-zero rows: any scale gives zeros; 1 keeps 1/scale finite
    scale = torch.where(amax > 0, amax / top, torch.ones_like(amax))
    # row-major whatever x's layout (a transposed view's would be column-major): what cuBLAS reads
    q = (x.float() / scale).clamp_(-top, top).to(E4M3).contiguous()
    return q, scale


def quantize_cols(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] -> the rows of x^T quantized: (e4m3 [C, R] contiguous, fp32 scale [C, 1]); on CUDA
    by a tiled Triton kernel (`fp8_cols` says why), elsewhere `quantize_rows` of the transpose."""
    if x.is_cuda and fp8_cols.AVAILABLE:
        return torch.ops.dfpipe.fp8_quantize_cols(x)
    return quantize_rows(x.t())


def _pad_inner(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero columns appended to both operands up to a multiple of ALIGN in the contracted
    dimension (zeros add nothing to the products)."""
    k = a.shape[1]
    pad = -k % ALIGN
    if not pad:
        return a, b
    return (torch.cat([a, a.new_zeros(a.shape[0], pad)], 1).contiguous(),
            torch.cat([b, b.new_zeros(b.shape[0], pad)], 1).contiguous())


def scaled_mm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
              out_dtype: torch.dtype, emulate: bool) -> torch.Tensor:
    """(a * a_scale) @ (b * b_scale)^T: a [M, K], b [N, K] e4m3 row-major, scales [M, 1], [N, 1]."""
    if emulate:
        with torch.autocast(a.device.type, enabled=False):
            return ((a.float() * a_scale) @ (b.float() * b_scale).t()).to(out_dtype)
    a, b = _pad_inner(a, b)
    # cuBLAS wants b column-major: b.t() of a row-major [N, K] is exactly that
    return torch._scaled_mm(a, b.t(), scale_a=a_scale, scale_b=b_scale.t().contiguous(), out_dtype=out_dtype)


def _out_dtype(x: torch.Tensor, emulate: bool) -> torch.dtype:
    """The compute dtype (autocast's when on, else the input's) emulated; bf16 else, the only one
    _scaled_mm's row-wise path writes."""
    if not emulate:
        return torch.bfloat16
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype


class _Fp8Linear(torch.autograd.Function):
    """y = x W^T with all three matmuls scaled e4m3 (the table in the module docstring), x [M, K].
    No shape arithmetic in here (`linear` flattens and restores the leading dims): a symbolic size
    inside the function breaks dynamo's tracing of a second call in a layer compiled with dynamic
    shapes (torch 2.13: "lift_tracked_freevar_to_input should not be called on root SubgraphTracer")."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, emulate: bool, out_dtype: torch.dtype) -> torch.Tensor:
        x = x.to(out_dtype)                      # what a bf16 linear under autocast saves
        ctx.save_for_backward(x, weight)
        ctx.emulate = emulate
        return scaled_mm(*quantize_rows(x), *quantize_rows(weight), out_dtype, emulate)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = scaled_mm(*quantize_rows(g), *quantize_cols(weight), x.dtype, ctx.emulate)
        if ctx.needs_input_grad[1]:
            grad_w = scaled_mm(*quantize_cols(g), *quantize_cols(x), x.dtype, ctx.emulate).to(weight.dtype)
        return grad_x, grad_w, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, precision: str) -> torch.Tensor:
    """F.linear (no bias) in `precision`: fp8 / fp8-emulated scaled matmuls, else the plain one."""
    if precision == "fp8" or precision == "fp8-emulated":
        emulate = precision == "fp8-emulated"
        y = _Fp8Linear.apply(x.reshape(-1, x.shape[-1]), weight, emulate, _out_dtype(x, emulate))
        return y.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight)
