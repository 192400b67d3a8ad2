"""drafter.compile and the loss head: the compiled layers and the head's kernels compute what the
eager code did.

The compiled paths run on the CPU here through inductor's C++ backend (the GPU run uses Triton,
the same graphs): the loss head's elementwise function against the per-chunk math it replaced
(on CUDA also its Triton kernel), the chunked loss against full logits, and a compiled drafter
against an eager one over two context lengths (dynamic shapes: the second batch must neither
crash nor recompile wrongly).
Compiles are a few seconds each on two cores, so each graph is built once and shapes are tiny.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from common.config import ConfigError, load_config
from drafter_trainer.blocks import build_blocks
from drafter_trainer.loss import _ChunkedLinearCrossEntropy, cross_entropy_fn, dflash_loss, softmax_cross_entropy
from drafter_trainer.model import DrafterConfigError
from test_drafter_model import MASK, autocast_rtol, drafter_terms, make_batch, make_model, tiny_config
from tolerances import assert_close, rel_err, tol


def per_chunk_reference(logits: torch.Tensor, labels: torch.Tensor, w: torch.Tensor, need_grad: bool):
    """The loss head's per-chunk math as it was before the fusion (separate eager passes)."""
    buf = logits.float().clone()
    target_logit = buf.gather(1, labels[:, None]).squeeze(1)
    correct = buf.argmax(dim=-1) == labels
    top = buf.amax(dim=-1, keepdim=True)
    sum_exp = buf.sub_(top).exp_().sum(dim=-1, keepdim=True)
    ce_sum = ((top + sum_exp.log()).squeeze(1) - target_logit).mul(w).sum()
    if not need_grad:
        return ce_sum, correct, None
    buf.div_(sum_exp)
    buf[torch.arange(labels.shape[0]), labels] -= 1.0
    buf.mul_(w[:, None])
    return ce_sum, correct, buf.to(logits.dtype)


def chunk_case(rows: int, vocab: int = 300, dtype: torch.dtype = torch.float32, seed: int = 0):
    """Logits with a planted argmax in some rows, labels at both vocabulary edges, zero weights."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    labels = torch.randint(0, vocab, (rows,), generator=g)
    labels[0], labels[1 % rows] = 0, vocab - 1
    weights = torch.rand(rows, generator=g)
    weights[2 % rows] = 0.0
    hit = torch.arange(0, rows, 2)
    logits[hit, labels[hit]] = 20.0             # these rows' argmax is their label
    return logits, labels, weights


def assert_same_head(got, want, logits: torch.Tensor, weights: torch.Tensor, exact: bool) -> None:
    """Both heads compute in fp32 from the same logits, summing in their own order (tolerances.py)."""
    ce, correct, grad = got
    ce_w, correct_w, grad_w = want
    rows, vocab = logits.shape
    assert correct.dtype == torch.bool and torch.equal(correct, correct_w)
    assert ce.dtype == torch.float32 and ce.dim() == 0
    # per row top + log(sum of V exps) - the label's logit: the log turns the sum's relative error
    # (sqrt(V) ulps) into an absolute one; top - label is off by ulps of the logits' size (they
    # cancel in rows that hit); the rows' weighted sum (w <= 1) adds those up
    log_sum, logit = tol(rows * vocab), tol(rows, scale=logits.float().abs().max())
    torch.testing.assert_close(ce, ce_w, rtol=log_sum["rtol"], atol=log_sum["atol"] + logit["atol"])
    if grad_w is None:
        assert grad is None
        return
    assert grad.dtype == logits.dtype
    if exact:
        assert torch.equal(grad, grad_w)
    else:
        # w * (p - onehot): p is one exp over the V-term sum; p - 1 cancels where p is near 1, so the
        # error is relative to w (p <= 1), not to the result; bf16 then rounds at most one step apart
        torch.testing.assert_close(grad.float(), grad_w.float(),
                                   **tol(vocab, scale=weights.max(), rounded_to=logits.dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("need_grad", [True, False])
def test_fused_cross_entropy_equals_the_per_chunk_math_it_replaced(dtype, need_grad):
    logits, labels, weights = chunk_case(7, dtype=dtype)
    want = per_chunk_reference(logits, labels, weights, need_grad)
    got = softmax_cross_entropy(logits.clone(), labels, weights, need_grad)
    assert_same_head(got, want, logits, weights, exact=True)
    assert int(got[1].sum()) >= 4                                   # the planted hits are counted
    if need_grad:
        assert not got[2][2].any() and got[2][0].any()              # weight 0: no gradient


def test_chunked_head_loss_and_hidden_gradient_equal_full_logits_cross_entropy():
    g = torch.Generator().manual_seed(3)
    rows, hidden_size, vocab = 11, 16, 300
    hidden = torch.randn(rows, hidden_size, generator=g, requires_grad=True)
    head = torch.randn(vocab, hidden_size, generator=g)
    labels = torch.randint(0, vocab, (rows,), generator=g)
    labels[0], labels[-1] = 0, vocab - 1
    weights = torch.rand(rows, generator=g)
    weights[4] = 0.0

    want = (F.cross_entropy(hidden @ head.t(), labels, reduction="none") * weights).sum()
    (want_grad,) = torch.autograd.grad(want, hidden)
    ce_sum, correct = _ChunkedLinearCrossEntropy.apply(hidden, head, labels, weights, 4, True)
    (got_grad,) = torch.autograd.grad(ce_sum * 2.0, hidden)
    # the logits sum hidden_size terms, the loss a softmax over the vocabulary per row, then the rows;
    # the hidden gradient sums (p - onehot) * W over the vocabulary after the same forward
    logits = (hidden @ head.t()).detach()
    torch.testing.assert_close(ce_sum, want.detach(),
                               **tol(rows * (hidden_size + vocab), scale=logits.abs().max()))
    assert_close(got_grad, 2.0 * want_grad, n=2 * hidden_size + vocab)
    assert torch.equal(correct, (hidden @ head.t()).argmax(-1) == labels)


# split: the attention runs eager between two graphs (traced into one, it got wrong gradients);
# one layer is enough there. flex has no CPU backward (see below).
@pytest.mark.usefixtures("cxx_compiler")
@pytest.mark.parametrize("impl, layers", [("sdpa", 2), ("split", 1)])
def test_compiled_drafter_equals_eager_over_two_context_lengths(impl, layers):
    cfg = tiny_config(num_hidden_layers=layers, layer_types=["sliding_attention", "full_attention"][-layers:],
                      sliding_window=5)
    eager, compiled = make_model(cfg, std=0.05, attn_impl=impl), make_model(cfg, std=0.05, attn_impl=impl)
    keys = list(compiled.state_dict())
    assert compiled.compile_for("cpu", "on") and compiled.compiled
    assert list(compiled.state_dict()) == keys and not any("_orig_mod" in k for k in keys)
    params = {n: p for n, p in compiled.named_parameters() if p.requires_grad}
    for docs, anchors in (([12, 22], [1, 5, 13, 20, 28]), ([30, 9, 17], [2, 6, 11, 19, 33, 40, 44])):
        batch = make_batch(docs)
        blocks = build_blocks(batch, torch.tensor(anchors), 4, MASK, 7.0)
        results = []
        for model in (eager, compiled):
            model.zero_grad(set_to_none=True)
            out = dflash_loss(model, batch, blocks, chunk=8)
            out.loss.backward()
            hidden = model(batch.hidden, blocks.block_input_ids, blocks).detach()   # the same graph again
            results.append((hidden, out, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
        (h_e, out_e, grads_e), (h_c, out_c, grads_c) = results
        rows = blocks.labels.numel()
        assert_close(h_c, h_e, n=drafter_terms(cfg, sum(docs)))
        assert_close(out_c.loss, out_e.loss, n=drafter_terms(cfg, sum(docs), rows))
        assert torch.equal(out_c.correct_per_pos, out_e.correct_per_pos)
        assert set(grads_c) == set(params)
        for name, grad in grads_e.items():
            assert_close(grads_c[name], grad, n=drafter_terms(cfg, sum(docs), rows, backward=True), msg=name)
    assert not compiled.compile_for("cpu", "off") and compiled.layers[0]._compiled_call_impl is None


@pytest.mark.usefixtures("cxx_compiler")
def test_compiled_norm_rounds_to_bf16_where_eager_does():
    # RMSNorm casts the normalised bf16 input back to bf16 before the fp32 gain (an fp32 result
    # under autocast); a fused kernel must not skip that rounding
    model = make_model()
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16) * 3
    with torch.no_grad():
        want = model.norm(x)
        model.compile_for("cpu", "on")
        got = model.norm(x)
    assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_inside_a_compiled_layer_traces_once_for_every_context_length():
    """Dynamo and autograd tracing only (inductor's CPU flex kernel is not the GPU's Triton one):
    flex is called un-wrapped inside the layer's graph, and a new batch (new BlockMask, new T)
    reuses that graph."""
    graphs = []

    def counting_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    cfg = tiny_config(num_hidden_layers=2)
    eager, compiled = make_model(cfg, attn_impl="flex"), make_model(cfg, attn_impl="flex")
    for layer in compiled.layers:
        layer.compile(dynamic=True, backend=counting_backend)
    # two key tiles of the block mask's 64 or more in both batches: dynamo specialises a size of 1
    # (the trainer's batches hold far more keys)
    for docs, anchors in (([40, 30], [1, 5, 13, 20, 48]), ([50, 9, 17], [2, 6, 11, 19, 53, 60, 64])):
        batch = make_batch(docs)
        blocks = build_blocks(batch, torch.tensor(anchors), 4, MASK, 7.0)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = eager(batch.hidden, blocks.block_input_ids, blocks)
            got = compiled(batch.hidden, blocks.block_input_ids, blocks)
        assert_close(got, want, n=drafter_terms(cfg, sum(docs)))
    # one graph: both layers (same code, same mask rule) and both batches, flex inside it
    assert len(graphs) == 1, [g.code for g in graphs]
    assert any("flex_attention" in str(node.target) for node in graphs[0].graph.nodes)


def test_compile_option_is_checked():
    assert load_config(None, []).drafter.compile == "auto"
    assert load_config(None, ["drafter.compile=off"]).drafter.compile == "off"     # YAML's bare off
    assert load_config(None, ["drafter.compile=on"]).drafter.compile == "on"
    with pytest.raises(ConfigError, match="drafter.compile: auto | off | on"):
        load_config(None, ["drafter.compile=yes please"])
    model = make_model()
    with pytest.raises(DrafterConfigError, match="compile must be one of"):
        model.compile_for("cpu", "always")
    assert not model.compile_for("cpu", "auto") and not model.compiled        # auto: eager on the CPU
    assert model.compile_for(torch.device("cuda", 0), "off") is False


# ---- CUDA (the GPU host: pytest -k cuda tests/test_drafter_compile.py) ---------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_loss_head_kernel_equals_the_per_chunk_math(dtype):
    from drafter_trainer import ce_kernel

    assert ce_kernel.available()
    kernel = cross_entropy_fn(torch.device("cuda"))
    assert kernel is ce_kernel.softmax_cross_entropy_kernel          # CUDA's head, compiled or not
    # fewer columns than one tile, a ragged last tile, the 27B vocabulary; 37 rows and 1
    for rows, vocab in ((37, 300), (37, 50_001), (1, 248_320), (64, 248_320)):
        logits, labels, weights = chunk_case(rows, vocab=vocab, dtype=dtype, seed=rows + vocab)
        if rows > 5:
            # ties of the max: the first index is the argmax (torch.argmax), in one tile and across tiles
            logits[3, [5, vocab - 2]] = logits[5, [7, 8]] = 30.0
            labels[3], labels[5] = vocab - 2, 7
        logits, labels, weights = logits.cuda(), labels.cuda(), weights.cuda()
        for need_grad in (True, False):
            want = per_chunk_reference(logits, labels, weights, need_grad)
            buffer = logits.clone()
            got = kernel(buffer, labels, weights, need_grad)
            assert_same_head(got, want, logits, weights, exact=False)
            assert torch.equal(got[1], want[1])
            if need_grad:
                assert got[2].data_ptr() == buffer.data_ptr(), "the gradient is written over the logits"
            else:
                assert torch.equal(buffer, logits), "without a gradient the logits stay as they were"
        if rows > 5:
            assert not bool(got[1][3]) and bool(got[1][5])
    # a NaN logit makes its row's CE and gradient NaN: the step's finite check then skips the step
    logits[0, 17] = float("nan")
    ce, _, grad = kernel(logits.clone(), labels, weights, True)
    assert torch.isnan(ce) and torch.isnan(grad[0].float()).all() and torch.isfinite(grad[1:].float()).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("impl", ["flex", "sdpa", "flash"])
def test_cuda_compiled_drafter_agrees_with_eager_under_bf16_autocast(impl):
    cfg = tiny_config(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=5)
    results = []
    for mode in ("off", "on"):
        model = make_model(cfg, std=0.05, attn_impl=impl).cuda()
        assert model.compile_for("cuda", mode) == (mode == "on")
        for docs, anchors in (([12, 22], [1, 5, 13, 20, 28]), ([30, 9, 17], [2, 6, 11, 19, 33, 40, 44])):
            batch = make_batch(docs).to("cuda")
            blocks = build_blocks(batch, torch.tensor(anchors, device="cuda"), 4, MASK, 7.0)
            model.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = dflash_loss(model, batch, blocks, chunk=8)
            out.loss.backward()
            results.append((out.loss.item(), model.fc.weight.grad.float().clone(), docs, blocks.labels.numel()))
    for (loss_e, grad_e, docs, rows), (loss_c, grad_c, _, _) in zip(results[:2], results[2:]):
        loss_bound, grad_bound = autocast_rtol(cfg, sum(docs), rows)
        assert abs(loss_c - loss_e) <= loss_bound * abs(loss_e)
        assert rel_err(grad_c, grad_e) <= grad_bound


# ---- the trainer's kernel warm-up (drafter_trainer/warmup.py) ------------------------------------

def _step(model, device: torch.device, docs: list[int], autocast: bool, anchors: int = 6):
    from drafter_trainer.blocks import sample_anchors

    batch = make_batch(docs, seed=len(docs)).to(device)
    if autocast:
        batch.hidden = batch.hidden.to(torch.bfloat16)
    picked = sample_anchors(batch.loss_mask.cpu(), batch.doc_lens.cpu(), anchors, torch.Generator().manual_seed(0))
    blocks = build_blocks(batch, picked.to(device), model.config.block_size, MASK, 4.0)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        out = dflash_loss(model, batch, blocks, chunk=8)
    out.loss.backward()
    return out


def test_warm_up_leaves_weights_and_gradients_alone_and_needs_no_target_head():
    from drafter_trainer.model import DFlashDraftModel
    from drafter_trainer.warmup import warm_up_kernels

    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    headless = DFlashDraftModel(model.config)
    headless.load_state_dict({k: v for k, v in before.items() if not k.startswith(("embed", "lm_head"))},
                             strict=False)
    assert not headless.embed_tokens.loaded
    assert warm_up_kernels(headless, torch.device("cpu"), torch.float32, tokens=40, max_anchors=6, gamma=4.0) > 0
    assert all(p.grad is None for p in headless.parameters())
    assert warm_up_kernels(model, torch.device("cpu"), torch.float32, tokens=40, max_anchors=6, gamma=4.0) > 0
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())
    # a real step after the warm-up computes what it computes without one
    fresh = make_model()
    a, b = _step(model, torch.device("cpu"), [20, 12], False), _step(fresh, torch.device("cpu"), [20, 12], False)
    assert torch.equal(a.loss, b.loss)
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad)), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("impl", ["flex", "sdpa", "flash"])
def test_cuda_warm_up_compiles_every_graph_the_first_step_runs(impl):
    from torch._dynamo.utils import counters

    from drafter_trainer.warmup import warm_up_kernels

    torch._dynamo.reset()    # graphs an earlier test compiled count here
    device = torch.device("cuda", 0)
    model = make_model(attn_impl=impl).to(device)
    model.set_target_head(model.embed_tokens.weight.to(torch.bfloat16), model.lm_head.weight.to(torch.bfloat16))
    assert model.compile_for(device, "on")
    warm_up_kernels(model, device, torch.bfloat16, tokens=400, max_anchors=40, gamma=4.0)
    graphs = counters["stats"]["unique_graphs"]
    # two context lengths, neither the warm-up's; 40 blocks of 4: more query rows than one flex tile
    for docs in ([130, 150, 96], [47, 260]):
        out = _step(model, device, docs, True, anchors=40)
        assert torch.isfinite(out.loss)
    assert counters["stats"]["unique_graphs"] == graphs, "the first steps compiled graphs the warm-up missed"


# ---- compiling behind the first steps (warmup.CompileBehind) -------------------------------------

def test_shadow_shares_the_weights_but_not_their_gradients_or_versions():
    from drafter_trainer.warmup import shadow_of, warm_up_once

    model = make_model()
    shadow = shadow_of(model, "split")
    assert shadow.attn_impl == "split" and not shadow.embed_tokens.loaded
    own = dict(model.named_parameters())
    for name, p in shadow.named_parameters():
        if name.startswith(("embed_tokens", "lm_head")):
            continue
        assert p.data_ptr() == own[name].data_ptr() and p.shape == own[name].shape, name
    assert len(dict(shadow.named_parameters())) == len(own)
    sentinel = {n: torch.full_like(p, 7.0) for n, p in own.items() if p.requires_grad}
    for n, p in own.items():
        p.grad = sentinel.get(n)
    # the optimizer updates the model's weights in place between the shadow's forward and backward
    gen = torch.Generator().manual_seed(0)
    original_backward = torch.Tensor.backward

    def update_then_backward(loss, *args, **kwargs):
        with torch.no_grad():
            for p in own.values():
                p.add_(0.5)
        return original_backward(loss, *args, **kwargs)

    torch.Tensor.backward = update_then_backward
    try:
        warm_up_once(shadow, torch.device("cpu"), torch.float32, 40, 6, 4.0, gen)
    finally:
        torch.Tensor.backward = original_backward
    assert all(p.grad is None for p in shadow.parameters()), "the shadow's gradients are dropped"
    for n, p in own.items():
        assert p.grad is sentinel.get(n), f"{n}: the model's gradient was touched"
    assert torch.equal(shadow.fc.weight, model.fc.weight), "one memory: the update shows in the shadow"


@pytest.mark.usefixtures("cxx_compiler")
def test_compile_behind_trains_eagerly_then_switches_to_the_graphs_the_shadow_compiled():
    from torch._dynamo.utils import counters

    from drafter_trainer.warmup import CompileBehind, compiling_in_background

    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    model = make_model(attn_impl="sdpa")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    behind = CompileBehind(model, torch.device("cpu"), "on", torch.float32, tokens=48, max_anchors=6, gamma=4.0)
    assert not behind.started and not behind.switch_if_ready(), "nothing compiles before start()"
    behind.start()
    assert not model.compiled and behind.state == "compiling" and compiling_in_background()
    eager_steps = 0
    while not behind.switch_if_ready():     # the trainer's loop: eager steps while the thread compiles
        out = _step(model, torch.device("cpu"), [20, 12], False)
        assert torch.isfinite(out.loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        eager_steps += 1
        assert eager_steps < 20_000, "the background compile never finished"
    assert behind.state == "compiled", behind.error
    assert model.compiled and model.attn_impl == "sdpa" and eager_steps >= 1
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > before, "the shadow compiled the graphs"
    reference = make_model(attn_impl="sdpa")
    reference.load_state_dict(model.state_dict())
    for docs in ([30, 9, 17], [41, 6]):    # context lengths neither the warm-up's nor the eager steps'
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        got, want = _step(model, torch.device("cpu"), docs, False), _step(reference, torch.device("cpu"), docs, False)
        rows = 6 * model.config.block_size        # _step's anchors
        assert_close(got.loss, want.loss, n=drafter_terms(model.config, sum(docs), rows))
        assert_close(model.fc.weight.grad, reference.fc.weight.grad,
                     n=drafter_terms(model.config, sum(docs), rows, backward=True))
    # the held-out eval (Validator.evaluate): eval mode, no gradient
    model.eval()
    with torch.no_grad():
        batch = make_batch([25, 14], seed=5)
        blocks = build_blocks(batch, torch.tensor([1, 4, 9, 27, 33]), model.config.block_size, MASK, 4.0)
        assert torch.isfinite(dflash_loss(model, batch, blocks, chunk=8).loss)
    assert counters["stats"]["unique_graphs"] == graphs, "the model recompiled what the shadow had compiled"
    assert not behind.running and not compiling_in_background()


def test_a_failed_background_compile_leaves_the_drafter_eager(monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture):
    from drafter_trainer import warmup

    def broken(*_args, **_kwargs):
        raise RuntimeError("inductor exploded")
    monkeypatch.setattr(warmup, "warm_up_kernels", broken)
    model = make_model(attn_impl="sdpa")
    behind = warmup.CompileBehind(model, torch.device("cpu"), "on", torch.float32, tokens=48, max_anchors=6,
                                  gamma=4.0).start()
    assert behind.wait(60)
    with caplog.at_level("WARNING"):
        assert behind.switch_if_ready()
    assert behind.state == "failed" and "inductor exploded" in behind.error
    assert not model.compiled and "stays eager" in caplog.text
    assert torch.isfinite(_step(model, torch.device("cpu"), [20, 12], False).loss)


def test_a_background_warm_up_out_of_memory_still_switches_to_the_compiled_step(monkeypatch: pytest.MonkeyPatch):
    from drafter_trainer import warmup

    def no_memory(*_args, **_kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.50 GiB")
    monkeypatch.setattr(warmup, "warm_up_kernels", no_memory)
    model = make_model(attn_impl="sdpa")
    behind = warmup.CompileBehind(model, torch.device("cpu"), "on", torch.float32, tokens=48, max_anchors=6,
                                  gamma=4.0).start()
    assert behind.wait(60) and behind.switch_if_ready()
    assert behind.state == "compiled" and behind.out_of_memory and "9.50 GiB" in behind.error
    assert model.compiled


def test_auto_attention_is_flash_where_its_kernels_run_else_flex_else_sdpa(monkeypatch):
    from drafter_trainer import model as drafter_model
    from drafter_trainer.model import resolve_attention, sliding_attention_path

    monkeypatch.setattr(drafter_model, "flash_kernels_available", lambda: True)
    assert [resolve_attention("auto", d, 256) for d in ("cuda", "cpu")] == ["flash", "split"]
    assert resolve_attention("auto", "cuda", 80) == "flash"          # any multiple of 8 up to 256
    # fp32 compute, a head size its kernels lack: flex, or sdpa
    assert resolve_attention("auto", "cuda", 256, half=False) == "flex"
    assert resolve_attention("auto", "cuda", 512) == "flex" and resolve_attention("auto", "cuda", 12) == "sdpa"
    # under flash a sliding-window layer runs flex in a compiled layer, else split (no compile)
    assert [sliding_attention_path(d, c) for d, c in (("cuda", True), ("cuda", False), ("cpu", True))] == \
        ["flex", "split", "split"]
    assert resolve_attention("flex", "cuda", 256) == "flex"          # an explicit choice stays
    monkeypatch.setattr(drafter_model, "flash_kernels_available", lambda: False)   # pre-sm80 GPUs
    assert resolve_attention("auto", "cuda", 256) == "flex"


def test_auto_attention_takes_fa4_only_in_a_compiled_model_where_its_probe_agrees(monkeypatch, caplog):
    from drafter_trainer import model as drafter_model
    from drafter_trainer.model import resolve_attention
    from drafter_trainer.warmup import eager_attention, needs_compiling

    monkeypatch.setattr(drafter_model, "flash_kernels_available", lambda: True)
    monkeypatch.setattr(drafter_model, "fa4_problem", lambda head_dim: None)
    assert resolve_attention("auto", "cuda", 256) == "fa4"
    assert resolve_attention("auto", "cuda", 256, compiled=False) == "flash"   # FA4 runs through a compile
    assert resolve_attention("auto", "cuda", 256, half=False) == "flex"        # fp32: no FlashAttention
    assert resolve_attention("auto", "cpu", 256) == "split"
    # where it cannot run: flash, and one log line saying why, once
    monkeypatch.setattr(drafter_model, "_fa4_reported", set())
    monkeypatch.setattr(drafter_model, "fa4_problem", lambda head_dim: "no flash-attn-4 here")
    with caplog.at_level("INFO", logger="dfpipe.trainer"):
        assert [resolve_attention("auto", "cuda", 256) for _ in range(3)] == ["flash"] * 3
    said = [r.getMessage() for r in caplog.records if "FlashAttention 4" in r.getMessage()]
    assert len(said) == 1 and "no flash-attn-4 here" in said[0]

    # eager steps and the decision to compile never wait for the probe
    def no_probe(head_dim: int) -> str | None:
        raise AssertionError("probed")
    monkeypatch.setattr(drafter_model, "fa4_problem", no_probe)
    cuda = torch.device("cuda", 0)
    assert eager_attention("fa4", cuda, 256) == "flash" and eager_attention("auto", cuda, 256) == "auto"
    assert needs_compiling("off", "fa4", cuda, 256) and not needs_compiling("off", "auto", cuda, 256)


def test_eager_steps_avoid_flex_only_on_cuda_and_only_compiling_settings_start_a_background_compile(monkeypatch):
    from drafter_trainer import model as drafter_model
    from drafter_trainer.model import resolve_attention
    from drafter_trainer.warmup import eager_attention, needs_compiling

    monkeypatch.setattr(drafter_model, "flash_kernels_available", lambda: False)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    # auto without FlashAttention: flex on CUDA for head sizes flex has kernels for, else sdpa
    assert [resolve_attention("auto", d, 256) for d in ("cuda", "cpu")] == ["flex", "split"]
    assert resolve_attention("auto", "cuda", 80) == "sdpa" and resolve_attention("sdpa", "cuda", 256) == "sdpa"
    assert eager_attention("flex", cuda, 256) == "split" and eager_attention("auto", cuda, 256) == "split"
    assert eager_attention("flash", cuda, 256) == "flash"       # precompiled kernels: nothing to avoid
    assert [eager_attention(i, cuda, 256) for i in ("sdpa", "split")] == ["sdpa", "split"]
    assert eager_attention("auto", cuda, 80) == "auto"          # resolves to sdpa: nothing to avoid
    assert eager_attention("flex", cpu, 256) == "flex"          # eager flex on the CPU compiles nothing
    assert needs_compiling("auto", "auto", cuda, 256) and needs_compiling("off", "flex", cuda, 256)
    assert needs_compiling("off", "auto", cuda, 256) and not needs_compiling("off", "auto", cuda, 80)
    assert not needs_compiling("off", "sdpa", cuda, 256) and not needs_compiling("auto", "flex", cpu, 256)
    assert needs_compiling("on", "split", cpu, 256)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("impl", ["flex", "sdpa", "flash"])
def test_cuda_compile_behind_steps_eagerly_then_switches_without_compiling_again(impl):
    from torch._dynamo.utils import counters

    from drafter_trainer.warmup import BEHIND_SHRINK, CompileBehind

    torch._dynamo.reset()
    device = torch.device("cuda", 0)
    model = make_model(attn_impl=impl).to(device)
    model.set_target_head(model.embed_tokens.weight.to(torch.bfloat16), model.lm_head.weight.to(torch.bfloat16))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    # training shapes BEHIND_SHRINK times those of test_cuda_warm_up_compiles_every_graph_the_first_step_runs
    behind = CompileBehind(model, device, "on", torch.bfloat16, tokens=400 * BEHIND_SHRINK,
                           max_anchors=40 * BEHIND_SHRINK, gamma=4.0).start()
    assert model.attn_impl == ("split" if impl == "flex" else impl), "eager steps must not compile flex"
    eager_steps = 0
    while not behind.switch_if_ready():
        out = _step(model, device, [90, 70], True, anchors=40)
        assert torch.isfinite(out.loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        eager_steps += 1
    assert behind.state == "compiled", behind.error
    assert model.compiled and model.attn_impl == impl and eager_steps >= 1
    graphs = counters["stats"]["unique_graphs"]
    for docs in ([130, 150, 96], [47, 260]):
        out = _step(model, device, docs, True, anchors=40)
        assert torch.isfinite(out.loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        batch = make_batch([120, 77], seed=3).to(device)
        batch.hidden = batch.hidden.to(torch.bfloat16)
        blocks = build_blocks(batch, torch.arange(1, 190, 5, device=device), 4, MASK, 4.0)
        assert torch.isfinite(dflash_loss(model, batch, blocks, chunk=8).loss)
    assert counters["stats"]["unique_graphs"] == graphs, "the switched model compiled graphs the shadow missed"


def test_the_compile_thread_makes_the_trainers_device_its_current_one(monkeypatch: pytest.MonkeyPatch):
    import threading

    from drafter_trainer import warmup

    # a new thread's current CUDA device is cuda:0: a rank placed on cuda:3 must not touch GPU 0
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append((threading.current_thread().name, str(d))))
    behind = warmup.CompileBehind(make_model(), torch.device("cuda", 3), "off", torch.float32, tokens=48,
                                  max_anchors=6, gamma=4.0).start()
    assert behind.wait(120)
    assert calls and calls[0] == ("compile-behind", "cuda:3")
