"""The DFlash drafter: config, target head, context projection, attention paths, chunked loss.

The central check is `test_batched_forward_equals_a_brute_force_reference`: an independent,
deliberately naive implementation (one block at a time, explicit loops over queries, float64)
written from docs/architecture.md ("The DFlash drafter"), compared with every attention path of the
batched model.
Helpers here (tiny_config, make_model, make_batch) are shared by the other drafter test files.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from common.batch import PackedBatch, check_batch, document_positions
from common.config import DrafterConfig
from drafter_trainer.blocks import build_blocks
from drafter_trainer.loss import dflash_loss, implied_acceptance_length
from drafter_trainer.model import ContextError, DFlashConfig, DFlashDraftModel, DrafterConfigError
from drafter_trainer.target_head import TargetHeadError, read_target_head
from tolerances import assert_close, rel_err, tol, transformer_roundings, transformer_terms

pytestmark = pytest.mark.numerics   # run again under ATEN_CPU_CAPABILITY=default (make test-numerics)

VOCAB, HIDDEN, MASK = 97, 64, 96


def tiny_config(**overrides) -> DFlashConfig:
    fields = dict(hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, rms_norm_eps=1e-6, rope_theta=10_000.0,
                  block_size=4, target_layer_ids=[1, 3, 5], mask_token_id=MASK, num_target_layers=8)
    fields.update(overrides)
    return DFlashConfig(**fields)


def drafter_terms(cfg: DFlashConfig, context: int, loss_rows: int = 0, backward: bool = False) -> int:
    """tolerances.py's n for the drafter: one output's path through the context projection and the
    layers (attention over at most `context` positions plus a block); with `loss_rows`, the head's
    hidden-size logits, its vocabulary-wide softmax and the weighted mean over that many rows. A
    gradient sums along the same path once more, backwards."""
    n = transformer_terms(cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, context + cfg.block_size,
                          projected_in=len(cfg.target_layer_ids) * cfg.hidden_size)
    if loss_rows:
        n += cfg.hidden_size + cfg.vocab_size + loss_rows
    return 2 * n if backward else n


def autocast_rtol(cfg: DFlashConfig, context: int, loss_rows: int) -> tuple[float, float]:
    """(loss, weight gradient) rtol between two bf16-autocast runs of the drafter that compute some
    operations with other kernels: besides the fp32 sums (`drafter_terms`), every output the path
    stores in bf16 may round apart (tolerances.py): the layers' (`transformer_roundings`), fc's input
    and output, hidden_norm, norm and the logits; the gradient takes the same path back."""
    roundings = transformer_roundings(cfg.num_hidden_layers, 5)
    loss = tol(drafter_terms(cfg, context, loss_rows), rounded_to=torch.bfloat16, roundings=roundings)
    grad = tol(drafter_terms(cfg, context, loss_rows, backward=True), rounded_to=torch.bfloat16,
               roundings=2 * roundings)
    return loss["rtol"], grad["rtol"]


def make_model(cfg: DFlashConfig | None = None, seed: int = 0, std: float = 0.1, **kwargs) -> DFlashDraftModel:
    """A drafter with a random target head; weights larger than the 0.02 init so every path is felt."""
    cfg = cfg or tiny_config()
    torch.manual_seed(seed)
    model = DFlashDraftModel(cfg, **kwargs)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, std)
            else:
                p.uniform_(0.5, 1.5)       # norm gains away from 1, so a swapped norm shows
    g = torch.Generator().manual_seed(seed + 1)
    model.set_target_head(torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g),
                          torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g))
    return model


def make_batch(doc_lens: list[int], k: int = 3, seed: int = 0, loss_mask: torch.Tensor | None = None) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(doc_lens, dtype=torch.int32)
    t = int(lens.sum())
    batch = PackedBatch(
        hidden=torch.randn(k, t, HIDDEN, generator=g),
        input_ids=torch.randint(0, MASK, (t,), generator=g, dtype=torch.int32),
        loss_mask=torch.ones(t, dtype=torch.uint8) if loss_mask is None else loss_mask.to(torch.uint8),
        position_ids=document_positions(lens).to(torch.int32), doc_lens=lens,
        sample_ids=torch.arange(len(doc_lens), dtype=torch.int64), doc_ids=torch.arange(len(doc_lens), dtype=torch.int64))
    check_batch(batch)
    return batch


def forward(model: DFlashDraftModel, batch: PackedBatch, anchors: list[int]) -> torch.Tensor:
    blocks = build_blocks(batch, torch.tensor(anchors), model.config.block_size, MASK, 7.0)
    return model(batch.hidden, blocks.block_input_ids, blocks)


# ---- config and target head ------------------------------------------------------------------
def _qwen35_configs(tie: bool = False):
    """A tiny multimodal Qwen3.5 config (text fields nested under text_config) and its text part."""
    from transformers import Qwen3_5Config, Qwen3_5TextConfig

    text = Qwen3_5TextConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=16,
                             linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2)
    return Qwen3_5Config(text_config=text.to_dict(), vision_config=vision, tie_word_embeddings=tie), text


def test_config_from_a_multimodal_qwen35_target_reads_its_text_config():
    full, _text = _qwen35_configs()
    cfg = DFlashConfig.from_target(full.to_dict(), DrafterConfig(num_layers=3, block_size=8), [1, 3, 6], 250)
    assert (cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == \
        (64, 300, 4, 2, 16)
    assert cfg.num_target_layers == 8 and cfg.num_context_layers == 3 and cfg.target_layer_ids == [1, 3, 6]
    assert cfg.layer_types == ["full_attention"] * 3 and cfg.sliding_window is None and cfg.block_size == 8
    assert cfg.rope_theta == full.text_config.rope_parameters["rope_theta"]


def test_config_from_a_flat_target_uses_overrides_and_default_layer_ids():
    target = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 36, "num_attention_heads": 8,
              "num_key_value_heads": 4, "head_dim": 16, "vocab_size": 1000, "rms_norm_eps": 1e-6, "rope_theta": 1e6}
    drafter = DrafterConfig(num_layers=2, num_heads=4, num_kv_heads=1, intermediate_size=64, sliding_window=32,
                            layer_types=["sliding_attention", "full_attention"])
    cfg = DFlashConfig.from_target(target, drafter, [], 999)
    assert cfg.target_layer_ids == [1, 9, 17, 25, 33]
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size) == (4, 1, 64)
    assert cfg.layer_window(0) == 32 and cfg.layer_window(1) is None


def test_config_refuses_a_mask_token_that_is_not_an_embedding_row():
    with pytest.raises(DrafterConfigError, match="mask_token_id"):
        tiny_config(mask_token_id=VOCAB)
    target = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 8, "num_attention_heads": 4,
              "vocab_size": VOCAB}
    with pytest.raises(DrafterConfigError, match="mask_token_id"):
        DFlashConfig.from_target(target, DrafterConfig(), [1, 3], -1)


def test_target_head_reads_only_embedding_and_head_from_a_sharded_checkpoint(tmp_path, monkeypatch):
    import os

    from transformers import Qwen3_5ForCausalLM

    import drafter_trainer.target_head as target_head

    _full, text = _qwen35_configs()
    target = Qwen3_5ForCausalLM(text)
    target.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()

    read_bytes: list[int] = []
    real_preadv = os.preadv

    def counting_preadv(fd, buffers, offset):
        n = real_preadv(fd, buffers, offset)
        read_bytes.append(n)
        return n

    monkeypatch.setattr(os, "preadv", counting_preadv)
    monkeypatch.setattr(target_head, "READ_CHUNK", 4096)   # several spans and chunks even at this size
    head = read_target_head(str(tmp_path))
    # the tensor data read is exactly the two tensors: nothing else of the checkpoint
    assert sum(read_bytes) == 2 * target.lm_head.weight.numel() * target.lm_head.weight.element_size()
    assert len(read_bytes) > 2
    assert not head.tied
    assert torch.equal(head.embed_tokens, target.model.embed_tokens.weight)
    assert torch.equal(head.lm_head, target.lm_head.weight)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the pinned, multi-stream read")
def test_cuda_target_head_read_equals_the_cpu_read(tmp_path, monkeypatch):
    import drafter_trainer.target_head as target_head
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(5)
    # not a multiple of the chunk: the last chunk of each span is short
    tensors = {"model.embed_tokens.weight": torch.randn(1001, 96, generator=g).to(torch.bfloat16),
               "lm_head.weight": torch.randn(1001, 96, generator=g).to(torch.bfloat16)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text('{"vocab_size": 1001, "hidden_size": 96}')
    monkeypatch.setattr(target_head, "READ_CHUNK", 4096)
    head = read_target_head(str(tmp_path), device="cuda")
    assert head.embed_tokens.device.type == "cuda" and head.embed_tokens.dtype == torch.bfloat16
    assert torch.equal(head.embed_tokens.cpu(), tensors["model.embed_tokens.weight"])
    assert torch.equal(head.lm_head.cpu(), tensors["lm_head.weight"])


def test_a_truncated_or_mislabelled_head_tensor_is_a_clear_error(tmp_path):
    import json

    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    save_file({"model.embed_tokens.weight": torch.randn(10, 4), "lm_head.weight": torch.randn(10, 4)}, str(path))
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 10, "hidden_size": 4}))
    whole = path.read_bytes()
    path.write_bytes(whole[:-8])
    with pytest.raises(TargetHeadError, match="truncated"):
        read_target_head(str(tmp_path))
    save_file({"model.embed_tokens.weight": torch.zeros(10, 4, dtype=torch.int8), "lm_head.weight": torch.zeros(10, 4)},
              str(path))
    with pytest.raises(TargetHeadError, match="dtype"):
        read_target_head(str(tmp_path))


def test_target_head_of_a_tied_multimodal_checkpoint_is_the_embedding(tmp_path):
    from transformers import Qwen3_5ForConditionalGeneration

    full, _text = _qwen35_configs(tie=True)
    target = Qwen3_5ForConditionalGeneration(full)
    target.save_pretrained(tmp_path)
    head = read_target_head(str(tmp_path))
    assert head.tied and head.lm_head is head.embed_tokens
    assert torch.equal(head.embed_tokens, target.model.language_model.embed_tokens.weight)

    cfg = DFlashConfig.from_target(full.to_dict(), DrafterConfig(num_layers=1), [1, 3], 250)
    model = DFlashDraftModel(cfg)
    model.load_target_head(str(tmp_path))
    assert model.lm_head.weight is model.embed_tokens.weight


def test_missing_lm_head_without_tied_embeddings_is_an_error(tmp_path):
    import json

    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(10, 4)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 10, "hidden_size": 4}))
    with pytest.raises(TargetHeadError, match="no lm_head"):
        read_target_head(str(tmp_path))


def test_model_without_a_target_head_refuses_to_run():
    model = DFlashDraftModel(tiny_config())
    batch = make_batch([12])
    with pytest.raises(TargetHeadError, match="embed_tokens is not loaded"):
        forward(model, batch, [2])


def test_token_ids_outside_the_vocabulary_are_refused_before_any_lookup():
    model = make_model()
    batch = make_batch([12])
    batch.input_ids[7] = VOCAB + 3
    blocks = build_blocks(batch, torch.tensor([2]), 4, MASK, 7.0)
    with pytest.raises(ContextError, match="outside the 97-token vocabulary"):
        dflash_loss(model, batch, blocks, chunk=8)
    blocks.block_input_ids[0, 0] = -1
    with pytest.raises(ContextError, match="block_input_ids"):
        model(batch.hidden, blocks.block_input_ids, blocks)


# ---- context projection ----------------------------------------------------------------------
def test_split_fc_equals_concat_fc_in_value_and_gradient():
    # Default initialisation and unit-scale planes: the two differ only in summation order (a few
    # fp32 ulps of the output), never by a misplaced column block.
    model = DFlashDraftModel(tiny_config())
    batch = make_batch([40, 24])
    grads, outs = [], []
    for split in (False, True):
        model.split_fc = split
        model.zero_grad()
        out = model.fc_project(batch.hidden)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        outs.append(out.detach())
        grads.append(model.fc.weight.grad.clone())
    k_hidden = len(model.config.target_layer_ids) * HIDDEN
    assert_close(outs[1], outs[0], n=k_hidden)          # one matmul over the k concatenated planes
    assert_close(grads[1], grads[0], n=batch.hidden.shape[1])   # the weight gradient sums over the tokens


# ---- the brute-force reference ---------------------------------------------------------------
def reference_forward(model: DFlashDraftModel, batch: PackedBatch, anchors: list[int]) -> torch.Tensor:
    """docs/architecture.md, "The DFlash drafter", read literally: one block at a time, one query at a
    time, float64."""
    cfg = model.config
    w = {name: p.detach().double() for name, p in model.named_parameters()}
    heads, kv_heads, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    def rms(x, weight):
        return weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.rms_norm_eps)

    def rope(x, pos):   # x [L, heads, hd]: rotate pairs (i, i + hd/2) by pos * theta^(-2i/hd)
        freq = cfg.rope_theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        ang = pos.double()[:, None, None] * freq
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], -1)

    planes = batch.hidden.double()
    context = rms(torch.cat(list(planes), dim=-1) @ w["fc.weight"].T, w["hidden_norm.weight"])
    doc_of, start_of = [], []
    for d, n in enumerate(batch.doc_lens.tolist()):
        start_of += [len(doc_of)] * n
        doc_of += [d] * n
    b = cfg.block_size
    outputs = []
    for a in anchors:
        s = start_of[a]
        visible_ctx = list(range(s, a))                 # same document, strictly before the anchor
        ctx_pos = torch.tensor([j - s for j in visible_ctx], dtype=torch.float64)
        q_pos = torch.arange(a - s, a - s + b, dtype=torch.float64)
        x = w["embed_tokens.weight"][[batch.input_ids[a].item()] + [MASK] * (b - 1)]
        for i in range(cfg.num_hidden_layers):
            p = f"layers.{i}."
            window = cfg.layer_window(i)
            h = rms(x, w[p + "input_layernorm.weight"])
            q = rms((h @ w[p + "self_attn.q_proj.weight"].T).view(b, heads, hd), w[p + "self_attn.q_norm.weight"])
            kv_in = torch.cat([context[visible_ctx], h])
            k = rms((kv_in @ w[p + "self_attn.k_proj.weight"].T).view(-1, kv_heads, hd), w[p + "self_attn.k_norm.weight"])
            v = (kv_in @ w[p + "self_attn.v_proj.weight"].T).view(-1, kv_heads, hd)
            k_pos = torch.cat([ctx_pos, q_pos])
            q, k = rope(q, q_pos), rope(k, k_pos)
            attn = torch.zeros(b, heads, hd, dtype=torch.float64)
            for qi in range(b):
                allowed = []
                for j in range(len(visible_ctx)):
                    allowed.append(window is None or q_pos[qi] - ctx_pos[j] < window)
                for j in range(b):                      # own block: all of it, or causal on sliding layers
                    allowed.append(window is None or (j <= qi and qi - j < window))
                allowed = torch.tensor(allowed)
                for head in range(heads):
                    kvh = head // (heads // kv_heads)
                    scores = (k[:, kvh] @ q[qi, head]) / math.sqrt(hd)
                    scores[~allowed] = float("-inf")
                    attn[qi, head] = torch.softmax(scores, 0) @ v[:, kvh]
            x = x + attn.reshape(b, heads * hd) @ w[p + "self_attn.o_proj.weight"].T
            h = rms(x, w[p + "post_attention_layernorm.weight"])
            gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
            x = x + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        outputs.append(rms(x, w["norm.weight"]))
    return torch.stack(outputs)


# doc lengths 9, 14, 11 (starts 0, 9, 23): anchors at a document start (no context), two and three
# apart (closer than B), one whose block runs past its document's end, anchors in every document.
REF_DOCS = [9, 14, 11]
REF_ANCHORS = [0, 3, 5, 7, 9, 11, 12, 20, 23, 26, 31]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("impl", ["split", "sdpa", "flex", "flash"])
def test_batched_forward_equals_a_brute_force_reference(impl):
    cfg = tiny_config(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                      sliding_window=3)
    model = make_model(cfg, attn_impl=impl)
    batch = make_batch(REF_DOCS)
    with torch.no_grad():      # flex has no CPU backward; gradients are compared below (split vs sdpa)
        got = forward(model, batch, REF_ANCHORS).double()
    want = reference_forward(model, batch, REF_ANCHORS)
    assert_close(got, want, n=drafter_terms(cfg, sum(REF_DOCS)))       # float64 reference: fp32 error only


@pytest.mark.parametrize("other", ["sdpa", "flash"])
def test_attention_paths_agree_with_split_in_gradients(other):
    # flash on the CPU runs a plain reference of FlashAttention's kernels: this checks its key
    # runs, the merge of its two parts and their backward (the kernels themselves: CUDA tests)
    cfg = tiny_config(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=5)
    batch = make_batch(REF_DOCS)
    grads = []
    for impl in ("split", other):
        model = make_model(cfg, attn_impl=impl)
        out = forward(model, batch, REF_ANCHORS)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    for name in grads[0]:
        assert_close(grads[0][name], grads[1][name], n=drafter_terms(cfg, sum(REF_DOCS), backward=True), msg=name)


@pytest.mark.parametrize("impl", ["split", "sdpa", "flash"])
def test_padding_blocks_change_nothing_for_real_blocks(impl):
    model = make_model(attn_impl=impl)
    batch = make_batch(REF_DOCS)
    anchors = torch.tensor(REF_ANCHORS)
    plain = build_blocks(batch, anchors, 4, MASK, 7.0)
    padded = build_blocks(batch, anchors, 4, MASK, 7.0, pad_to=len(REF_ANCHORS) + 3)
    with torch.no_grad():
        want = model(batch.hidden, plain.block_input_ids, plain)
        got = model(batch.hidden, padded.block_input_ids, padded)
    assert torch.isfinite(got).all()
    assert_close(got[: len(REF_ANCHORS)], want, n=drafter_terms(model.config, sum(REF_DOCS)))


def test_layer_checkpointing_recomputes_the_same_loss_and_gradients():
    batch = make_batch(REF_DOCS)
    blocks = build_blocks(batch, torch.tensor(REF_ANCHORS), 4, MASK, 7.0)
    results = []
    for recompute in (False, True):
        model = make_model(std=0.05)
        model.checkpoint_layers = recompute
        out = dflash_loss(model, batch, blocks, chunk=16)
        out.loss.backward()
        results.append((out.loss.item(), model.layers[0].self_attn.q_proj.weight.grad.clone()))
    rows = blocks.labels.numel()
    terms = drafter_terms(model.config, sum(REF_DOCS), rows)
    assert_close(torch.tensor(results[1][0]), torch.tensor(results[0][0]), n=terms)
    assert_close(results[1][1], results[0][1], n=2 * terms)        # the gradient: the same path backwards


# ---- loss -------------------------------------------------------------------------------------
def _reference_loss(model, batch, blocks) -> torch.Tensor:
    hidden = model(batch.hidden, blocks.block_input_ids, blocks)
    logits = F.linear(hidden, model.lm_head.weight).flatten(0, 1)
    ce = F.cross_entropy(logits, blocks.labels.flatten(), reduction="none", ignore_index=-100)
    return (ce * blocks.weights.flatten()).sum() / blocks.weights.sum()


@pytest.mark.parametrize("chunk", [1, 7, 10_000])
def test_chunked_loss_equals_unchunked_loss_and_gradients(chunk):
    model = make_model(std=0.05)
    mask = torch.ones(34, dtype=torch.uint8)
    mask[[2, 10, 11, 25]] = 0
    batch = make_batch(REF_DOCS, loss_mask=mask)
    blocks = build_blocks(batch, torch.tensor(REF_ANCHORS), 4, MASK, 3.0)
    params = [p for p in model.parameters() if p.requires_grad]

    want = _reference_loss(model, batch, blocks)
    want_grads = torch.autograd.grad(want, params)
    out = dflash_loss(model, batch, blocks, chunk=chunk)
    got_grads = torch.autograd.grad(out.loss, params)
    rows = blocks.labels.numel()
    assert_close(out.loss, want, n=drafter_terms(model.config, sum(REF_DOCS), rows))
    for g, w in zip(got_grads, want_grads):
        assert_close(g, w, n=drafter_terms(model.config, sum(REF_DOCS), rows, backward=True))


def test_loss_reports_accuracy_per_block_position():
    model = make_model(std=0.05)
    batch = make_batch(REF_DOCS)
    blocks = build_blocks(batch, torch.tensor(REF_ANCHORS), 4, MASK, 7.0)
    out = dflash_loss(model, batch, blocks, chunk=5)
    with torch.no_grad():
        logits = model.compute_logits(model(batch.hidden, blocks.block_input_ids, blocks))
    counted = blocks.weights > 0
    hits = (logits.argmax(-1) == blocks.labels) & counted
    assert out.count_per_pos.tolist() == counted.sum(0).float().tolist()
    assert out.count_per_pos[0] == 0 and out.num_anchors == len(REF_ANCHORS)
    assert out.correct_per_pos.tolist() == hits.sum(0).float().tolist()


def test_loss_divides_by_the_all_rank_weight_norm_when_given():
    model = make_model(std=0.05)
    batch = make_batch([20])
    blocks = build_blocks(batch, torch.tensor([2, 9]), 4, MASK, 7.0)
    local = dflash_loss(model, batch, blocks, chunk=4)
    shared = dflash_loss(model, batch, blocks, chunk=4, weight_norm=local.weight_sum * 4)
    assert_close(shared.loss * 4, local.loss, n=3)     # a division and a multiplication by 4 (exact)


def test_batch_without_anchors_gives_every_trainable_parameter_a_zero_gradient():
    model = make_model()
    batch = make_batch([10], loss_mask=torch.zeros(10))
    blocks = build_blocks(batch, torch.zeros(0, dtype=torch.int64), 4, MASK, 7.0)
    out = dflash_loss(model, batch, blocks, chunk=8)
    out.loss.backward()
    assert out.loss.item() == 0.0 and out.num_anchors == 0
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and not p.grad.any(), name
        else:
            assert p.grad is None and name.startswith(("embed_tokens.", "lm_head."))


def test_implied_acceptance_length_multiplies_accuracies_along_the_block():
    # halves and ones: every product and sum is exact in binary floating point
    assert implied_acceptance_length(torch.tensor([1.0, 1.0, 1.0])) == 4.0
    assert implied_acceptance_length(torch.tensor([0.5, 0.5, 0.0, 1.0])) == 1.75
    assert implied_acceptance_length(torch.tensor([0.0, 1.0])) == 1.0


def test_trainable_state_is_exactly_the_parameters_that_learn():
    model = make_model()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(model.trainable_state_dict()) == trainable
    assert not any(n.startswith(("embed_tokens", "lm_head")) for n in trainable)


# ---- CUDA -------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_attention_paths_agree_under_bf16_autocast():
    cfg = tiny_config(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=5)
    batch = make_batch(REF_DOCS).to("cuda")
    results = {}
    for impl in ("split", "sdpa", "flex", "flash"):
        model = make_model(cfg, attn_impl=impl).cuda()
        blocks = build_blocks(batch, torch.tensor(REF_ANCHORS, device="cuda"), 4, MASK, 7.0)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = dflash_loss(model, batch, blocks, chunk=8)
        out.loss.backward()
        results[impl] = (out.loss.item(), model.fc.weight.grad.float().clone())
    loss, grad = results["split"]
    loss_bound, grad_bound = autocast_rtol(cfg, sum(REF_DOCS), blocks.labels.numel())
    for impl in ("sdpa", "flex", "flash"):
        assert abs(results[impl][0] - loss) <= loss_bound * abs(loss)
        assert rel_err(results[impl][1], grad) <= grad_bound
