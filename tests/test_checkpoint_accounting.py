"""Exactly-once accounting kept in every checkpoint: per epoch, from the sample ids trained."""
from __future__ import annotations

import numpy as np

from drafter_trainer.checkpoint import epoch_stats, sample_stats


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
