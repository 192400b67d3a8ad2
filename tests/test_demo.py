"""`dfpipe demo` owns its services and explains how it stopped: a killed demo takes both services
and the ring with it, Ctrl-C says how to continue and the next run continues from the checkpoint,
another server on the ring is named at the console. The demo runs here on a small config; the
full demo run is in test_e2e_trainer."""
from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

import yaml

from common.config import load_config
from common.ring import ProducerRing
from dfpipe.demo import _continue_or_clear, _demo_lock
from common.seqset import SeqSet
from drafter_trainer.checkpoint import FINISHED, TrainerState, latest_checkpoint, read_meta
from e2e import REPO, assert_exactly_once, ctl, load, wait_for, write_config
from machine_speed import scaled

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def start_demo(config: Path, out: Path, *args: str) -> subprocess.Popen:
    """`dfpipe demo -c config`, its console in `out`; in a session of its own, as a terminal runs it."""
    return subprocess.Popen([sys.executable, "-m", "dfpipe", "demo", "-c", str(config), *args],
                            stdout=open(out, "wb"), stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)


def ring_files(cfg: dict) -> list[str]:
    return glob.glob(os.path.join(cfg["ring"].get("shm_dir", "/dev/shm"), f"{cfg['ring']['name']}.*"))


def kill_leftovers(procs: list[psutil.Process]) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def test_a_demo_killed_with_sigkill_takes_both_services_and_the_ring_with_it(tmp_path: Path) -> None:
    config = write_config(tmp_path, samples=300)
    cfg = load(config)
    demo = start_demo(config, tmp_path / "demo.out")
    services: list[psutil.Process] = []
    try:
        def both_up() -> list[psutil.Process] | None:
            kids = psutil.Process(demo.pid).children()
            serving = any(not f.endswith(".lock") for f in ring_files(cfg))
            return kids if len(kids) == 2 and serving else None
        services = wait_for(both_up, 180, "the demo's two services, the target serving its ring")
        demo.send_signal(signal.SIGKILL)
        demo.wait(10)

        def all_gone() -> bool:
            alive = [p for p in services if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            return not alive and not ring_files(cfg)
        wait_for(all_gone, 30, "no service process and no ring file left")
    finally:
        demo.kill()
        kill_leftovers(services)


def test_ctrl_c_says_how_to_continue_and_the_next_demo_continues_from_that_checkpoint(tmp_path: Path) -> None:
    config = write_config(tmp_path, samples=300)
    cfg = load(config)
    run = Path(cfg["train"]["out_dir"])
    first = start_demo(config, tmp_path / "first.out")
    try:
        wait_for(lambda: latest_checkpoint(str(run)), 240, "the demo's first checkpoint")
        first.send_signal(signal.SIGINT)              # what Ctrl-C sends the demo (its services run apart)
        assert first.wait(60) == 130
    finally:
        first.kill()
    said = (tmp_path / "first.out").read_text()
    m = re.search(r"^dfpipe demo: interrupted; rerun `dfpipe demo -c (\S+)` to continue from the checkpoint at "
                  r"step (\d+)$", said, re.M)
    assert m and m[1] == str(config), said
    step = int(m[2])
    assert read_meta(latest_checkpoint(str(run)))["step"] == step, "the step named is the latest checkpoint's"
    assert "exited with" not in said, said
    assert not ring_files(cfg)

    again = subprocess.run([sys.executable, "-m", "dfpipe", "demo", "-c", str(config),
                            "--set", f"train.max_steps={step + 2}"], capture_output=True, text=True, timeout=scaled(300),
                           cwd=REPO)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"continuing from the checkpoint at step {step} " in again.stdout
    assert read_meta(latest_checkpoint(str(run)))["step"] == step + 2, "trained on from the checkpoint"
    # the summary quotes the numbers the plot ends with: the trainer's last metrics record
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "loss" in r][-1]
    assert (f"at step {last['step']} (the plot's last point): loss {last['loss']:.4f}, "
            f"{last['tokens_per_s']:,.0f} tok/s") in again.stdout, again.stdout


def test_a_demo_whose_ring_another_server_holds_says_so_at_the_console(tmp_path: Path) -> None:
    config = write_config(tmp_path, samples=40)
    cfg = load(config)
    role = ProducerRing.take_role("/dev/shm", cfg["ring"]["name"], 0)   # a server left over from an earlier run
    try:
        res = subprocess.run([sys.executable, "-m", "dfpipe", "demo", "-c", str(config)], capture_output=True,
                             text=True, timeout=scaled(300), cwd=REPO)
    finally:
        role.release(unlink=True)
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    line = next((x for x in res.stdout.splitlines() if x.startswith("dfpipe demo: the target server exited")), "")
    assert f"another target server serves ring '{cfg['ring']['name']}'" in line, res.stdout
    assert f"held by pid {os.getpid()}" in line and "target.log" in line


def _checkpoint(out_dir: Path, step: int, reason: str) -> None:
    """A checkpoint as the trainer writes it (manifest included), holding nothing but its step."""
    TrainerState(step=step, epoch=0, have=SeqSet(), trained_samples={}).save(str(out_dir), keep=5, reason=reason,
                                                                              epoch_samples=0)


@pytest.mark.parametrize("reason, fresh, continues", [
    ("SIGINT", False, True),          # interrupted: the next run continues from it
    ("SIGINT", True, False),          # --fresh
    (FINISHED, False, False),         # the last run finished its epochs: a new demo starts afresh
])
def test_the_demo_continues_an_unfinished_run_unless_asked_to_start_afresh(tmp_path: Path, reason: str, fresh: bool,
                                                                           continues: bool) -> None:
    _checkpoint(tmp_path / "run", 3, "periodic")
    _checkpoint(tmp_path / "run", 5, reason)
    step = _continue_or_clear(str(tmp_path / "run"), fresh)
    assert step == (5 if continues else None)
    assert (tmp_path / "run" / "checkpoints").exists() == continues   # cleared: the folder stays, emptied


def _default_names_config(tmp: Path, samples: int) -> Path:
    """A small config that names no ring and no endpoint: the run's own, derived from its out_dir."""
    config = write_config(tmp, samples=samples)
    cfg = load(config)
    del cfg["ring"]["name"]
    del cfg["service"]["target_endpoint"], cfg["service"]["trainer_endpoint"]
    config.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return config


def test_two_demos_of_one_user_side_by_side_each_train_exactly_once_and_leave_nothing(tmp_path: Path) -> None:
    """Two clones, or two configs, of one user at once: each demo gets its own ring and endpoints
    (from its out_dir), trains its epoch exactly once, and stops only its own services."""
    configs = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        configs.append(_default_names_config(tmp_path / name, samples=40))
    loaded = [load_config(str(c)) for c in configs]
    names = [(c.ring.name, c.service.target_endpoint, c.service.trainer_endpoint) for c in loaded]
    assert not set(names[0]) & set(names[1]), names
    demos = [start_demo(c, c.parent / "demo.out") for c in configs]
    try:
        rcs = [d.wait(scaled(540)) for d in demos]
    finally:
        for d in demos:
            d.kill()
    said = [(c.parent / "demo.out").read_text() for c in configs]
    assert rcs == [0, 0], said
    for config, cfg, out, demo in zip(configs, loaded, said, demos):
        info = assert_exactly_once(config)
        # each demo stopped its own target server, which logged who told it to
        target_log = (Path(cfg.resolve(cfg.train.out_dir)) / "logs" / "target.log").read_text()
        assert f"target server stopping (ctl shutdown from pid {demo.pid} (python" in target_log, target_log[-2000:]
        assert f"trained              samples {info['epoch_samples']}/{info['epoch_samples']} (0 duplicated)" in out
        assert "/dev/shm left over   none" in out and f"ring {cfg.ring.name}," in out, out
        assert not glob.glob(os.path.join(cfg.ring.shm_dir, f"{cfg.ring.name}.*"))
        # a console that is a file: a few plain lines, only values the services reported
        status = [line for line in out.splitlines() if line.startswith("  [")]
        assert 1 <= len(status) <= 40, out
        assert not re.search(r"\bNone\b|\bnan\b|/0 ", out), out
    left = [p.info["pid"] for p in psutil.process_iter(["pid", "cmdline"])
            if any(str(c) in (p.info["cmdline"] or []) for c in configs)]
    assert not left, f"processes of the two demos left running: {left}"


def test_a_second_demo_of_the_same_run_folder_is_refused_and_touches_nothing(tmp_path: Path) -> None:
    config = write_config(tmp_path, samples=40)
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    (out_dir / "metrics.jsonl").write_text("{}\n")       # the first demo's run, in progress
    lock = _demo_lock(str(out_dir))
    lock.acquire()                                        # as the first demo holds it
    try:
        res = subprocess.run([sys.executable, "-m", "dfpipe", "demo", "-c", str(config)], capture_output=True,
                             text=True, timeout=scaled(120), cwd=REPO)
    finally:
        lock.release(unlink=True)
    assert res.returncode == 1, res.stdout + res.stderr
    assert f"another demo trains into {out_dir} (demo role is held by pid {os.getpid()}" in res.stdout, res.stdout
    assert "--set train.out_dir=PATH" in res.stdout
    assert (out_dir / "metrics.jsonl").exists(), "the running demo's folder is left as it is"


def test_the_demo_redraws_one_line_on_a_terminal_and_writes_rare_plain_lines_to_a_file(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from dfpipe import demo

    clock = iter(float(t) for t in range(1000, 2000))        # a look a second
    monkeypatch.setattr(demo.time, "time", lambda: next(clock))
    monkeypatch.setenv("COLUMNS", "60")                         # a narrow terminal: the line is cut, not wrapped
    waiting = {"state": "waiting_for_target", "step": 0, "epoch": 0, "loss": float("nan"), "tokens_per_s": None}
    training = {**waiting, "state": "training", "loss": 4.5, "progress": 0.25, "eta_s": 90.0}
    live = demo.Progress(t0=1000.0, live=True)
    for status in (waiting, training):
        live.show(None, status)
    live.done()
    drawn = capsys.readouterr().out
    assert drawn.count("\r") == 2 and drawn.count("\x1b[K") == 2 and drawn.endswith("\n"), repr(drawn)
    assert "\r[    1s] trainer[training] step 0 epoch 0, 25.0% of the pla\x1b[K" in drawn, repr(drawn)
    assert all(len(line) <= 59 for line in re.findall(r"\r(.*?)\x1b\[K", drawn))   # one column short of the edge
    plain = demo.Progress(t0=1000.0, live=False)
    for status in [waiting] * 30 + [training] * 30:              # a minute of looks
        plain.show(None, status)
    lines = capsys.readouterr().out.splitlines()
    # the first look, every PLAIN_EVERY_S (20 s), and the change of state
    assert len(lines) == 4 and all(line.startswith("  [") for line in lines), lines
    assert "nan" not in "".join(lines) and "None" not in "".join(lines)


def _bind_mount(source: Path, target: Path) -> str | None:
    """Bind-mount source at target; None when done, else why this host cannot (not root, no mount
    namespace rights in this container): the real condition the bind-mount case skips on."""
    if os.geteuid() != 0:
        return "bind mounts need root"
    target.mkdir()
    res = subprocess.run(["mount", "--bind", str(source), str(target)], capture_output=True, text=True)
    return None if res.returncode == 0 else f"mount --bind refused here: {res.stderr.strip()}"


@pytest.mark.parametrize("alias", ["symlink", "bind-mount"])
def test_a_fresh_demo_through_another_name_of_a_running_run_folder_is_refused_and_clears_nothing(
        tmp_path: Path, alias: str) -> None:
    config = write_config(tmp_path, samples=40)
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    (out_dir / "metrics.jsonl").write_text("{}\n")       # the first demo's run, in progress
    other = tmp_path / "other-name"
    if alias == "symlink":
        other.symlink_to(out_dir)
    elif (why := _bind_mount(out_dir, other)) is not None:
        pytest.skip(why)
    lock = _demo_lock(str(out_dir))
    lock.acquire()                                        # as the first demo holds it
    try:
        res = subprocess.run([sys.executable, "-m", "dfpipe", "demo", "-c", str(config), "--fresh",
                              "--set", f"train.out_dir={other}"], capture_output=True, text=True,
                             timeout=scaled(120), cwd=REPO)
    finally:
        lock.release(unlink=True)
        if alias == "bind-mount":
            subprocess.run(["umount", str(other)], check=True)
    out = (res.stdout + res.stderr).strip()
    assert res.returncode != 0 and len(out.splitlines()) == 1, out
    assert "another demo trains into" in out or "refused" in out, out
    assert (out_dir / "metrics.jsonl").exists(), "the running demo's folder is left as it is"


def test_a_training_demo_is_not_cleared_through_a_symlink_or_a_bind_mount_of_its_folder_and_finishes_exactly(
        tmp_path: Path) -> None:
    """A live first demo, and `--fresh` demos that reach its run folder by other names meanwhile:
    each is refused in one line, and the first finishes its epoch exactly once."""
    config = write_config(tmp_path, samples=200)    # an epoch of many steps: paused after its first
    cfg = load_config(str(config))
    out_dir = Path(cfg.resolve(cfg.train.out_dir))
    first = start_demo(config, tmp_path / "first.out")
    aliases = {"symlink": tmp_path / "via-symlink", "bind-mount": tmp_path / "via-bind-mount"}
    aliases["symlink"].symlink_to(out_dir, target_is_directory=True)
    mounted = False
    try:
        wait_for(lambda: (out_dir / "metrics.jsonl").exists() and (out_dir / "metrics.jsonl").stat().st_size > 0,
                 scaled(300), "the first demo's first step")
        assert ctl(cfg.service.trainer_endpoint, "pause") is not None   # it trains on after the two tries
        why = _bind_mount(out_dir, aliases["bind-mount"])
        mounted = why is None
        for name, other in aliases.items():
            if name == "bind-mount" and not mounted:
                continue
            res = subprocess.run([sys.executable, "-m", "dfpipe", "demo", "-c", str(config), "--fresh",
                                  "--set", f"train.out_dir={other}"], capture_output=True, text=True,
                                 timeout=scaled(120), cwd=REPO)
            out = (res.stdout + res.stderr).strip()
            assert res.returncode != 0 and len(out.splitlines()) == 1, (name, out)
        assert ctl(cfg.service.trainer_endpoint, "resume") is not None
        assert first.wait(scaled(540)) == 0, (tmp_path / "first.out").read_text()
    finally:
        first.kill()
        if mounted:
            subprocess.run(["umount", str(aliases["bind-mount"])], check=False)
    said = (tmp_path / "first.out").read_text()
    info = assert_exactly_once(config)
    assert f"trained              samples {info['epoch_samples']}/{info['epoch_samples']} (0 duplicated)" in said
    if not mounted:
        pytest.skip(f"the symlink was checked; {why}")


def test_fresh_never_clears_a_folder_a_trainer_holds(tmp_path: Path) -> None:
    from drafter_trainer.checkpoint import OutDirInUse, lock_out_dir
    _checkpoint(tmp_path / "run", 3, "periodic")
    fd = lock_out_dir(str(tmp_path / "run"))             # a trainer started without a demo
    try:
        with pytest.raises(OutDirInUse):
            _continue_or_clear(str(tmp_path / "run"), fresh=True)
    finally:
        os.close(fd)
    assert (tmp_path / "run" / "checkpoints").exists()
