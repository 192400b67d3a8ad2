"""How close two float computations of the same value must be: from the dtype and the reduction length.

A fixed `atol=1e-7` is below one fp32 ulp of 1.0 (eps = 1.19e-7): two correct implementations
that sum in a different order (fused against eager, compiled against not, packed against one
document at a time) fail it on some machines and pass it on others, depending on the vector
width the CPU kernels pick. What the math gives instead:

- A value formed by summing n rounded terms carries an error of at most (n-1)·u times the sum
  of the terms' magnitudes (u = eps/2, the unit roundoff). That worst case needs every rounding
  to go the same way; under the probabilistic model (independent, mean-zero rounding errors:
  Higham & Mary, "A New Approach to Probabilistic Rounding Error Analysis", SIAM J. Sci.
  Comput. 41(5), 2019) the error is λ·sqrt(n)·u with a small λ.
- Two computations in different orders each carry such an error, so they differ by up to
  2·λ·sqrt(n)·u = λ·sqrt(n)·eps. With λ = C = 2 that is `rtol` below; n = 1 still allows the
  couple of ulps an exp, log or division rounds to.
- The error is relative to the magnitude of the summed terms, not of the result: where the
  result cancels to near zero (p - 1 for a softmax probability near 1; a residual stream
  entry), the absolute error stays at eps·sqrt(n) times the operands' size. So `atol` is the
  same bound times `scale`, the magnitude of the compared values (their largest, by default).
- A result stored in a narrower dtype than it was computed in (bf16 from fp32) may land one
  rounding step apart on either side of a rounding boundary: one eps of the narrow dtype,
  relative, on top. A path stored in the narrow dtype r times (under autocast every GEMM's and
  norm's output is rounded to bf16; `transformer_roundings` counts them) carries r such
  independent roundings on each side, each uniform within half a step: the two results differ by
  sqrt(2r/3)·u = 0.41·sqrt(r)·eps per standard deviation, so eps·sqrt(r) allows more than C = 2 of
  them (and is exactly the one step for r = 1). Once two runs differ at all, every later rounding
  may land apart too, so r counts from the first operation the two runs compute differently to the
  compared value.

For a deep computation n is the number of terms summed along one output value's path (every
reduction it passes through: a transformer layer's norms, projections, attention and MLP), so
independent errors of successive reductions add as sqrt(sum n_i). Each call site says which n.
"""
from __future__ import annotations

import math

import pytest
import torch

C = 2.0     # λ above: the spread of the accumulated rounding error, in units of its standard deviation


def eps(dtype: torch.dtype) -> float:
    """The distance from 1.0 to the next representable number of `dtype`."""
    return torch.finfo(dtype).eps


def tol(n: int, dtype: torch.dtype = torch.float32, *, scale: float | torch.Tensor = 1.0,
        rounded_to: torch.dtype | None = None, roundings: int = 1) -> dict[str, float]:
    """rtol and atol (for torch.testing.assert_close) between two orders of an n-term reduction in `dtype`.

    scale: the magnitude of the values compared (atol = the relative bound times it); rounded_to:
    the narrower dtype the results were stored in after computing in `dtype`, `roundings` times
    along the compared value's path.
    """
    if n < 1 or roundings < 1:
        raise ValueError(f"a reduction has at least 1 term and a path at least 1 rounding, got n={n}, "
                         f"roundings={roundings}")
    bound = C * eps(dtype) * math.sqrt(n)
    if rounded_to is not None and eps(rounded_to) > eps(dtype):
        bound += eps(rounded_to) * math.sqrt(roundings)
    return {"rtol": bound, "atol": bound * float(scale)}


def _scale(expected: torch.Tensor) -> float:
    return expected.detach().abs().max().float().item() if expected.numel() else 0.0


def assert_close(actual: torch.Tensor, expected: torch.Tensor, n: int, dtype: torch.dtype = torch.float32, *,
                 rounded_to: torch.dtype | None = None, roundings: int = 1, msg: str | None = None) -> None:
    """torch.testing.assert_close at `tol(n, dtype)`, atol scaled by the expected values' largest magnitude."""
    expected = torch.as_tensor(expected)
    torch.testing.assert_close(torch.as_tensor(actual), expected, msg=msg,
                               **tol(n, dtype, scale=_scale(expected), rounded_to=rounded_to, roundings=roundings))


def differs(actual: torch.Tensor, expected: torch.Tensor, n: int, dtype: torch.dtype = torch.float32, *,
            rounded_to: torch.dtype | None = None, roundings: int = 1) -> bool:
    """True when the two are farther apart than `assert_close` with the same arguments allows: what a
    test asserts to show that a change is felt, i.e. that its equality check could fail."""
    expected = torch.as_tensor(expected)
    t = tol(n, dtype, scale=_scale(expected), rounded_to=rounded_to, roundings=roundings)
    return not torch.allclose(torch.as_tensor(actual).to(expected.dtype), expected, rtol=t["rtol"], atol=t["atol"])


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| (Frobenius), in fp32: a norm-wise relative error, bounded by
    `tol(...)["rtol"]` when every element is within it."""
    return float((actual.float() - expected.float()).norm() / expected.float().norm())


def approx(expected: float | list[float], n: int = 1, dtype: torch.dtype = torch.float64) -> object:
    """pytest.approx at `tol(n, dtype)` for numbers a test reads back (`.item()`, `.tolist()`): computed
    in `dtype` (float64: plain Python arithmetic) through an n-term reduction."""
    values = expected if isinstance(expected, (list, tuple)) else [expected]
    t = tol(n, dtype, scale=max((abs(v) for v in values), default=0.0))
    return pytest.approx(expected, rel=t["rtol"], abs=t["atol"])


def transformer_roundings(layers: int, extra: int = 0) -> int:
    """How many times one output value's path through `layers` pre-norm transformer layers is stored
    in the compute dtype under autocast: per layer the two norms' outputs, the q, k, v and output
    projections, the attention's scores and output, the MLP's gate, up, product and down (12; a
    Gated DeltaNet layer's projections, conv, recurrence and gated norm are as many); plus `extra`
    for the operations outside the layers (an input projection, a final norm, a head)."""
    return 12 * layers + extra


def transformer_terms(layers: int, hidden: int, intermediate: int, context: int, projected_in: int = 0) -> int:
    """About how many terms one output value's path sums through `layers` pre-norm transformer layers.

    Per layer: two RMSNorms (hidden each), the q/k/v and output projections (hidden each), the
    attention scores and weighted sum over `context` positions (or a linear-attention layer's
    recurrence over as many steps), the MLP (hidden, then intermediate); plus an input
    projection of `projected_in` terms (the drafter's fc) and the final norm.
    """
    return projected_in + layers * (6 * hidden + context + intermediate) + hidden


def target_terms(runner: object, context: int) -> int:
    """`transformer_terms` for a TargetRunner's captures: through its deepest captured layer, over
    `context` tokens (a Gated DeltaNet layer's recurrence runs over as many steps as attention's keys)."""
    text = runner.model.config
    return transformer_terms(max(runner.layer_ids) + 1, runner.hidden_size, int(text.intermediate_size), context)


# ---- FP8 (e4m3) --------------------------------------------------------------------------------
# e4m3: 3 mantissa bits, eps = 2^-3, unit roundoff u = 2^-4; normals from 2^-6, subnormals spaced
# 2^-9 below that (torch.finfo(torch.float8_e4m3fn)).
E4M3 = torch.float8_e4m3fn
# Hopper's FP8 tensor cores sum the products of one MMA chain in an accumulator of about 14 bits,
# not fp32 (DeepSeek-V3 technical report, 3.3.2, "Increasing Accumulation Precision"); the block
# kernel adds each 128-column group's sum into fp32 registers, as that report does.
HOPPER_FP8_ACCUMULATOR_EPS = 2.0 ** -13


def e4m3_rounding(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """The largest error of storing x as an e4m3 value times `scale` (round to nearest) and reading
    it back in fp32: half a step of e4m3 at |x / scale|. A normal is within u = eps/2 of itself,
    relative; a subnormal within half the subnormal spacing (smallest normal x eps / 2) times the
    scale; reading back in fp32 rounds once more (eps(fp32)/2, relative)."""
    f = torch.finfo(E4M3)
    subnormal = torch.as_tensor(scale, dtype=torch.float32) * (f.smallest_normal * f.eps / 2)
    return torch.maximum(x.abs() * (f.eps / 2), subnormal) + x.abs() * eps(torch.float32)


def fp8_matmul_tol(k: int, *, scale: float, rounded_to: torch.dtype) -> dict[str, float]:
    """rtol / atol between the block FP8 kernel and the same e4m3 values and scales multiplied in
    fp32: a k-term reduction at the tensor cores' accumulator precision, stored in `rounded_to`."""
    bound = C * HOPPER_FP8_ACCUMULATOR_EPS * math.sqrt(k)
    return {"rtol": bound + eps(rounded_to), "atol": bound * scale}


def fp8_activation_rtol(quantized_matmuls: int) -> float:
    """Relative (Frobenius) difference between a computation whose matmul inputs are rounded to
    e4m3 (dynamic activations: per token and per 128 columns) and the same computation without.

    Round to nearest moves each input element by at most u = eps/2 = 2^-4 relative, uniformly
    within half a step: u / sqrt(3) relative RMS. A matmul output sums those independent errors
    weighted by its terms, so its relative RMS error is u / sqrt(3) too; along a value's path
    `quantized_matmuls` such matmuls add theirs in quadrature; C spreads it as above."""
    return C * (eps(E4M3) / 2) / math.sqrt(3) * math.sqrt(quantized_matmuls)
