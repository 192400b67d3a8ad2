"""Checkpoints: the exactly-once accounting each one keeps (per epoch, from the sample ids
trained), and what a full disk does to a save and to the metrics log."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from common.seqset import SeqSet
from drafter_trainer.checkpoint import (MANIFEST, PIECE_BYTES, SAVE_FAULT_POINTS, CheckpointInvalid,
                                        NoCheckpointVerifies, OutDirInUse, TrainerState, bytes_digest,
                                        epoch_stats, file_digest, inspect_run, list_checkpoints, list_moved_aside,
                                        lock_out_dir, resume_checkpoint, sample_stats, save_checkpoint,
                                        sweep_partial, trained_pairs, verify_checkpoint)
from drafter_trainer.checkpoint import _save_state
from drafter_trainer.metrics_sink import MetricsSink


def test_every_epoch_is_accounted_for_with_its_own_duplicates() -> None:
    # (sample id, document id) per document trained; sample 1 is two documents (documents 1 and 2)
    trained = {0: np.array([[0, 0], [1, 1], [1, 2], [2, 3]]),
               1: np.array([[3, 4], [1, 1], [1, 1], [0, 0], [0, 0], [2, 3], [1, 2]]),
               2: np.array([[5, 7]])}
    assert epoch_stats(trained) == {
        "0": {"samples_trained": 3, "samples_duplicated": 0, "documents_trained": 4, "documents_duplicated": 0},
        "1": {"samples_trained": 4, "samples_duplicated": 2, "documents_trained": 5, "documents_duplicated": 2},
        "2": {"samples_trained": 1, "samples_duplicated": 0, "documents_trained": 1, "documents_duplicated": 0},
    }
    # the current epoch's figures in the meta are the same numbers, beside the epoch's sizes
    assert sample_stats(trained, 1, 4, 6) == {"samples_trained": 4, "samples_duplicated": 2, "epoch_samples": 4,
                                              "documents_trained": 5, "documents_duplicated": 2, "epoch_documents": 6}


def test_a_row_made_into_several_documents_trained_once_is_no_duplicate() -> None:
    """A stock Qwen3 template re-renders a row with later turns into several documents: 64 rows as
    104 documents, each trained once, are 64 samples and 104 documents, none duplicated."""
    rows = np.repeat(np.arange(64), [2] * 40 + [1] * 24)      # 40 rows of two documents, 24 of one
    trained = {0: np.stack([rows, np.arange(len(rows))], axis=1)}
    assert len(rows) == 104
    assert sample_stats(trained, 0, 64, 104) == {"samples_trained": 64, "samples_duplicated": 0, "epoch_samples": 64,
                                                 "documents_trained": 104, "documents_duplicated": 0,
                                                 "epoch_documents": 104}


def test_a_checkpoint_from_before_documents_were_counted_still_counts_its_samples() -> None:
    # sample ids alone: documents unknown, so each is counted and none is taken for a duplicate
    old = {0: np.array([0, 1, 1, 2])}
    assert trained_pairs(old[0]).tolist() == [[0, -1], [1, -1], [1, -1], [2, -1]]
    assert epoch_stats(old) == {"0": {"samples_trained": 3, "samples_duplicated": 0, "documents_trained": 4,
                                      "documents_duplicated": 0}}
    resumed = {0: np.concatenate([trained_pairs(old[0]), [[1, 5], [1, 5]]])}   # then one document trained twice
    assert epoch_stats(resumed)["0"] == {"samples_trained": 3, "samples_duplicated": 1, "documents_trained": 5,
                                         "documents_duplicated": 1}


def test_a_run_that_trained_nothing_has_no_epochs() -> None:
    assert epoch_stats({}) == {}


def _files(state: dict, meta: dict) -> dict:
    """save_checkpoint's files: a torch state (written as the trainer writes it) and a JSON meta."""
    return {"state.pt": lambda f: _save_state(state, f), "meta.json": lambda f: f.write(json.dumps(meta).encode())}


def test_a_save_that_fails_leaves_no_folder_and_the_next_one_lands(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFPIPE_FAULT", "checkpoint.write:1")
    state, meta = {"w": torch.ones(3)}, {"step": 3}
    with pytest.raises(OSError) as failed:
        save_checkpoint(str(tmp_path), 3, _files(state, meta), {"step": 3}, keep=2)
    assert failed.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path / "checkpoints") == []          # no .tmp- folder filling the disk further
    path = save_checkpoint(str(tmp_path), 3, _files(state, meta), {"step": 3}, keep=2)
    assert list_checkpoints(str(tmp_path)) == [path]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_metrics_lines_that_cannot_be_written_are_counted_not_fatal(tmp_path: Path) -> None:
    sink = MetricsSink(str(tmp_path))
    sink.write({"step": 0}, 0, {"train/loss": 1.0})
    sink._jsonl.close()
    sink._jsonl = open("/dev/full", "ab", buffering=0)   # every write: ENOSPC, as on a full disk
    for step in range(1, 4):
        sink.write({"step": step}, step, {"train/loss": 1.0})
    assert sink.lines_lost == 3
    sink.close()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 0}\n'


def test_a_really_full_disk_fails_the_save_as_an_os_error_and_leaves_nothing(tmp_path: Path, small_tmpfs) -> None:
    # torch.save on a full tmpfs raises RuntimeError("unexpected pos"), not OSError: the trainer's
    # full-disk handling (a failed save costs the save, not the run) must still be what runs
    root = tmp_path / "checkpoints"
    small_tmpfs(str(root), "64k")
    filler = root / "filler"
    filler.write_bytes(b"\0" * 48 * 1024)
    state, meta = {"w": torch.randn(16 * 1024)}, {"step": 3}           # 64 kB of weights: no room
    with pytest.raises(OSError) as failed:
        save_checkpoint(str(tmp_path), 3, _files(state, meta), meta, keep=2)
    assert failed.value.errno == errno.ENOSPC and "unexpected pos" in str(failed.value.__cause__)
    assert os.listdir(root) == ["filler"], "the half-written checkpoint is removed"
    filler.unlink()                                                    # room again: the next save lands
    state["w"] = torch.randn(4 * 1024)
    path = save_checkpoint(str(tmp_path), 3, _files(state, meta), meta, keep=2)
    assert list_checkpoints(str(tmp_path)) == [path]
    assert torch.equal(torch.load(os.path.join(path, "state.pt"))["w"], state["w"])


def test_a_runtime_error_that_is_no_failed_write_stays_a_runtime_error(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_: object) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        save_checkpoint(str(tmp_path), 1, _files({}, {"step": 1}), {"step": 1}, keep=1)
    assert os.listdir(tmp_path / "checkpoints") == []


def test_one_trainer_per_out_dir_and_a_dead_holder_never_blocks(tmp_path: Path) -> None:
    out = str(tmp_path / "run")
    first = lock_out_dir(out)
    try:
        with pytest.raises(OutDirInUse, match=rf"in use by another trainer \(pid {os.getpid()}"):
            lock_out_dir(out)                # a second open file: flock refuses it as another process
    finally:
        os.close(first)                      # what the kernel does when the holder dies, even by kill -9
    os.close(lock_out_dir(out))


def test_trainer_state_round_trips_through_save_and_load(tmp_path):
    """The one place a checkpoint's contents are written and read: what is saved is what is resumed."""
    from drafter_trainer.checkpoint import read_meta

    model = torch.nn.Linear(3, 2, bias=False)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    saved = TrainerState(step=7, epoch=1, have=SeqSet([0, 1, 2, 5]), skipped_steps=2,
                         trained_samples={0: np.arange(4), 1: np.array([9, 3])},
                         sample_seqs={0: np.array([0, 0, 1, 2]), 1: np.array([5, 5])}, plan={}, epoch_sizes=[4, 4],
                         config_hash="abc", model=model.state_dict(), optimizer=opt.state_dict(),
                         rng=torch.get_rng_state(), drafter_config={"hidden_size": 3}, split_fc=True,
                         target_precision="fp8-block")
    path, meta = saved.save(str(tmp_path), keep=2, reason="test", epoch_samples=6, num_hosts=2, epoch_documents=9)
    assert read_meta(path) == json.loads(json.dumps(meta))
    assert (meta["epoch_samples"], meta["epoch_documents"]) == (6, 9)
    assert [h["batches_trained"] for h in meta["cluster"]["hosts"]] == [3, 1]
    loaded = TrainerState.load(path)
    assert (loaded.step, loaded.epoch, loaded.skipped_steps, loaded.epoch_sizes) == (7, 1, 2, [4, 4])
    assert list(loaded.have) == [0, 1, 2, 5] and loaded.config_hash == "abc" and loaded.split_fc
    assert loaded.target_precision == meta["target_precision"] == "fp8-block"
    assert {e: v.tolist() for e, v in loaded.trained_samples.items()} == {0: [0, 1, 2, 3], 1: [9, 3]}
    assert {e: v.tolist() for e, v in loaded.sample_seqs.items()} == {0: [0, 0, 1, 2], 1: [5, 5]}
    fresh = torch.nn.Linear(3, 2, bias=False)
    loaded.restore_weights(fresh)
    assert torch.equal(fresh.weight, model.weight) and torch.equal(torch.get_rng_state(), saved.rng)
    loaded.model["extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match="unknown weights"):
        loaded.restore_weights(fresh)


# ---- verification --------------------------------------------------------------------------------
WEIGHT = torch.arange(4096, dtype=torch.float32)   # its bytes are easy to find in state.pt


def _state(step: int, batches: int = 0) -> TrainerState:
    """A small run's state after `batches` batches (seq s holds samples 2s and 2s+1), one epoch of 8."""
    batches = batches or step
    seqs = np.repeat(np.arange(batches), 2)
    return TrainerState(step=step, epoch=0, have=SeqSet(range(batches)), trained_samples={0: np.arange(2 * batches)},
                        sample_seqs={0: seqs}, epoch_sizes=[8], model={"w": WEIGHT + step},
                        optimizer={"state": {}, "param_groups": []}, rng=torch.get_rng_state())


def _save(out: Path, step: int, keep: int = 3) -> str:
    return _state(step).save(str(out), keep=keep, reason="test", epoch_samples=16)[0]


def _flip_weight_byte(path: str) -> None:
    data = bytearray(Path(path, "state.pt").read_bytes())
    at = data.find((WEIGHT + 4).numpy().tobytes()) + 1234     # inside the weight's own bytes
    data[at] ^= 0x10
    Path(path, "state.pt").write_bytes(bytes(data))


def _change_a_digit_of_have(path: str) -> None:
    meta = Path(path, "meta.json")
    text = meta.read_text()
    assert '"have": [\n  [\n   0,\n   4\n' in text
    meta.write_text(text.replace('"have": [\n  [\n   0,\n   4\n', '"have": [\n  [\n   0,\n   5\n'))


def _truncate(name: str):
    return lambda path: os.truncate(os.path.join(path, name), os.path.getsize(os.path.join(path, name)) // 2)


def _delete(name: str):
    return lambda path: os.unlink(os.path.join(path, name))


CORRUPTIONS = {
    "truncated state.pt": (_truncate("state.pt"), "state.pt-size"),
    "a flipped byte in a weight": (_flip_weight_byte, "state.pt-checksum"),
    "truncated meta.json": (_truncate("meta.json"), "meta.json-size"),
    "deleted meta.json": (_delete("meta.json"), "meta.json-missing"),
    "one changed digit in have": (_change_a_digit_of_have, "meta.json-checksum"),
    "deleted samples.npz": (_delete("samples.npz"), "samples.npz-missing"),
    "deleted state.pt": (_delete("state.pt"), "state.pt-missing"),
    "deleted manifest": (_delete(MANIFEST), "manifest.json-missing"),
}


@pytest.mark.parametrize("damage", sorted(CORRUPTIONS))
def test_a_damaged_checkpoint_is_moved_aside_and_the_one_before_it_resumed(
        tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    corrupt, check = CORRUPTIONS[damage]
    older, newest = _save(tmp_path, 2), _save(tmp_path, 4)
    corrupt(newest)
    with pytest.raises(CheckpointInvalid) as failed:
        TrainerState.load(newest)                      # never believed, never unpickled first
    assert failed.value.check == check
    path, state = resume_checkpoint(str(tmp_path))
    assert path == older and state.step == 2 and list(state.have) == [0, 1]
    assert list_checkpoints(str(tmp_path)) == [older]
    assert list_moved_aside(str(tmp_path)) == [f"{newest}.bad-{check}"], "kept, not deleted"
    assert f"{newest} failed verification ({check}:" in caplog.text


def test_a_have_that_disagrees_with_the_trained_samples_is_caught_with_every_digest_right(tmp_path: Path) -> None:
    # one batch too many in have, written as if by the trainer: meta.json and the manifest agree with
    # each other and every digest matches, but the samples beside it were trained in batches 0-3 only
    lying = _state(4)
    lying.have = SeqSet(range(5))
    path = lying.save(str(tmp_path), keep=3, reason="test", epoch_samples=16)[0]
    with pytest.raises(CheckpointInvalid, match=r"have holds 5 batches, the trained samples were of 4: "
                                                r"1 in have only \[\[4, 5\]\]") as failed:
        verify_checkpoint(path)
    assert failed.value.check == "samples-disagree"
    # and a sample counted under an epoch its batch is not in
    elsewhere = _state(2)
    elsewhere.epoch_sizes = [1, 7]
    with pytest.raises(CheckpointInvalid, match="epoch 0: batch seqs outside its range"):
        verify_checkpoint(elsewhere.save(str(tmp_path), keep=3, reason="test", epoch_samples=16)[0])


def test_when_no_checkpoint_verifies_the_trainer_stops_until_someone_puts_a_good_one_back(tmp_path: Path) -> None:
    older, newest = _save(tmp_path, 2), _save(tmp_path, 4)
    _truncate("state.pt")(older)
    _flip_weight_byte(newest)
    with pytest.raises(NoCheckpointVerifies) as stopped:
        resume_checkpoint(str(tmp_path))
    root = str(tmp_path / "checkpoints")
    assert f"no checkpoint under {root} verifies" in str(stopped.value)
    assert f"mv {root} {root}.failed" in str(stopped.value) and "Nothing was deleted" in str(stopped.value)
    assert [os.path.basename(p) for p in list_moved_aside(str(tmp_path))] == [
        "step-00000002.bad-state.pt-size", "step-00000004.bad-state.pt-checksum"]
    with pytest.raises(NoCheckpointVerifies):     # a restart stops again, and does not start from nothing
        resume_checkpoint(str(tmp_path))
    good = _save(tmp_path / "elsewhere", 2)       # a good copy put back
    os.rename(good, older)
    path, state = resume_checkpoint(str(tmp_path))
    assert path == older and state.step == 2


def _legacy(out: Path, step: int, batches: int) -> str:
    """A checkpoint as dfpipe wrote them before manifests: state.pt with the sample ids, meta.json."""
    s = _state(step, batches)
    path = out / "checkpoints" / f"step-{step:08d}"
    path.mkdir(parents=True)
    torch.save({"model": s.model, "optimizer": s.optimizer, "step": step, "drafter_config": {}, "split_fc": False,
                "rng": {"torch": s.rng}, "trained_samples": s.trained_samples}, path / "state.pt")
    meta = {"step": step, "epoch": 0, "have": s.have.to_wire(), "epoch_sizes": [8],
            **sample_stats(s.trained_samples, 0, 16), "epochs": epoch_stats(s.trained_samples),
            "cluster": {"total": {"batches_trained": batches, "batches_planned": 8}}}
    (path / "meta.json").write_text(json.dumps(meta))
    return str(path)


def test_a_checkpoint_from_before_manifests_is_resumed_after_a_consistency_check(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    old = _legacy(tmp_path, 3, 3)
    path, state = resume_checkpoint(str(tmp_path))
    assert path == old and state.step == 3 and "has no manifest" in caplog.text
    assert state.sample_seqs[0].tolist() == [-1] * 6 and list(state.unattributed) == [0, 1, 2]
    # the next checkpoint, of its samples and two more batches, has a manifest and verifies
    state.step, state.have = 5, SeqSet(range(5))
    state.trained_samples[0] = np.arange(10)
    state.sample_seqs[0] = np.concatenate([state.sample_seqs[0], [3, 3, 4, 4]])
    nxt = state.save(str(tmp_path), keep=3, reason="test", epoch_samples=16)[0]
    assert verify_checkpoint(nxt).unattributed == SeqSet(range(3))
    # what the check catches in one: a have whose batch count the accounting contradicts, a torn state.pt
    meta = json.loads(Path(old, "meta.json").read_text())
    meta["have"] = [[0, 4]]
    Path(old, "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointInvalid, match="have holds 4 batches, cluster.total says 3"):
        verify_checkpoint(old)
    torn = _legacy(tmp_path / "torn", 3, 3)
    _truncate("state.pt")(torn)
    with pytest.raises(CheckpointInvalid) as failed:
        verify_checkpoint(torn)
    assert failed.value.check == "state.pt-unreadable"


def test_the_manifest_records_each_file_s_size_and_digest_and_the_checkpoint_s_facts(tmp_path: Path) -> None:
    path = _save(tmp_path, 4)
    manifest = json.loads(Path(path, MANIFEST).read_text())
    assert sorted(manifest["files"]) == ["meta.json", "samples.npz", "state.pt"]
    for name, entry in manifest["files"].items():
        data = Path(path, name).read_bytes()
        assert entry["size"] == len(data) == os.path.getsize(os.path.join(path, name))
        # sha256 over each piece's sha256: a small file is one piece
        assert entry["sha256"] == hashlib.sha256(hashlib.sha256(data).digest()).hexdigest() == bytes_digest(data)
        assert file_digest(os.path.join(path, name), len(data)) == entry["sha256"]
    assert (manifest["step"], manifest["epoch"], manifest["have"], manifest["samples"]) == (4, 0, [[0, 4]], {"0": 8})
    assert os.path.getmtime(os.path.join(path, MANIFEST)) >= max(
        os.path.getmtime(os.path.join(path, n)) for n in manifest["files"]), "written last"


def test_a_file_s_digest_is_the_same_hashed_while_written_or_in_parallel_pieces(tmp_path: Path,
                                                                                 monkeypatch) -> None:
    import drafter_trainer.checkpoint as ckpt
    monkeypatch.setattr(ckpt, "PIECE_BYTES", 1000)        # many pieces from a small file
    monkeypatch.setattr(ckpt, "OVERLAP_BYTES", 512)       # and writes hashed beside the write
    data = os.urandom(10_500)
    cuts = [0, 100, 800, 5300, 5600, 10_500]     # small writes, and large ones spanning whole pieces
    path = save_checkpoint(str(tmp_path), 1, {"blob": lambda f: [f.write(data[a:b]) for a, b in zip(cuts, cuts[1:])]},
                           {}, keep=1)
    entry = json.loads(Path(path, MANIFEST).read_text())["files"]["blob"]
    pieces = b"".join(hashlib.sha256(data[i:i + 1000]).digest() for i in range(0, len(data), 1000))
    assert entry == {"size": 10_500, "sha256": hashlib.sha256(pieces).hexdigest()}
    assert ckpt.file_digest(os.path.join(path, "blob"), 10_500, threads=3) == entry["sha256"]
    assert PIECE_BYTES == 64 << 20


def test_checkpoint_files_and_folders_are_private_to_the_service_user(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    root.mkdir(mode=0o755)                     # as an older version left it
    os.chmod(root, 0o755)
    old = os.umask(0o022)
    try:
        path = _save(tmp_path, 2)
    finally:
        os.umask(old)
    assert root.stat().st_mode & 0o777 == 0o700
    assert os.stat(path).st_mode & 0o777 == 0o700
    assert {n: os.stat(os.path.join(path, n)).st_mode & 0o777 for n in os.listdir(path)} == {
        n: 0o600 for n in ("state.pt", "samples.npz", "meta.json", MANIFEST)}


def _killed_in_save(out: Path, step: int, point: str) -> None:
    """Save `step` in a child process killed (SIGKILL, by the fault hook) at `point`."""
    pid = os.fork()
    if pid == 0:
        try:
            os.environ["DFPIPE_FAULT"] = point
            _save(out, step, keep=1)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"{point} not reached"


@pytest.mark.parametrize("point", SAVE_FAULT_POINTS)
def test_a_kill_anywhere_in_a_save_leaves_a_checkpoint_that_verifies(tmp_path: Path, point: str) -> None:
    # the same step saved again (a stop right after a periodic save), or a new one past keep_checkpoints
    same_step = point in ("checkpoint.displaced", "checkpoint.removing_old")
    _save(tmp_path, 2, keep=1)
    _killed_in_save(tmp_path, 2 if same_step else 4, point)
    sweep_partial(str(tmp_path))
    assert not [n for n in os.listdir(tmp_path / "checkpoints") if n.startswith(".")], "swept"
    path, state = resume_checkpoint(str(tmp_path))
    assert state.step in (2, 4) and list_moved_aside(str(tmp_path)) == []
    found = inspect_run(str(tmp_path))["checkpoints"]
    assert [c["verified"] for c in found] == ["ok"] * len(list_checkpoints(str(tmp_path)))


def test_inspect_reports_each_checkpoint_s_verification(tmp_path: Path) -> None:
    from dfpipe.cli import main

    _save(tmp_path, 2)
    _flip_weight_byte(_save(tmp_path, 4))
    info = inspect_run(str(tmp_path))
    assert info["step"] == 2 and info["verified"] == "ok"
    assert [(c["name"], c["verified"].split(":")[0]) for c in info["checkpoints"]] == [
        ("step-00000004", "failed"), ("step-00000002", "ok")]
    assert "state.pt-checksum" in info["checkpoints"][0]["verified"]
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    assert main(["inspect", str(tmp_path / "checkpoints" / "step-00000004"), "--json"]) == 1


def test_inspect_shows_when_a_checkpoint_was_saved_as_a_date_and_an_age(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from dfpipe.cli import main, saved_at

    _save(tmp_path, 2)
    assert main(["inspect", str(tmp_path)]) == 0
    shown = re.search(r"^time: (.*)$", capsys.readouterr().out, re.M)
    assert shown and re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \S* ?\(\d+s ago\)", shown[1]), shown
    assert saved_at(1000.0, now=1000.0 + 3725).endswith("(1h02m ago)")
    assert main(["inspect", str(tmp_path), "--json"]) == 0          # JSON keeps the number, for machines
    assert isinstance(json.loads(capsys.readouterr().out)["time"], float)
