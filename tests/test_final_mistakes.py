"""The mistakes a restart cannot fix exit with status 2 (final) in one line naming the key, without
a traceback (issue 47): each is checked where the services start, before anything runs."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.config import ConfigError
from common.seqset import SeqSet
from drafter_trainer.checkpoint import TrainerState

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "configs" / "demo.yaml"


def _dfpipe(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dfpipe", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=600)


def _final(res: subprocess.CompletedProcess, key: str) -> None:
    """Status 2, no traceback, and a line naming `key` (a service's log adds its own lines around it)."""
    out = res.stdout + res.stderr
    assert res.returncode == 2, (res.returncode, out[-3000:])
    assert "Traceback" not in out, out[-3000:]
    assert any(key in line for line in out.splitlines()), out[-3000:]


class _TwoLayers(torch.nn.Module):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(width)


def test_seven_mistakes_exit_2_in_a_line_naming_the_key(tmp_path: Path) -> None:
    out = f"train.out_dir={tmp_path / 'run'}"
    cache = f"target.cache_dir={tmp_path / 'cache'}"
    walk = [
        (["--set", "data.max_row_bytes=0"], "data.max_row_bytes"),
        (["--set", f"data.chat_template={tmp_path / 'missing.jinja'}", "--set", cache], "data.chat_template"),
        (["--set", "train.lr=[1e-3"], "train.lr"),                                  # not YAML
        (["--set", "ring.slots=5000"], "ring.slots"),                               # the ring refuses 4097..65536
        (["--set", f"data.token_budget={1 << 39}"], "data.token_budget"),           # its slot is past the ring's
        (["--set", "train.lr=1e38"], "train.lr"),
    ]
    for overrides, key in walk:
        _final(_dfpipe("target-server", "-c", str(DEMO), "--set", out, *overrides, cwd=tmp_path), key)
    # the seventh: resuming with another drafter shape, where the trainer meets it (after the target's
    # WELCOME, its drafter built): one ConfigError line naming both shapes and the ways on
    saved = _TwoLayers(2, 8)
    resumed = TrainerState(step=1, epoch=0, have=SeqSet(), trained_samples={}, model=saved.state_dict())
    resumed.check_fits(_TwoLayers(2, 8), str(tmp_path / "run" / "checkpoints" / "step-00000001"))
    for other in (_TwoLayers(3, 8), _TwoLayers(2, 16)):
        with pytest.raises(ConfigError) as refused:
            resumed.check_fits(other, str(tmp_path / "run" / "checkpoints" / "step-00000001"))
        line = str(refused.value)
        assert "\n" not in line and line.startswith("drafter: ") and "2 layers, width 8" in line
        assert "another train.out_dir" in line and "--fresh" in line
