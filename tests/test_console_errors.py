"""A user's mistake gets one clear line at the console, through the real command line: what is
wrong and the key that fixes it, an exit status that says so, no traceback."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from e2e import write_config


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dfpipe", *args], capture_output=True, text=True, timeout=120)


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
