"""End to end with real processes: the checkpoint is evidence, not trust. A trainer killed at every
point inside a save, checkpoints damaged on disk (truncated, a flipped byte, one changed digit, a
deleted file) and a disk that fills up before the end of training: every run ends with every
sample trained exactly once, after a fallback to an older checkpoint or a clear stop, and never
with a traceback. One target server serves every test here (each has its own train.out_dir)."""
from __future__ import annotations

import errno
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from drafter_trainer.checkpoint import SAVE_FAULT_POINTS
from drafter_trainer.checkpoint import inspect_run as verify_run
from e2e import Service, assert_exactly_once, ctl, inspect_run, load, serving, wait_for, write_config
from machine_speed import scaled

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One target server (16 batches an epoch) for the module; yields its config."""
    tmp = tmp_path_factory.mktemp("served")
    config = write_config(tmp, train={"checkpoint_every": 1})
    cfg = load(config)
    target = Service("target-server", config, tmp)
    try:
        wait_for(lambda: serving(cfg["service"]["target_endpoint"]), 180, "target serving")
        yield config
        assert ctl(cfg["service"]["target_endpoint"], "status")["batches"]["quarantined"] == 0
    finally:
        target.stop()
    assert target.proc.returncode == 0, target.log()


def _trainer(config: Path, run: Path, *sets: str, env: dict[str, str] | None = None) -> Service:
    return Service("trainer", config, run.parent, env=env, overrides=[f"train.out_dir={run}", *sets])


def _no_traceback(tr: Service) -> str:
    log = tr.log(tail=100_000)
    assert "Traceback" not in log, log
    return log


def test_a_trainer_killed_at_every_point_inside_a_save_trains_every_sample_exactly_once(
        served: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    for point in SAVE_FAULT_POINTS:
        # a same-step re-save: max_steps ends the trainer after one step, whose periodic checkpoint
        # its final one saves again
        same_step = point in ("checkpoint.displaced", "checkpoint.removing_old")
        tr = _trainer(served, run, "train.keep_checkpoints=1", *(["train.max_steps=1"] if same_step else []),
                      env={"DFPIPE_FAULT": point})
        assert tr.wait(300) == -signal.SIGKILL, f"{point} was not reached\n{tr.log()}"
        # what the restart will find: a whole checkpoint, or none yet; nothing that fails verification
        found = verify_run(str(run))["checkpoints"]
        assert all(c["verified"] == "ok" for c in found), (point, found)
    final = _trainer(served, run)
    assert final.wait(300) == 0, final.log()
    assert "failed verification" not in _no_traceback(final)
    assert_exactly_once(served, run)


def _damage(path: Path, how: str) -> None:
    if how == "truncated state.pt":
        size = (path / "state.pt").stat().st_size
        with open(path / "state.pt", "r+b") as f:
            f.truncate(size // 2)
    elif how == "a flipped byte in a weight":
        data = bytearray((path / "state.pt").read_bytes())
        data[len(data) // 2] ^= 0x01    # the middle of state.pt: the weights and moments are most of it
        (path / "state.pt").write_bytes(bytes(data))
    elif how == "one changed digit in have":
        text = (path / "meta.json").read_text()
        at = re.search(r'"have": \[\s*\[\s*\d+,\s*\d*(\d)', text)
        digit = at.start(1)
        (path / "meta.json").write_text(text[:digit] + str((int(text[digit]) + 1) % 10) + text[digit + 1:])
    elif how == "truncated meta.json":
        text = (path / "meta.json").read_text()
        (path / "meta.json").write_text(text[: len(text) // 2])
    else:
        (path / how.removeprefix("deleted ")).unlink()


def _resumed_after(tr: Service, failed: dict[str, str]) -> str:
    """The trainer's log, checked: each damaged checkpoint named with the check it failed, moved aside."""
    log = _no_traceback(tr)
    for name, check in failed.items():
        assert re.search(rf"{name} failed verification \({re.escape(check)}: .*moved aside to \S+{name}\.bad-", log), \
            (name, check, log)
    return log


def test_damaged_checkpoints_fall_back_to_one_that_verifies_or_stop_and_every_sample_is_trained_once(
        served: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    first = _trainer(served, run, "train.keep_checkpoints=3", "train.max_steps=3")
    assert first.wait(300) == 0, first.log()
    rounds = [{"step-00000003": ("truncated state.pt", "state.pt-size"),
               "step-00000002": ("a flipped byte in a weight", "state.pt-checksum")},
              {"step-00000003": ("one changed digit in have", "meta.json-checksum"),
               "step-00000002": ("deleted meta.json", "meta.json-missing")},
              {"step-00000003": ("truncated meta.json", "meta.json-size"),
               "step-00000002": ("deleted samples.npz", "samples.npz-missing")}]
    for damages in rounds:
        for name, (how, _) in damages.items():
            _damage(ckpts / name, how)
        # falls back past both to step 1, trains steps 2 and 3 again (their batches delivered again)
        tr = _trainer(served, run, "train.keep_checkpoints=3", "train.max_steps=3")
        assert tr.wait(300) == 0, tr.log()
        log = _resumed_after(tr, {n: check for n, (_, check) in damages.items()})
        assert f"resuming from {ckpts / 'step-00000001'}: step 1" in log, log
        assert sorted(p.name for p in ckpts.iterdir() if ".bad-" not in p.name) == [
            "step-00000001", "step-00000002", "step-00000003"]

    # none verifies: one clear stop, exit 7, nothing deleted; a restart stops the same way
    shutil.copytree(ckpts / "step-00000003", tmp_path / "backup")
    for name, how in (("step-00000003", "a flipped byte in a weight"), ("step-00000002", "truncated state.pt"),
                      ("step-00000001", "deleted meta.json")):
        _damage(ckpts / name, how)
    before = len(list(ckpts.iterdir()))
    for _ in range(2):
        stopped = _trainer(served, run)
        assert stopped.wait(300) == 7, stopped.log()
        log = _no_traceback(stopped)
        assert log.count(f"trainer stopped: no checkpoint under {ckpts} verifies") == 1, log
        assert f"mv {ckpts} {ckpts}.failed" in log
        assert len(list(ckpts.iterdir())) == before, "moved aside, never deleted"
    # the operator puts a good copy back: the run ends exactly once
    shutil.copytree(tmp_path / "backup", ckpts / "step-00000003")
    final = _trainer(served, run)
    assert final.wait(300) == 0, final.log()
    assert f"resuming from {ckpts / 'step-00000003'}: step 3" in _no_traceback(final)
    assert_exactly_once(served, run)


def test_a_run_that_ends_on_a_full_disk_keeps_its_last_good_checkpoint_and_says_how_to_export_it(
        served: Path, tmp_path: Path, small_tmpfs) -> None:
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    small_tmpfs(str(ckpts), "64m")
    first = _trainer(served, run, "train.keep_checkpoints=1", "train.max_steps=3")
    assert first.wait(300) == 0, first.log()
    used = int(subprocess.run(["df", "--output=used", "-B1", str(ckpts)], capture_output=True, text=True,
                              check=True).stdout.split()[1])
    # the disk fills up: room for what is there and half a checkpoint more, so every save from now on fails
    subprocess.run(["mount", "-o", f"remount,size={used + used // 2}", str(ckpts)], check=True)
    full = _trainer(served, run, "train.keep_checkpoints=1", "train.max_checkpoint_failures=99")
    assert full.wait(300) == 4, full.log()
    log = _no_traceback(full)
    last = ckpts / "step-00000003"
    assert "No space left on device" in log and "at step 16, without a final checkpoint" in log, log
    hint = re.search(rf"`dfpipe export -c {re.escape(str(served))} --checkpoint {re.escape(str(last))} --out DIR`",
                     log)
    assert hint and "trains the 13 batches it lacks" in log, log
    # the last good state is whole, and the command the message gives exports it
    assert [p.name for p in ckpts.iterdir()] == ["step-00000003"]
    info = inspect_run(served, run)
    assert info["step"] == 3 and info["verified"] == "ok"
    exported = subprocess.run([sys.executable, "-m", "dfpipe", "export", "-c", str(served), "--checkpoint", str(last),
                               "--out", str(tmp_path / "export")], capture_output=True, text=True, timeout=scaled(120))
    assert exported.returncode == 0, exported.stderr
    assert (tmp_path / "export" / "config.json").is_file() and (tmp_path / "export" / "model.safetensors").is_file()
    # room again: the restart resumes from it and the run ends exactly once, exported
    subprocess.run(["mount", "-o", "remount,size=64m", str(ckpts)], check=True)
    again = _trainer(served, run, "train.keep_checkpoints=1")
    assert again.wait(300) == 0, again.log()
    assert (run / "export" / "config.json").is_file()
    assert_exactly_once(served, run)


def _du(path: Path) -> int:
    """Bytes `path` takes on its disk (whole pages, as a tmpfs counts them)."""
    return int(subprocess.run(["du", "-sB1", str(path)], capture_output=True, text=True, check=True).stdout.split()[0])


def test_a_run_whose_last_step_is_checkpointed_finishes_and_exports_on_a_disk_with_no_room_for_a_second_copy(
        served: Path, tmp_path: Path, small_tmpfs) -> None:
    # the last step (16) is a periodic checkpoint's; the end of training saves that same state again,
    # which needs room for a second copy. First, with room: what the run leaves and what each part takes.
    roomy, tight = tmp_path / "roomy", tmp_path / "tight"
    sets = ("train.checkpoint_every=16", "train.keep_checkpoints=1")
    small_tmpfs(str(roomy), "64m")
    first = _trainer(served, roomy, *sets)
    assert first.wait(300) == 0, first.log()
    used = _du(roomy)
    checkpoint, export = _du(roomy / "checkpoints" / "step-00000016"), _du(roomy / "export")
    assert checkpoint > 2 * export, (checkpoint, export)   # weights, AdamW's moments and the accounting vs bf16 weights
    # Then a disk with room for all of that (the checkpoint and the export beside it) and half of
    # what a second copy of the checkpoint would need more
    small_tmpfs(str(tight), str(used + (checkpoint - export) // 2))
    tr = _trainer(served, tight, *sets)
    assert tr.wait(300) == 0, tr.log()
    log = _no_traceback(tr)
    assert re.search(r"checkpoint at step 16 \(end of training\) could not be written again: .*No space left on "
                     rf"device.*Nothing is lost: {re.escape(str(tight / 'checkpoints' / 'step-00000016'))} holds this "
                     r"same step and its 16 batches, and stands", log), log
    assert f"exported drafter to {tight / 'export'}" in log and (tight / "export" / "model.safetensors").is_file()
    assert [p.name for p in (tight / "checkpoints").iterdir()] == ["step-00000016"], "the failed copy removed"
    assert_exactly_once(served, tight)


@pytest.mark.parametrize("after_a_run", [False, True])
def test_a_trainer_started_on_a_full_disk_stops_with_status_4_and_one_line(served: Path, tmp_path: Path,
                                                                           small_tmpfs, after_a_run: bool) -> None:
    # fresh: its lock file is the first thing it writes; after a run (the lock file's page is there
    # to reuse): TensorBoard's folder, whose writer thread used to die with a traceback (exit 1)
    run = tmp_path / "run"
    small_tmpfs(str(run), "256k")
    if after_a_run:
        (run / "trainer.lock").write_text("1\n")
    with open(run / "filler", "wb", buffering=0) as f:      # the disk fills up to its last page
        with pytest.raises(OSError) as full:
            while True:
                f.write(b"\0" * 4096)
    assert full.value.errno == errno.ENOSPC
    tr = _trainer(served, run, "train.tensorboard=true")
    assert tr.wait(300) == 4, tr.log()
    log = _no_traceback(tr)
    errors = [line for line in log.splitlines() if " ERROR " in line]
    path = run / "tensorboard" if after_a_run else run
    assert len(errors) == 1 and f"trainer stopped: cannot write {path}: No space left on device [errno 28]. Free space " \
        f"there (`df -h {path}`), or set train.out_dir to a disk with room, and start it again" in errors[0], log


def test_resuming_with_another_drafter_depth_exits_2_in_one_line_and_keeps_the_checkpoint(
        served: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    first = _trainer(served, run, "train.max_steps=2")
    assert first.wait(300) == 0, first.log()
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    deeper = _trainer(served, run, "drafter.num_layers=2")
    assert deeper.wait(300) == 2, deeper.log()
    log = _no_traceback(deeper)
    refused = [line for line in log.splitlines() if "drafter: " in line and "--fresh" in line]
    assert refused and "another train.out_dir" in refused[0], log
    # nothing moved aside or lost: the same run resumes under its own shape
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before
    again = _trainer(served, run)
    assert again.wait(300) == 0, again.log()
    assert_exactly_once(served, run)
