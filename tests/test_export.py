"""The exported drafter folder: exactly what SGLang / vLLM / the reference loader read, written atomically.

The Transformers trust_remote_code path is tested in test_export_remote_code.py."""
from __future__ import annotations

import json
import os
import stat

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from drafter_trainer.export import ExportError, export_drafter, load_drafter
from test_drafter_model import MASK, drafter_terms, forward, make_batch, make_model, tiny_config
from tolerances import assert_close, transformer_roundings

LAYER_KEYS = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
              "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
              "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
              "input_layernorm.weight", "post_attention_layernorm.weight"]


def _sliding_config():
    return tiny_config(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=6)


def test_export_holds_exactly_the_design_keys_and_no_target_tensors(tmp_path):
    export_drafter(make_model(_sliding_config()), str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors", "modeling_dflash.py"]
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    want = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {f"layers.{i}.{k}" for i in range(2) for k in LAYER_KEYS}
    assert keys == want
    assert load_file(str(tmp_path / "out" / "model.safetensors"))["fc.weight"].shape == (64, 3 * 64)


def test_export_config_has_the_fields_serving_engines_read(tmp_path):
    cfg = _sliding_config()
    export_drafter(make_model(cfg), str(tmp_path / "out"))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"mask_token_id": MASK, "target_layer_ids": [1, 3, 5]}
    assert config["tie_word_embeddings"] is False
    expected = {"block_size": 4, "num_target_layers": 8, "num_hidden_layers": 2, "hidden_size": 64,
                "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                "vocab_size": 97, "rms_norm_eps": 1e-6, "rope_theta": 10_000.0, "sliding_window": 6,
                "layer_types": ["sliding_attention", "full_attention"], "dtype": "bfloat16"}
    assert {k: config[k] for k in expected} == expected
    assert "mask_token_id" not in config and "target_layer_ids" not in config


def test_exported_config_reads_as_a_transformers_qwen3_config(tmp_path):
    from transformers import Qwen3Config

    export_drafter(make_model(_sliding_config()), str(tmp_path / "out"))
    qc = Qwen3Config.from_pretrained(str(tmp_path / "out"))
    assert (qc.num_hidden_layers, qc.hidden_size, qc.head_dim, qc.num_key_value_heads) == (2, 64, 16, 2)
    assert qc.layer_types == ["sliding_attention", "full_attention"] and qc.sliding_window == 6
    assert qc.rope_parameters["rope_theta"] == 10_000.0 and qc.tie_word_embeddings is False
    assert qc.dflash_config["target_layer_ids"] == [1, 3, 5] and qc.block_size == 4


def test_export_then_load_gives_the_same_outputs(tmp_path):
    model = make_model(_sliding_config())
    export_drafter(model, str(tmp_path / "out"), dtype=torch.float32)
    target_dir = tmp_path / "target"
    target_dir.mkdir()
    save_file({"model.embed_tokens.weight": model.embed_tokens.weight.contiguous(),
               "lm_head.weight": model.lm_head.weight.contiguous()}, str(target_dir / "model.safetensors"))
    (target_dir / "config.json").write_text(json.dumps({"vocab_size": 97, "hidden_size": 64}))

    loaded = load_drafter(str(tmp_path / "out"), str(target_dir))
    assert not loaded.training
    batch = make_batch([9, 14, 11])
    with torch.no_grad():
        assert torch.equal(forward(loaded, batch, [3, 12, 25]), forward(model, batch, [3, 12, 25]))


def test_bf16_export_loads_close_to_the_trained_model(tmp_path):
    model = make_model(_sliding_config(), std=0.05)
    export_drafter(model, str(tmp_path / "out"))
    loaded = load_drafter(str(tmp_path / "out"), None)
    loaded.set_target_head(model.embed_tokens.weight, model.lm_head.weight)
    batch = make_batch([9, 14, 11])
    with torch.no_grad():
        got, want = forward(loaded, batch, [3, 12]), forward(model, batch, [3, 12])
    # fp32 compute on both sides; every weight on the path rounded to bf16 once (one per layer
    # operation, plus fc, hidden_norm and the final norm), each moving its output by up to half a step
    cfg = model.config
    assert_close(got, want, n=drafter_terms(cfg, batch.num_tokens), rounded_to=torch.bfloat16,
                 roundings=transformer_roundings(cfg.num_hidden_layers, 3))


def test_export_is_readable_by_other_users_whatever_the_umask(tmp_path):
    """A serving process often runs as another user: files 0644, folder 0755 (safetensors alone
    writes 0600, and a strict umask would narrow config.json and the folder too)."""
    old_umask = os.umask(0o077)
    try:
        export_drafter(make_model(), str(tmp_path / "out"))
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(os.stat(tmp_path / "out").st_mode) == 0o755
    modes = {name: stat.S_IMODE(os.stat(tmp_path / "out" / name).st_mode) for name in os.listdir(tmp_path / "out")}
    assert modes == {"config.json": 0o644, "model.safetensors": 0o644, "modeling_dflash.py": 0o644}


def test_export_replaces_an_older_export_and_leaves_no_temporary_folders(tmp_path):
    out = tmp_path / "out"
    export_drafter(make_model(seed=1), str(out))
    first = load_file(str(out / "model.safetensors"))["fc.weight"]
    export_drafter(make_model(seed=2), str(out))
    assert sorted(os.listdir(tmp_path)) == ["out"]
    assert not torch.equal(load_file(str(out / "model.safetensors"))["fc.weight"], first)


def test_a_failed_export_keeps_the_previous_one(tmp_path, monkeypatch):
    out = tmp_path / "out"
    export_drafter(make_model(seed=1), str(out))
    before = (out / "model.safetensors").read_bytes()
    import safetensors.torch

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        export_drafter(make_model(seed=2), str(out))
    assert sorted(os.listdir(tmp_path)) == ["out"] and (out / "model.safetensors").read_bytes() == before


def test_export_refuses_a_config_without_the_targets_layer_count(tmp_path):
    with pytest.raises(ExportError, match="num_target_layers"):
        export_drafter(make_model(tiny_config(num_target_layers=0)), str(tmp_path / "out"))


def test_load_refuses_weights_that_disagree_with_the_config(tmp_path):
    out = tmp_path / "out"
    export_drafter(make_model(), str(out))
    state = load_file(str(out / "model.safetensors"))
    del state["norm.weight"]
    save_file(state, str(out / "model.safetensors"))
    with pytest.raises(ExportError, match="norm.weight"):
        load_drafter(str(out), None)
    config = json.loads((out / "config.json").read_text())
    export_drafter(make_model(), str(out))
    config["intermediate_size"] = 50
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match="do not match"):
        load_drafter(str(out), None)


def test_export_records_its_targets_config_fingerprint_only_when_told_the_target(tmp_path):
    from drafter_trainer.export import target_fingerprint

    target = tmp_path / "target"
    target.mkdir()
    target_config = {"hidden_size": 64, "vocab_size": 97, "num_hidden_layers": 8, "transformers_version": "5.0"}
    (target / "config.json").write_text(json.dumps(target_config))
    export_drafter(make_model(tiny_config()), str(tmp_path / "with"), target_dir=str(target))
    export_drafter(make_model(tiny_config()), str(tmp_path / "without"))
    recorded = json.loads((tmp_path / "with" / "config.json").read_text())["dfpipe"]
    assert recorded == {"target_config_sha256": target_fingerprint(target_config), "target": str(target)}
    assert "dfpipe" not in json.loads((tmp_path / "without" / "config.json").read_text())
    # the writer's version and key order are not the model; any model field is
    resaved = dict(reversed(list({**target_config, "transformers_version": "5.9"}.items())))
    assert target_fingerprint(resaved) == target_fingerprint(target_config)
    assert target_fingerprint({**target_config, "rms_norm_eps": 1e-5}) != target_fingerprint(target_config)
    # nor is how its weights are stored: the FP8 checkpoint of a model is that model (the precision
    # the drafter trained on is recorded beside it, and `dfpipe eval` compares that on its own)
    fp8 = {**target_config, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    assert target_fingerprint(fp8) == target_fingerprint(target_config)


def test_export_records_the_target_precision_the_drafter_trained_on(tmp_path):
    export_drafter(make_model(tiny_config()), str(tmp_path / "out"), target_precision="fp8-block")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["dfpipe"] == {"target_precision": "fp8-block"}
    # only under our own key: the fields serving engines read are those of any export
    assert "target_precision" not in config["dflash_config"] and "target_precision" not in config
