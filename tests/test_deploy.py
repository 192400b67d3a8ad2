"""Deployment files checked by the real validators: docker-compose's parser and systemd-analyze.

Both come from Debian packages that `make test` installs (deploy/install-validators.sh). On a
developer machine without them these tests skip with the install hint; under CI they must exist.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from machine_speed import scaled

REPO = Path(__file__).resolve().parents[1]
UNITS = REPO / "deploy" / "systemd"


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is missing under CI: deploy/install-validators.sh should have installed it")
        pytest.skip(f"{name} not installed (run deploy/install-validators.sh)")
    return path


def _compose_config(*files: Path) -> subprocess.CompletedProcess:
    """`docker-compose [-f file]... config`; no file: the project's default (COMPOSE_FILE in .env)."""
    tool = _tool("docker-compose")
    args = [a for f in files for a in ("-f", str(f))]
    return subprocess.run([tool, *args, "config"], capture_output=True, text=True,
                          cwd=files[0].parent if files else REPO, timeout=scaled(60))


def _gpus(svc: dict) -> list[str]:
    devs = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    return [d for dev in devs for d in dev["device_ids"]]


def _mount_targets(svc: dict) -> set[str]:
    """Container paths of a service's volumes (short "src:dst[:mode]" or long form)."""
    out = set()
    for v in svc.get("volumes", []):
        out.add(v["target"] if isinstance(v, dict) else v.split(":")[1])
    return out


def test_compose_file_is_valid_and_shares_shm_between_services() -> None:
    res = _compose_config()   # what a plain `docker compose up` runs: .env picks the 8-GPU shape
    assert res.returncode == 0, res.stderr
    cfg = yaml.safe_load(res.stdout)
    target, trainer = cfg["services"]["target-server"], cfg["services"]["trainer"]
    for svc in (target, trainer):
        assert svc["ipc"] == "host", "rings live in /dev/shm: both services must share the host's"
        assert "/etc/dfpipe/config.yaml" in _mount_targets(svc)
    assert _gpus(target) == ["0", "1", "2"] and _gpus(trainer) == ["3", "4", "5", "6", "7"]   # 3+5
    assert trainer["restart"] == "on-failure"
    assert target["restart"] in ("unless-stopped", "always", "on-failure")
    # the target must not be tied to the trainer's lifecycle
    assert "depends_on" not in target
    assert "/cache/triton" in _mount_targets(target), "autotune once: persistent Triton cache"
    assert "/checkpoints" in _mount_targets(trainer)
    # a restart must not compile again: the trainer's compile caches live on a volume
    assert trainer["environment"]["TORCHINDUCTOR_CACHE_DIR"].startswith("/cache/compile/")
    assert trainer["environment"]["TRITON_CACHE_DIR"].startswith("/cache/compile/")
    assert trainer["environment"]["CUDA_CACHE_PATH"].startswith("/cache/compile/")
    assert "/cache/compile" in _mount_targets(trainer)
    assert trainer["environment"]["NCCL_NVLS_ENABLE"] == "0"
    assert "torchrun" in trainer["entrypoint"]


@pytest.mark.parametrize("shape", ["8gpu-3+5", "8gpu-5+3", "8gpu-6+2", "4gpu-1+3", "2gpu-1+1"])
def test_each_compose_placement_gives_disjoint_gpus_one_rank_or_worker_each(shape: str) -> None:
    base = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    assert not any(_gpus(svc) for svc in base["services"].values()), \
        "the base file names no GPUs: a shape file's device list would be appended to it"
    res = _compose_config(REPO / "docker-compose.yml", REPO / "deploy" / "compose" / f"{shape}.yml")
    assert res.returncode == 0, res.stderr
    services = yaml.safe_load(res.stdout)["services"]
    target, trainer = services["target-server"], services["trainer"]
    t_gpus, r_gpus = _gpus(target), _gpus(trainer)
    n_target, n_trainer = (int(x) for x in re.match(r"\dgpu-(\d)\+(\d)", shape).groups())
    assert (len(t_gpus), len(r_gpus)) == (n_target, n_trainer) and not set(t_gpus) & set(r_gpus)
    entry = trainer["entrypoint"]
    assert entry[:3] == ["dfpipe", "torchrun", "--nproc-per-node"] and int(entry[3]) == n_trainer
    overrides = [a for a in target["command"] if a.startswith("target.devices=")]
    from common.config import load_config
    devices = load_config(None, overrides).target.devices
    assert devices == [f"cuda:{i}" for i in range(n_target)], "one worker per GPU the container sees"
    # each service reads one config; the long-document shape mounts its own over the base file's
    config = "gpu-long.yaml" if shape == "8gpu-6+2" else "gpu.yaml"
    for svc in (target, trainer):
        sources = [v["source"] if isinstance(v, dict) else v.split(":")[0] for v in svc["volumes"]
                   if (v["target"] if isinstance(v, dict) else v.split(":")[1]) == "/etc/dfpipe/config.yaml"]
        assert len(sources) == 1 and sources[0].endswith(f"configs/{config}"), sources
    if config == "gpu-long.yaml":      # its workers are the shape's (gpu.yaml's are the default 3+5's)
        assert load_config(str(REPO / "configs" / config)).target.devices == devices


def test_systemd_placements_are_consistent() -> None:
    from common.config import load_config

    shapes = sorted((UNITS / "placements").iterdir())
    assert {p.name for p in shapes} == {"8gpu-3+5", "8gpu-5+3", "8gpu-6+2", "4gpu-1+3", "2gpu-1+1"}
    for shape in shapes:
        env = {}
        for f in ("target.env", "trainer.env"):
            lines = [ln for ln in (shape / f).read_text().splitlines() if ln and not ln.startswith("#")]
            env[f] = dict(ln.split("=", 1) for ln in lines)
        t_gpus = env["target.env"]["CUDA_VISIBLE_DEVICES"].split(",")
        r_gpus = env["trainer.env"]["CUDA_VISIBLE_DEVICES"].split(",")
        n_target, n_trainer = (int(x) for x in re.match(r"\dgpu-(\d)\+(\d)", shape.name).groups())
        assert (len(t_gpus), len(r_gpus)) == (n_target, n_trainer) and not set(t_gpus) & set(r_gpus)
        assert int(env["trainer.env"]["DFPIPE_TRAINER_RANKS"]) == n_trainer
        devices = load_config(None, [f"target.devices={env['target.env']['DFPIPE_TARGET_DEVICES']}"]).target.devices
        assert devices == [f"cuda:{i}" for i in range(n_target)]
    # the units' own defaults are the 8-GPU shape
    for unit, f in (("dfpipe-target.service", "target.env"), ("dfpipe-trainer.service", "trainer.env")):
        text = (UNITS / unit).read_text()
        for line in (UNITS / "placements" / "8gpu-3+5" / f).read_text().splitlines():
            if line and not line.startswith("#"):
                assert f"Environment={line}" in text, (unit, line)
        assert f"EnvironmentFile=-/etc/dfpipe/{f}" in text


def test_compose_validator_rejects_a_broken_file(tmp_path: Path) -> None:
    broken = tmp_path / "docker-compose.yml"
    broken.write_text("version: '3.8'\nservices:\n  trainer:\n    image: x\n    restart: [not, a, string]\n")
    assert _compose_config(broken).returncode != 0


def _verify_units(paths: list[Path]) -> subprocess.CompletedProcess:
    tool = _tool("systemd-analyze")
    return subprocess.run([tool, "verify", *map(str, paths)], capture_output=True, text=True, timeout=scaled(60))


def _units_with_local_binaries(tmp_path: Path) -> list[Path]:
    """The units as shipped, with /opt/dfpipe/.venv/bin pointing at this environment's binaries
    (verify checks that ExecStart exists)."""
    bindir = Path(sys.executable).parent
    assert (bindir / "torchrun").exists(), "torchrun must be installed next to python"
    out = []
    for unit in sorted(UNITS.glob("*.service")):
        text = unit.read_text().replace("/opt/dfpipe/.venv/bin/", f"{bindir}/")
        (tmp_path / unit.name).write_text(text)
        out.append(tmp_path / unit.name)
    return out


def test_systemd_units_verify_cleanly(tmp_path: Path) -> None:
    units = _units_with_local_binaries(tmp_path)
    assert {u.name for u in units} == {"dfpipe-target.service", "dfpipe-trainer.service"}
    res = _verify_units(units)
    assert res.returncode == 0 and res.stderr.strip() == "", res.stderr


def test_trainer_unit_follows_target_without_binding_to_it() -> None:
    text = (UNITS / "dfpipe-trainer.service").read_text()
    assert re.search(r"^After=.*dfpipe-target\.service", text, re.M)
    assert not re.search(r"^(BindsTo|PartOf|Requires)=", text, re.M)
    assert re.search(r"^Restart=on-failure$", text, re.M)
    assert re.search(r"^KillSignal=SIGTERM$", text, re.M)
    stop = int(re.search(r"^TimeoutStopSec=(\d+)$", text, re.M).group(1))
    assert stop >= 120, "a final checkpoint needs time"
    cache = re.search(r"^CacheDirectory=(\S+)$", text, re.M).group(1)
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "CUDA_CACHE_PATH"):   # compile once, not per restart
        assert re.search(rf"^Environment={var}=/var/cache/{re.escape(cache)}/", text, re.M), var
    target = (UNITS / "dfpipe-target.service").read_text()
    assert "dfpipe-trainer" not in target


def test_systemd_verify_flags_a_typo(tmp_path: Path) -> None:
    units = _units_with_local_binaries(tmp_path)
    bad = units[0]
    bad.write_text(bad.read_text().replace("Restart=on-failure", "Restart=sometimes\nRestartSecs=5"))
    res = _verify_units([bad])
    assert "sometimes" in res.stderr or "RestartSecs" in res.stderr


def test_dockerfile_builds_on_a_cuda_pytorch_base_with_pinned_gpu_requirements() -> None:
    text = (REPO / "deploy" / "Dockerfile").read_text()
    base = re.search(r"^ARG BASE_IMAGE=(\S+)", text, re.M).group(1)
    assert "pytorch" in base and "cuda" in base
    installed = re.search(r"-r (requirements/\S+\.txt)", text).group(1)
    files, seen = [REPO / installed], []
    while files:                      # the file the image installs and every file it includes
        path = files.pop()
        seen.append(path.name)
        for line in path.read_text().splitlines():
            if line.startswith("-r "):
                files.append(path.parent / line.split()[1])
            elif line and not line.startswith("#"):
                assert "==" in line, f"unpinned GPU requirement in {path.name}: {line}"
    assert {"gpu.txt", "base.txt"} <= set(seen), seen


def _torchrun_args(argv: list[str], env: dict[str, str]) -> Any:
    """What torchrun itself makes of a command line and its PET_* environment (its own parser)."""
    from torch.distributed.run import get_args_parser

    saved = {k: v for k, v in os.environ.items() if k.startswith("PET_")}
    for k in saved:
        del os.environ[k]
    os.environ.update({k: v for k, v in env.items() if k.startswith("PET_")})
    try:
        return get_args_parser().parse_args(argv)
    finally:
        for k in [k for k in os.environ if k.startswith("PET_")]:
            del os.environ[k]
        os.environ.update(saved)


def test_compose_takes_the_host_rank_and_rendezvous_from_the_environment() -> None:
    from common.config import env_overrides, load_config

    shape = REPO / "deploy" / "compose" / "8gpu-3+5.yml"
    hosts = {"DFPIPE_NUM_HOSTS": "2", "DFPIPE_HOST_RANK": "1", "DFPIPE_RDZV_ENDPOINT": "10.0.0.1:29400"}
    for env, multihost in (({}, False), (hosts, True)):
        files = [REPO / "docker-compose.yml", shape]
        if multihost:
            files.append(REPO / "deploy" / "compose" / "multihost.yml")
        tool = _tool("docker-compose")
        res = subprocess.run([tool, *[a for f in files for a in ("-f", str(f))], "config"], capture_output=True,
                             text=True, cwd=REPO, timeout=scaled(60),
                             env={**{k: v for k, v in os.environ.items() if not k.startswith("DFPIPE_")}, **env})
        assert res.returncode == 0, res.stderr
        services = yaml.safe_load(res.stdout)["services"]
        target, trainer = services["target-server"], services["trainer"]
        # both services of a host read its shard from the environment (one config file for every host)
        for svc in (target, trainer):
            cluster = load_config(None, env_overrides({k: str(v) for k, v in svc["environment"].items()})).cluster
            assert (cluster.num_hosts, cluster.host_rank) == ((2, 1) if multihost else (1, 0))
        t_env = {k: str(v) for k, v in trainer["environment"].items()}
        args = _torchrun_args(trainer["entrypoint"][2:] + ["trainer"], t_env)
        assert args.rdzv_backend == "c10d" and args.nnodes == ("2" if multihost else "1")
        assert args.rdzv_endpoint == ("10.0.0.1:29400" if multihost else "127.0.0.1:29400")
        assert t_env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1", "a restarted world needs a fresh store"
        # gradients cross hosts: the trainer on the host's network; the target never needs it
        assert trainer.get("network_mode") == ("host" if multihost else None)
        assert "network_mode" not in target


def test_systemd_units_take_the_host_rank_and_rendezvous_from_cluster_env() -> None:
    from common.config import env_overrides, load_config

    def unit_env(text: str) -> dict[str, str]:
        return dict(m.split("=", 1) for m in re.findall(r"^Environment=(\S+)$", text, re.M))

    cluster_env = dict(ln.split("=", 1) for ln in (UNITS / "cluster.env").read_text().splitlines()
                       if ln and not ln.startswith("#"))
    trainer = (UNITS / "dfpipe-trainer.service").read_text()
    target = (UNITS / "dfpipe-target.service").read_text()
    for text in (trainer, target):   # the file is read after the units' defaults, so it wins
        assert "EnvironmentFile=-/etc/dfpipe/cluster.env" in text
        assert text.index("EnvironmentFile=-/etc/dfpipe/cluster.env") > text.index("Environment=DFPIPE_HOST_RANK=0")
    exec_start = re.search(r"^ExecStart=(.*?)(?<!\\)$", trainer, re.M | re.S).group(1).replace("\\\n", " ")
    argv = exec_start.split()
    assert argv[0].endswith("/dfpipe") and argv[1] == "torchrun"
    for env, expect in ((unit_env(trainer), ("1", "127.0.0.1:29400", (1, 0))),
                        ({**unit_env(trainer), **cluster_env}, ("2", "10.0.0.1:29400", (2, 0)))):
        expanded = [re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], a) for a in argv[2:]]
        args = _torchrun_args(expanded, {})
        assert (args.nnodes, args.rdzv_endpoint, args.rdzv_backend) == (*expect[:2], "c10d"), expanded
        cluster = load_config(None, env_overrides(env)).cluster
        assert (cluster.num_hosts, cluster.host_rank) == expect[2]
    assert unit_env(trainer)["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"


def test_no_deployment_restarts_either_service_on_a_final_status() -> None:
    from common.exits import EXIT_OK, FINAL_AS_SUCCESS, FINAL_EXITS

    for unit in ("dfpipe-target.service", "dfpipe-trainer.service"):
        text = (UNITS / unit).read_text()
        assert re.search(r"^Restart=on-failure$", text, re.M), unit
        prevented = re.findall(r"^RestartPreventExitStatus=(.*)$", text, re.M)
        assert len(prevented) == 1 and set(map(int, prevented[0].split())) == FINAL_EXITS, (unit, prevented)
        assert EXIT_OK not in FINAL_EXITS   # on-failure never restarts 0 anyway
    # compose cannot exclude statuses: each service restarts on failure only, and ends a final status
    # with 0 (FINAL_AS_SUCCESS), through `dfpipe` (the image's entrypoint, or `dfpipe torchrun`)
    assert re.search(r'^ENTRYPOINT \["dfpipe"\]$', (REPO / "deploy" / "Dockerfile").read_text(), re.M)
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    shapes = [yaml.safe_load(p.read_text()) for p in sorted((REPO / "deploy" / "compose").glob("*.yml"))]
    assert set(compose["services"]) == {"target-server", "trainer"}
    for name, svc in compose["services"].items():
        assert svc["restart"] == "on-failure", (name, svc["restart"])
        assert str(svc["environment"][FINAL_AS_SUCCESS]) == "1", name
        for shape in shapes:
            entry = (shape.get("services") or {}).get(name, {}).get("entrypoint", ["dfpipe"])
            assert entry[0] == "dfpipe", (name, entry)


@pytest.mark.parametrize("under_compose", [False, True])
def test_a_target_refused_with_a_final_status_ends_with_0_only_under_compose(tmp_path: Path,
                                                                             under_compose: bool) -> None:
    # a real refusal of the target's own, before anything is taken or loaded: no model folder there
    from common.exits import EXIT_CONFIG, EXIT_OK

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for key in ("DFPIPE_FINAL_EXIT_AS_SUCCESS", "DFPIPE_CONFIG"):
        env.pop(key, None)
    if under_compose:
        env["DFPIPE_FINAL_EXIT_AS_SUCCESS"] = compose_environment("target-server")["DFPIPE_FINAL_EXIT_AS_SUCCESS"]
    done = subprocess.run([sys.executable, "-m", "dfpipe", "target-server", "-c", str(REPO / "configs" / "demo.yaml"),
                           "--set", f"target.model={tmp_path / 'missing'}", "--set", "target.devices=[cpu]"],
                          capture_output=True, text=True, timeout=scaled(300), env=env, cwd=tmp_path)
    assert done.returncode == (EXIT_OK if under_compose else EXIT_CONFIG), done.stderr[-2000:]
    assert "target.model: no such folder" in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert ("ending with 0 so that the container is not restarted" in done.stderr) == under_compose


def test_the_readme_s_table_of_exit_statuses_is_common_exits() -> None:
    from common.exits import FINAL_EXITS, WHY

    rows = re.findall(r"^\| (\d+) \| (.+?) \| (yes|no) \|$", (REPO / "README.md").read_text(), re.M)
    assert {int(status) for status, _, _ in rows} == set(WHY), rows
    for status, why, restarted in rows:
        assert why == WHY[int(status)], (status, why)
        assert (restarted == "no") == (int(status) in FINAL_EXITS) or int(status) == 0, (status, restarted)


@pytest.mark.parametrize(("rank_status", "launcher_status", "under_compose"),
                         [(7, 7, False), (2, 2, False), (9, 1, False), (7, 0, True), (9, 1, True)])
def test_dfpipe_torchrun_passes_on_a_rank_s_final_status(tmp_path: Path, rank_status: int, launcher_status: int,
                                                         under_compose: bool) -> None:
    # torchrun alone exits 1 for any failed rank, so RestartPreventExitStatus would never match;
    # under compose (which restarts any non-zero status) a final status ends with 0, a crash with 1
    rank = tmp_path / "rank.py"
    rank.write_text(f"import sys\nsys.exit({rank_status})\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("DFPIPE_FINAL_EXIT_AS_SUCCESS", None)
    if under_compose:
        env["DFPIPE_FINAL_EXIT_AS_SUCCESS"] = compose_environment("trainer")["DFPIPE_FINAL_EXIT_AS_SUCCESS"]
    done = subprocess.run([sys.executable, "-m", "dfpipe", "torchrun", "--standalone", "--nproc-per-node", "1",
                           str(rank)], capture_output=True, text=True, timeout=scaled(120), env=env)
    assert done.returncode == launcher_status, done.stderr[-2000:]


def compose_environment(service: str) -> dict[str, str]:
    """A service's environment as docker-compose.yml sets it."""
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    return {k: str(v) for k, v in compose["services"][service]["environment"].items()}
