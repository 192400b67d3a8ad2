"""Config: typos and wrong types are errors naming the key; overrides; derived defaults."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from common.config import ConfigError, default_gamma, default_layer_ids, load_config, run_tag

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _write(tmp_path: Path, text: str) -> str:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return str(p)


def test_unknown_key_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="train.lrr"):
        load_config(_write(tmp_path, "train:\n  lrr: 0.1\n"))


def test_a_removed_key_says_why_it_went(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"drafter.warm_up no longer exists: .*compile.*delete it"):
        load_config(_write(tmp_path, "drafter:\n  warm_up: off\n"))


def test_wrong_type_is_an_error_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="data.token_budget: expected int"):
        load_config(_write(tmp_path, "data:\n  token_budget: lots\n"))


def test_overrides_apply_and_are_type_checked(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, "train:\n  lr: 0.1\n"), ["train.lr=3e-4", "ring.slots=3"])
    assert cfg.train.lr == 3e-4 and cfg.ring.slots == 3
    with pytest.raises(ConfigError, match="train.epochs"):
        load_config(None, ["train.epochs=many"])
    # more epochs than a HELLO can carry: refused at load, not by the trainer's first message
    with pytest.raises(ConfigError, match=r"train.epochs: 1 to 4096"):
        load_config(None, ["train.epochs=10000"])
    assert load_config(None, ["train.epochs=4096"]).train.epochs == 4096
    for key, value in (("ring.slots", "70000"), ("train.eval_batches", "5000"), ("train.max_checkpoint_failures", "0")):
        with pytest.raises(ConfigError, match=key):
            load_config(None, [f"{key}={value}"])
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load_config(None, ["train.lr"])


def test_yaml_off_means_the_string_off(tmp_path: Path) -> None:
    assert load_config(_write(tmp_path, "ring:\n  cuda_register: off\n")).ring.cuda_register == "off"
    with pytest.raises(ConfigError, match="cuda_register"):
        load_config(None, ["ring.cuda_register=on"])


def test_cross_field_rules(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="max_len"):
        load_config(None, ["data.token_budget=1024", "data.max_len=2048"])
    with pytest.raises(ConfigError, match="sliding_window"):
        load_config(None, ["drafter.num_layers=1", "drafter.layer_types=[sliding_attention]"])
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(_write(tmp_path, "train: [unclosed\n"))


def test_a_sliding_window_narrower_than_a_block_is_refused_with_the_key_that_fixes_it() -> None:
    layers = ["drafter.num_layers=2", "drafter.layer_types=[sliding_attention, full_attention]"]
    with pytest.raises(ConfigError, match=r"drafter.sliding_window \(8\) is smaller than drafter.block_size \(16\)"
                                          r".*set drafter.sliding_window to at least 16"):
        load_config(None, [*layers, "drafter.sliding_window=8"])
    assert load_config(None, [*layers, "drafter.sliding_window=16"]).drafter.sliding_window == 16
    assert load_config(None, [*layers, "drafter.sliding_window=4", "drafter.block_size=4"]).drafter.block_size == 4
def test_a_document_longer_than_the_budget_is_refused_naming_both_keys_and_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"data.max_len \(32768\) must not exceed data.token_budget \(16384\): a "
                                          r"document is trained whole.*Raise data.token_budget to at least 32768, or "
                                          r"lower data.max_len .*data.overlong"):
        load_config(None, ["data.token_budget=16384", "data.max_len=32768"])
    # whole long documents: any length up to the budget (64K-token budgets and documents as well)
    for budget, max_len in ((32768, 32768), (65536, 32768), (65536, 65536)):
        cfg = load_config(None, [f"data.token_budget={budget}", f"data.max_len={max_len}"])
        assert (cfg.data.token_budget, cfg.data.max_len) == (budget, max_len)


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_shipped_config_loads(name: str) -> None:
    cfg = load_config(str(CONFIGS / name))
    assert cfg.data.max_len <= cfg.data.token_budget


def test_the_long_document_config_trains_32k_token_documents_whole() -> None:
    cfg = load_config(str(CONFIGS / "gpu-long.yaml"))
    assert cfg.data.max_len == 32768 and cfg.data.token_budget >= cfg.data.max_len
    assert cfg.drafter.max_anchors == 512      # anchors per document as for chat-length data


def test_relative_paths_resolve_against_the_config_file(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, "data:\n  train_path: demo/chat.jsonl\n"))
    assert cfg.resolve(cfg.data.train_path) == str(tmp_path / "demo" / "chat.jsonl")
    assert cfg.resolve("builtin:tiny-qwen3.5") == "builtin:tiny-qwen3.5"


def test_each_run_gets_its_own_ring_and_endpoints_unless_the_config_names_them(tmp_path: Path) -> None:
    """Two clones, or two configs, of one user: two out_dirs, two rings, two pairs of endpoints.
    Both services read one file, so they derive the same names; a name the config gives wins."""
    clones = [tmp_path / "clone-a", tmp_path / "clone-b"]
    for clone in clones:
        (clone / "configs").mkdir(parents=True)
        (clone / "configs" / "demo.yaml").write_text((CONFIGS / "demo.yaml").read_text())
    a, b = (load_config(str(clone / "configs" / "demo.yaml")) for clone in clones)
    again = load_config(str(clones[0] / "configs" / "demo.yaml"))   # the other service of clone a
    names = lambda cfg: (cfg.ring.name, cfg.service.target_endpoint, cfg.service.trainer_endpoint)  # noqa: E731
    assert names(a) == names(again)
    assert not set(names(a)) & set(names(b)), (names(a), names(b))
    tag = run_tag(str(clones[0] / "runs" / "demo"))          # the demo's out_dir: ../runs/demo
    assert a.ring.name == f"dfpipe-{tag}" and a.service.target_endpoint.endswith(f"/{tag}-target.sock")
    assert re.fullmatch(r"demo-[0-9a-f]{8}", tag)
    # another config of one clone: another out_dir, other names
    other = load_config(str(clones[0] / "configs" / "demo.yaml"), ["train.out_dir=../runs/other"])
    assert not set(names(other)) & set(names(a))
    # named in the config (the deployment files do): those, whatever the out_dir
    gpu = load_config(str(CONFIGS / "gpu.yaml"), ["train.out_dir=/elsewhere"])
    assert names(gpu) == ("dfpipe", "ipc:///run/dfpipe/target.sock", "ipc:///run/dfpipe/trainer.sock")
    # a long, odd folder name still makes a short, safe tag: a unix socket path is at most 107 bytes
    odd = run_tag(str(tmp_path / ("ü x/" * 3) / ("very long run name " * 8)))
    assert re.fullmatch(r"[A-Za-z0-9._-]{1,16}-[0-9a-f]{8}", odd), odd
    assert len(load_config(None, [f"train.out_dir={'x' * 200}"]).service.trainer_endpoint) < 100


def test_dflash_layer_ids_and_gamma_follow_the_published_recipe() -> None:
    assert default_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_layer_ids(36, 1) == [18] and default_layer_ids(8, 1) == [4] and default_layer_ids(5, 1) == [2]
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7.0, 5.0, 4.0)
    with pytest.raises(ConfigError):
        default_layer_ids(4, 5)


def test_eval_during_training_needs_heldout_data(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"train.eval_every \(5\) needs data.heldout_path"):
        load_config(None, ["train.eval_every=5"])
    cfg = load_config(None, ["train.eval_every=5", "data.heldout_path=heldout.jsonl", "data.train_path=chat.jsonl"])
    assert cfg.train.eval_every == 5 and cfg.train.eval_batches == 4
    assert load_config(None, ["data.heldout_path=heldout.jsonl"]).train.eval_every == 0  # data alone: eval off
    with pytest.raises(ConfigError, match="train.eval_every"):
        load_config(None, ["train.eval_every=-1"])
    with pytest.raises(ConfigError, match="train.eval_batches"):
        load_config(None, ["train.eval_every=5", "data.heldout_path=h.jsonl", "train.eval_batches=0"])
    with pytest.raises(ConfigError, match="data.heldout_path: must not be data.train_path"):
        load_config(_write(tmp_path, "data:\n  train_path: chat.jsonl\n  heldout_path: ./chat.jsonl\n"))


def test_placement_and_attention_path_are_checked() -> None:
    cfg = load_config(None, ["train.devices=[cuda:5, cuda:6, cuda:7]", "drafter.attn=flex"])
    assert cfg.train.devices == ["cuda:5", "cuda:6", "cuda:7"] and cfg.drafter.attn == "flex"
    assert load_config(None, ["train.devices=[cpu, cpu]"]).train.devices == ["cpu", "cpu"]
    with pytest.raises(ConfigError, match="train.devices: each GPU once"):
        load_config(None, ["train.devices=[cuda:5, cuda:5]"])
    with pytest.raises(ConfigError, match="drafter.attn: auto | split | sdpa | flex"):
        load_config(None, ["drafter.attn=dense"])


def test_curve_keys_come_in_pairs_and_resolve_against_the_config(tmp_path: Path) -> None:
    from common.channel import CurveKeys
    with pytest.raises(ConfigError, match="curve_server_key and service.curve_client_key: set both"):
        load_config(None, ["service.curve_server_key=keys/server.key_secret"])
    cfg = load_config(_write(tmp_path, "service:\n  curve_server_key: k/server.key_secret\n"
                                       "  curve_client_key: k/client.key_secret\n"))
    assert CurveKeys.from_config(cfg) == CurveKeys(str(tmp_path / "k/server.key_secret"),
                                                   str(tmp_path / "k/client.key_secret"))
    assert CurveKeys.from_config(load_config(None)) is None


def test_allowed_uids_are_user_ids_and_name_their_key_when_not() -> None:
    assert load_config(None, ["service.allowed_uids=[1001]"]).service.allowed_uids == [1001]
    for bad in ("[-1]", "[true]", "1001"):
        with pytest.raises(ConfigError, match="service.allowed_uids"):
            load_config(None, [f"service.allowed_uids={bad}"])


def _readme_config_keys() -> set[str]:
    """`section.key` of every row of the README's configuration table (a row may list several keys)."""
    text = (CONFIGS.parent / "README.md").read_text(encoding="utf-8")
    table = text.split("\n## Configuration reference\n", 1)[1].split("\n## ", 1)[0]
    keys = set()
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 4 and cells[0] not in ("section", "---"):
            keys |= {f"{cells[0]}.{k.strip()}" for k in cells[1].split(",")}
    return keys


def test_the_readme_configuration_table_lists_exactly_the_keys_the_code_reads() -> None:
    import dataclasses

    from common.config import Config
    code = {f"{section.name}.{key.name}" for section in dataclasses.fields(Config) if section.name != "source"
            for key in dataclasses.fields(section.default_factory())}
    readme = _readme_config_keys()
    assert len(readme) > 50, "the table was not found or not parsed"
    assert not code - readme, f"keys missing from README.md's configuration table: {sorted(code - readme)}"
    assert not readme - code, f"README.md's configuration table lists keys that do not exist: {sorted(readme - code)}"


def test_compute_dtype_is_one_the_step_knows() -> None:
    assert load_config(None, ["train.compute_dtype=bf16"]).train.compute_dtype == "bf16"
    with pytest.raises(ConfigError, match=r"train.compute_dtype: auto \| bf16 \| fp32"):
        load_config(None, ["train.compute_dtype=fp16"])
