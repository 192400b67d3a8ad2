"""The target forward captures the right layers, stops early, and loads only what it needs.

Layer id l must equal Hugging Face hidden_states[l + 1] (an off-by-one here silently ruins a drafter),
captures on hybrid targets must be real numbers (the all-zero bug), and the tiny built-in targets
must be reproducible.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import transformers.models.qwen3_5.modeling_qwen3_5  # noqa: F401  (bind HF's kernels while conftest blocks FLA)
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from common.batch import BatchError, document_positions
from common.config import default_layer_ids
from target_server import tiny
from target_server.target import TargetRunner
from target_server.tiny import build_tiny_target, resolve_target
from tolerances import assert_close, differs, rel_err, target_terms, tol, transformer_roundings

pytestmark = pytest.mark.numerics   # run again under ATEN_CPU_CAPABILITY=default (make test-numerics)

ARCHS = ("qwen3.5", "qwen3")


@pytest.fixture(scope="module")
def runners(tiny_dirs: dict[str, str]) -> dict[str, TargetRunner]:
    return {arch: TargetRunner.load(path) for arch, path in tiny_dirs.items()}


def _tokens(n: int, seed: int, vocab: int = 512) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _single_doc(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lens = torch.tensor([ids.numel()], dtype=torch.int32)
    return ids, document_positions(lens), lens


@pytest.mark.parametrize("arch", ARCHS)
def test_layer_id_l_is_the_output_of_decoder_layer_l(arch: str, tiny_dirs: dict[str, str],
                                                     runners: dict[str, TargetRunner]) -> None:
    runner = runners[arch]
    ids = _tokens(40, seed=1)
    captured = runner.capture(*_single_doc(ids))
    ref = AutoModelForCausalLM.from_pretrained(tiny_dirs[arch], attn_implementation="sdpa").eval()
    with torch.no_grad():
        hs = ref(input_ids=ids[None], use_cache=False, output_hidden_states=True).hidden_states
    for plane, layer in enumerate(runner.layer_ids):
        assert_close(captured[plane], hs[layer + 1][0], n=target_terms(runner, ids.numel()))
        # an off-by-one in either direction is far outside the tolerance
        for wrong in (layer, layer + 2):
            assert differs(captured[plane], hs[wrong][0], n=target_terms(runner, ids.numel()))
    assert_close(runner.capture_unpacked(ids), captured, n=target_terms(runner, ids.numel()))


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral"])
def test_other_decoders_of_the_same_layout_capture_like_transformers(model_type: str, tmp_path) -> None:
    """Any decoder whose layers are self_attn + mlp between two norms loads (README, "Your model"):
    two packed documents capture what one transformers forward per document gives."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, vocab_size=512, hidden_size=128, intermediate_size=256,
                                  num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                  sliding_window=None)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(tmp_path))
    runner = TargetRunner.load(str(tmp_path), layer_ids=[1, 3])
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="sdpa").eval()
    docs = [_tokens(9, seed=3), _tokens(6, seed=4)]
    lens = torch.tensor([len(d) for d in docs], dtype=torch.int32)
    captured = runner.capture(torch.cat(docs), document_positions(lens), lens)
    start = 0
    for doc in docs:
        with torch.no_grad():
            hs = ref(input_ids=doc[None], use_cache=False, output_hidden_states=True).hidden_states
        for plane, layer in enumerate(runner.layer_ids):
            assert_close(captured[plane, start:start + len(doc)], hs[layer + 1][0],
                         n=target_terms(runner, len(doc)))
        start += len(doc)


def test_forward_stops_after_the_deepest_captured_layer(tiny_dirs: dict[str, str]) -> None:
    runner = TargetRunner.load(tiny_dirs["qwen3.5"], layer_ids=[0, 2])
    model = runner.model
    assert runner.num_layers == 8 and len(model.layers) == 3, "layers past the deepest capture were built"
    assert not hasattr(model, "lm_head") and not any("lm_head" in n for n in model.state_dict())
    calls: dict[str, int] = {}

    def count(name: str):  # noqa: ANN202
        def hook(*_: object) -> None:
            calls[name] = calls.get(name, 0) + 1
        return hook

    for i, layer in enumerate(model.layers):
        layer.mlp.register_forward_hook(count(f"layer{i}"))
    model.norm.register_forward_hook(count("final_norm"))
    runner.capture(*_single_doc(_tokens(9, seed=2)))
    assert calls == {"layer0": 1, "layer1": 1, "layer2": 1}, calls


def test_hybrid_target_captures_are_nonzero_and_finite(tiny_dirs: dict[str, str],
                                                      runners: dict[str, TargetRunner]) -> None:
    lens = torch.tensor([3, 60, 1, 25], dtype=torch.int32)
    ids = _tokens(int(lens.sum()), seed=3)
    for runner in (runners["qwen3.5"], TargetRunner.load(tiny_dirs["qwen3.5"], dtype="bf16")):
        hidden = runner.capture(ids, document_positions(lens), lens).float()
        assert torch.isfinite(hidden).all()
        row_rms = hidden.pow(2).mean(-1).sqrt()
        # (near) zero: no larger than the rounding error of the largest row, i.e. zero for this computation
        noise = tol(target_terms(runner, ids.numel()), rounded_to=runner.dtype)["rtol"] * row_rms.max()
        assert row_rms.min() > noise, f"{runner.dtype}: a captured row is (near) zero"
    bf16 = hidden
    fp32_runner = runners["qwen3.5"]
    fp32 = fp32_runner.capture(ids, document_positions(lens), lens)
    for plane, layer in enumerate(fp32_runner.layer_ids):
        # the bf16 target rounds every weight and every operation's output on the path through
        # layers 0..l once each; the fp32 one sums in its own order
        bound = tol(target_terms(fp32_runner, ids.numel()), rounded_to=torch.bfloat16,
                    roundings=2 * transformer_roundings(layer + 1))["rtol"]
        assert rel_err(bf16[plane], fp32[plane]) <= bound, (layer, rel_err(bf16[plane], fp32[plane]), bound)


def test_capture_fills_a_provided_out_view(runners: dict[str, TargetRunner]) -> None:
    runner = runners["qwen3.5"]
    lens = torch.tensor([5, 11], dtype=torch.int32)
    ids, pos = _tokens(16, seed=4), document_positions(lens)
    k, h = len(runner.layer_ids), runner.hidden_size
    slot = torch.full((3 + k * 16 * h,), float("nan"))  # a slot with a header before the planes
    view = slot[3:].view(k, 16, h)
    got = runner.capture(ids, pos, lens, out=view)
    assert got.data_ptr() == view.data_ptr()
    torch.testing.assert_close(view, runner.capture(ids, pos, lens), atol=0, rtol=0)
    assert torch.isnan(slot[:3]).all()
    with pytest.raises(ValueError, match="out is"):
        runner.capture(ids, pos, lens, out=torch.empty(k, 15, h))
    with pytest.raises(ValueError, match="out is"):
        runner.capture(ids, pos, lens, out=torch.empty(k, 16, h, dtype=torch.bfloat16))


@pytest.mark.parametrize("case, match", [
    ("id_too_large", "outside"), ("id_negative", "outside"), ("lens_do_not_sum", "sum to"),
    ("zero_length_doc", "positive"), ("positions_do_not_restart", "restart"), ("two_dimensional", "1-d"),
])
def test_inconsistent_batches_are_refused_with_a_clear_error(case: str, match: str,
                                                             runners: dict[str, TargetRunner]) -> None:
    lens = torch.tensor([4, 6], dtype=torch.int32)
    ids, pos = _tokens(10, seed=5), document_positions(lens)
    if case == "id_too_large":
        ids[7] = 512
    elif case == "id_negative":
        ids[0] = -1
    elif case == "lens_do_not_sum":
        lens = torch.tensor([4, 5], dtype=torch.int32)
    elif case == "zero_length_doc":
        lens = torch.tensor([0, 4, 6], dtype=torch.int32)
    elif case == "positions_do_not_restart":
        pos = torch.arange(10)
    elif case == "two_dimensional":
        ids = ids[None]
    with pytest.raises(BatchError, match=match):
        runners["qwen3.5"].capture(ids, pos, lens)


def test_layer_ids_default_to_the_dflash_spacing_and_are_validated(tiny_dirs: dict[str, str],
                                                                   runners: dict[str, TargetRunner]) -> None:
    assert runners["qwen3"].layer_ids == default_layer_ids(8, 5)
    assert TargetRunner.load(tiny_dirs["qwen3"], num_capture_layers=3).layer_ids == default_layer_ids(8, 3)
    for bad in ([3, 2], [1, 8], [-1, 2], [2, 2]):
        with pytest.raises(ValueError, match="layer_ids"):
            TargetRunner.load(tiny_dirs["qwen3"], layer_ids=bad)


def test_vision_language_sharded_checkpoint_loads_only_the_text_decoder(tmp_path: os.PathLike,
                                                                       tiny_dirs: dict[str, str],
                                                                       runners: dict[str, TargetRunner]) -> None:
    """Qwen3.5 releases ship model.language_model.* plus a vision tower and MTP head, in shards."""
    src = tiny_dirs["qwen3.5"]
    state = load_file(os.path.join(src, "model.safetensors"))
    renamed = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in state.items()}
    renamed["model.visual.blocks.0.attn.qkv.weight"] = torch.ones(2, 2)
    renamed["mtp.layers.0.mlp.up_proj.weight"] = torch.ones(2, 2)
    names = sorted(renamed)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: renamed[k].contiguous() for k in keys}, os.path.join(tmp_path, file))
        weight_map.update({k: file for k in keys})
    with open(os.path.join(tmp_path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(src, "config.json")) as f, open(os.path.join(tmp_path, "config.json"), "w") as g:
        g.write(f.read())
    runner = TargetRunner.load(str(tmp_path))
    lens = torch.tensor([7, 9], dtype=torch.int32)
    ids = _tokens(16, seed=6)
    torch.testing.assert_close(runner.capture(ids, document_positions(lens), lens),
                               runners["qwen3.5"].capture(ids, document_positions(lens), lens), atol=0, rtol=0)


def test_a_checkpoint_missing_a_needed_tensor_is_a_clear_error(tmp_path: os.PathLike,
                                                              tiny_dirs: dict[str, str]) -> None:
    src = tiny_dirs["qwen3"]
    state = load_file(os.path.join(src, "model.safetensors"))
    del state["model.layers.2.mlp.up_proj.weight"]
    save_file(state, os.path.join(tmp_path, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f, open(os.path.join(tmp_path, "config.json"), "w") as g:
        g.write(f.read())
    with pytest.raises(RuntimeError, match="layers.2.mlp.up_proj.weight"):
        TargetRunner.load(str(tmp_path))
    # a layer deeper than the capture needs may be absent: it is never read
    TargetRunner.load(str(tmp_path), layer_ids=[0, 1])


def test_tiny_target_is_deterministic_per_seed(tmp_path: os.PathLike) -> None:
    a = build_tiny_target(str(tmp_path / "a"), arch="qwen3.5", num_layers=4, hidden_size=64, seed=7)
    b = build_tiny_target(str(tmp_path / "b"), arch="qwen3.5", num_layers=4, hidden_size=64, seed=7)
    c = build_tiny_target(str(tmp_path / "c"), arch="qwen3.5", num_layers=4, hidden_size=64, seed=8)
    wa, wb, wc = (load_file(os.path.join(d, "model.safetensors")) for d in (a, b, c))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not torch.equal(wa["model.layers.0.linear_attn.in_proj_qkv.weight"],
                           wc["model.layers.0.linear_attn.in_proj_qkv.weight"])
    with open(os.path.join(a, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert cfg["tie_word_embeddings"] is False and "lm_head.weight" in wa


def test_builtin_target_is_built_once_and_reused(tmp_path: os.PathLike) -> None:
    first = resolve_target("builtin:tiny-qwen3", str(tmp_path), num_layers=4, hidden_size=64)
    stamp = os.stat(os.path.join(first, "model.safetensors")).st_mtime_ns
    again = resolve_target("builtin:tiny-qwen3", str(tmp_path), num_layers=4, hidden_size=64)
    assert again == first and os.stat(os.path.join(first, "model.safetensors")).st_mtime_ns == stamp
    other = resolve_target("builtin:tiny-qwen3", str(tmp_path), num_layers=4, hidden_size=64, seed=1)
    assert other != first
    assert sorted(os.listdir(tmp_path)) == sorted({os.path.basename(first), os.path.basename(other)})
    assert resolve_target(first, "/nonexistent") == first
    for bad in ("builtin:tiny-llama", "builtin:qwen3", "/no/such/model"):
        with pytest.raises((ValueError, FileNotFoundError)):
            resolve_target(bad, str(tmp_path))


def test_builtin_build_that_loses_a_race_keeps_the_winners_folder(tmp_path: os.PathLike,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    cache, kw = str(tmp_path / "cache"), {"num_layers": 4, "hidden_size": 64}
    final = resolve_target("builtin:tiny-qwen3", cache, **kw)
    saved = str(tmp_path / "saved")
    shutil.move(final, saved)  # back to "nothing built yet"
    real_build = tiny.build_tiny_target

    def build_while_another_process_finishes_first(out_dir: str, **kwargs: object) -> str:
        real_build(out_dir, **kwargs)  # type: ignore[arg-type]
        shutil.copytree(saved, final)  # the other process renames its build into place first
        open(os.path.join(final, "winner"), "w").close()
        return out_dir

    monkeypatch.setattr(tiny, "build_tiny_target", build_while_another_process_finishes_first)
    assert resolve_target("builtin:tiny-qwen3", cache, **kw) == final
    assert os.path.exists(os.path.join(final, "winner")), "the winner's folder was replaced"
    assert os.listdir(cache) == [os.path.basename(final)], "the loser's temp folder was left behind"


def test_tokenizer_files_are_copied_and_checked_against_the_vocab(tmp_path: os.PathLike) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(20)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok_dir = tmp_path / "tok"
    os.makedirs(tok_dir)
    tok.save(str(tok_dir / "tokenizer.json"))
    out = build_tiny_target(str(tmp_path / "m"), arch="qwen3", num_layers=4, hidden_size=64, vocab_size=32,
                            tokenizer_dir=str(tok_dir))
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))
    with pytest.raises(ValueError, match="vocab_size"):
        build_tiny_target(str(tmp_path / "m2"), arch="qwen3", num_layers=4, hidden_size=64, vocab_size=16,
                          tokenizer_dir=str(tok_dir))
    assert not os.path.exists(tmp_path / "m2"), "a model without usable embeddings was written"
