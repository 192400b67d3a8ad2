"""Documents packed into one row never interact: packed capture == one forward per document.

The fixture is proven meaningful: transformers' own packed forward (restarting position_ids) DOES
leak across documents on the hybrid Qwen3.5 target (short conv + Gated DeltaNet state), so a
packing path that fell back to it would fail here.
"""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
import transformers.models.qwen3_5.modeling_qwen3_5  # noqa: F401  (bind HF's kernels while conftest blocks FLA)
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import AutoModelForCausalLM

from common.batch import document_positions
from target_server import varlen
from target_server.target import TargetRunner
from tolerances import assert_close, differs, rel_err, target_terms, tol, transformer_roundings

pytestmark = pytest.mark.numerics   # run again under ATEN_CPU_CAPABILITY=default (make test-numerics)

ARCHS = ("qwen3.5", "qwen3")
# length 1, lengths below the conv kernel (4), and lengths across the delta rule's 64-token chunks
DOC_LENS = [1, 2, 3, 5, 70, 17, 130]
# a long document (a thinking trace, at the tiny target's scale: longer than the demo's whole
# 2,048-token budget, 33 delta-rule chunks) between two short ones
LONG_DOC_LENS = [5, 2100, 70]
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def hf_models(tiny_dirs: dict[str, str]) -> dict[str, torch.nn.Module]:
    return {arch: AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
            for arch, path in tiny_dirs.items()}


@pytest.fixture(scope="module")
def runners(tiny_dirs: dict[str, str]) -> dict[str, TargetRunner]:
    return {arch: TargetRunner.load(path) for arch, path in tiny_dirs.items()}


def _packed(lens: list[int], seed: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, 512, (n,), generator=g) for n in lens]
    doc_lens = torch.tensor(lens, dtype=torch.int32)
    return docs, torch.cat(docs), document_positions(doc_lens), doc_lens


def _hf_layers(model: torch.nn.Module, ids: torch.Tensor, layer_ids: list[int], **kwargs: object) -> torch.Tensor:
    """HF hidden_states[l + 1] for the captured ids, stacked [k, T, H]."""
    with torch.no_grad():
        hs = model(input_ids=ids[None], use_cache=False, output_hidden_states=True, **kwargs).hidden_states
    return torch.stack([hs[layer + 1][0] for layer in layer_ids])


@pytest.mark.parametrize("doc_lens", [DOC_LENS, LONG_DOC_LENS], ids=["short", "long"])
@pytest.mark.parametrize("arch", ARCHS)
def test_packed_capture_equals_one_hf_forward_per_document(arch: str, doc_lens: list[int],
                                                           hf_models: dict[str, torch.nn.Module],
                                                           runners: dict[str, TargetRunner]) -> None:
    runner = runners[arch]
    docs, ids, pos, lens = _packed(doc_lens, seed=0)
    packed = runner.capture(ids, pos, lens)
    start = 0
    for doc in docs:
        alone = _hf_layers(hf_models[arch], doc, runner.layer_ids)
        assert_close(packed[:, start:start + len(doc)], alone, n=target_terms(runner, ids.numel()))
        start += len(doc)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_fixed_linear_token_count_changes_no_captured_value(arch: str, runners: dict[str, TargetRunner]) -> None:
    # the padding document the Gated DeltaNet kernels see must not reach any real token
    runner = runners[arch]
    _, ids, pos, lens = _packed(DOC_LENS, seed=3)
    plain = runner.capture(ids, pos, lens)
    assert runner.fix_linear_shape(ids.numel() + 37).fixed_tokens == 0, "the torch path needs no fixed shape"
    try:
        runner.fixed_tokens = ids.numel() + 37
        padded = runner.capture(ids, pos, lens)
        runner.fixed_tokens = ids.numel() - 5   # shorter than the row: no padding, same result
        shorter = runner.capture(ids, pos, lens)
    finally:
        runner.fixed_tokens = 0
    # fp32: only the summation order of kernels sized by the longer row may differ
    assert_close(padded, plain, n=target_terms(runner, ids.numel() + 37))
    assert torch.equal(shorter, plain)


class LargestTensor(TorchDispatchMode):
    """The largest tensor (by elements) any op makes while active."""

    def __init__(self) -> None:
        super().__init__()
        self.numel, self.shape = 0, ()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in tree_flatten(out)[0]:
            if isinstance(x, torch.Tensor) and x.numel() > self.numel:
                self.numel, self.shape = x.numel(), tuple(x.shape)
        return out


@pytest.mark.parametrize("arch", ARCHS)
def test_a_long_document_never_makes_a_token_by_token_tensor(arch: str, runners: dict[str, TargetRunner]) -> None:
    # per document SDPA on the CPU is causal attention without a mask; the audit's unpacked forward
    # (transformers' own) skips its causal mask too. A T x T score or mask tensor would make the
    # capture's memory grow with the square of the document: at 64K tokens, 16 GB a head in fp32.
    runner = runners[arch]
    t = 1024          # every real tensor here is at most k x T x hidden (640 x T) elements
    _, ids, pos, lens = _packed([t], seed=9)
    for capture in (lambda: runner.capture(ids, pos, lens), lambda: runner.capture_unpacked(ids)):
        with LargestTensor() as largest:
            capture()
        assert largest.numel < t * t, f"a {largest.shape} tensor for a {t}-token document"


def test_padded_docs_add_one_document_and_refuse_too_few_tokens() -> None:
    docs = varlen.PackedDocs.from_doc_lens(torch.tensor([3, 2]), "cpu")
    padded = docs.padded(8)
    assert padded.bounds == ((0, 3), (3, 5), (5, 8)) and padded.cu_seqlens.tolist() == [0, 3, 5, 8]
    assert padded.doc_pos.tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    assert docs.padded(5) is docs and docs.padded(2) is docs
    with pytest.raises(ValueError, match="docs cover 5 tokens"):
        varlen.gated_deltanet_forward(torch.nn.Module(), torch.zeros(1, 6, 4), docs)


def test_hf_packed_forward_leaks_across_documents_on_the_hybrid_target(hf_models: dict[str, torch.nn.Module],
                                                                       runners: dict[str, TargetRunner]) -> None:
    """The reason this module exists: stock transformers mixes packed documents in GDN layers."""
    runner = runners["qwen3.5"]
    docs, ids, pos, lens = _packed(DOC_LENS, seed=0)
    naive = _hf_layers(hf_models["qwen3.5"], ids, runner.layer_ids, position_ids=pos[None])
    ours = runner.capture(ids, pos, lens)
    first = len(docs[0])
    assert_close(naive[:, :first], ours[:, :first], n=target_terms(runner, ids.numel()))
    start = first
    for doc in docs[1:]:
        # every later document differs already at its first token: conv taps and recurrent state leak in
        assert differs(naive[:, start], ours[:, start], n=target_terms(runner, ids.numel()))
        start += len(doc)


def test_attention_only_target_needs_document_boundaries_too(hf_models: dict[str, torch.nn.Module],
                                                            runners: dict[str, TargetRunner]) -> None:
    """On Qwen3 a packed row without boundaries (plain causal attention) differs from ours."""
    runner = runners["qwen3"]
    docs, ids, pos, lens = _packed(DOC_LENS, seed=0)
    naive = _hf_layers(hf_models["qwen3"], ids, runner.layer_ids)
    ours = runner.capture(ids, pos, lens)
    assert differs(naive[:, len(docs[0]):], ours[:, len(docs[0]):], n=target_terms(runner, ids.numel()))


def test_varlen_conv_zeroes_history_at_each_document_start() -> None:
    g = torch.Generator().manual_seed(1)
    lens = [1, 2, 3, 5, 9]
    x = torch.randn(sum(lens), 6, generator=g)
    w = torch.randn(6, 4, generator=g)
    docs = varlen.PackedDocs.from_doc_lens(torch.tensor(lens), "cpu")

    def hf_conv(seq: torch.Tensor) -> torch.Tensor:  # transformers' torch conv on [T, C]
        return F.silu(F.conv1d(seq.T[None], w[:, None], padding=3, groups=6)[0, :, :seq.shape[0]].T)

    ours = varlen.causal_conv1d(x, w, None, docs)
    per_doc = torch.cat([hf_conv(x[s:e]) for s, e in docs.bounds])
    taps = w.shape[1]                   # each output sums the kernel's 4 taps, then one silu
    assert_close(ours, per_doc, n=taps)
    # over the packed row the stock conv differs exactly in the first 3 tokens of every later document
    leaked = ~torch.isclose(hf_conv(x), per_doc, **tol(taps, scale=per_doc.abs().max())).all(1)
    expected = torch.zeros(sum(lens), dtype=torch.bool)
    for s, e in docs.bounds[1:]:
        expected[s:min(e, s + 3)] = True
    assert torch.equal(leaked, expected)


def test_gated_delta_rule_restarts_its_state_at_each_document() -> None:
    g = torch.Generator().manual_seed(2)
    lens, heads, dk, dv = [1, 3, 66, 10], 2, 8, 8
    t = sum(lens)
    q, k = torch.randn(1, t, heads, dk, generator=g), torch.randn(1, t, heads, dk, generator=g)
    v = torch.randn(1, t, heads, dv, generator=g)
    decay = -torch.rand(1, t, heads, generator=g)
    beta = torch.rand(1, t, heads, generator=g)
    docs = varlen.PackedDocs.from_doc_lens(torch.tensor(lens), "cpu")
    ours = varlen.gated_delta_rule(q, k, v, decay, beta, docs)
    one_doc = varlen.PackedDocs.from_doc_lens(torch.tensor([t]), "cpu")
    for s, e in docs.bounds:
        sl = slice(s, e)
        alone = varlen.gated_delta_rule(q[:, sl], k[:, sl], v[:, sl], decay[:, sl], beta[:, sl],
                                        varlen.PackedDocs.from_doc_lens(torch.tensor([e - s]), "cpu"))
        # every step updates a dk x dv state from dk-term products, over up to the longest document
        assert_close(ours[:, sl], alone, n=max(lens) * dk)
    carried = varlen.gated_delta_rule(q, k, v, decay, beta, one_doc)
    assert differs(carried[:, lens[0]:], ours[:, lens[0]:], n=max(lens) * dk)


@settings(max_examples=8, deadline=None)
@given(lens=st.lists(st.integers(1, 40), min_size=1, max_size=6), seed=st.integers(0, 2**16))
def test_a_documents_states_do_not_depend_on_its_neighbours(lens: list[int], seed: int,
                                                            runners: dict[str, TargetRunner]) -> None:
    runner = runners["qwen3.5"]
    docs, ids, pos, doc_lens = _packed(lens, seed)
    packed = runner.capture(ids, pos, doc_lens)
    start = 0
    for doc in docs:
        one = torch.tensor([len(doc)], dtype=torch.int32)
        alone = runner.capture(doc, document_positions(one), one)
        assert_close(packed[:, start:start + len(doc)], alone, n=target_terms(runner, ids.numel()))
        start += len(doc)


def test_linear_backend_choice_is_checked() -> None:
    assert varlen.resolve_backend("auto", torch.device("cpu")) == "torch"
    assert varlen.resolve_backend("torch", torch.device("cpu")) == "torch"
    with pytest.raises(RuntimeError, match="fla"):
        varlen.resolve_backend("fla", torch.device("cpu"))
    with pytest.raises(ValueError, match="backend"):
        varlen.resolve_backend("triton", torch.device("cpu"))


# ---- GPU (run by the lead on the H200; skipped on CPU-only machines) ---------------------------------


@pytest.fixture
def real_fla() -> None:
    """conftest blocks FLA for the CPU fallback; FLA-vs-torch tests need the real package back."""
    blocked = sys.modules.get("fla", "absent") is None
    if blocked:
        del sys.modules["fla"]
    try:
        if varlen.fla_ops() is None:
            pytest.skip("flash-linear-attention is not installed")
        yield
    finally:
        if blocked:
            sys.modules["fla"] = None  # type: ignore[assignment]


# FLA's chunked delta rule stores five intermediates in the input dtype besides its output (the
# inverted triangle, w, u, the chunk states, the corrected values): roundings the torch path, which
# computes in fp32 and rounds once at the end, does not make.
FLA_RULE_ROUNDINGS = 5


def _bf16_rtol(runner: TargetRunner, tokens: int) -> float:
    """How far two bf16 forwards of the target may differ when some operations run other kernels:
    from the first layer on, every stored output may round apart (`transformer_roundings` through the
    deepest captured layer, FLA's own in each Gated DeltaNet layer), on top of the fp32 sums."""
    layers = max(runner.layer_ids) + 1
    types = getattr(runner.model.config, "layer_types", None) or ["full_attention"] * layers
    linear = sum(t == "linear_attention" for t in types[:layers])
    return tol(target_terms(runner, tokens), rounded_to=torch.bfloat16,
               roundings=transformer_roundings(layers, FLA_RULE_ROUNDINGS * linear))["rtol"]


@cuda_only
def test_fla_kernels_match_the_torch_path_on_gpu(real_fla: None) -> None:
    g = torch.Generator(device="cuda").manual_seed(3)
    lens, heads, dk, dv, c = [1, 3, 70, 200, 9], 4, 32, 32, 64
    t = sum(lens)
    docs = varlen.PackedDocs.from_doc_lens(torch.tensor(lens), "cuda")
    x = torch.randn(t, c, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(c, 4, device="cuda", generator=g, dtype=torch.bfloat16)
    # both sum the 4 taps in fp32 and round the activated output to bf16 once
    assert rel_err(varlen.causal_conv1d(x, w, None, docs, backend="fla"),
                   varlen.causal_conv1d(x, w, None, docs, backend="torch")) <= tol(4, rounded_to=torch.bfloat16)["rtol"]
    q = torch.randn(1, t, heads, dk, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(1, t, heads, dk, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(1, t, heads, dv, device="cuda", generator=g, dtype=torch.bfloat16)
    decay = -torch.rand(1, t, heads, device="cuda", generator=g)
    beta = torch.rand(1, t, heads, device="cuda", generator=g, dtype=torch.bfloat16)
    # a state of dk-term products over the longest document; FLA rounds its intermediates, torch once
    bound = tol(max(lens) * dk, rounded_to=torch.bfloat16, roundings=1 + FLA_RULE_ROUNDINGS)["rtol"]
    assert rel_err(varlen.gated_delta_rule(q, k, v, decay, beta, docs, backend="fla"),
                   varlen.gated_delta_rule(q, k, v, decay, beta, docs, backend="torch")) <= bound


@cuda_only
def test_fla_target_forward_matches_the_torch_path_on_gpu(real_fla: None, tiny_dirs: dict[str, str]) -> None:
    fla = TargetRunner.load(tiny_dirs["qwen3.5"], device="cuda", dtype="bf16", linear_backend="fla")
    ref = TargetRunner.load(tiny_dirs["qwen3.5"], device="cuda", dtype="bf16", linear_backend="torch")
    _, ids, pos, lens = _packed(DOC_LENS, seed=4)
    assert rel_err(fla.capture(ids, pos, lens), ref.capture(ids, pos, lens)) <= _bf16_rtol(fla, ids.numel())


@cuda_only
def test_fla_with_a_fixed_token_count_matches_the_row_length_on_gpu(real_fla: None,
                                                                     tiny_dirs: dict[str, str]) -> None:
    runner = TargetRunner.load(tiny_dirs["qwen3.5"], device="cuda", dtype="bf16", linear_backend="fla")
    _, ids, pos, lens = _packed(DOC_LENS, seed=6)
    plain = runner.capture(ids, pos, lens)
    assert runner.fix_linear_shape(512).fixed_tokens == 512
    # the same kernels on a longer row may tune (and so sum) differently: the bf16 bound of two kernels
    assert rel_err(runner.capture(ids, pos, lens), plain) <= _bf16_rtol(runner, ids.numel())
    assert not torch.backends.cuda.cudnn_sdp_enabled(), "per-document attention must not build cuDNN plans"


@cuda_only
@pytest.mark.parametrize("arch", ARCHS)
def test_packed_equals_per_document_on_gpu_in_bf16(arch: str, real_fla: None, tiny_dirs: dict[str, str]) -> None:
    runner = TargetRunner.load(tiny_dirs[arch], device="cuda")  # auto: bf16, FLA when importable
    assert runner.dtype == torch.bfloat16
    if arch == "qwen3.5":
        assert runner.linear_backend == "fla", "on a GPU the packed path must run FLA's varlen kernels"
    docs, ids, pos, lens = _packed(DOC_LENS, seed=5)
    packed = runner.capture(ids, pos, lens).cpu()
    start = 0
    for doc in docs:
        alone = runner.capture_unpacked(doc).cpu()  # transformers' own forward, one document
        assert rel_err(packed[:, start:start + len(doc)], alone) <= _bf16_rtol(runner, ids.numel())
        start += len(doc)


def test_attention_paths_refuse_what_they_cannot_run(runners: dict[str, TargetRunner]) -> None:
    runner = runners["qwen3.5"]
    _, ids, pos, lens = _packed(DOC_LENS, seed=7)
    reference = runner.capture(ids, pos, lens)
    runner.attention_path = "varlen"   # torch's flash kernel: CUDA and half precision only
    try:
        if not torch.cuda.is_available():
            with pytest.raises(ValueError, match="varlen attention needs"):
                runner.capture(ids, pos, lens)
        runner.attention_path = "per_document"
        assert torch.equal(runner.capture(ids, pos, lens), reference)   # "auto" on the CPU is per document
        runner.attention_path = "sideways"
        with pytest.raises(ValueError, match="attention path"):
            runner.capture(ids, pos, lens)
    finally:
        runner.attention_path = "auto"


@cuda_only
@pytest.mark.parametrize("arch", ARCHS)
def test_varlen_attention_matches_per_document_sdpa_on_gpu(arch: str, real_fla: None,
                                                           tiny_dirs: dict[str, str]) -> None:
    runner = TargetRunner.load(tiny_dirs[arch], device="cuda")
    _, ids, pos, lens = _packed(DOC_LENS, seed=8)
    runner.attention_path = "per_document"
    per_doc = runner.capture(ids, pos, lens)
    runner.attention_path = "varlen"
    varlen_out = runner.capture(ids, pos, lens)
    bound = _bf16_rtol(runner, ids.numel())
    assert rel_err(varlen_out, per_doc) <= bound
    # documents stay apart: changing the first document leaves every later one's states alone
    ids2 = ids.clone()
    ids2[: DOC_LENS[0]] = (ids2[: DOC_LENS[0]] + 1) % 512
    moved = runner.capture(ids2, pos, lens)
    later = (moved[:, DOC_LENS[0]:].float() - varlen_out[:, DOC_LENS[0]:].float()).abs().max()
    assert float(later) <= bound * float(varlen_out.float().abs().max())


@cuda_only
def test_to_device_sends_one_batch_without_waiting_for_the_gpu() -> None:
    docs = varlen.PackedDocs.from_doc_lens(torch.tensor([3, 1, 70]))
    odd = torch.arange(7, dtype=torch.int32)          # odd length: the next tensor must still be 16-byte aligned
    grid = torch.arange(6).view(3, 2)
    busy = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    for _ in range(8):                                 # queue work the copy must not wait for
        busy = busy @ busy / 64
    torch.cuda.set_sync_debug_mode("error")
    try:
        moved_odd, moved_docs, moved_grid = varlen.to_device("cuda", odd, docs, grid)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert moved_odd.dtype == torch.int64 and torch.equal(moved_odd.cpu(), odd.to(torch.int64))
    assert torch.equal(moved_grid.cpu(), grid) and moved_grid.shape == (3, 2)
    assert moved_docs.bounds == docs.bounds and moved_docs.chunk_indices is None
    assert torch.equal(moved_docs.cu_seqlens.cpu(), docs.cu_seqlens)
    assert torch.equal(moved_docs.doc_pos.cpu(), docs.doc_pos)
    for t in (moved_odd, moved_docs.cu_seqlens, moved_docs.doc_pos, moved_grid):
        assert t.is_cuda and t.data_ptr() % 16 == 0


@cuda_only
def test_fla_kernels_take_the_host_built_chunk_table_on_gpu(real_fla: None) -> None:
    assert varlen.fla_takes_chunk_table(), "the pinned FLA (0.6.0) accepts chunk_indices"
    lens = [1, 3, 64, 65, 200, 9]
    host = varlen.PackedDocs.from_doc_lens(torch.tensor(lens)).padded(400).with_fla_chunks()
    assert host.chunk_indices is not None and host.chunk_indices.shape == (1 + 1 + 1 + 2 + 4 + 1 + 1, 2)
    (with_table,) = varlen.to_device("cuda", host)
    without = varlen.PackedDocs.from_doc_lens(torch.tensor(lens), "cuda").padded(400)
    assert without.chunk_indices is None
    g = torch.Generator(device="cuda").manual_seed(5)
    t, heads, dk, c = 400, 4, 32, 64
    x = torch.randn(t, c, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(c, 4, device="cuda", generator=g, dtype=torch.bfloat16)
    assert torch.equal(varlen.causal_conv1d(x, w, None, with_table, backend="fla"),
                       varlen.causal_conv1d(x, w, None, without, backend="fla"))
    q, k, v = (torch.randn(1, t, heads, dk, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    decay = -torch.rand(1, t, heads, device="cuda", generator=g)
    beta = torch.rand(1, t, heads, device="cuda", generator=g, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")   # given the table, FLA reads nothing back
    try:
        fast = varlen.gated_delta_rule(q, k, v, decay, beta, with_table, backend="fla")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(fast, varlen.gated_delta_rule(q, k, v, decay, beta, without, backend="fla"))


@cuda_only
@pytest.mark.parametrize("fixed_tokens", [0, 512])
def test_a_warm_capture_never_waits_for_the_gpu(fixed_tokens: int, real_fla: None, tiny_dirs: dict[str, str]) -> None:
    """The host launches batch N+1 while the GPU still runs batch N: nothing in the packed forward
    (input copies, FLA's varlen set-up, the attention call) may synchronise with the device."""
    runner = TargetRunner.load(tiny_dirs["qwen3.5"], device="cuda", dtype="bf16", linear_backend="fla")
    runner.fix_linear_shape(fixed_tokens)
    _, ids, pos, lens = _packed(DOC_LENS, seed=9)
    out = torch.empty(len(runner.layer_ids), ids.numel(), runner.hidden_size, dtype=runner.dtype, device="cuda")
    reference = runner.capture(ids, pos, lens).clone()     # the first call tunes the Triton kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            runner.capture(ids, pos, lens, out=out)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(out, reference)
