"""Each service's preflight: every problem the config and the host show, listed at once (one line
each, naming the key), exit status 2, before the service takes, waits for or loads anything; and
the trainer finds the mask token where the server finds its tokenizer."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from common.config import Config, ConfigError, validate
from common.preflight import check_endpoint, Problems, port_problem, writable_folder_problem
from drafter_trainer.fp8 import fp8_supported
from drafter_trainer.preflight import mask_token_id
from machine_speed import scaled
from e2e import DEMO, load, write_config


def run(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "dfpipe", *args], capture_output=True, text=True, timeout=scaled(120))
    return res, time.monotonic() - t0


def problem_lines(res: subprocess.CompletedProcess) -> list[str]:
    """The listed problems of a refused start: `dfpipe: config error: ... (N problems):` then one line each."""
    console = res.stdout + res.stderr
    assert "Traceback" not in console, console
    head, *rest = [line for line in console.splitlines() if line.strip()]
    assert head.startswith("dfpipe: config error: ") and f"({len(rest)} problems):" in head, console
    assert all(line.startswith("  - ") for line in rest), console
    return [line[4:] for line in rest]


@pytest.fixture
def listening() -> int:
    """A port another process (this test) listens on."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("0.0.0.0", 0))
    s.listen(1)
    yield s.getsockname()[1]
    s.close()


def test_a_trainer_started_alone_lists_every_problem_at_once_and_exits_2_without_waiting(
        tmp_path: Path, listening: int) -> None:
    (tmp_path / "a-file").write_text("not a folder")
    config = write_config(tmp_path, target={"model": str(tmp_path / "missing-model")},
                          drafter={"precision": "fp8"},
                          train={"out_dir": str(tmp_path / "a-file" / "run")},
                          service={"trainer_metrics_port": listening})
    res, seconds = run("trainer", "-c", str(config))
    assert res.returncode == 2, res.stdout + res.stderr
    lines = problem_lines(res)
    expected = ["target.model: no such folder", "train.out_dir: ", f"service.trainer_metrics_port: port {listening}"]
    if not fp8_supported():
        expected.insert(0, "drafter.precision fp8 needs FP8 tensor cores")
    assert len(lines) == len(expected), lines
    for line, start in zip(lines, expected):
        assert line.startswith(start), (start, lines)
    assert "a-file is a file" in lines[expected.index("train.out_dir: ")]
    # refused before anything: no control endpoint bound, no session with a target attempted
    assert not Path(load(config)["service"]["trainer_endpoint"][len("ipc://"):]).exists()
    assert "waiting" not in res.stdout + res.stderr
    assert seconds < 60, f"refused after {seconds:.0f}s: should be at start"


def test_a_target_server_lists_every_problem_at_once_before_taking_a_ring_or_loading(
        tmp_path: Path, listening: int) -> None:
    (tmp_path / "a-file").write_text("not a folder")
    config = write_config(tmp_path, target={"model": str(tmp_path / "missing-model"), "tokenizer": "",
                                            "triton_cache_dir": str(tmp_path / "a-file" / "triton")},
                          data={"train_path": str(tmp_path / "no-data.jsonl")},
                          ring={"shm_dir": str(tmp_path / "no-shm")},
                          service={"target_metrics_port": listening})
    overrides = [] if torch.cuda.is_available() else ["--set", "target.devices=[cuda:0]"]
    res, seconds = run("target-server", "-c", str(config), *overrides)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = problem_lines(res)
    expected = ["target.model: no such folder", "data.train_path: no such file or folder",
                "target.triton_cache_dir: ", "ring.shm_dir: no such folder", f"service.target_metrics_port: port {listening}"]
    if overrides:
        expected.insert(0, "target.devices: [cuda:0] asks for CUDA")
    assert len(lines) == len(expected), lines
    for line, start in zip(lines, expected):
        assert line.startswith(start), (start, lines)
    assert not Path(load(config)["service"]["target_endpoint"][len("ipc://"):]).exists()
    assert seconds < 60, f"refused after {seconds:.0f}s: should be at start"


def test_a_shipped_gpu_config_on_a_host_without_its_folders_is_refused_creating_nothing(tmp_path: Path) -> None:
    # configs/gpu-long.yaml names its deployment's container paths (/models, /data, /checkpoints, /run/dfpipe):
    # elsewhere both services say what is missing instead of making folders at the filesystem's root
    from common.config import load_config

    cfg = load_config(str(Path(__file__).resolve().parents[1] / "configs" / "gpu-long.yaml"))
    made = [p for p in ("/checkpoints", "/run/dfpipe", "/models/target") if os.path.exists(p)]
    if made or torch.cuda.is_available():
        pytest.skip(f"this host is set up like the deployment ({made or 'CUDA'}): nothing to refuse")
    from drafter_trainer.preflight import preflight as trainer_preflight
    from target_server.preflight import preflight as target_preflight
    for check in (trainer_preflight, target_preflight):
        with pytest.raises(ConfigError, match="target.model: no such folder /models/target"):
            check(cfg)
    assert not any(os.path.exists(p) for p in ("/checkpoints", "/run/dfpipe"))


def test_a_folder_is_checked_writable_or_makeable_without_making_it(tmp_path: Path) -> None:
    deep = tmp_path / "a" / "b" / "c"
    assert writable_folder_problem("train.out_dir", str(deep)) is None
    assert not (tmp_path / "a").exists(), "checking made the folder"
    (tmp_path / "f").write_text("x")
    problem = writable_folder_problem("train.out_dir", str(tmp_path / "f" / "run"))
    assert problem and problem.startswith("train.out_dir: ") and f"{tmp_path / 'f'} is a file" in problem
    assert "set train.out_dir to a folder" in problem
    assert writable_folder_problem("train.out_dir", "/proc/1/dfpipe-run") is not None   # no new folders there


def test_a_port_in_use_is_a_problem_and_a_free_one_is_not(listening: int) -> None:
    assert port_problem("service.target_metrics_port", 0) is None
    problem = port_problem("service.target_metrics_port", listening)
    assert problem and problem.startswith(f"service.target_metrics_port: port {listening} cannot be listened on")
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    assert port_problem("service.target_metrics_port", port) is None
    assert "not a port" in port_problem("service.target_metrics_port", 70000)


def test_an_endpoint_folder_others_may_write_in_is_a_problem_before_binding(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)   # not sticky: anyone could replace the socket
    problems = Problems()
    check_endpoint(problems, "service.trainer_endpoint", f"ipc://{shared}/trainer.sock", [])
    check_endpoint(problems, "service.target_endpoint", f"ipc://{tmp_path}/new/target.sock", [])   # made at bind
    check_endpoint(problems, "service.target_endpoint", "udp://nowhere", [])
    assert len(problems.lines) == 2, problems.lines
    assert problems.lines[0].startswith("service.trainer_endpoint: endpoint ipc://") and "writable by other users" \
        in problems.lines[0]
    assert problems.lines[1].startswith("service.target_endpoint: endpoint 'udp://nowhere': expected ipc://")
    assert not (tmp_path / "new").exists()


def test_one_problem_is_one_line_several_are_listed() -> None:
    problems = Problems()
    problems.raise_all("trainer")   # none: nothing raised
    problems.add("train.out_dir: x")
    with pytest.raises(ConfigError) as one:
        problems.raise_all("trainer")
    assert str(one.value) == "train.out_dir: x"
    problems.add(None)
    problems.add("service.trainer_metrics_port: y")
    with pytest.raises(ConfigError) as two:
        problems.raise_all("trainer")
    assert str(two.value).splitlines() == ["the trainer cannot start with this config (2 problems):",
                                           "  - train.out_dir: x", "  - service.trainer_metrics_port: y"]


# ---- the mask token ------------------------------------------------------------------------------
def _cfg(model: str, tokenizer: str = "") -> Config:
    cfg = Config()
    cfg.data.train_path = "unused.jsonl"
    cfg.target.model, cfg.target.tokenizer = model, tokenizer
    return validate(cfg)


def test_the_mask_token_comes_from_target_tokenizer_when_the_model_folder_has_none(tmp_path: Path) -> None:
    from target_server.tiny import build_tiny_target

    model = build_tiny_target(str(tmp_path / "t"), num_layers=4)        # no tokenizer files, like an FP8 copy
    assert mask_token_id(_cfg(model, str(DEMO / "tokenizer")), model) == 3   # <|mask|> of the demo tokenizer
    from drafter_trainer.preflight import preflight
    with pytest.raises(ConfigError, match="drafter.mask_token_id: no tokenizer to find the mask token in .*set "
                                          "target.tokenizer"):
        preflight(_cfg(model))


def test_asking_for_fa4_where_it_cannot_run_is_refused_at_start_with_the_reason(tmp_path: Path) -> None:
    from drafter_trainer.block_mask import fa4_missing
    from drafter_trainer.preflight import preflight
    from target_server.tiny import build_tiny_target

    model = build_tiny_target(str(tmp_path / "t"), num_layers=4)
    cfg = _cfg(model, str(DEMO / "tokenizer"))
    cfg.train.device, cfg.train.out_dir, cfg.target.num_capture_layers = "cpu", str(tmp_path / "run"), 1
    preflight(cfg)                                  # auto: nothing to refuse
    cfg.drafter.attn = "fa4"
    with pytest.raises(ConfigError, match="drafter.attn fa4: FlashAttention 4 runs on CUDA GPUs only"):
        preflight(cfg)
    if torch.cuda.is_available() and fa4_missing(torch.device("cuda", 0)) is None:
        cfg.train.device = "cuda:0"
        preflight(cfg)                              # where it runs, asked for: taken


def _tokenizer_without_mask(folder: Path, tokens: int) -> str:
    from tokenizers import Tokenizer, models

    folder.mkdir()
    vocab = {f"t{i}": i for i in range(tokens - 1)} | {"<unk>": tokens - 1}
    Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                              "unk_token": "<unk>"}))
    return str(folder)


@pytest.mark.parametrize("rows, says", [(64, "set drafter.mask_token_id to an id no text encodes, e.g. 40: the "
                                               "first id past this tokenizer's 40 tokens, a row of the target's "
                                               "64-row embedding"),
                                        (40, "its 40 tokens fill the target's 40-row embedding")])
def test_a_tokenizer_without_a_mask_token_is_refused_with_the_id_it_leaves_free(tmp_path: Path, rows: int,
                                                                                says: str) -> None:
    tokenizer = _tokenizer_without_mask(tmp_path / "tok", 40)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": rows}))
    with pytest.raises(ConfigError, match="drafter.mask_token_id: the target tokenizer in .* has no mask token") as e:
        mask_token_id(_cfg(str(model), tokenizer), str(model))
    assert says in str(e.value)
    assert "151669" not in str(e.value)
