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

from common.ring import ProducerRing
from dfpipe.demo import _continue_or_clear
from common.seqset import SeqSet
from drafter_trainer.checkpoint import FINISHED, TrainerState, latest_checkpoint, read_meta
from e2e import REPO, load, wait_for, write_config
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
    assert (tmp_path / "run").exists() == continues
