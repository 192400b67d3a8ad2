"""The trainer's start-up shortcuts: the drafter is built from the shared config while the feed
connects (kept only when the server's WELCOME names the same target), and the mask token is read
from the tokenizer's JSON files instead of importing transformers."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.config import Config, validate
from common.liveness import process_age_s
from drafter_trainer.preflight import MASK_TOKENS, added_token_ids, mask_token_id
from drafter_trainer.startup import expected_target, same_target
from e2e import Service, ctl, load, wait_for, write_config

REPO = Path(__file__).resolve().parents[1]


def _cfg(model: str, layer_ids: list[int] | None = None) -> Config:
    cfg = Config()
    cfg.data.train_path = "unused.jsonl"
    cfg.target.model = model
    if layer_ids is not None:
        cfg.target.layer_ids = layer_ids
    return validate(cfg)


@pytest.mark.parametrize("folder", ["tokenizer", "target"])
def test_added_token_ids_agree_with_the_tokenizer(folder: str, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from target_server.tiny import build_tiny_target

    path = str(REPO / "configs" / "demo" / "tokenizer")
    if folder == "target":   # a model folder with the tokenizer saved next to the weights
        path = build_tiny_target(str(tmp_path / "t"), num_layers=4, tokenizer_dir=path)
    tok = AutoTokenizer.from_pretrained(path)
    found = added_token_ids(path)
    assert found, "the tokenizer folders all have added tokens"
    for content, tid in found.items():
        assert tok.convert_tokens_to_ids(content) == tid, content
    mask = next(t for t in MASK_TOKENS if t in found)
    cfg = _cfg(path)
    cfg.drafter.mask_token_id = -1
    assert mask_token_id(cfg, path) == tok.convert_tokens_to_ids(mask)


def test_added_token_ids_of_a_folder_without_tokenizer_files_is_empty(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{not json", encoding="utf-8")
    assert added_token_ids(str(tmp_path)) == {}


@pytest.mark.parametrize("layer_ids", [None, [1, 3, 5]])
def test_expected_target_is_what_the_server_loads(layer_ids: list[int] | None, tiny_dirs: dict[str, str]) -> None:
    from target_server.target import TargetRunner

    path = tiny_dirs["qwen3.5"]
    cfg = _cfg(path, layer_ids)
    runner = TargetRunner.load(path, device="cpu", layer_ids=cfg.target.layer_ids or None,
                               num_capture_layers=cfg.target.num_capture_layers)
    guess = expected_target(cfg)
    announced = {"model_path": runner.model_path, "layer_ids": list(runner.layer_ids)}
    assert guess is not None and guess["layer_ids"] == announced["layer_ids"]
    assert same_target(guess, announced)


def test_same_target_follows_links_and_refuses_other_layers(tmp_path: Path, tiny_dirs: dict[str, str]) -> None:
    path = tiny_dirs["qwen3.5"]
    link = tmp_path / "target-link"
    os.symlink(path, link)
    guess = expected_target(_cfg(str(link)))
    assert guess is not None
    assert same_target(guess, {"model_path": path, "layer_ids": guess["layer_ids"]})
    assert not same_target(guess, {"model_path": path, "layer_ids": guess["layer_ids"][:-1]})
    assert not same_target(guess, {"model_path": str(tmp_path), "layer_ids": guess["layer_ids"]})
    assert not same_target(guess, {"layer_ids": guess["layer_ids"]})
    assert not same_target(None, {"model_path": path, "layer_ids": guess["layer_ids"]})


def test_no_expected_target_for_a_builtin_spec_or_a_missing_folder(tmp_path: Path) -> None:
    assert expected_target(_cfg("builtin:tiny-qwen3.5")) is None
    assert expected_target(_cfg(str(tmp_path / "absent"))) is None


def test_process_age_counts_from_the_process_start() -> None:
    out = subprocess.run([sys.executable, "-c", "import time; time.sleep(0.3); from common.liveness import "
                          "process_age_s; print(process_age_s())"], cwd=REPO, capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    child = float(out.stdout)
    assert 0.3 <= child < 30.0
    a = process_age_s()
    time.sleep(0.05)
    b = process_age_s()
    assert a is not None and b is not None and b > a


_ORPHAN = """
import os, signal, sys, time
sys.path.insert(0, {repo!r})
from common.liveness import signal_on_parent_death
out = {out!r}
def on_term(signum, frame):
    with open(out, "a") as f:
        f.write("term\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
assert signal_on_parent_death(signal.SIGTERM)
with open(out, "a") as f:
    f.write("ready\\n")
time.sleep(60)
"""

_LAUNCHER = """
import subprocess, sys, time
# like torchrun: the rank in a session of its own, so killing the launcher's group misses it
subprocess.Popen([sys.executable, "-c", {child!r}], start_new_session=True)
time.sleep(60)
"""


def test_a_rank_stops_when_its_launcher_is_killed(tmp_path: Path) -> None:
    import signal

    out = tmp_path / "rank.out"
    child = _ORPHAN.format(repo=str(REPO), out=str(out))
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER.format(child=child)])
    try:
        deadline = time.monotonic() + 30
        while "ready" not in (out.read_text() if out.exists() else ""):
            assert time.monotonic() < deadline, "the rank never started"
            time.sleep(0.05)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 10
        while "term" not in out.read_text():
            assert time.monotonic() < deadline, "the rank outlived its launcher without a SIGTERM"
            time.sleep(0.05)
    finally:
        if launcher.poll() is None:
            launcher.kill()


def test_build_drafter_reads_the_head_beside_the_build(tmp_path: Path) -> None:
    import torch

    from drafter_trainer import startup as train
    from target_server.tiny import build_tiny_target

    target = build_tiny_target(str(tmp_path / "t"), num_layers=4,
                               tokenizer_dir=str(REPO / "configs" / "demo" / "tokenizer"))
    cfg = _cfg(target, [0, 1, 3])
    info = expected_target(cfg)
    assert info is not None
    times: dict[str, float] = {}
    model, behind = train.build_drafter(cfg, info, torch.device("cpu"), times)
    assert behind is None and not model.compiled          # on the CPU nothing compiles: no compile behind
    assert model.embed_tokens.loaded and model.lm_head.loaded
    assert times["build_s"] > 0 and times["head_s"] > 0
    assert times["build_and_head_s"] >= max(times["build_s"], times["head_s"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["SIGTERM", "ctl shutdown"])
def test_a_trainer_waiting_for_its_target_says_so_and_stops_when_told(how: str, tmp_path: Path) -> None:
    config = write_config(tmp_path)                  # no target server is started
    cfg = load(config)
    trainer = Service("trainer", config, tmp_path)
    try:
        wait_for(lambda: "waiting" in trainer.log() and "for the target server at" in trainer.log(), 120,
                 "the waiting trainer's log line")
        assert f"no target server is running for ring {cfg['ring']['name']!r}" in trainer.log()
        if how == "SIGTERM":
            trainer.signal(signal.SIGTERM)
        else:
            assert ctl(cfg["service"]["trainer_endpoint"], "shutdown") is not None
        assert trainer.wait(20) == 0, trainer.log()
        assert "while waiting for the target server" in trainer.log()
        # who stopped it: a signal by its name (Python is not told its sender); a ctl shutdown by its sender
        said = ("trainer stopping (SIGTERM (from outside" if how == "SIGTERM" else
                f"trainer stopping (ctl shutdown from pid {os.getpid()} (python")
        assert said in trainer.log(), trainer.log()
    finally:
        trainer.stop()


def test_a_stop_signal_is_named_and_so_is_a_launcher_that_died(monkeypatch: pytest.MonkeyPatch) -> None:
    from common import liveness
    from common.stopping import sender_text, stop_signal_text
    from common.trust import Peer

    monkeypatch.setattr(liveness, "_death_parent", None)
    assert stop_signal_text(signal.SIGTERM).startswith("SIGTERM (from outside")
    monkeypatch.setattr(liveness, "_death_parent", os.getppid())          # armed, the launcher alive
    assert stop_signal_text(signal.SIGINT).startswith("SIGINT (from outside")
    monkeypatch.setattr(liveness, "_death_parent", os.getppid() + 100000)  # re-parented: the launcher died
    assert stop_signal_text(signal.SIGTERM) == (f"SIGTERM: its launcher, pid {os.getppid() + 100000}, is gone "
                                                "(the parent-death signal)")
    me = sender_text(Peer(uid=os.geteuid(), gid=os.getegid(), pid=os.getpid()))
    assert me.startswith(f"pid {os.getpid()} (python") and me.endswith(f", uid {os.geteuid()} (root)"
                                                                          if os.geteuid() == 0 else ")"), me
    assert sender_text(None).startswith("a peer whose process is not known")
