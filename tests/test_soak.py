"""The chaos soak (`bench/soak.py`): its checks can fail, and a short run of it, taking every
action once, passes. The long runs are made by hand and recorded in docs/benchmarks.md."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.soak import ACTIONS, TARGET_KILL, audit_epochs, lifetime_trends  # noqa: E402
from machine_speed import scaled


def _info(epoch: int, size: int, **epochs: tuple[int, int]) -> dict:
    return {"epoch": epoch, "epoch_samples": size,
            "epochs": {k.lstrip("e"): {"samples_trained": t, "samples_duplicated": d} for k, (t, d) in epochs.items()}}


def test_the_epoch_audit_names_every_loss_and_every_duplicate() -> None:
    assert audit_epochs(_info(2, 10, e0=(10, 0), e1=(10, 0), e2=(4, 0))) == []
    assert audit_epochs(_info(2, 10, e0=(10, 0), e1=(9, 0), e2=(4, 1))) == [
        "epoch 1: 9 of 10 samples trained", "epoch 2: 1 samples trained twice"]
    assert audit_epochs(_info(1, 10, e1=(3, 0))) == ["epoch 0: nothing trained"]
    assert audit_epochs({"epoch": 0, "epoch_samples": 5})[0].startswith("the checkpoint carries no per-epoch")


def test_the_epoch_audit_counts_documents_apart_from_the_rows_they_come_from() -> None:
    # 10 rows the template renders as 14 documents: each trained once is no duplicate
    info = {"epoch": 1, "epoch_samples": 10, "epoch_documents": 14, "epochs": {
        "0": {"samples_trained": 10, "samples_duplicated": 0, "documents_trained": 14, "documents_duplicated": 0},
        "1": {"samples_trained": 3, "samples_duplicated": 1, "documents_trained": 5, "documents_duplicated": 1}}}
    assert audit_epochs(info) == ["epoch 1: 1 samples trained twice", "epoch 1: 1 documents trained twice"]
    info["epochs"]["0"]["documents_trained"] = 13
    assert audit_epochs(info)[0] == "epoch 0: 13 of 14 documents trained"


def test_lifetime_trends_see_a_steady_climb_and_not_the_settling_minute() -> None:
    rows = [{"target": "target-1", "t": 1000.0 + s, "rss_mb": (900.0 if s < 60 else 500.0 + s / 36.0),
             "threads": 9, "fds": 20 + (s % 3), "ring_files": 1} for s in range(0, 1200, 2)]
    rows += [{"target": "target-2", "t": 3000.0 + s, "rss_mb": 400.0, "threads": 9, "fds": 20, "ring_files": 1}
             for s in range(0, 30, 2)]   # too short a life to judge
    (life,) = lifetime_trends(rows, settle_s=60)
    assert life["target"] == "target-1"
    # the figures are reported rounded (0.01 MB/hour, 0.1 MB); the float64 fit's own error, about
    # sqrt(n)·eps of its sums, is ten orders of magnitude below that, so they are exact
    assert life["rss_mb_per_hour"] == 100.0   # 1/36 MB a second
    assert life["rss_mb_per_hour_late"] == 100.0   # a leak keeps its pace
    assert life["fds"] == [20, 22] and life["threads"] == [9, 9]
    assert life["rss_mb_first"] == round(500.0 + 60 / 36.0, 1)   # the first minute left out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_short_soak_takes_every_action_and_loses_nothing(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    res = subprocess.run([sys.executable, str(REPO / "bench" / "soak.py"), "--minutes", "0", "--samples", "60",
                          "--seed", "3", "--every-action-first", "--workdir", str(tmp_path), "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=scaled(560))
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["failures"] == []
    assert result["actions"] == {name: 1 for name in [*(n for _, n in ACTIONS), TARGET_KILL]}
    assert result["targets_started"] == 2 and result["final_target_exit"] == 0
    info = result["checkpoint"]
    assert info["epoch"] >= 1 and info["samples_duplicated"] == 0
    # after all that, the finished epochs hold every sample once
    assert all(info["epochs"][str(e)] == {"samples_trained": info["epoch_samples"], "samples_duplicated": 0,
                                          "documents_trained": info["epoch_documents"], "documents_duplicated": 0}
               for e in range(info["epoch"]))


def test_an_allocator_that_settles_is_told_apart_from_a_leak() -> None:
    # +10 MB over the first four minutes, then flat: the whole life has a slope, its second half none
    rows = [{"target": "target-1", "t": float(s), "rss_mb": 400.0 + min(s, 240) / 24.0, "threads": 4, "fds": 19,
             "ring_files": 2} for s in range(0, 1200, 2)]
    (life,) = lifetime_trends(rows, settle_s=0)
    assert life["rss_mb_per_hour"] > 10
    assert life["rss_mb_per_hour_late"] == 0.0     # reported to 0.01 MB/hour
