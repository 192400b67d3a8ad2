"""A user's mistake gets one clear line at the console, through the real command line: what is
wrong and the key that fixes it, an exit status that says so, no traceback. And a trainer whose
target server exited says that none is running, not that it is still loading."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from e2e import Service, write_config
from machine_speed import scaled


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dfpipe", *args], capture_output=True, text=True, timeout=scaled(120))


def one_error_line(res: subprocess.CompletedProcess, *needles: str) -> str:
    """The console's error line, checked to be the only one, with no traceback: what the user reads."""
    console = res.stdout + res.stderr
    assert "Traceback" not in console, console
    lines = [line for line in console.splitlines() if "error" in line.lower()]
    assert len(lines) == 1, console
    assert all(n in lines[0] for n in needles), console
    return lines[0]


no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA: asking for it is no mistake")


@no_cuda
@pytest.mark.parametrize("service, setting, key, fix", [
    ("trainer", "train.device=cuda", "train.device", "set train.device: cpu"),
    ("trainer", "train.devices=[cuda:0]", "train.devices", "set train.devices: [cpu]"),
    ("target-server", "target.devices=[cuda:0]", "target.devices", "set target.devices: [cpu]"),
])
def test_cuda_asked_for_on_a_host_without_it_is_an_error_at_start(tmp_path: Path, service: str, setting: str,
                                                                  key: str, fix: str) -> None:
    res = run(service, "-c", str(write_config(tmp_path)), "--set", setting)
    assert res.returncode == 2
    one_error_line(res, f"{key}: ", "no CUDA device", fix)


@pytest.mark.parametrize("model, says", [
    ("missing", "target.model: no such folder {path}"),
    ("empty", "target.model: {path} has no config.json"),
])
def test_a_target_model_that_is_no_model_folder_is_named_not_blamed_on_the_tokenizer(tmp_path: Path, model: str,
                                                                                      says: str) -> None:
    path = tmp_path / model
    if model == "empty":
        path.mkdir()
    # no target.tokenizer: the chat file would be prepared with the model folder's own tokenizer
    config = write_config(tmp_path, target={"model": str(path), "tokenizer": ""})
    res = run("target-server", "-c", str(config))
    assert res.returncode == 2
    line = one_error_line(res, says.format(path=path))
    assert "tokenizer" not in line.split("config.json")[0], line


@pytest.mark.slow
def test_a_target_that_exits_names_the_key_and_its_trainer_reports_it_dead_not_loading(tmp_path: Path) -> None:
    # the built-in target has 8 layers: 9 capture layers cannot be spread over it
    config = write_config(tmp_path, samples=40, target={"num_capture_layers": 9})
    target = Service("target-server", config, tmp_path)
    trainer = Service("trainer", config, tmp_path)
    try:
        assert target.wait(180) == 2, target.log()
        exited = time.monotonic()
        log = target.log(200)
        assert "Traceback" not in log, log
        assert ("cannot place 9 capture layers in a 8-layer target: set target.num_capture_layers to at most 5, "
                "or list the layers in target.layer_ids") in log
        dead = "no target server is running for ring"
        deadline = exited + 15     # the trainer says what it waits for every few seconds
        while dead not in trainer.log(5) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert dead in trainer.log(5), trainer.log()
        assert trainer.alive(), "it waits for a target server to be started (the runbook's way)"
    finally:
        trainer.stop()
        target.stop()
