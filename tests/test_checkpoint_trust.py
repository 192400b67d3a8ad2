"""Checkpoints another user controls, and checkpoints that carry code or lie about their audit.

A real second user (uid 65534, tests/stranger.py) makes the trainer's out_dir first in a shared
sticky folder, or the folder a symbolic link out_dir leads into; an own out_dir is left writable
by others. The trainer's start-up (`lock_out_dir`, `resume_checkpoint`), `dfpipe inspect` and
`dfpipe export` refuse each (`common.trust.Untrusted`) naming the path, its owner and its mode,
and the pickle the stranger planted in a pre-manifest state.pt never runs: its reducer would
create a marker file. A state.pt with a reducer in a folder of our own fails verification
(`state.pt-unsafe`), manifest or not. A resealed checkpoint whose sample ids hold a duplicate
shows it."""
from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from common.seqset import SeqSet
from common.trust import Untrusted
from dfpipe.cli import main
from drafter_trainer.checkpoint import (CheckpointInvalid, NoCheckpointVerifies, TrainerState, bytes_digest, inspect,
                                        inspect_run, list_moved_aside, lock_out_dir, resume_checkpoint,
                                        verify_checkpoint)
from drafter_trainer.checkpoint import _manifest_bytes
from machine_speed import scaled
from stranger import UID, as_stranger, need_root

STRANGER = f"uid {UID} (nobody)"
THEM = re.escape(STRANGER)   # in a pattern


class _Reducer:
    """Unpickled by anything that runs a pickle's reducers, it creates `marker` (opens it for writing)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return open, (self.marker, "w")


def _planted_state(marker: str) -> bytes:
    """A pre-manifest state.pt as a stranger would plant it: weights, sample ids and a reducer."""
    buf = io.BytesIO()
    torch.save({"model": {}, "step": 3, "trained_samples": {0: np.arange(3)}, "payload": _Reducer(marker)}, buf)
    return buf.getvalue()


def _write_legacy(run: str, state: bytes) -> str:
    """A pre-manifest checkpoint (state.pt, meta.json) under run/checkpoints; its folder."""
    path = os.path.join(run, "checkpoints", "step-00000003")
    os.makedirs(path, 0o755)
    with open(os.path.join(path, "state.pt"), "wb") as f:
        f.write(state)
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump({"step": 3, "epoch": 0, "have": [[0, 1]]}, f)
    return path


def _plant_run(run: str, state: bytes) -> None:
    """As the stranger: out_dir `run` with a pre-manifest checkpoint in it (its folders 0755)."""
    os.umask(0o022)
    os.mkdir(run, 0o755)
    _write_legacy(run, state)


@pytest.fixture
def shared() -> Iterator[str]:
    """A shared sticky folder (like /tmp) that the stranger can reach: tmp_path is root's only."""
    need_root()
    folder = tempfile.mkdtemp(prefix="dfck", dir="/tmp")
    os.chmod(folder, 0o1777)
    try:
        yield folder
    finally:
        shutil.rmtree(folder)


def _refusals(run: str, match: str, its_checkpoint: bool = True) -> None:
    """The trainer's start-up, its resume, inspect and export each refuse `run`, with `match` in
    the message, and with `its_checkpoint` also its checkpoint named on its own (`dfpipe export
    --checkpoint`); nothing is written into it."""
    before = sorted(os.listdir(run)) if os.path.isdir(run) else None
    with pytest.raises(Untrusted, match=match):
        lock_out_dir(run)
    with pytest.raises(Untrusted, match=match):
        resume_checkpoint(run)
    with pytest.raises(Untrusted, match=match):
        inspect_run(run)
    checkpoint = os.path.join(run, "checkpoints", "step-00000003")
    if its_checkpoint:
        with pytest.raises(Untrusted, match=match):
            TrainerState.load(checkpoint)
        with pytest.raises(SystemExit, match="dfpipe export: refused: .*" + match):
            main(["export", "--checkpoint", checkpoint, "--out", os.path.join(os.path.dirname(run), "export")])
    with pytest.raises(SystemExit, match="dfpipe export: refused: .*" + match):
        main(["export", "--set", f"train.out_dir={run}", "--out", os.path.join(os.path.dirname(run), "export")])
    assert (sorted(os.listdir(run)) if os.path.isdir(run) else None) == before, "nothing written into out_dir"


def _inspect_cli(path: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dfpipe", "inspect", path], capture_output=True, text=True,
                          timeout=scaled(300))


def test_an_out_dir_another_user_made_first_is_refused_and_its_pickle_never_runs(shared: str,
                                                                                 tmp_path: Path) -> None:
    marker = str(tmp_path / "ran")
    run = os.path.join(shared, "run")
    as_stranger(_plant_run, run, _planted_state(marker))
    assert os.stat(run).st_uid == UID
    _refusals(run, rf"bad ownership or modes for directory {run} \(owner {THEM}, mode 0755\)")
    done = _inspect_cli(run)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"dfpipe inspect: refused: train.out_dir {run}: bad ownership or modes for directory {run} (owner "
        f"{STRANGER}, mode 0755): the folder {run} belongs to {STRANGER}"]
    assert not os.path.exists(marker), "the planted pickle ran"


def test_an_out_dir_that_is_a_link_into_another_user_s_folder_is_refused(shared: str, tmp_path: Path) -> None:
    marker = str(tmp_path / "ran")
    theirs = os.path.join(shared, "theirs")
    as_stranger(_plant_run, theirs, _planted_state(marker))
    # the stranger's link, in the shared folder, where only its owner may repoint it
    link = os.path.join(shared, "run")
    as_stranger(os.symlink, theirs, link)
    _refusals(link, rf"directory {link} \(owner {THEM}, mode 0777\): {link} is a symbolic link that belongs "
                    rf"to {THEM}")
    # our own link, into their folder
    ours = str(tmp_path / "run")
    os.symlink(theirs, ours)
    _refusals(ours, rf"directory {ours} \(owner {THEM}, mode 0755\): the folder {ours} belongs to {THEM}")
    # a folder of ours inside theirs: they can rename it away and put theirs in its place
    inside = os.path.join(theirs, "ours")
    os.mkdir(inside, 0o755)
    _write_legacy(inside, _planted_state(marker))
    _refusals(inside, rf"directory {theirs} \(owner {THEM}, mode 0755\)")
    done = _inspect_cli(os.path.join(link, "checkpoints", "step-00000003"))
    assert done.returncode != 0 and "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert "dfpipe inspect: refused: checkpoint" in done.stderr and "symbolic link" in done.stderr, done.stderr
    assert not os.path.exists(marker), "the planted pickle ran"


def test_an_own_out_dir_others_may_write_to_is_refused(tmp_path: Path) -> None:
    need_root()
    marker = str(tmp_path / "ran")
    run = str(tmp_path / "run")
    os.mkdir(run)
    _write_legacy(run, _planted_state(marker))
    for mode in (0o775, 0o777, 0o1777):   # sticky or not: others could still put names in it
        os.chmod(run, mode)
        # a checkpoint named on its own is above a sticky folder, like one in /tmp: others cannot rename it
        _refusals(run, rf"directory {run} \(owner uid 0 \(root\), mode {mode:04o}\): the folder {run} is writable "
                       "by other users", its_checkpoint=mode != 0o1777)
    os.chmod(run, 0o755)
    root = os.path.join(run, "checkpoints")
    os.chmod(root, 0o777)
    _refusals(run, rf"directory {root} \(owner uid 0 \(root\), mode 0777\)")
    os.chmod(root, 0o755)
    os.chown(root, UID, UID)   # what a stranger puts in place of a checkpoints/ it renamed away
    _refusals(run, rf"directory {root} \(owner {THEM}, mode 0755\)")
    os.chown(root, 0, 0)
    state = os.path.join(root, "step-00000003", "state.pt")
    os.chown(state, UID, UID)
    with pytest.raises(Untrusted, match=rf"file {state} \(owner {THEM}, mode 0644\)"):
        verify_checkpoint(os.path.dirname(state))
    os.chown(state, 0, 0)
    os.chmod(state, 0o666)
    with pytest.raises(Untrusted, match=rf"file {state} \(owner uid 0 \(root\), mode 0666\)"):
        inspect_run(run)
    assert not os.path.exists(marker), "the planted pickle ran"


def test_a_fresh_out_dir_is_made_without_write_access_for_others(tmp_path: Path) -> None:
    run = tmp_path / "a" / "b" / "run"
    old = os.umask(0)
    try:
        fd = lock_out_dir(str(run))
    finally:
        os.umask(old)
    os.close(fd)
    assert [oct(p.stat().st_mode & 0o777) for p in (tmp_path / "a", tmp_path / "a" / "b", run)] == ["0o755"] * 3


def test_a_state_pt_with_a_reducer_fails_verification_and_never_runs(tmp_path: Path) -> None:
    marker = str(tmp_path / "ran")
    run = tmp_path / "run"
    run.mkdir()
    legacy = _write_legacy(str(run), _planted_state(marker))
    # the reducer's callable as the running Python pickles it: io.open (3.10, 3.11) or _io.open (3.12)
    assert re.match(r"failed: state\.pt-unsafe: its pickle calls or builds _?io\.open", inspect(legacy)["verified"])
    with pytest.raises(NoCheckpointVerifies):
        resume_checkpoint(str(run))
    assert [os.path.basename(p) for p in list_moved_aside(str(run))] == ["step-00000003.bad-state.pt-unsafe"]
    # with a manifest resealed over it: its digest matches, and it is still never run
    sealed = _save(tmp_path / "sealed", [[0, 0], [1, 1]])
    Path(sealed, "state.pt").write_bytes(_planted_state(marker))
    _reseal(sealed)
    with pytest.raises(CheckpointInvalid) as failed:
        TrainerState.load(sealed)
    assert failed.value.check == "state.pt-unsafe"
    assert not os.path.exists(marker), "the planted pickle ran"
    # the planted pickle is live: a load that runs reducers (as checkpoints were read before) runs it
    live = str(tmp_path / "live")
    torch.load(io.BytesIO(_planted_state(live)), weights_only=False)
    assert os.path.exists(live)


def _save(out: Path, pairs: list[list[int]]) -> str:
    """A checkpoint of one batch per (sample id, document id) pair; its folder."""
    n = len(pairs)
    state = TrainerState(step=n, epoch=0, have=SeqSet(range(n)), trained_samples={0: np.array(pairs)},
                         sample_seqs={0: np.arange(n)}, model={"w": torch.zeros(2)})
    return state.save(str(out), keep=2, reason="test", epoch_samples=n, epoch_documents=n)[0]


def _reseal(path: str) -> None:
    """Write the manifest again over the files as they are now, as anyone who can write the folder can."""
    manifest = json.loads(Path(path, "manifest.json").read_text())
    files = {name: {"size": len(data), "sha256": bytes_digest(data)}
             for name in manifest["files"] for data in [Path(path, name).read_bytes()]}
    with np.load(Path(path, "samples.npz")) as z:
        samples = {k[4:]: len(z[k]) for k in z.files if k.startswith("ids_")}
    facts = {k: manifest[k] for k in ("step", "epoch", "have")} | {"samples": samples}
    Path(path, "manifest.json").write_bytes(_manifest_bytes(facts, files))


def test_a_resealed_checkpoint_whose_ids_hold_a_duplicate_shows_it(tmp_path: Path) -> None:
    path = _save(tmp_path, [[0, 0], [1, 1], [2, 2]])
    assert inspect(path)["samples_duplicated"] == 0
    # document 1 once more, in batch 2 (have unchanged), meta.json's counters left as they were
    with np.load(Path(path, "samples.npz")) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["ids_0"] = np.concatenate([arrays["ids_0"], [[1, 1]]])
    arrays["seqs_0"] = np.concatenate([arrays["seqs_0"], [2]])
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    Path(path, "samples.npz").write_bytes(buf.getvalue())
    _reseal(path)
    info = inspect(path)
    assert info["verified"] == "failed: meta.json-disagrees: samples_duplicated: meta.json 0, the sample ids give 1"
    assert "samples_duplicated" not in info, "a failed checkpoint's audit is not shown"
    # meta.json made to tell the truth too: it verifies, and the duplicate is shown, from the ids
    meta = json.loads(Path(path, "meta.json").read_text())
    meta.update(samples_duplicated=1, documents_duplicated=1, documents_trained=3, samples_trained=3)
    meta["epochs"]["0"].update(samples_duplicated=1, documents_duplicated=1)
    Path(path, "meta.json").write_text(json.dumps(meta))
    _reseal(path)
    info = inspect(path)
    assert info["verified"] == "ok"
    assert (info["samples_duplicated"], info["documents_duplicated"], info["samples_trained"]) == (1, 1, 3)
    assert info["epochs"]["0"]["documents_duplicated"] == 1


def test_a_run_folder_that_is_not_there_has_no_checkpoint(tmp_path: Path) -> None:
    assert inspect_run(str(tmp_path / "none"))["checkpoints"] == []
    assert resume_checkpoint(str(tmp_path / "none")) is None
    assert not (tmp_path / "none").exists(), "reading makes nothing"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_real_trainer_refuses_an_out_dir_another_user_made_at_start_and_writes_nothing(shared: str,
                                                                                         tmp_path: Path) -> None:
    from e2e import Service, write_config

    marker = str(tmp_path / "ran")
    run = os.path.join(shared, "run")
    as_stranger(_plant_run, run, _planted_state(marker))
    before = sorted(str(p) for p in Path(run).rglob("*"))
    trainer = Service("trainer", write_config(tmp_path, train={"out_dir": run}), tmp_path)
    try:
        rc = trainer.wait(300)
    finally:
        trainer.stop()
    # no target server runs: the refusal comes first, before the trainer looks for one
    assert rc != 0, trainer.log()
    assert f"bad ownership or modes for directory {run} (owner {STRANGER}, mode 0755)" in trainer.log()
    assert sorted(str(p) for p in Path(run).rglob("*")) == before, "the refused trainer wrote into out_dir"
    assert not os.path.exists(marker), "the planted pickle ran"
