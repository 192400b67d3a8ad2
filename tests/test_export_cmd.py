"""`dfpipe export`: a checkpoint -> the export folder, checked against the target it is for."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
from safetensors.torch import load_file

from dfpipe.cli import main
from common.seqset import SeqSet
from drafter_trainer.checkpoint import TrainerState
from test_drafter_model import make_model, tiny_config

# The tiny drafter's target: width 64, 97 tokens, 8 layers (tiny_config).
TARGET_SHAPE = {"hidden_size": 64, "vocab_size": 97, "num_hidden_layers": 8}


@pytest.fixture
def run_dir(tmp_path):
    """A train.out_dir holding one checkpoint of the tiny drafter."""
    model = make_model(tiny_config())
    state = TrainerState(step=5, epoch=0, have=SeqSet(), trained_samples={}, model=model.trainable_state_dict(),
                         drafter_config=dataclasses.asdict(model.config))
    state.save(str(tmp_path / "run"), keep=1, reason="test", epoch_samples=0)
    return tmp_path / "run"


def _target(path, **config) -> str:
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    return str(path)


def _export(run_dir, out, *extra: str) -> int:
    return main(["export", "-c", "", "--set", f"train.out_dir={run_dir}", "--out", str(out), *extra])


def test_export_with_its_target_writes_the_folder(run_dir, tmp_path, capsys):
    target = _target(tmp_path / "target", model_type="qwen3", **TARGET_SHAPE)
    assert _export(run_dir, tmp_path / "out", "--target", target) == 0
    assert "exported drafter to" in capsys.readouterr().out
    assert set(load_file(str(tmp_path / "out" / "model.safetensors"))) >= {"fc.weight", "norm.weight"}
    # the checked target is recorded, so `dfpipe eval` can tell it from another target of the same shape
    with open(tmp_path / "out" / "config.json", encoding="utf-8") as f:
        assert json.load(f)["dfpipe"]["target"] == os.path.abspath(target)


def test_the_export_records_the_target_precision_its_checkpoint_trained_on(tmp_path):
    model = make_model(tiny_config())
    state = TrainerState(step=5, epoch=0, have=SeqSet(), trained_samples={}, model=model.trainable_state_dict(),
                         drafter_config=dataclasses.asdict(model.config), target_precision="fp8-block")
    state.save(str(tmp_path / "run"), keep=1, reason="test", epoch_samples=0)
    target = _target(tmp_path / "target", model_type="qwen3", **TARGET_SHAPE)
    assert _export(tmp_path / "run", tmp_path / "out", "--target", target) == 0
    recorded = json.loads((tmp_path / "out" / "config.json").read_text())["dfpipe"]
    assert recorded["target_precision"] == "fp8-block" and recorded["target"] == os.path.abspath(target)


def test_a_multimodal_targets_text_config_is_what_is_checked(run_dir, tmp_path):
    target = _target(tmp_path / "target", model_type="qwen3_5", text_config=TARGET_SHAPE)
    assert _export(run_dir, tmp_path / "out", "--target", target) == 0


def test_a_missing_target_folder_is_an_error_and_nothing_is_written(run_dir, tmp_path):
    with pytest.raises(SystemExit, match="target /nonexistent: no such folder"):
        _export(run_dir, tmp_path / "out", "--target", "/nonexistent")
    assert not (tmp_path / "out").exists()


def test_a_folder_without_a_config_is_an_error(run_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no config.json"):
        _export(run_dir, tmp_path / "out", "--target", str(tmp_path / "empty"))


def test_a_config_that_is_not_json_is_an_error(run_dir, tmp_path):
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text("{hidden_size: 64")
    with pytest.raises(SystemExit, match="not JSON"):
        _export(run_dir, tmp_path / "out", "--target", str(tmp_path / "target"))


@pytest.mark.parametrize("key, value", [("hidden_size", 128), ("vocab_size", 151936), ("num_hidden_layers", 36)])
def test_a_target_of_another_shape_is_an_error_naming_the_difference(run_dir, tmp_path, key, value):
    target = _target(tmp_path / "target", **{**TARGET_SHAPE, key: value})
    with pytest.raises(SystemExit, match=f"not the target this drafter was trained for: {key} {value} "
                                         rf"\(the drafter's: {TARGET_SHAPE[key]}\)"):
        _export(run_dir, tmp_path / "out", "--target", target)
    assert not (tmp_path / "out").exists()


def test_without_target_the_configs_target_folder_is_checked(run_dir, tmp_path):
    wrong = _target(tmp_path / "target", **{**TARGET_SHAPE, "vocab_size": 5})
    with pytest.raises(SystemExit, match="the config's target; pass --target"):
        _export(run_dir, tmp_path / "out", "--set", f"target.model={wrong}")


def test_a_builtin_target_is_not_checked_and_says_so(run_dir, tmp_path, capsys):
    assert _export(run_dir, tmp_path / "out", "--set", "target.model=builtin:tiny-qwen3") == 0
    assert "not checked" in capsys.readouterr().out and (tmp_path / "out" / "config.json").exists()


def test_export_takes_the_newest_checkpoint_that_verifies_and_refuses_a_damaged_one(run_dir, tmp_path, capsys):
    model = make_model(tiny_config(), seed=1)
    newer, _ = TrainerState(step=6, epoch=0, have=SeqSet(), trained_samples={}, model=model.trainable_state_dict(),
                            drafter_config=dataclasses.asdict(model.config)).save(str(run_dir), keep=2, reason="test",
                                                                                  epoch_samples=0)
    state_pt = os.path.join(newer, "state.pt")
    data = bytearray(open(state_pt, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(state_pt, "wb").write(bytes(data))
    target = _target(tmp_path / "target", model_type="qwen3", **TARGET_SHAPE)
    assert _export(run_dir, tmp_path / "out", "--target", target) == 0
    assert f"skipping {newer}: fails verification (state.pt-checksum" in capsys.readouterr().err
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))["fc.weight"]
    step_5 = make_model(tiny_config()).fc.weight      # run_dir's checkpoint, the one before the damaged one
    assert exported.equal(step_5.to(exported.dtype)) and not exported.equal(model.fc.weight.to(exported.dtype))
    with pytest.raises(SystemExit, match="state.pt-checksum: .*fails verification and is not exported"):
        _export(run_dir, tmp_path / "out2", "--target", target, "--checkpoint", newer)
    assert not (tmp_path / "out2").exists()
