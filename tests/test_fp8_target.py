"""Block-wise FP8 targets (target_server/fp8.py, `dfpipe quantize-fp8`).

The quantizer writes the published format (e4m3 weights, one fp32 scale per 128 x 128 block, a
partial block at an edge with its own), and a target in that format captures what its dequantized
model captures: on the CPU the weights are dequantized at load, so the two are the same math (fp32
rounding); with FP8 matmuls on a Hopper GPU the activations are quantized too, and the two differ
by e4m3 rounding of the matmul inputs (tests/tolerances.py derives both bounds).

The tiny targets here are 192 wide: K = 192 is one whole and one partial 128-column block, and
the k / v projections (96 rows) are partial row blocks.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import transformers.models.qwen3_5.modeling_qwen3_5  # noqa: F401  (bind HF's kernels while conftest blocks FLA)
from safetensors.torch import load_file, save_file

from common.batch import document_positions
from common.config import TargetConfig
from dfpipe.cli import main as dfpipe_main
from dfpipe.quantize_fp8 import quantize_checkpoint
from target_server import fp8
from target_server.target import TargetRunner
from target_server.tiny import build_tiny_target
from tolerances import assert_close, e4m3_rounding, fp8_activation_rtol, fp8_matmul_tol, target_terms, tol

ARCHS = ("qwen3.5", "qwen3")
LAYER_IDS = [1, 3]          # a Gated DeltaNet layer and (Qwen3.5) the first full-attention one
HIDDEN = 192


def _expand(scale: torch.Tensor, n: int, k: int, block: tuple[int, int]) -> torch.Tensor:
    """scale[n // bn, k // bk] at every element of an [n, k] weight: the format's definition."""
    rows = torch.arange(n, device=scale.device) // block[0]
    cols = torch.arange(k, device=scale.device) // block[1]
    return scale[rows][:, cols]


def _dequantized_reference(fp8_dir: str, out: str) -> str:
    """The FP8 checkpoint as a plain one: every e4m3 weight times its block's scale, in fp32."""
    tensors = load_file(os.path.join(fp8_dir, "model.safetensors"))
    plain = {}
    for name, t in tensors.items():
        if name.endswith(fp8.SCALE_SUFFIX):
            continue
        if t.dtype == torch.float8_e4m3fn:
            scale = tensors[name + fp8.SCALE_SUFFIX]
            t = t.float() * _expand(scale, *t.shape, fp8.BLOCK)
        plain[name] = t
    os.makedirs(out)
    save_file(plain, os.path.join(out, "model.safetensors"))
    with open(os.path.join(fp8_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    del config["quantization_config"]
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    return out


@pytest.fixture(scope="module")
def targets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    """Per architecture: the source (fp32), its FP8 checkpoint and the FP8 one dequantized."""
    root = tmp_path_factory.mktemp("fp8-targets")
    out = {}
    for arch in ARCHS:
        src = build_tiny_target(str(root / f"{arch}-src"), arch=arch, hidden_size=HIDDEN, num_layers=4, seed=3)
        q = str(root / f"{arch}-fp8")
        quantize_checkpoint(src, q)
        out[arch] = {"src": src, "fp8": q, "ref": _dequantized_reference(q, str(root / f"{arch}-ref"))}
    return out


def _batch(lens: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    doc_lens = torch.tensor(lens, dtype=torch.int32)
    ids = torch.randint(0, 512, (sum(lens),), generator=torch.Generator().manual_seed(seed))
    return ids, document_positions(doc_lens), doc_lens


# ---- the quantizer ---------------------------------------------------------------------------------
def test_quantized_weights_are_within_e4m3_rounding_of_each_block_with_a_scale_per_partial_block() -> None:
    g = torch.Generator().manual_seed(0)
    n, k = 300, 200                                    # 3 x 2 blocks, the last row and column partial
    # blocks of very different magnitudes: a shared scale would flush the small ones to zero
    magnitude = 10.0 ** torch.randint(-4, 3, (3, 2), generator=g).float()
    w = torch.randn(n, k, generator=g) * _expand(magnitude, n, k, fp8.BLOCK)
    w[128:256, 128:] = 0.0                             # an all-zero block
    q, scale = fp8.quantize_weight(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (n, k)
    assert scale.dtype == torch.float32 and scale.shape == (3, 2)
    for i in range(3):
        for j in range(2):
            block = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]     # its real entries only
            amax = block.abs().max()
            assert scale[i, j] == (amax / fp8.FP8_MAX if amax > 0 else 1.0), (i, j)
    back = fp8.dequantize_weight(q, scale, fp8.BLOCK, torch.float32)
    err = (back - w).abs()
    assert bool((err <= e4m3_rounding(w, _expand(scale, n, k, fp8.BLOCK))).all()), float(err.max())
    assert float(err.max()) > 0, "nothing was rounded: not an e4m3 round trip"
    assert bool((back[128:256, 128:] == 0).all())
    # each block's largest entry is the top of e4m3's range, so it comes back whole
    top = w.abs().argmax()
    assert back.flatten()[top] == w.flatten()[top]


def test_quantize_fp8_writes_the_published_layout_that_transformers_reads(
        targets: dict[str, dict[str, str]], tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    src = targets["qwen3.5"]["src"]
    out = str(tmp_path / "fp8")
    assert dfpipe_main(["quantize-fp8", "--model", src, "--out", out]) == 0
    assert "weights in e4m3 with 128x128 block scales" in capsys.readouterr().out
    with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
        q = json.load(f)["quantization_config"]
    assert {k: v for k, v in q.items() if k != "modules_to_not_convert"} == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert {"lm_head", "model.embed_tokens", "model.layers.0.linear_attn.in_proj_a",
            "model.layers.0.linear_attn.in_proj_b", "model.norm"} <= set(q["modules_to_not_convert"])
    before, after = load_file(os.path.join(src, "model.safetensors")), load_file(os.path.join(out, "model.safetensors"))
    quantized = [n for n in before if n in after and after[n].dtype == torch.float8_e4m3fn]
    assert {n.split(".")[-2] for n in quantized} == {"q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv",
                                                     "in_proj_z", "out_proj", "gate_proj", "up_proj", "down_proj"}
    for name, t in before.items():
        if name in quantized:
            scale = after[name + fp8.SCALE_SUFFIX]
            assert scale.dtype == torch.float32 and scale.shape == (-(-t.shape[0] // 128), -(-t.shape[1] // 128))
        else:
            assert torch.equal(after[name], t), f"{name} changed"
    assert set(after) == set(before) | {n + fp8.SCALE_SUFFIX for n in quantized}
    # transformers' own reader of the format sees the same weights, where it can: its dequantization
    # reads the block size off the scale grid, so only for weights of whole 128 x 128 blocks
    whole = build_tiny_target(str(tmp_path / "whole"), arch="qwen3", hidden_size=256, num_layers=2, seed=4)
    quantize_checkpoint(whole, str(tmp_path / "whole-fp8"))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "whole-fp8"), dtype=torch.float32)
    tensors = load_file(str(tmp_path / "whole-fp8" / "model.safetensors"))
    for name in (n for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn):
        weight = model.get_parameter(name)
        scale = tensors[name + fp8.SCALE_SUFFIX]
        assert torch.equal(weight, tensors[name].float() * _expand(scale, *weight.shape, fp8.BLOCK)), name
    capsys.readouterr()

    for argv, why in ((["--model", src, "--out", out], "exists and is not an empty folder"),
                      (["--model", out, "--out", str(tmp_path / "again")], "is already quantized"),
                      (["--model", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")],
                       "no readable config.json")):
        assert dfpipe_main(["quantize-fp8", *argv]) == 2
        err = capsys.readouterr().err
        assert why in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "again").exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".")]
    assert oct(os.stat(out).st_mode & 0o777) == "0o755"
    assert {oct(os.stat(os.path.join(out, n)).st_mode & 0o777) for n in os.listdir(out)} == {"0o644"}


# ---- the target on the CPU -----------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_target_captures_what_its_dequantized_model_captures_on_the_cpu(
        arch: str, targets: dict[str, dict[str, str]]) -> None:
    paths = targets[arch]
    runner = TargetRunner.load(paths["fp8"], layer_ids=LAYER_IDS)
    reference = TargetRunner.load(paths["ref"], layer_ids=LAYER_IDS)
    assert runner.precision == "fp8-block-dequantized-fp32" and reference.precision == "fp32"
    assert runner.layer_ids == reference.layer_ids == LAYER_IDS
    batch = _batch([7, 30, 1, 12])
    captured = runner.capture(*batch)
    assert_close(captured, reference.capture(*batch), n=target_terms(runner, 30))
    # the FP8 model is not the model it was quantized from
    source = TargetRunner.load(paths["src"], layer_ids=LAYER_IDS).capture(*batch)
    assert float((captured - source).norm() / source.norm()) > 1e-3


class _EmulatedBlockFp8Linear(torch.nn.Module):
    """What a BlockFp8Linear computes, in torch ops on the CPU: the input quantized by the definition
    (per token, per 128 columns), then multiplied with the dequantized e4m3 weight in fp32."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.q, self.scale = fp8.quantize_weight(weight.detach().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq, xs = fp8.quantize_activations_reference(x.reshape(-1, x.shape[-1]), fp8.BLOCK[1])
        y = fp8.dequantized_matmul(xq, xs, self.q, self.scale, fp8.BLOCK)
        return y.to(x.dtype).view(*x.shape[:-1], -1)


def _alone_against_packed(runner: TargetRunner) -> float:
    """The server's audit of the second document of a batch: largest difference over largest value."""
    batch = _batch([7, 30, 1, 12])
    packed = runner.capture(*batch).float()[:, 7:37]
    alone = runner.capture_unpacked(batch[0][7:37]).float()
    return float((alone - packed).abs().max() / alone.abs().max())


def test_fp8_activations_alone_against_packed_differ_by_bf16_noise_within_the_fp8_audit_tolerance(
        targets: dict[str, dict[str, str]]) -> None:
    """Quantizing activations per token adds no packing dependency: in fp32 a document's planes
    alone and packed agree with FP8 activations as they do without. In bf16 the two orders' noise
    moves some inputs across e4m3 rounding boundaries (run BE on the H200: 0.077 of the largest
    value, over the 0.05 set for unquantized matmuls): the audit allows an FP8 target one e4m3
    step more (fp8.audit_tolerance), and the configured tolerance to every other precision."""
    configured = TargetConfig().audit_tolerance
    assert fp8.audit_tolerance(configured, "bf16") == configured
    assert fp8.audit_tolerance(configured, "fp8-block-dequantized-bf16") == configured
    errors = {}
    for dtype in ("fp32", "bf16"):
        runner = TargetRunner.load(targets["qwen3.5"]["fp8"], dtype=dtype, layer_ids=LAYER_IDS, linear_backend="torch")
        plain = _alone_against_packed(runner)
        for name, module in list(runner.model.named_modules()):
            if isinstance(module, torch.nn.Linear) and fp8.should_quantize(f"{name}.weight", module.weight):
                runner.model.set_submodule(name, _EmulatedBlockFp8Linear(module.weight))
        errors[dtype] = (plain, _alone_against_packed(runner))
    # fp32: both within two orders of the same fp32 computation through the captured layers
    fp32_bound = tol(target_terms(runner, 30))["rtol"]
    assert errors["fp32"][0] <= fp32_bound and errors["fp32"][1] <= fp32_bound, errors
    # bf16: the FP8 activations amplify the noise, and the FP8 audit tolerance holds them
    plain, quantized = errors["bf16"]
    assert plain <= configured and plain < quantized <= fp8.audit_tolerance(configured, fp8.FP8_PRECISION), errors


@pytest.mark.parametrize("change, match", [
    ({"activation_scheme": "static"}, "activation_scheme 'static'"),
    ({"weight_block_size": None}, "weight_block_size None"),
    ({"weight_block_size": [128, 100]}, r"weight_block_size \[128, 100\]"),
    ({"quant_method": "gptq"}, "quant_method 'gptq'"),
    ({"fmt": "e5m2"}, "fmt 'e5m2'"),
])
def test_a_quantization_the_target_cannot_run_is_refused_naming_the_setting(change: dict, match: str) -> None:
    config = {"quantization_config": {**fp8.quantization_config(fp8.BLOCK, []), **change}}
    with pytest.raises(fp8.Fp8FormatError, match=match):
        fp8.read_format(config)


def test_an_fp8_weight_without_its_scale_or_its_config_is_a_clear_error(targets: dict[str, dict[str, str]],
                                                                         tmp_path) -> None:
    no_scale = shutil.copytree(targets["qwen3"]["fp8"], tmp_path / "no-scale")
    tensors = load_file(str(no_scale / "model.safetensors"))
    del tensors["model.layers.0.mlp.down_proj.weight_scale_inv"]
    save_file(tensors, str(no_scale / "model.safetensors"))
    with pytest.raises(fp8.Fp8FormatError, match="has no layers.0.mlp.down_proj.weight_scale_inv"):
        TargetRunner.load(str(no_scale), layer_ids=LAYER_IDS)
    no_config = shutil.copytree(targets["qwen3"]["fp8"], tmp_path / "no-config")
    config = json.loads((no_config / "config.json").read_text())
    del config["quantization_config"]
    (no_config / "config.json").write_text(json.dumps(config))
    with pytest.raises(fp8.Fp8FormatError, match="config.json has no quantization_config"):
        TargetRunner.load(str(no_config), layer_ids=LAYER_IDS)


# ---- FP8 matmuls (CUDA, Hopper or newer) ---------------------------------------------------------
def _fp8_matmul_missing() -> str | None:
    if not torch.cuda.is_available():
        return "needs CUDA"
    return fp8.fp8_matmul_unavailable(torch.device("cuda"))


fp8_cuda_only = pytest.mark.skipif(_fp8_matmul_missing() is not None, reason=str(_fp8_matmul_missing()))


def _blocks_of_many_magnitudes(n: int, k: int, block: tuple[int, int], g: torch.Generator) -> torch.Tensor:
    """randn [n, k] with each block scaled by its own power of two: a scale applied to the wrong block shows."""
    rows, cols = -(-n // block[0]), -(-k // block[1])
    magnitude = 2.0 ** torch.randint(-6, 7, (rows, cols), generator=g, device=g.device).float()
    return torch.randn(n, k, generator=g, device=g.device) * _expand(magnitude, n, k, block)


@fp8_cuda_only
def test_activation_quantization_kernel_is_its_definition_bit_for_bit_on_cuda() -> None:
    """The kernel and `quantize_activations_reference` both divide by IEEE division. A torch tensor
    divided by a Python number on CUDA is multiplied by the number's reciprocal instead (ATen's
    div_true_kernel_cuda), one bit off the quotient for about half of all amax: the last-bit
    difference of the scales seen on the H200 (run BE) was that, in the definition."""
    g = torch.Generator(device="cuda").manual_seed(1)
    m, k = 300, 300                                    # a partial 128-column group
    x = _blocks_of_many_magnitudes(m, k, (1, 128), g).to(torch.bfloat16)
    x[5] = 0                                           # an all-zero token
    got_q, got_scale = fp8.quantize_activations(x, 128)
    want_q, want_scale = fp8.quantize_activations_reference(x, 128)
    assert got_scale.shape == (m, 3) and got_scale.stride() == (1, m)     # token-minor, as cuBLAS reads
    assert torch.equal(got_scale, want_scale)
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
    assert bool((got_q[5].float() == 0).all())
    # padded to more rows (cuBLAS's multiple of 4 tokens): the same, then zero tokens
    pad_q, pad_scale = fp8.quantize_activations(x, 128, rows=m + 3)
    assert pad_scale.stride() == (1, m + 3) and torch.equal(pad_scale[:m], want_scale)
    assert torch.equal(pad_q[:m].view(torch.uint8), want_q.view(torch.uint8)) and bool((pad_q[m:].float() == 0).all())
    # the definition is the same on the CPU and on CUDA, and so is the weight quantizer's
    cpu_q, cpu_scale = fp8.quantize_activations_reference(x.cpu(), 128)
    assert torch.equal(cpu_scale, want_scale.cpu())
    assert torch.equal(cpu_q.view(torch.uint8), want_q.view(torch.uint8).cpu())
    w = _blocks_of_many_magnitudes(260, 300, fp8.BLOCK, g)
    (wq, ws), (cq, cs) = fp8.quantize_weight(w), fp8.quantize_weight(w.cpu())
    assert torch.equal(ws.cpu(), cs) and torch.equal(wq.view(torch.uint8).cpu(), cq.view(torch.uint8))


def _gemm_or_skip(gemm: str) -> None:
    if gemm == fp8.GEMM_CUBLAS and (why := fp8.cublas_block_gemm_unavailable(torch.device("cuda", 0))):
        pytest.skip(f"cuBLAS's block-scaled FP8 GEMM does not run here: {why}")


@fp8_cuda_only
@pytest.mark.parametrize("gemm, m, n, k", [
    ("triton", 300, 260, 300),       # partial blocks in every dimension
    ("triton", 1, 272, 1024),
    ("cublas", 300, 272, 1024),      # the shapes cuBLAS takes: K a multiple of 512, N of 16 (a partial row block)
    ("cublas", 301, 272, 1024),      # tokens not a multiple of 4: padded for cuBLAS, the padding cut off
    ("cublas", 1, 272, 1024),        # one token
])
def test_each_block_fp8_gemm_computes_the_dequantized_product_on_cuda(gemm: str, m: int, n: int, k: int) -> None:
    _gemm_or_skip(gemm)
    g = torch.Generator(device="cuda").manual_seed(2)
    x = _blocks_of_many_magnitudes(m, k, (1, 128), g).to(torch.bfloat16)
    q, scale = fp8.quantize_weight(_blocks_of_many_magnitudes(n, k, fp8.BLOCK, g))
    xq, xs = fp8.quantize_activations(x, 128)
    expected = fp8.dequantized_matmul(xq, xs, q, scale, fp8.BLOCK)
    y = fp8.block_fp8_linear(x.view(1, m, k), q, scale, fp8.BLOCK, gemm)
    assert y.dtype == torch.bfloat16 and y.shape == (1, m, n)
    # the same e4m3 values and scales: apart only by the tensor cores' accumulation of k terms
    # and the bf16 output
    torch.testing.assert_close(y[0].float(), expected, **fp8_matmul_tol(k, scale=float(expected.abs().max()),
                                                                        rounded_to=torch.bfloat16))
    assert fp8.block_fp8_linear(x[:0], q, scale, fp8.BLOCK, gemm).shape == (0, n)


@fp8_cuda_only
def test_the_gemm_is_chosen_at_load_by_what_the_cuda_device_runs_and_the_shape_fits() -> None:
    device, bf16 = torch.device("cuda", 0), torch.bfloat16
    cublas = fp8.cublas_block_gemm_unavailable(device) is None
    assert fp8.choose_gemm(device, 272, 1024, fp8.BLOCK, bf16) == (fp8.GEMM_CUBLAS if cublas else fp8.GEMM_TRITON)
    for n, k, block, dtype in ((272, 1000, fp8.BLOCK, bf16), (272, 384, fp8.BLOCK, bf16), (260, 1024, fp8.BLOCK, bf16),
                               (272, 1024, (64, 64), bf16), (272, 1024, fp8.BLOCK, torch.float32)):
        assert fp8.choose_gemm(device, n, k, block, dtype) == fp8.GEMM_TRITON, (n, k, block, dtype)
    linear = torch.nn.Linear(1024, 272, bias=False, device="cuda", dtype=bf16)
    q, scale = fp8.quantize_weight(linear.weight.detach())
    module = fp8.runnable(linear, q, scale, fp8.BLOCK, fp8_matmul=True)
    assert isinstance(module, fp8.BlockFp8Linear) and module.gemm == fp8.choose_gemm(device, 272, 1024, fp8.BLOCK, bf16)
    x = torch.randn(5, 1024, device="cuda", dtype=bf16)
    assert module(x).shape == (5, 272) and module(x).dtype == bf16


@pytest.fixture(scope="module")
def wide_targets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Per architecture an FP8 checkpoint 512 wide: every quantized Linear's K a multiple of 512, the
    shapes cuBLAS's block-scaled GEMM takes (the 192-wide ones all run the Triton kernel)."""
    root = tmp_path_factory.mktemp("fp8-wide")
    out = {}
    for arch in ARCHS:
        src = build_tiny_target(str(root / f"{arch}-src"), arch=arch, hidden_size=512, num_layers=4, seed=3)
        out[arch] = str(root / f"{arch}-fp8")
        quantize_checkpoint(src, out[arch])
    return out


@fp8_cuda_only
@pytest.mark.parametrize("width", [HIDDEN, 512])
@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_target_on_cuda_captures_its_dequantized_model_within_fp8_activation_rounding(
        arch: str, width: int, targets: dict[str, dict[str, str]], wide_targets: dict[str, str]) -> None:
    path = targets[arch]["fp8"] if width == HIDDEN else wide_targets[arch]
    runner = TargetRunner.load(path, device="cuda", dtype="bf16", layer_ids=LAYER_IDS, linear_backend="torch",
                               fp8_matmul=True)
    dequantized = TargetRunner.load(path, device="cuda", dtype="bf16", layer_ids=LAYER_IDS, linear_backend="torch",
                                    fp8_matmul=False)
    assert runner.precision == "fp8-block" and dequantized.precision == "fp8-block-dequantized-bf16"
    gemms = {m.gemm for m in runner.model.modules() if isinstance(m, fp8.BlockFp8Linear)}
    cublas = width == 512 and fp8.cublas_block_gemm_unavailable(runner.device) is None
    assert gemms == {fp8.GEMM_CUBLAS if cublas else fp8.GEMM_TRITON}, gemms
    batch = _batch([7, 30, 1, 12])
    runner.capture(*batch)                             # tunes the kernels once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")            # a warm FP8 forward never waits for the GPU
    try:
        captured = runner.capture(*batch).float()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    reference = dequantized.capture(*batch).float()
    for plane, layer in enumerate(LAYER_IDS):
        rel = float((captured[plane] - reference[plane]).norm() / reference[plane].norm())
        # four quantized matmuls per layer along a value's path: the mixer's two, the MLP's two
        assert 0 < rel <= fp8_activation_rtol(4 * (layer + 1)), (layer, rel)
    # the server's audit (a document alone through transformers' forward against its packed planes)
    # passes at its tolerance for an FP8 target (bf16 noise across e4m3 rounding boundaries: the
    # CPU test above shows it is no packing dependency)
    alone = runner.capture_unpacked(batch[0][7:37]).float()
    err = float((alone - captured[:, 7:37]).abs().max() / alone.abs().max())
    assert err <= fp8.audit_tolerance(TargetConfig().audit_tolerance, runner.precision), err


@fp8_cuda_only
def test_eval_runs_an_fp8_target_with_the_target_servers_fp8_matmuls_on_cuda(
        targets: dict[str, dict[str, str]]) -> None:
    """transformers' own FP8 Linear needs a kernel from the hub: eval takes its modules over."""
    from dfpipe.eval import TargetModel

    path = targets["qwen3.5"]["fp8"]
    model = TargetModel.load(path, torch.device("cuda"), LAYER_IDS, dtype=torch.bfloat16)
    assert model.precision == "fp8-block"
    assert any(isinstance(m, fp8.BlockFp8Linear) for m in model.model.modules())
    batch = _batch([40])
    logits, features = model.forward(batch[0].tolist())
    assert bool(torch.isfinite(logits).all())
    dequantized = TargetRunner.load(path, device="cuda", dtype="bf16", layer_ids=LAYER_IDS, linear_backend="torch",
                                    fp8_matmul=False)
    reference = dequantized.capture(*batch).float()
    for plane, layer in enumerate(LAYER_IDS):
        rel = float((features[plane].float() - reference[plane]).norm() / reference[plane].norm())
        assert 0 < rel <= fp8_activation_rtol(4 * (layer + 1)), (layer, rel)


# ---- end to end: an FP8 copy of the demo target, served and trained on --------------------------
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_fp8_copy_of_the_demo_target_serves_a_trainer_that_finds_the_mask_token_through_target_tokenizer(
        tmp_path) -> None:
    """`dfpipe quantize-fp8` of the built-in tiny target writes no tokenizer (the built-in one has
    none): the server prepares data with target.tokenizer, and the trainer finds the mask token
    there too, not in the model folder."""
    from drafter_trainer.checkpoint import TrainerState
    from e2e import Service, inspect_run, load, serving, wait_for, write_config

    fp8_target = str(tmp_path / "fp8-target")
    assert dfpipe_main(["quantize-fp8", "--model", "builtin:tiny-qwen3.5", "--out", fp8_target]) == 0
    assert not any(name.startswith("tokenizer") for name in os.listdir(fp8_target))
    config = write_config(tmp_path, samples=40, target={"model": fp8_target}, train={"max_steps": 3})
    assert load(config)["target"]["tokenizer"], "the demo tokenizer, as the served target's"
    cfg = load(config)
    target = Service("target-server", config, tmp_path)
    trainer = None
    try:
        status = wait_for(lambda: serving(cfg["service"]["target_endpoint"]), 300, "the FP8 target serving")
        assert status["target"]["precision"].startswith("fp8-block"), status["target"]
        trainer = Service("trainer", config, tmp_path)
        assert trainer.wait(300) == 0, trainer.log()
        assert "max_steps reached" in trainer.log()
        info = inspect_run(config)
        assert info["step"] == 3
        assert TrainerState.load(info["path"]).drafter_config["mask_token_id"] == 3   # <|mask|> of the demo tokenizer
    finally:
        if trainer is not None:
            trainer.stop()
        target.stop()
