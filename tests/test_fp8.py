"""drafter.precision fp8: row-wise scaled e4m3 matmuls (drafter_trainer/fp8.py).

On the CPU the emulated path runs: the same e4m3 values and scales as the GPU path, then fp32
products. So these tests pin the quantization scheme (which axis each operand is scaled along,
per the table in fp8.py) against an explicit dequantize-and-multiply reference, bound the FP8
error from e4m3's own precision, and check the drafter and its loss head run in it. The CUDA test
compares torch._scaled_mm with the emulation (skipped without CUDA).
"""
from __future__ import annotations

import math

import pytest
import torch

from common.config import ConfigError
from drafter_trainer import fp8
from drafter_trainer.blocks import build_blocks, sample_anchors
from drafter_trainer.loss import dflash_loss
from drafter_trainer.model import DFlashDraftModel
from test_drafter_model import MASK, make_batch, make_model, tiny_config
from tolerances import C, assert_close, eps

pytestmark = pytest.mark.numerics   # run again under ATEN_CPU_CAPABILITY=default (make test-numerics)

E4M3_U = eps(fp8.E4M3) / 2          # unit roundoff of e4m3: 3 mantissa bits, 2^-4
E4M3_SUBNORMAL_HALF_STEP = 2.0 ** -10   # half the spacing of e4m3's subnormals (2^-9), in units of the scale
FP8_MMA_ACCUMULATOR_EPS = 2.0 ** -13    # Hopper FP8 MMA: partial sums with ~14 significant bits


def dequantized(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale


def test_rows_are_scaled_to_fill_e4m3_and_dequantize_within_its_rounding() -> None:
    torch.manual_seed(0)
    x = torch.randn(33, 70) * torch.logspace(-3, 3, 33)[:, None]     # rows of very different size
    x[5] = 0.0                                                          # an all-zero row
    q, scale = fp8.quantize_rows(x)
    assert q.dtype == fp8.E4M3 and scale.shape == (33, 1)
    assert torch.equal(q[5].float(), torch.zeros(70)) and float(scale[5]) == 1.0
    live = torch.ones(33, dtype=torch.bool)
    live[5] = False
    # every live row reaches e4m3's largest value: the scale is its amax / 448
    assert torch.equal(q[live].float().abs().amax(1), torch.full((32,), fp8.E4M3_MAX))
    err = (dequantized(q, scale) - x).abs()
    bound = E4M3_U * x.abs() + E4M3_SUBNORMAL_HALF_STEP * scale
    assert bool((err <= bound * (1 + eps(torch.float32))).all())


def test_a_nan_survives_quantization_and_spoils_no_other_row() -> None:
    """A non-finite activation must reach the step's finite check (which skips the step), not be
    rounded into a finite e4m3 value; the other rows keep their scales."""
    x = torch.randn(4, 32)
    x[2, 7] = float("nan")
    q, scale = fp8.quantize_rows(x)
    deq = dequantized(q, scale)
    assert bool(torch.isnan(deq[2]).any()) and bool(torch.isfinite(deq[[0, 1, 3]]).all())
    y = fp8.linear(x, torch.randn(8, 32), "fp8-emulated")
    assert bool(torch.isnan(y[2]).all()) and bool(torch.isfinite(y[[0, 1, 3]]).all())


def _reference_linear(x: torch.Tensor, w: torch.Tensor, gy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The three matmuls of a linear layer with each operand quantized along its contraction dim."""
    y = dequantized(*fp8.quantize_rows(x)) @ dequantized(*fp8.quantize_rows(w)).t()
    gx = dequantized(*fp8.quantize_rows(gy)) @ dequantized(*fp8.quantize_rows(w.t())).t()
    gw = dequantized(*fp8.quantize_rows(gy.t())) @ dequantized(*fp8.quantize_rows(x.t())).t()
    return y, gx, gw


def test_emulated_linear_scales_each_operand_along_its_contraction_dimension() -> None:
    torch.manual_seed(1)
    m, k, n = 48, 80, 40
    x = torch.randn(m, k, dtype=torch.float32) * torch.logspace(-1, 1, k)     # features of different size
    w = torch.randn(n, k) * 0.05
    gy = torch.randn(m, n) * torch.logspace(-2, 0, m)[:, None]
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8.linear(xr, wr, "fp8-emulated")
    y.backward(gy)
    ref_y, ref_gx, ref_gw = _reference_linear(x, w, gy)
    # the same e4m3 values and scales; only fp32's summation order differs
    assert_close(y, ref_y, n=k)
    assert_close(xr.grad, ref_gx, n=n)
    assert_close(wr.grad, ref_gw, n=m)


def test_fp8_error_of_a_linear_layer_is_bounded_by_e4m3_rounding() -> None:
    torch.manual_seed(2)
    m, k, n = 64, 128, 96
    x, w = torch.randn(m, k), torch.randn(n, k) * 0.05
    y = fp8.linear(x, w, "fp8-emulated")
    exact = x.double() @ w.double().t()
    # each quantized operand is within u (relative) plus half a subnormal step (absolute, in its
    # row's scale) of the true value; a product of two such is within the sum of both, and the
    # errors of the k terms add at most linearly
    qx, sx = fp8.quantize_rows(x)
    qw, sw = fp8.quantize_rows(w)
    ax = E4M3_U * x.abs() + E4M3_SUBNORMAL_HALF_STEP * sx
    aw = E4M3_U * w.abs() + E4M3_SUBNORMAL_HALF_STEP * sw
    bound = (ax.double() @ w.abs().double().t() + x.abs().double() @ aw.double().t()
             + ax.double() @ aw.double().t())
    fp32_slack = k * eps(torch.float32) * (x.abs().double() @ w.abs().double().t())
    assert bool(((y.double() - exact).abs() <= bound + fp32_slack).all())
    # and it is FP8, not a no-op: the error is of e4m3's size, far above fp32's
    rel = float((y.double() - exact).norm() / exact.norm())
    assert E4M3_U / 16 < rel < 2 * E4M3_U, rel


def test_precision_fp8_on_a_cpu_is_refused_naming_the_setting() -> None:
    cpu = torch.device("cpu")
    with pytest.raises(ConfigError, match=r"drafter\.precision fp8 needs FP8 tensor cores.*bf16"):
        fp8.resolve_precision("fp8", cpu)
    assert fp8.resolve_precision("auto", cpu) == "bf16"
    assert fp8.resolve_precision("fp8-emulated", cpu) == "fp8-emulated"
    with pytest.raises(ConfigError, match="one of"):
        fp8.resolve_precision("fp4", cpu)


def _tiny_drafter(precision: str, layers: int = 2) -> DFlashDraftModel:
    return make_model(tiny_config(num_hidden_layers=layers), std=0.05, precision=precision)


def test_the_loss_head_stays_in_the_compute_dtype_under_fp8() -> None:
    """The frozen head's two matmuls (logits, input gradient) are not FP8's: in e4m3 they lost the
    gradient of a drafter with sharp predictions (fp8.py). Given the same hidden states, the FP8
    drafter's loss and input gradient are the exact ones, to fp32's rounding."""
    from drafter_trainer.loss import _ChunkedLinearCrossEntropy

    model = _tiny_drafter("fp8-emulated")
    torch.manual_seed(4)
    h = torch.randn(10, model.config.hidden_size, requires_grad=True)
    labels = torch.randint(0, model.config.vocab_size, (10,))
    w = model.lm_head.weight
    ce, _ = _ChunkedLinearCrossEntropy.apply(h, w, labels, torch.ones(10), 4, True)
    (grad,) = torch.autograd.grad(ce, h)
    want = torch.nn.functional.cross_entropy(h @ w.t(), labels, reduction="sum")
    (want_grad,) = torch.autograd.grad(want, h)
    assert_close(ce, want, n=model.config.hidden_size + model.config.vocab_size)
    assert_close(grad, want_grad, n=2 * model.config.hidden_size + model.config.vocab_size)


def test_every_linear_of_the_drafter_follows_its_precision_and_checkpoints_do_not_change() -> None:
    bf16, fp8_model = _tiny_drafter("bf16"), _tiny_drafter("fp8-emulated")
    assert fp8_model.precision == "fp8-emulated" and bf16.precision == "bf16"
    linears = [m for m in fp8_model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 1 + 2 * 7 and all(m.precision == "fp8-emulated" for m in linears)
    assert bf16.trainable_state_dict().keys() == fp8_model.trainable_state_dict().keys()
    with pytest.raises(ValueError, match="resolved"):
        fp8_model.precision = "auto"


def fp8_cosine_floor(matmuls_on_path: int) -> float:
    """The least cosine between a gradient computed with FP8 matmuls and the exact one.

    Quantizing both operands of a matmul to e4m3 (round to nearest: a uniform relative error of
    at most u, standard deviation u/sqrt(3) each) leaves a relative error of about
    sqrt(2/3)*u in its output, independent of the contraction length; errors of the L matmuls on a
    gradient's path add in quadrature: r^2 = L*(2/3)*u^2, and C (tolerances.py) standard
    deviations of spread. An error orthogonal to the gradient lowers the cosine to ~1 - r^2/2."""
    r2 = (2.0 * C) ** 2 * matmuls_on_path * (2.0 / 3.0) * E4M3_U ** 2 / 4
    return 1.0 - r2 / 2


def test_a_drafter_step_in_fp8_follows_the_full_precision_gradient() -> None:
    """The whole step (fc, every layer's projections and MLP, the loss head) in emulated FP8 against
    fp32 on one batch: the gradient of every weight points the same way (cosine). The GPU gate asks
    >= 0.99 of the bf16 step at the 27B widths (bench/gpu, p5d), where each weight's gradient
    averages over thousands of tokens; this tiny one averages over few, so its floor is the
    worst-case path bound."""
    batch = make_batch([40, 9, 56, 120])
    anchors = sample_anchors(batch.loss_mask, batch.doc_lens, 64, torch.Generator().manual_seed(5))
    blocks = build_blocks(batch, anchors, 4, MASK, 3.0)
    grads = {}
    for precision in ("bf16", "fp8-emulated"):
        model = _tiny_drafter(precision)
        out = dflash_loss(model, batch, blocks, chunk=16, blocks_per_chunk=3, backward=True)
        assert math.isfinite(float(out.loss))
        grads[precision] = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    layers = model.config.num_hidden_layers
    # per layer 4 matmuls in sequence forward (qkv, o, gate/up, down) and 4 backward; fc and the
    # weight-gradient matmul itself (the loss head is not FP8's)
    floor = fp8_cosine_floor(8 * layers + 2)
    worst = 1.0
    for name, g in grads["bf16"].items():
        g8 = grads["fp8-emulated"][name]
        assert not torch.equal(g, g8), name                     # FP8 really ran on this weight's path
        cos = float(torch.nn.functional.cosine_similarity(g.flatten(), g8.flatten(), dim=0))
        assert cos >= floor, (name, cos, floor)
        worst = min(worst, cos)
    print(f"least gradient cosine {worst:.4f} (floor {floor:.4f})")


@pytest.mark.skipif(not fp8.fp8_supported(), reason="needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9)")
def test_scaled_mm_on_the_gpu_equals_the_emulation() -> None:
    torch.manual_seed(6)
    dev = torch.device("cuda")
    m, k, n = 200, 512, 384                       # m not a multiple of 16: grad W pads the tokens
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = (torch.randn(n, k, device=dev) * 0.05).requires_grad_()
    gy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    outs = {}
    for precision in ("fp8", "fp8-emulated"):
        xr, wr = x.clone().requires_grad_(), w.detach().clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = fp8.linear(xr, wr, precision)
        y.backward(gy)
        outs[precision] = (y.float(), xr.grad.float(), wr.grad.float())
    for got, want, n_terms in zip(outs["fp8"], outs["fp8-emulated"], (k, n, m)):
        # The same e4m3 operands. Hopper's FP8 tensor cores add the products in an accumulator of
        # about 14 significant bits (cuBLAS promotes the partial sums to fp32 between blocks of
        # the contraction), against fp32's 24 in the emulation; then both round to bf16.
        bound = C * FP8_MMA_ACCUMULATOR_EPS * math.sqrt(n_terms)
        scale = float(want.abs().max())
        torch.testing.assert_close(got, want, rtol=bound + eps(torch.bfloat16), atol=bound * scale)


@pytest.mark.usefixtures("cxx_compiler")
def test_a_compiled_fp8_drafter_traces_every_linear_and_follows_the_eager_one() -> None:
    """The trainer compiles the layers with dynamic shapes, so each FP8 linear is traced into a
    graph next to the others (a float global in the quantization once made the second one fail to
    trace). Two context lengths: the graphs are reused, not retraced per shape. The compiled
    quantization may round a value on the other side of an e4m3 boundary than eager does, so the
    two agree to FP8's own bound, not to fp32's. One layer holds all seven FP8 linears; a second
    layer is the same graph traced again (half this test's CPU time)."""
    eager, compiled = _tiny_drafter("fp8-emulated", layers=1), _tiny_drafter("fp8-emulated", layers=1)
    assert compiled.compile_for("cpu", "on")
    layers = compiled.config.num_hidden_layers
    for docs in ([40, 9, 56], [30, 70]):
        batch = make_batch(docs)
        anchors = sample_anchors(batch.loss_mask, batch.doc_lens, 64, torch.Generator().manual_seed(5))
        blocks = build_blocks(batch, anchors, 4, MASK, 3.0)
        grads = []
        for model in (eager, compiled):
            model.zero_grad(set_to_none=True)
            dflash_loss(model, batch, blocks, chunk=16, blocks_per_chunk=3, backward=True)
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
        for name, g in grads[0].items():
            cos = float(torch.nn.functional.cosine_similarity(g.flatten(), grads[1][name].flatten(), dim=0))
            assert cos >= fp8_cosine_floor(8 * layers + 4), (name, cos)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_column_quantization_kernel_equals_quantizing_the_transpose() -> None:
    """fp8_cols: the Triton kernel behind quantize_cols on CUDA against quantize_rows of the
    transpose: the same scales, each value within e4m3's rounding, the layout cuBLAS reads, and a
    NaN that reaches the matmul (its column's scale is NaN)."""
    from drafter_trainer import fp8_cols

    assert fp8_cols.AVAILABLE
    torch.manual_seed(7)
    for r, c, dtype in ((12_288, 640, torch.bfloat16), (1000, 130, torch.bfloat16), (77, 5120, torch.float32)):
        x = (torch.randn(r, c, device="cuda") * torch.logspace(-2, 2, c, device="cuda")).to(dtype)
        x[:, 3] = 0
        q, scale = fp8.quantize_cols(x)
        want_q, want_scale = fp8.quantize_rows(x.t())
        assert q.shape == (c, r) and q.is_contiguous() and q.dtype == fp8.E4M3
        torch.testing.assert_close(scale, want_scale, rtol=eps(torch.float32), atol=0)
        deq, ref = dequantized(q, scale), x.t().float()
        bound = E4M3_U * ref.abs() + E4M3_SUBNORMAL_HALF_STEP * scale
        assert bool(((deq - ref).abs() <= bound * (1 + eps(torch.float32))).all())
    x = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
    x[5, 7] = float("nan")
    q, scale = fp8.quantize_cols(x)
    assert bool(torch.isnan(scale[7])) and bool(torch.isfinite(scale[[0, 1, 8]]).all())


def test_held_out_eval_runs_the_drafter_as_served_and_training_resumes_in_fp8() -> None:
    """Validator.evaluate scores the drafter with its matmuls as serving runs them; the training
    precision comes back afterwards, also when the eval raises."""
    model = _tiny_drafter("fp8-emulated")
    batch = make_batch([40, 56])
    blocks = build_blocks(batch, sample_anchors(batch.loss_mask, batch.doc_lens, 16, torch.Generator().manual_seed(1)),
                          4, MASK, 3.0)
    with torch.no_grad():
        trained = dflash_loss(model, batch, blocks, chunk=16).loss
        with model.as_served():
            assert model.precision == "bf16" and all(m.precision == "bf16" for m in model.modules()
                                                     if isinstance(m, torch.nn.Linear))
            served = dflash_loss(model, batch, blocks, chunk=16).loss
        assert model.precision == "fp8-emulated"
        assert float(served) != float(trained)                   # FP8 rounding was off inside
        assert float(served) == float(dflash_loss(_tiny_drafter("bf16"), batch, blocks, chunk=16).loss)
    with pytest.raises(RuntimeError), model.as_served():
        raise RuntimeError("an eval that fails")
    assert model.precision == "fp8-emulated"


def test_compute_dtype_bf16_runs_the_cpu_step_in_bf16_as_the_gpu_does() -> None:
    """A CPU run can use the GPU's compute dtype: train.compute_dtype
    bf16 is honoured on a CPU (auto stays fp32 there, bf16 on CUDA unless fp32 is asked for)."""
    from common.config import Config
    from drafter_trainer.step import StepSettings

    cfg = Config()
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert StepSettings.from_config(cfg, cpu).compute_dtype == torch.float32
    assert StepSettings.from_config(cfg, cuda).compute_dtype == torch.bfloat16
    cfg.train.compute_dtype = "bf16"
    assert StepSettings.from_config(cfg, cpu).compute_dtype == torch.bfloat16
    cfg.train.compute_dtype = "fp32"
    assert StepSettings.from_config(cfg, cuda).compute_dtype == torch.float32
