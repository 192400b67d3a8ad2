"""Checkpoints: the exactly-once accounting each one keeps (per epoch, from the sample ids
trained), and what a full disk does to a save and to the metrics log."""
from __future__ import annotations

import errno
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from drafter_trainer.checkpoint import epoch_stats, list_checkpoints, sample_stats, save_checkpoint
from drafter_trainer.train import Trainer


def test_every_epoch_is_accounted_for_with_its_own_duplicates() -> None:
    trained = {0: np.array([0, 1, 2, 3]), 1: np.array([3, 1, 1, 0, 0, 2]), 2: np.array([5])}
    assert epoch_stats(trained) == {
        "0": {"samples_trained": 4, "samples_duplicated": 0},
        "1": {"samples_trained": 4, "samples_duplicated": 2},
        "2": {"samples_trained": 1, "samples_duplicated": 0},
    }
    # the current epoch's figures in the meta are the same numbers
    assert sample_stats(trained, 1, 6) == {"samples_trained": 4, "samples_duplicated": 2, "epoch_samples": 6}


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
def test_metrics_lines_that_cannot_be_written_are_counted_not_fatal() -> None:
    with open("/dev/full", "ab", buffering=0) as full:   # every write: ENOSPC, as on a full disk
        trainer = SimpleNamespace(metrics_file=full, metrics_lines_lost=0)
        for step in range(3):
            Trainer._write_metrics(trainer, {"step": step})
        assert trainer.metrics_lines_lost == 3
