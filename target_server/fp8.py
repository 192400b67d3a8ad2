"""Block-wise FP8 targets as their makers publish them, and how the target runs one.

A published block-wise FP8 checkpoint (Qwen3 / Qwen3.5 "-FP8", DeepSeek-V3) keeps each quantized
Linear weight as e4m3 values with one dequantization scale per 128 x 128 block:

    config.json   quantization_config: {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                        "weight_block_size": [128, 128],
                                        "modules_to_not_convert": [modules left in bf16]}
    <module>.weight              float8_e4m3fn  [N, K]
    <module>.weight_scale_inv    float32        [ceil(N / 128), ceil(K / 128)]

    W[n, k] = weight[n, k] * weight_scale_inv[n // 128, k // 128]

A block at an edge (N or K not a multiple of 128) is a partial block with a scale of its own, taken
from its real entries only. Embeddings, lm_head, norms, the short conv and (in Qwen3.5's Gated
DeltaNet) the small a / b projections stay bf16. "dynamic" activations: the serving engines
quantize a Linear's input at run time, per token and per 128 columns (one group per weight block
along K), scale = amax / 448.

The target runs such a checkpoint one of two ways; the name is its `precision` (status, WELCOME,
checkpoint, export, `dfpipe eval`):

    fp8-block                       CUDA on Hopper or newer (compute capability >= 9.0) with Triton:
                                    each quantized Linear is a `BlockFp8Linear`: its input quantized
                                    as the serving engines do (`quantize_activations`), e4m3 x e4m3
                                    products summed per 128-column group on the tensor cores, the
                                    groups' scaled sums added in fp32 (`block_fp8_matmul`), by one
                                    of two GEMMs chosen per Linear at load (`choose_gemm`): cuBLAS's
                                    block-scaled FP8 GEMM (`torch._scaled_mm` with 1x128 activation
                                    and 128x128 weight scales; Hopper, cuBLASLt >= 12.9) where this
                                    torch and device run it, else the Triton kernel here
    fp8-block-dequantized-<dtype>   elsewhere (the CPU, older GPUs): the weights dequantized to the
                                    compute dtype at load; the math of the FP8 model's weights with
                                    unquantized activations
    bf16 | fp16 | fp32              an unquantized checkpoint, in that compute dtype

Why not transformers' own FP8 support: in transformers 5.17 to 5.24 its matmul is a kernel the
`kernels` package downloads from the Hugging Face hub at the first forward, and the GPU host has
no network; its dequantization reads the block size off the scale grid, wrong for a partial
block. torch's own GEMM and the two Triton kernels here are all the FP8 path needs.

The scales are IEEE quotients (amax / 448 correctly rounded) in every implementation: on CUDA a
torch tensor divided by a Python number is computed as a product with the number's reciprocal
(ATen's div_true_kernel_cuda), which is one fp32 bit off the quotient for some amax; `_div_448`
divides by a tensor on the same device instead, and the Triton kernel uses `div_rn`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)         # 448
BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"                         # <module>.weight -> <module>.weight_scale_inv
FP8_PRECISION = "fp8-block"
# 2-D weights a published Qwen3 / Qwen3.5 FP8 checkpoint leaves in bf16 (besides every tensor
# outside the decoder layers: embeddings, lm_head, the vision tower, the MTP head).
KEEP_BF16 = ("linear_attn.in_proj_a", "linear_attn.in_proj_b", "linear_attn.in_proj_ba")
# Smallest activation group maximum the quantizer divides by: an all-zero group quantizes to zeros.
ACT_EPS = 1e-10


class Fp8FormatError(ValueError):
    """A quantization_config or FP8 tensor this loader cannot run (another method, static activations)."""


@dataclass(frozen=True)
class BlockFp8:
    """A checkpoint's block-wise FP8 settings (config.json's quantization_config). Which modules
    are quantized the tensors themselves say (an e4m3 weight beside its scales), not the config."""

    block: tuple[int, int]                   # (rows, columns) of one weight scale's block


def read_format(config: dict[str, Any]) -> BlockFp8 | None:
    """The block-wise FP8 settings of a model's config.json dict; None for an unquantized model.

    Raises Fp8FormatError for a quantization the target cannot run, naming what is wrong."""
    q = config.get("quantization_config")
    if q is None and isinstance(config.get("text_config"), dict):
        q = config["text_config"].get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise Fp8FormatError(f"quantization_config is {type(q).__name__}, not an object")
    if (method := q.get("quant_method")) != "fp8":
        raise Fp8FormatError(f"quantization_config.quant_method {method!r}: only block-wise 'fp8' checkpoints are "
                             "supported; use the bf16 checkpoint of this model")
    block = q.get("weight_block_size")
    # powers of two from 16: the kernels' tiles (published checkpoints use [128, 128])
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 16 and b & (b - 1) == 0
                       for b in block)):
        raise Fp8FormatError(f"quantization_config.weight_block_size {block!r}: expected two powers of two from 16, "
                             "such as [128, 128] (per-tensor FP8 is not supported)")
    if (scheme := q.get("activation_scheme", "dynamic")) != "dynamic":
        raise Fp8FormatError(f"quantization_config.activation_scheme {scheme!r}: only 'dynamic' (activations "
                             "quantized at run time, per token) is supported")
    if (fmt := q.get("fmt", "e4m3")) != "e4m3":
        raise Fp8FormatError(f"quantization_config.fmt {fmt!r}: only e4m3 weights are supported")
    if (scale_fmt := q.get("scale_fmt", "float")) not in (None, "float"):
        raise Fp8FormatError(f"quantization_config.scale_fmt {scale_fmt!r}: only float scales are supported")
    return BlockFp8(block=(int(block[0]), int(block[1])))


def quantization_config(block: tuple[int, int], modules_to_not_convert: list[str]) -> dict[str, Any]:
    """config.json's quantization_config of a block-wise FP8 checkpoint (the published layout)."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(block), "modules_to_not_convert": list(modules_to_not_convert)}


def should_quantize(name: str, tensor: torch.Tensor) -> bool:
    """Whether a published FP8 checkpoint holds tensor `name` in e4m3: the 2-D weight of a Linear
    inside the decoder layers, except the small Gated DeltaNet projections (KEEP_BF16)."""
    if tensor.dim() != 2 or not name.endswith(".weight") or not tensor.is_floating_point():
        return False
    if not re.search(r"(^|\.)layers\.\d+\.", name) or name.startswith("mtp.") or ".visual." in f".{name}":
        return False
    module = name[: -len(".weight")]
    return not any(module.endswith(k) for k in KEEP_BF16)


def quantize_weight(weight: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight [N, K], fp32 weight_scale_inv [ceil(N/bn), ceil(K/bk)]) of a 2-D weight.

    Each block's scale is its largest magnitude / 448, so the block's largest entry lands on the
    top of e4m3's range; an edge block's scale comes from its real entries (the zero padding
    never raises a maximum). An all-zero block gets scale 1."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_weight: a 2-D weight, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    padded = F.pad(weight.float(), (0, cols * bk - k, 0, rows * bn - n))
    blocks = padded.view(rows, bn, cols, bk)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, _div_448(amax), torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(rows * bn, cols * bk)[:n, :k].contiguous(), scale.contiguous()


def _div_448(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448, the IEEE quotient on every device (module docstring: a Python divisor on CUDA
    would be a product with its reciprocal, one bit off)."""
    return amax / torch.full((), FP8_MAX, dtype=amax.dtype, device=amax.device)


def quantize_activations_reference(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_activations` by its definition in torch ops (the kernel must equal it bit for bit):
    each row's run of `group` columns scaled by its largest magnitude / 448 (at least ACT_EPS / 448),
    divided by that scale and rounded to nearest e4m3."""
    m, k = x.shape
    groups = -(-k // group)
    padded = F.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    scale = _div_448(padded.abs().amax(-1).clamp_min(ACT_EPS))
    q = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, groups * group)[:, :k], scale


def check_scales(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> None:
    """Fp8FormatError unless `scale_inv` has one scale per block of the 2-D `weight` (partial ones included)."""
    n, k = weight.shape
    want = (-(-n // block[0]), -(-k // block[1]))
    if tuple(scale_inv.shape) != want:
        raise Fp8FormatError(f"weight_scale_inv of a [{n}, {k}] weight with {block[0]}x{block[1]} blocks must be "
                             f"{list(want)}, got {list(scale_inv.shape)}")


def dequantize_weight(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype) -> torch.Tensor:
    """The weight the e4m3 values and their block scales stand for, in `dtype` (computed in fp32)."""
    check_scales(weight, scale_inv, block)
    n, k = weight.shape
    bn, bk = block
    scale = scale_inv.float().repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return (weight.float() * scale).to(dtype)


# ---- running FP8 matmuls ---------------------------------------------------------------------------
def fp8_matmul_unavailable(device: torch.device) -> str | None:
    """Why FP8 matmuls cannot run on `device` (None: they can): CUDA on Hopper or newer, Triton."""
    if device.type != "cuda":
        return f"{device.type} has no FP8 matmul"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"compute capability {major}.{minor} (FP8 matmuls need Hopper, 9.0, or newer)"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not importable"
    return None


def precision(quantized: bool, fp8_matmul: bool, dtype: torch.dtype) -> str:
    """The name a target's precision goes by (module docstring): fp8-block, fp8-block-dequantized-<dtype>,
    or the compute dtype of an unquantized target."""
    name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}[dtype]
    if not quantized:
        return name
    return FP8_PRECISION if fp8_matmul else f"{FP8_PRECISION}-dequantized-{name}"


def audit_tolerance(configured: float, precision: str) -> float:
    """The audit's tolerance (a document alone against its packed planes, largest difference over
    largest value) for a target run in `precision`: `configured` (target.audit_tolerance, the
    difference of two orders of the same bf16 computation) where the matmul inputs are not
    quantized; with FP8 matmuls (fp8-block) one e4m3 step more. Quantization is per token, so it
    adds no packing dependency (in fp32 alone and packed FP8 planes agree as the unquantized ones
    do), but the bf16 noise between the two orders moves some matmul inputs across an e4m3 rounding
    boundary, and each such input then lands a whole step apart: at most eps(e4m3) = 2^-3 of its
    value, so at most that much of the magnitude of the terms summed into an output."""
    return configured + (torch.finfo(FP8_DTYPE).eps if precision == FP8_PRECISION else 0.0)


GEMM_CUBLAS = "cublas"      # torch._scaled_mm, 1x128 activation x 128x128 weight scales (cuBLASLt)
GEMM_TRITON = "triton"      # the Triton kernel below (`_build_kernels`)
GEMMS = (GEMM_CUBLAS, GEMM_TRITON)
# cuBLASLt reads the token-minor activation scales in rows of 16 bytes: a multiple of 4 tokens (as
# vLLM's torch._scaled_mm block backend pads them)
CUBLAS_ROWS = 4
_CUBLAS_WHY: dict[torch.device, str | None] = {}     # per device: why cuBLAS's block GEMM cannot run (None: it can)


def cublas_block_gemm_unavailable(device: torch.device) -> str | None:
    """Why cuBLAS's block-scaled FP8 GEMM cannot run on `device` (None: it can), found once per
    device by running it on one small problem against the same e4m3 values multiplied in fp32.

    torch._scaled_mm takes 1x128 activation scales with 128x128 weight scales from torch 2.9 on,
    through cuBLASLt >= 12.9 and on compute capability 9.x only (ATen's _check_deepseek_support);
    a torch, cuBLAS or device without it raises, and a wrong result would be a layout misread, so
    both send the target to the Triton kernel."""
    if device.type != "cuda":
        return f"{device.type} has no cuBLAS"
    if device not in _CUBLAS_WHY:
        _CUBLAS_WHY[device] = _probe_cublas_block_gemm(device)
    return _CUBLAS_WHY[device]


def _probe_cublas_block_gemm(device: torch.device) -> str | None:
    g = torch.Generator(device=device).manual_seed(0)
    m, n, k = 37, 256, 512                  # a token count of no particular alignment
    # every weight block and activation group of another magnitude (powers of two): a scale read
    # from the wrong place moves whole tiles by a factor of 2 or more
    w_mag = 2.0 ** torch.arange(n // BLOCK[0] * (k // BLOCK[1]), device=device, dtype=torch.float32)
    w_mag = w_mag.view(n // BLOCK[0], k // BLOCK[1]).repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)
    x_mag = 2.0 ** -torch.arange(m * (k // BLOCK[1]), device=device, dtype=torch.float32).remainder(7)
    x = torch.randn(m, k, device=device, generator=g) * x_mag.view(m, -1).repeat_interleave(BLOCK[1], 1)
    w, w_scale = quantize_weight(torch.randn(n, k, device=device, generator=g) * w_mag)
    try:
        got = block_fp8_linear(x.to(torch.bfloat16), w, w_scale, BLOCK, GEMM_CUBLAS).float()   # as the target runs it
    except (RuntimeError, NotImplementedError, ValueError, TypeError) as e:
        return f"torch._scaled_mm with block scales: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
    want = dequantized_matmul(*quantize_activations_reference(x.to(torch.bfloat16), BLOCK[1]), w, w_scale, BLOCK)
    # rounding (the accumulation's, bf16's) is far below one e4m3 step; a misread scale far above
    err = float((got - want).norm() / want.norm())
    if not err < torch.finfo(FP8_DTYPE).eps:
        return f"torch._scaled_mm with block scales is {err:.3g} off the definition (relative)"
    return None


def choose_gemm(device: torch.device, out_features: int, in_features: int, block: tuple[int, int],
                dtype: torch.dtype) -> str:
    """The GEMM a Linear of this shape and compute dtype runs on `device`: cuBLAS's where it runs
    it (128 x 128 blocks; K a multiple of 512, so the weight scales' rows are 16-byte aligned
    without padding; N a multiple of 16, as torch._scaled_mm requires; bf16 outputs, what the
    probe checked), else Triton's."""
    fits = (tuple(block) == BLOCK and in_features % (4 * BLOCK[1]) == 0 and out_features % 16 == 0
            and dtype == torch.bfloat16)
    return GEMM_CUBLAS if fits and cublas_block_gemm_unavailable(device) is None else GEMM_TRITON


class BlockFp8Linear(nn.Module):
    """A Linear with e4m3 weights and block scales: the FP8 matmul of the serving engines.

    `weight` and `weight_scale_inv` carry the checkpoint's names, so a checkpoint's tensors load
    into it by name; `gemm` is the GEMM it runs (GEMMS, `choose_gemm` at load). Frozen: the target
    never trains."""

    def __init__(self, in_features: int, out_features: int, block: tuple[int, int], bias: bool = False,
                 device: torch.device | str | None = None, gemm: str = GEMM_TRITON) -> None:
        super().__init__()
        if gemm not in GEMMS:
            raise ValueError(f"BlockFp8Linear: gemm {gemm!r}, expected one of {GEMMS}")
        self.in_features, self.out_features, self.block, self.gemm = in_features, out_features, tuple(block), gemm
        scales = (-(-out_features // block[0]), -(-in_features // block[1]))
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
                                   requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.empty(scales, dtype=torch.float32, device=device),
                                             requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, device=device), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = block_fp8_linear(x, self.weight, self.weight_scale_inv, self.block, self.gemm)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}, "
                f"fp8 e4m3, gemm={self.gemm}")


def runnable(linear: nn.Linear, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
             fp8_matmul: bool) -> nn.Module:
    """What runs `linear` (shape, bias and dtype) from its e4m3 weight and block scales: a
    BlockFp8Linear with `fp8_matmul`, else `linear` itself holding the dequantized weight."""
    if tuple(weight.shape) != (linear.out_features, linear.in_features):
        raise Fp8FormatError(f"an e4m3 weight of shape {list(weight.shape)} for a Linear of "
                             f"{linear.in_features} -> {linear.out_features}")
    check_scales(weight, scale_inv, block)
    if not fp8_matmul:
        linear.weight = nn.Parameter(dequantize_weight(weight, scale_inv, block, linear.weight.dtype),
                                     requires_grad=False)
        return linear
    gemm = choose_gemm(weight.device, linear.out_features, linear.in_features, block, linear.weight.dtype)
    new = BlockFp8Linear(linear.in_features, linear.out_features, block, bias=linear.bias is not None,
                         device="meta", gemm=gemm)
    new.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    new.weight_scale_inv = nn.Parameter(scale_inv.float().contiguous(), requires_grad=False)
    if linear.bias is not None:
        new.bias = nn.Parameter(linear.bias.detach(), requires_grad=False)
    return new


def to_block_fp8(model: nn.Module, fp8_matmul: bool, block: tuple[int, int] = BLOCK) -> int:
    """Quantize `model`'s Linear layers in place as a published checkpoint holds them (`should_quantize`
    on their parameter names), run as a loaded FP8 checkpoint runs (`runnable`): the in-memory
    equivalent of `dfpipe quantize-fp8` and a load (the GPU benchmarks' FP8 target). Returns how
    many were quantized."""
    done = 0
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear and should_quantize(f"{name}.weight", module.weight):
            q, scale = quantize_weight(module.weight.detach(), block)
            model.set_submodule(name, runnable(module, q, scale, block, fp8_matmul))
            done += 1
    return done


def block_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                     block: tuple[int, int], gemm: str = GEMM_TRITON) -> torch.Tensor:
    """x [..., K] (bf16 / fp16 / fp32) @ dequantized(weight [N, K]).T -> [..., N] in x's dtype, with x
    quantized per token and per `block[1]` columns (dynamic activations), on CUDA, by `gemm`."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    q, xs = quantize_activations(x2, block[1], rows=-(-m // CUBLAS_ROWS) * CUBLAS_ROWS if gemm == GEMM_CUBLAS else m)
    return block_fp8_matmul(q, xs, weight, scale_inv, block, x.dtype, gemm)[:m].view(*lead, weight.shape[0])


def quantize_activations(x: torch.Tensor, group: int, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [rows, K], fp32 scales [rows, ceil(K/group)]): `quantize_activations_reference` of x [M, K]
    by a Triton kernel, bit for bit; `rows` (default M) may be more than M, the rows past M those
    of zero tokens (cuBLAS's GEMM takes a multiple of CUBLAS_ROWS). The scales are laid out
    token-minor (strides (1, rows)), the layout cuBLAS's 1x128 scaling reads; the Triton GEMM reads any."""
    m, k = x.shape
    rows = m if rows is None else rows
    if rows < m:
        raise ValueError(f"quantize_activations: rows {rows} < the {m} tokens of x")
    q = torch.empty(rows, k, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(-(-k // group), rows, dtype=torch.float32, device=x.device).t()
    if rows:
        kernels = _kernels()
        grid = (-(-rows // _QUANT_ROWS), scales.shape[1])
        kernels.quantize[grid](x, q, scales, m, rows, k, x.stride(0), q.stride(0), scales.stride(0),
                               scales.stride(1), GROUP=group, ROWS=_QUANT_ROWS, FP8_MAX=FP8_MAX, EPS=ACT_EPS,
                               num_warps=4)
    return q, scales


def dequantized_matmul(q: torch.Tensor, q_scales: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                       block: tuple[int, int]) -> torch.Tensor:
    """What `block_fp8_matmul` computes, in fp32 torch ops: the quantized activations and the
    weight, each times its scales, multiplied (the GEMMs' reference)."""
    m, k = q.shape
    cols = torch.arange(k, device=q.device) // block[1]
    return (q.float() * q_scales[:, cols]) @ dequantize_weight(weight, scale_inv, block, torch.float32).T


def block_fp8_matmul(q: torch.Tensor, q_scales: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                     block: tuple[int, int], out_dtype: torch.dtype, gemm: str = GEMM_TRITON) -> torch.Tensor:
    """quantized activations (q, q_scales) @ block-quantized weight.T -> [M, N] in out_dtype.

    Per group of `block[1]` columns: one e4m3 x e4m3 product tile summed on the tensor cores, times
    the activation row's scale and the weight block's; the groups' sums are added in fp32. `gemm`
    says by which GEMM (GEMMS)."""
    m, k = q.shape
    n = weight.shape[0]
    if weight.shape[1] != k or not weight.is_contiguous() or not scale_inv.is_contiguous():
        raise ValueError(f"block_fp8_matmul: a contiguous [N, {k}] weight and scales, got {tuple(weight.shape)}")
    if gemm == GEMM_CUBLAS:
        return _cublas_matmul(q, q_scales, weight, scale_inv, out_dtype)
    y = torch.empty(m, n, dtype=out_dtype, device=q.device)
    if m:
        kernels = _kernels()

        def grid(meta: dict[str, int]) -> tuple[int]:
            return (-(-m // meta["BLOCK_M"]) * -(-n // meta["BLOCK_N"]),)

        kernels.matmul[grid](q, q_scales, weight, scale_inv, y, m, n, k, q.stride(0), q_scales.stride(0),
                             q_scales.stride(1), weight.stride(0), scale_inv.stride(0), y.stride(0),
                             GROUP_N=block[0], BLOCK_K=block[1])
    return y


def _cublas_matmul(q: torch.Tensor, q_scales: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """cuBLAS's block-scaled FP8 GEMM through torch._scaled_mm, which tells the recipe by the
    scales' shapes: a [M, K/128] activation scale (1x128, token-minor: strides (1, M)) and a
    [K/128, N/128] weight scale (128x128, the checkpoint's [N/128, K/128] transposed: strides
    (1, K/128), 16-byte aligned as K/128 is a multiple of 4). The weight is the column-major
    [K, N] view of [N, K]."""
    if q.shape[0] % CUBLAS_ROWS:
        raise ValueError(f"cuBLAS's block-scaled GEMM takes a multiple of {CUBLAS_ROWS} tokens, got {q.shape[0]} "
                         "(quantize_activations(..., rows=) pads)")
    if q.shape[0] == 0:
        return torch.empty(0, weight.shape[0], dtype=out_dtype, device=q.device)
    return torch._scaled_mm(q, weight.t(), scale_a=q_scales, scale_b=scale_inv.t(), out_dtype=out_dtype)


_QUANT_ROWS = 32            # rows of activations per quantize program
_KERNELS: Any = None


def _kernels() -> Any:
    """The two Triton kernels, compiled on first use (Triton is imported only on the FP8 path)."""
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = _build_kernels()
    return _KERNELS


def _build_kernels() -> Any:
    import triton
    import triton.language as tl

    # The token count M is not specialized on (Triton would compile another variant whenever a
    # packed row's length changes between a multiple of 16 and not), nor the scales' group stride,
    # which is the row count in the token-minor layout.
    @triton.jit(do_not_specialize=["M", "M_OUT", "stride_sg"])
    def quantize(x_ptr, q_ptr, s_ptr, M, M_OUT, K, stride_x, stride_q, stride_sm, stride_sg,
                 GROUP: tl.constexpr, ROWS: tl.constexpr, FP8_MAX: tl.constexpr, EPS: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
        mask = (rows[:, None] < M_OUT) & (cols[None, :] < K)         # rows from M on: zero tokens
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask & (rows[:, None] < M),
                    other=0.0).to(tl.float32)
        # IEEE divisions (Triton's `/` is an approximate one on CUDA): the scales and e4m3 values are
        # exactly those of quantize_activations_reference
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), EPS), FP8_MAX)
        q = tl.clamp(tl.math.div_rn(x, scale[:, None]), -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + rows[:, None] * stride_q + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + rows * stride_sm + tl.program_id(1) * stride_sg, scale, mask=rows < M_OUT)

    # Tile shapes tried once per weight shape (N, K) at the warm-up; the number of tokens is left
    # out of the key, so a packed row of a new length never tunes again. The 128 x 256 tiles
    # (e4m3: 48 KB of operands a stage) halve the activation reads of the wide projections.
    configs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "GROUP_M": 8}, num_warps=w, num_stages=s)
               for bm, bn, w, s in ((128, 128, 8, 3), (128, 128, 4, 4), (64, 128, 4, 4), (128, 64, 4, 4),
                                    (128, 256, 8, 3), (128, 256, 8, 4), (256, 128, 8, 3))]

    @triton.autotune(configs=configs, key=["N", "K"])
    @triton.jit(do_not_specialize=["M", "stride_asg"])
    def matmul(a_ptr, as_ptr, w_ptr, ws_ptr, y_ptr, M, N, K, stride_a, stride_asm, stride_asg, stride_w, stride_ws,
               stride_y,
               GROUP_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               GROUP_M: tl.constexpr):
        # programs in groups of GROUP_M row tiles, so neighbours share weight tiles in L2
        pid = tl.program_id(0)
        tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        first_m = (pid // (GROUP_M * tiles_n)) * GROUP_M
        size_m = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % (GROUP_M * tiles_n)) % size_m
        pid_n = (pid % (GROUP_M * tiles_n)) // size_m
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok, n_ok = rm < M, rn < N
        a_ptrs = a_ptr + rm[:, None] * stride_a + rk[None, :]
        w_ptrs = w_ptr + rn[None, :] * stride_w + rk[:, None]        # [BLOCK_K, BLOCK_N] view of w [N, K]
        as_ptrs = as_ptr + rm * stride_asm
        ws_ptrs = ws_ptr + (rn // GROUP_N) * stride_ws               # the weight block of each column
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            k_ok = rk < K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            sa = tl.load(as_ptrs + kb * stride_asg, mask=m_ok, other=0.0)
            sw = tl.load(ws_ptrs + kb, mask=n_ok, other=0.0)
            acc += tl.dot(a, w) * sa[:, None] * sw[None, :]
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        y_ptrs = y_ptr + rm[:, None] * stride_y + rn[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    return SimpleNamespace(quantize=quantize, matmul=matmul)

