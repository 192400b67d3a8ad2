"""The export through Transformers' trust_remote_code path: AutoModel builds the DFlash drafter from
the exported weights and computes what the trainer's own model computes."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from drafter_trainer.blocks import BlockBatch, build_blocks
from drafter_trainer.export import export_drafter
from test_drafter_model import MASK, drafter_terms, make_batch, make_model, tiny_config
from tolerances import assert_close, differs, transformer_terms


def _config():
    # GQA (4 query heads on 2 kv heads), a sliding-window layer narrower than the context, and a
    # full-attention layer: every branch of the mask rule is exercised.
    return tiny_config(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=6)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(trainer model, AutoModel-loaded drafter, loading info, export dir), fp32 export."""
    from transformers import AutoModel

    trainer_model = make_model(_config()).eval()
    out = tmp_path_factory.mktemp("remote") / "export"
    export_drafter(trainer_model, str(out), dtype=torch.float32)
    draft, info = AutoModel.from_pretrained(str(out), trust_remote_code=True, output_loading_info=True)
    return trainer_model, draft.eval(), info, out


def _blocks(doc_lens: list[int], anchors: list[int], pad_to: int | None = None):
    batch = make_batch(doc_lens)
    blocks = build_blocks(batch, torch.tensor(anchors), 4, MASK, 7.0, pad_to=pad_to)
    return batch, blocks


def _remote_forward(draft, hidden: torch.Tensor, blocks: BlockBatch, **kwargs) -> torch.Tensor:
    return draft(hidden, blocks.block_positions, context_position_ids=blocks.context_positions,
                 context_sequence_ids=blocks.context_doc, block_sequence_ids=blocks.anchor_doc, **kwargs)


def _assert_close(got: torch.Tensor, want: torch.Tensor, cfg, context: int, logits: bool = False) -> None:
    """fp32 on both sides, the same operations in another order (dense SDPA against the trainer's
    per-segment softmax): tolerances.py's bound over the drafter's path through `context` tokens,
    and for logits the head's hidden-size sum after it."""
    assert got.shape == want.shape and got.dtype == want.dtype == torch.float32
    assert_close(got, want, n=drafter_terms(cfg, context) + (cfg.hidden_size if logits else 0))


def test_auto_model_builds_the_dflash_drafter_with_exactly_the_exported_weights(exported):
    trainer_model, draft, info, out = exported
    assert type(draft).__name__ == "DFlashDraftModel" and type(draft).__module__.endswith("modeling_dflash")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    on_disk = load_file(str(out / "model.safetensors"))
    loaded = draft.state_dict()
    assert set(loaded) == set(on_disk) == set(trainer_model.trainable_state_dict())
    for name, tensor in on_disk.items():      # bit for bit: nothing re-initialised after loading
        assert torch.equal(loaded[name], tensor), name
        assert torch.equal(tensor, trainer_model.trainable_state_dict()[name]), name
    assert draft.target_layer_ids == [1, 3, 5] and draft.mask_token_id == MASK and draft.block_size == 4


def test_remote_forward_equals_the_trainers_forward_on_two_documents_and_several_blocks(exported):
    trainer_model, draft, _, _ = exported
    # Documents of 14 and 13 tokens; blocks anchored early, mid and late in each, one at the
    # first token of document 1 (no context at all), two padding blocks (no document).
    batch, blocks = _blocks([14, 13], [2, 7, 10, 14, 20, 23], pad_to=8)
    assert blocks.anchor_doc.tolist() == [0, 0, 0, 1, 1, 1, -1, -1]
    draft.set_target_embeddings(trainer_model.embed_tokens.weight, trainer_model.lm_head.weight)
    with torch.no_grad():
        want = trainer_model(batch.hidden, blocks.block_input_ids, blocks)
        by_ids = _remote_forward(draft, batch.hidden, blocks, input_ids=blocks.block_input_ids)
        embeds = torch.nn.functional.embedding(blocks.block_input_ids, trainer_model.embed_tokens.weight)
        by_embeds = _remote_forward(draft, batch.hidden, blocks, inputs_embeds=embeds)
        concatenated = batch.hidden.permute(1, 0, 2).reshape(batch.hidden.shape[1], -1)   # [T, k*H]
        by_concat = _remote_forward(draft, concatenated, blocks, input_ids=blocks.block_input_ids)
    assert want.abs().max() > 0.5                     # a real signal, not near-zero outputs
    _assert_close(by_ids, want, _config(), batch.num_tokens)
    assert torch.equal(by_embeds, by_ids) and torch.equal(by_concat, by_ids)
    with torch.no_grad():
        _assert_close(draft.compute_logits(by_ids), trainer_model.compute_logits(want), _config(), batch.num_tokens,
                      logits=True)


def test_serve_time_call_one_sequence_no_ids_equals_the_trainers_block(exported):
    """At serve time the context is the sequence so far and one block follows it: no sequence ids,
    context positions 0..T-1 by default."""
    trainer_model, draft, _, _ = exported
    batch, blocks = _blocks([20], [13])
    draft.set_target_embeddings(trainer_model.embed_tokens.weight, trainer_model.lm_head.weight)
    with torch.no_grad():
        want = trainer_model(batch.hidden, blocks.block_input_ids, blocks)
        got = draft(batch.hidden[:, :13], blocks.block_positions, input_ids=blocks.block_input_ids)
    assert blocks.block_positions.tolist() == [[13, 14, 15, 16]]
    _assert_close(got, want, _config(), 13)


def test_the_context_is_felt_so_the_comparison_can_fail(exported):
    """Guards the comparison above: dropping the other document's rule or the context changes the output."""
    trainer_model, draft, _, _ = exported
    batch, blocks = _blocks([14, 13], [10, 20])
    draft.set_target_embeddings(trainer_model.embed_tokens.weight, trainer_model.lm_head.weight)
    with torch.no_grad():
        right = _remote_forward(draft, batch.hidden, blocks, input_ids=blocks.block_input_ids)
        one_sequence = draft(batch.hidden, blocks.block_positions, input_ids=blocks.block_input_ids,
                             context_position_ids=blocks.context_positions)
    assert differs(right[1], one_sequence[1], n=drafter_terms(_config(), batch.num_tokens))


def test_without_the_targets_embedding_token_ids_and_logits_are_refused(tmp_path):
    from transformers import AutoModel

    export_drafter(make_model(_config()), str(tmp_path / "out"), dtype=torch.float32)
    draft = AutoModel.from_pretrained(str(tmp_path / "out"), trust_remote_code=True)
    assert not any("embed" in name or "lm_head" in name for name in draft.state_dict())
    batch, blocks = _blocks([9], [3])
    with pytest.raises(RuntimeError, match="set_target_embeddings"):
        draft(batch.hidden, blocks.block_positions, input_ids=blocks.block_input_ids)
    with pytest.raises(RuntimeError, match="lm_head"):
        draft.compute_logits(torch.zeros(1, 64))
    with pytest.raises(ValueError, match=r"\[97, 64\]"):
        draft.set_target_embeddings(torch.zeros(96, 64))
    draft.set_target_embeddings(torch.zeros(97, 64))
    with pytest.raises(ValueError, match="token ids in \\[0, 97\\] outside the 97-token vocabulary"):
        draft(batch.hidden, blocks.block_positions, input_ids=torch.tensor([[97, 0, 0, 0]]))
    with pytest.raises(ValueError, match=r"target_hidden has shape \(2, 9, 64\)"):
        draft(batch.hidden[:2], blocks.block_positions, inputs_embeds=torch.zeros(1, 4, 64))


def test_config_keeps_what_serving_engines_read_and_adds_only_auto_model(exported):
    from transformers import AutoConfig

    _, _, _, out = exported
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"}
    # no AutoConfig entry: config readers (SGLang, vLLM, even with --trust-remote-code) get a
    # plain Qwen3Config and never execute the exported file
    assert type(AutoConfig.from_pretrained(str(out), trust_remote_code=True)).__name__ == "Qwen3Config"
    source = (out / "modeling_dflash.py").read_text()
    imports = {line.split()[1] for line in source.splitlines() if line.startswith(("import ", "from "))}
    assert imports == {"__future__", "inspect", "torch", "torch.nn.functional", "transformers"}   # no dfpipe


def test_the_readme_transformers_flow_on_a_real_target_matches_the_trainer(tmp_path):
    """README "Serving the exported drafter", Transformers: context from HF hidden_states[l + 1],
    the block after it, logits through the target's head == the trainer's model on the states its
    capture (a hook on decoder layer l) records."""
    from transformers import AutoModel, AutoModelForCausalLM

    from common.batch import PackedBatch
    from common.config import DrafterConfig
    from drafter_trainer.model import DFlashConfig
    from target_server.tiny import build_tiny_target

    target_dir = build_tiny_target(str(tmp_path / "target"), arch="qwen3", vocab_size=128, hidden_size=64)
    target_config = json.loads((tmp_path / "target" / "config.json").read_text())
    cfg = DFlashConfig.from_target(target_config, DrafterConfig(num_layers=2, block_size=4), None, mask_token_id=127)
    trainer_model = make_model(cfg).eval()
    trainer_model.load_target_head(target_dir)
    export_drafter(trainer_model, str(tmp_path / "export"), dtype=torch.float32)

    # the README lines
    draft = AutoModel.from_pretrained(str(tmp_path / "export"), trust_remote_code=True).eval()
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft.set_target_embeddings(target.get_input_embeddings(), target.get_output_embeddings())
    t, b = 11, draft.block_size
    sequence = torch.randint(0, 127, (1, t + b), generator=torch.Generator().manual_seed(3))
    ids, next_token = sequence[:, :t], int(sequence[0, t])
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
        context = torch.cat([hs[i + 1][0] for i in draft.target_layer_ids], dim=-1)
        block = torch.tensor([[next_token] + [draft.mask_token_id] * (draft.block_size - 1)])
        positions = t + torch.arange(draft.block_size)[None]
        hidden = draft(context, positions, input_ids=block)
        logits = draft.compute_logits(hidden)

    # the trainer, on what dfpipe's capture records for the whole row, block anchored at t
    planes: dict[int, torch.Tensor] = {}
    hooks = [target.model.layers[layer].register_forward_hook(
        lambda _m, _a, out, p=p: planes.__setitem__(p, (out[0] if isinstance(out, tuple) else out)[0]))
        for p, layer in enumerate(cfg.target_layer_ids)]
    with torch.no_grad():
        target(sequence)
    for hook in hooks:
        hook.remove()
    n = t + b
    batch = PackedBatch(hidden=torch.stack([planes[p] for p in range(len(planes))]),
                        input_ids=sequence[0].to(torch.int32), loss_mask=torch.ones(n, dtype=torch.uint8),
                        position_ids=torch.arange(n, dtype=torch.int32), doc_lens=torch.tensor([n], dtype=torch.int32),
                        sample_ids=torch.zeros(1, dtype=torch.int64), doc_ids=torch.zeros(1, dtype=torch.int64))
    blocks = build_blocks(batch, torch.tensor([t]), b, 127, 7.0)
    with torch.no_grad():
        want = trainer_model(batch.hidden, blocks.block_input_ids, blocks)
        want_logits = trainer_model.compute_logits(want)
    _assert_close(hidden, want, cfg, t)
    _assert_close(logits, want_logits, cfg, t, logits=True)


# ---- the reference loader's API: DFlash's README usage runs on our export ------------------------

DEMO_TOKENIZER = str(Path(__file__).resolve().parents[1] / "configs" / "demo" / "tokenizer")
NEW_TOKENS = 14     # not a multiple of the block: the last step is cut


@pytest.fixture(scope="module", params=["qwen3", "qwen3.5"])
def served(request, tmp_path_factory):
    """(target folder, export folder) for a tiny real-architecture target with the demo tokenizer (Qwen3:
    attention only, spec_generate keeps a KV cache; Qwen3.5: hybrid, recomputed every step) and an
    untrained drafter shaped for it, exported in fp32."""
    from common.config import DrafterConfig
    from drafter_trainer.model import DFlashConfig, DFlashDraftModel
    from target_server.tiny import build_tiny_target
    from target_server.tokenizer import MASK_TOKEN
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp(f"served-{request.param}")
    target_dir = build_tiny_target(str(root / "target"), arch=request.param, hidden_size=64, num_layers=6,
                                   tokenizer_dir=DEMO_TOKENIZER)
    mask = AutoTokenizer.from_pretrained(target_dir).convert_tokens_to_ids(MASK_TOKEN)
    target_config = json.loads((root / "target" / "config.json").read_text())
    # layer 5 is the last: its output is what a decoder layer gives, not transformers' normed hidden_states[6]
    cfg = DFlashConfig.from_target(target_config, DrafterConfig(num_layers=1, block_size=4), [1, 3, 5],
                                   mask_token_id=mask)
    torch.manual_seed(0)
    drafter = DFlashDraftModel(cfg)
    drafter.load_target_head(target_dir)
    export_drafter(drafter, str(root / "export"), dtype=torch.float32)
    return target_dir, str(root / "export")


def readme_transformers_lines() -> str:
    """The README's Transformers lines (the block that calls spec_generate), as written."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    (block,) = [b for b in blocks if "spec_generate(" in b]
    return block


def _readme_usage(target_dir: str, export_dir: str, max_new_tokens: int = NEW_TOKENS):
    """The README's Transformers lines (DFlash's README usage) run as written, on whatever device
    they pick, with our export, its target, and `max_new_tokens` instead of 2,048."""
    lines = readme_transformers_lines()
    assert 'max_new_tokens=2048' in lines
    lines = re.sub(r"(?m)^EXPORT, TARGET = .*$", f"EXPORT, TARGET = {export_dir!r}, {target_dir!r}", lines)
    scope: dict = {}
    exec(compile(lines.replace("max_new_tokens=2048", f"max_new_tokens={max_new_tokens}"), "README.md", "exec"), scope)
    input_ids = scope["input_ids"]
    prompt = input_ids if isinstance(input_ids, torch.Tensor) else input_ids["input_ids"]   # transformers 5: a BatchEncoding
    return scope["draft"], scope["target"], scope["tokenizer"], prompt[0].tolist(), scope["output"]


def test_the_reference_readme_usage_runs_on_our_export_and_equals_greedy_and_our_decode(served):
    import dfpipe.eval as ev

    target_dir, export_dir = served
    draft, target, tokenizer, prompt, output = _readme_usage(target_dir, export_dir)
    stop = {tokenizer.eos_token_id}
    assert output.shape[0] == 1 and output[0, :len(prompt)].tolist() == prompt
    generated = output[0, len(prompt):].tolist()
    # plain greedy decoding of the target, token for token: dfpipe eval's reference and transformers' own
    greedy = ev.greedy_decode(ev.TargetModel(target), prompt, NEW_TOKENS, stop).tokens
    assert generated == greedy and 0 < len(generated) <= NEW_TOKENS
    hf = target.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    assert hf[0, len(prompt):].tolist() == generated
    # and dfpipe eval's own speculative decoding of the same export
    ev_target, ev_drafter = ev.load_models(target_dir, export_dir, torch.device("cpu"))
    assert ev.speculative_decode(ev_target, ev_drafter, prompt, NEW_TOKENS, stop).tokens == generated


@pytest.mark.parametrize("right", [0, 1, 3])
def test_spec_generate_keeps_exactly_the_drafts_the_target_agrees_with(served, monkeypatch, right: int):
    """An oracle drafter (forward and compute_logits replaced) that knows the target's greedy
    continuation for `right` block positions and is wrong after: the output stays the target's, and
    the target runs once per right + 1 tokens (the accepted drafts and its own next choice)."""
    import dfpipe.eval as ev

    target_dir, export_dir = served
    draft, target, _, prompt, _ = _readme_usage(target_dir, export_dir, max_new_tokens=1)
    reference = ev.greedy_decode(ev.TargetModel(target), prompt, NEW_TOKENS + 8, set()).tokens
    b, vocab = draft.block_size, draft.config.vocab_size

    def oracle(**kwargs):
        anchor = int(kwargs["position_ids"][0, -b]) - len(prompt)         # output index of the anchor
        truth = reference[anchor + 1:anchor + b]
        tokens = [t if k < right else (t + 1) % vocab for k, t in enumerate(truth)]
        hidden = torch.zeros(1, b, 1)
        hidden[0, 1:, 0] = torch.tensor(tokens, dtype=torch.float32)
        return hidden

    monkeypatch.setattr(draft, "forward", oracle)
    monkeypatch.setattr(draft, "compute_logits",
                        lambda hidden, head: F.one_hot(hidden[..., 0].long(), vocab).float())
    calls = []
    target.register_forward_hook(lambda *_: calls.append(1))
    output = draft.spec_generate(input_ids=torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, temperature=0.0,
                                 target=target, stop_token_ids=[])
    assert output[0, len(prompt):].tolist() == reference[:NEW_TOKENS]
    assert len(calls) == 1 + -(-(NEW_TOKENS - 1) // (right + 1))      # the prefill, then one per step


def test_reference_forward_keywords_with_a_cache_equal_one_call_over_the_whole_context(exported):
    """The reference loop's calls: target_hidden [1, T, k*H], noise_embedding, position_ids of the
    context then the block, and a DynamicCache cropped after each call, over a context longer than
    the sliding window; what it gives equals one call over the whole context, and our own API."""
    from transformers import DynamicCache

    trainer_model, draft, _, _ = exported
    draft.set_target_embeddings(trainer_model.embed_tokens.weight, trainer_model.lm_head.weight)
    batch, blocks = _blocks([20], [13])
    b, context = draft.block_size, batch.hidden.permute(1, 0, 2).reshape(20, -1)[None]    # [1, T, k*H]
    embeds = draft.embed(blocks.block_input_ids)
    cache = DynamicCache()
    with torch.no_grad():
        whole = draft(target_hidden=context[:, :13], noise_embedding=embeds, position_ids=torch.arange(13 + b)[None])
        first = draft(target_hidden=context[:, :9], noise_embedding=draft.embed(blocks.block_input_ids),
                      position_ids=torch.arange(9 + b)[None], past_key_values=cache, use_cache=True)
        cache.crop(-b)
        assert cache.get_seq_length() == 9 and first.shape == (1, b, 64)
        cached = draft(target_hidden=context[:, 9:13], noise_embedding=embeds, position_ids=torch.arange(9, 13 + b)[None],
                       past_key_values=cache, use_cache=True)
        ours = draft(batch.hidden[:, :13], blocks.block_positions, input_ids=blocks.block_input_ids)
        want = trainer_model(batch.hidden, blocks.block_input_ids, blocks)
    assert torch.equal(whole, ours)
    _assert_close(cached, whole, _config(), 13)
    _assert_close(whole, want, _config(), 13)
    assert differs(first, whole, n=drafter_terms(_config(), 13))          # the cache's context is felt
    with torch.no_grad():
        assert torch.equal(draft.compute_logits(whole, trainer_model.lm_head), draft.compute_logits(whole))
    with pytest.raises(ValueError, match="attention_mask=None"):
        draft(target_hidden=context, noise_embedding=embeds, position_ids=torch.arange(20 + b)[None],
              attention_mask=torch.ones(1, 1, b, 20 + b, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"\[1, T \+ B\]"):
        draft(target_hidden=context, noise_embedding=embeds, position_ids=torch.arange(b)[None, None])
    with pytest.raises(ValueError, match="greedily"):
        draft.spec_generate(target=None, input_ids=torch.zeros(1, 3, dtype=torch.long), max_new_tokens=4,
                            temperature=0.7)


def test_each_block_spec_generate_drafts_sees_the_whole_verified_context(served, monkeypatch):
    """spec_generate hands the drafter only the newly verified positions and keeps the rest in its
    cache: every block's hidden states equal one call over the whole context so far."""
    target_dir, export_dir = served
    draft, target, tokenizer, prompt, _ = _readme_usage(target_dir, export_dir, max_new_tokens=1)
    forward, pieces, cfg = draft.forward, [], draft.config
    calls = []

    def spy(**kwargs):
        got = forward(**kwargs)
        pieces.append(kwargs["target_hidden"])
        whole = torch.cat(pieces, dim=1)
        want = forward(target_hidden=whole, noise_embedding=kwargs["noise_embedding"],
                       position_ids=torch.arange(whole.shape[1] + draft.block_size)[None])
        # the drafter's path (as drafter_terms counts it) through the whole context and the block
        n = transformer_terms(cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size,
                              whole.shape[1] + draft.block_size, projected_in=whole.shape[2])
        assert_close(got, want, n=n)
        calls.append(whole.shape[1])
        return got

    monkeypatch.setattr(draft, "forward", spy)
    draft.spec_generate(input_ids=torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, temperature=0.0, target=target,
                        stop_token_ids=[])
    assert calls[0] == len(prompt) and len(calls) >= 2 and calls == sorted(calls)
