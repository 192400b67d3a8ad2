"""Placement of trainer ranks from config (train.devices), and the GPU split the scaling
benchmark recommends from measured rates."""
from __future__ import annotations

import pytest
import torch

from bench.gpu.gpu_bench import recommend_split
from drafter_trainer.step import Ranks
from tolerances import approx


def test_each_local_rank_takes_its_own_listed_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "1")
    for local_rank in ("0", "1"):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        assert Ranks("auto", ["cpu", "cpu"]).device == torch.device("cpu")
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ValueError, match="local rank 2 has no device: train.devices lists 2"):
        Ranks("auto", ["cpu", "cpu"])
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert Ranks("cpu", []).device == torch.device("cpu")   # no list: train.device decides


def test_recommended_split_balances_supply_and_demand() -> None:
    # one target GPU makes 10 (units), one trainer GPU consumes 30; two of either scale at 0.9
    target = {"1": {"tok_s": 10.0, "efficiency": 1.0}, "2": {"tok_s": 18.0, "efficiency": 0.9}}
    drafter = {"1": {"tok_s": 30.0, "efficiency": 1.0}, "2": {"tok_s": 54.0, "efficiency": 0.9}}
    split = recommend_split(target, drafter, 1.0, hosts=(4, 8))
    best4 = split["4"]["best"]
    assert (best4["target_gpus"], best4["trainer_gpus"]) == (3, 1)
    # rates times GPU counts times efficiencies: a few float64 products, in another order
    assert best4["tok_s"] == approx(min(3 * 10 * 0.9, 30.0), n=3)
    # 8 GPUs: 6 target GPUs (54) against 2 trainer GPUs (54) beats 7+1 (30) and 5+3 (45)
    best8 = split["8"]["best"]
    assert (best8["target_gpus"], best8["trainer_gpus"]) == (6, 2)
    assert best8["bound_by"] in ("target", "trainer") and best8["tok_s"] == approx(54.0, n=3)
    # a deeper target (depth_scale) needs more target GPUs per trainer GPU
    deep = recommend_split(target, drafter, 0.25, hosts=(8,))["8"]["best"]
    assert (deep["target_gpus"], deep["trainer_gpus"]) == (7, 1) and deep["bound_by"] == "target"
