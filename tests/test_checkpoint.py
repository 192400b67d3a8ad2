"""Checkpoints: the exactly-once accounting each one keeps (per epoch, from the sample ids
trained), and what a full disk does to a save and to the metrics log."""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from drafter_trainer.checkpoint import (OutDirInUse, epoch_stats, list_checkpoints, lock_out_dir, sample_stats,
                                       save_checkpoint, trained_pairs)
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


def test_a_save_that_fails_leaves_no_folder_and_the_next_one_lands(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFPIPE_FAULT", "checkpoint.write:1")
    state, meta = {"w": torch.ones(3)}, {"step": 3}
    with pytest.raises(OSError) as failed:
        save_checkpoint(str(tmp_path), 3, state, meta, keep=2)
    assert failed.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path / "checkpoints") == []          # no .tmp- folder filling the disk further
    path = save_checkpoint(str(tmp_path), 3, state, meta, keep=2)
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
        save_checkpoint(str(tmp_path), 3, state, meta, keep=2)
    assert failed.value.errno == errno.ENOSPC and "unexpected pos" in str(failed.value.__cause__)
    assert os.listdir(root) == ["filler"], "the half-written checkpoint is removed"
    filler.unlink()                                                    # room again: the next save lands
    state["w"] = torch.randn(4 * 1024)
    path = save_checkpoint(str(tmp_path), 3, state, meta, keep=2)
    assert list_checkpoints(str(tmp_path)) == [path]
    assert torch.equal(torch.load(os.path.join(path, "state.pt"))["w"], state["w"])


def test_a_runtime_error_that_is_no_failed_write_stays_a_runtime_error(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_: object) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        save_checkpoint(str(tmp_path), 1, {}, {"step": 1}, keep=1)
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
    from common.seqset import SeqSet
    from drafter_trainer.checkpoint import TrainerState, read_meta

    model = torch.nn.Linear(3, 2, bias=False)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    saved = TrainerState(step=7, epoch=1, have=SeqSet([0, 1, 2, 5]), skipped_steps=2,
                         trained_samples={0: np.arange(4), 1: np.array([9, 3])}, plan={}, epoch_sizes=[4, 4],
                         config_hash="abc", model=model.state_dict(), optimizer=opt.state_dict(),
                         rng=torch.get_rng_state(), drafter_config={"hidden_size": 3}, split_fc=True)
    path, meta = saved.save(str(tmp_path), keep=2, reason="test", epoch_samples=6, num_hosts=2, epoch_documents=9)
    assert read_meta(path) == json.loads(json.dumps(meta))
    assert (meta["epoch_samples"], meta["epoch_documents"]) == (6, 9)
    assert [h["batches_trained"] for h in meta["cluster"]["hosts"]] == [3, 1]
    loaded = TrainerState.load(path)
    assert (loaded.step, loaded.epoch, loaded.skipped_steps, loaded.epoch_sizes) == (7, 1, 2, [4, 4])
    assert list(loaded.have) == [0, 1, 2, 5] and loaded.config_hash == "abc" and loaded.split_fc
    assert {e: v.tolist() for e, v in loaded.trained_samples.items()} == {0: [0, 1, 2, 3], 1: [9, 3]}
    fresh = torch.nn.Linear(3, 2, bias=False)
    loaded.restore_weights(fresh)
    assert torch.equal(fresh.weight, model.weight) and torch.equal(torch.get_rng_state(), saved.rng)
    loaded.model["extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match="unknown weights"):
        loaded.restore_weights(fresh)
