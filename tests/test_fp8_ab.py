"""bench/fp8_ab.py's statistics on synthetic numbers: the paired t-interval, the plateau detection and
the pass/fail decision of the converged FP8 A/B (issue 46). No training: the bench's own run is what
measures FP8; these check that its verdict follows from its numbers."""
from __future__ import annotations

import math

import pytest

from bench.fp8_ab import (LOSS_REL_BOUND, TAU_BOUND, Interval, decide, paired_t_interval, plateau_change, plateaued,
                          seed_noise, t975)


def test_t_quantiles_are_students_not_the_normals() -> None:
    # two-sided 95% quantiles from any t table: few seeds widen the interval far beyond +-1.96 sd
    assert t975(1) == pytest.approx(12.706, abs=1e-3)
    assert t975(3) == pytest.approx(3.182, abs=1e-3)
    assert t975(30) == pytest.approx(2.042, abs=1e-3)
    assert t975(40) == pytest.approx(2.021, abs=2e-3)      # beyond the table: the expansion
    assert t975(120) == pytest.approx(1.980, abs=2e-3)
    with pytest.raises(ValueError):
        t975(0)


def test_paired_t_interval_is_mean_plus_minus_t_sd_over_root_n() -> None:
    # differences 1, 2, 3, 4: mean 2.5, sample sd sqrt(5/3), n 4, t(3) 3.182
    interval = paired_t_interval([1.0, 2.0, 3.0, 4.0])
    half = 3.182 * math.sqrt(5 / 3) / 2
    assert interval.n == 4
    assert interval.mean == pytest.approx(2.5)
    assert interval.low == pytest.approx(2.5 - half, abs=1e-3)
    assert interval.high == pytest.approx(2.5 + half, abs=1e-3)
    # identical differences: no spread, the interval is the point
    same = paired_t_interval([0.003, 0.003, 0.003, 0.003])
    assert same.low == pytest.approx(0.003) and same.high == pytest.approx(0.003)


def test_plateau_is_judged_over_the_whole_last_fifth_of_the_steps() -> None:
    flat = [(0, 6.0), (200, 1.0), (400, 0.5), (600, 0.4), (800, 0.4003), (900, 0.4002), (1000, 0.4001)]
    assert plateau_change(flat) == pytest.approx(0.0002 / 0.4001)
    assert plateaued(flat)
    # 0.5% down over the last fifth: still learning
    falling = flat[:4] + [(800, 0.402), (900, 0.401), (1000, 0.4)]
    assert not plateaued(falling)
    # the window starts at the last eval at or before 80% of the steps: a drop before step 800
    # (the eval at 800 ends it) is outside; with evals at 750 and 850 the drop at 750 -> 850 is inside
    assert plateaued([(0, 6.0), (750, 0.5), (800, 0.4), (1000, 0.4004)])
    assert not plateaued([(0, 6.0), (750, 0.5), (850, 0.4), (1000, 0.4004)])
    # a held-out loss going up (overfitting) is movement too
    assert not plateaued(flat[:4] + [(800, 0.4), (1000, 0.41)])
    # too early to tell: no eval at or before the window's start, or one eval only
    assert plateau_change([(1000, 0.4)]) is None
    assert plateau_change([(900, 0.4), (1000, 0.4)]) is None
    assert not plateaued([(900, 0.4), (1000, 0.4)])


def test_decision_passes_only_inside_both_bounds_and_converged() -> None:
    loss_ok = Interval(0.001, -0.004, 0.006, 4)
    tau_ok = Interval(-0.01, -0.05, 0.03, 4)
    verdict = decide(loss_ok, tau_ok, all_plateaued=True)
    assert verdict.passed, verdict.reason
    assert "0.400%" in verdict.reason and "0.050" in verdict.reason       # the margins to spare

    loss_wide = Interval(0.004, -0.003, 0.012, 4)          # misses +1% by 0.2%
    verdict = decide(loss_wide, tau_ok, all_plateaued=True)
    assert not verdict.passed and "by 0.200%" in verdict.reason, verdict.reason
    tau_low = Interval(-0.05, -0.15, 0.05, 4)              # misses -0.1 by 0.05
    verdict = decide(loss_ok, tau_low, all_plateaued=True)
    assert not verdict.passed and "by 0.050" in verdict.reason, verdict.reason
    # inside both bounds but not converged: not decided, so not a pass
    verdict = decide(loss_ok, tau_ok, all_plateaued=False)
    assert not verdict.passed and "plateau" in verdict.reason
    # the bounds are the issue's: +-1% of the loss, +-0.1 of tau; an interval on the bound passes
    assert (LOSS_REL_BOUND, TAU_BOUND) == (0.01, 0.1)
    assert decide(Interval(0.0, -0.01, 0.01, 4), Interval(0.0, -0.1, 0.1, 4), all_plateaued=True).passed


def test_seed_noise_compares_every_two_seeds_bf16_runs() -> None:
    pairs = [{"arms": {"bf16": {"heldout_loss": loss, "tau": tau}}} for loss, tau in ((1.0, 5.0), (1.1, 5.2), (0.9, 4.9))]
    noise = seed_noise(pairs)
    assert noise["pairs_of_seeds"] == 3
    # 1.1/1.0 - 1, 0.9/1.0 - 1, 0.9/1.1 - 1
    assert noise["loss_rel_abs_max"] == pytest.approx(abs(0.9 / 1.1 - 1))
    assert noise["loss_rel_abs_mean"] == pytest.approx((0.1 + 0.1 + abs(0.9 / 1.1 - 1)) / 3)
    assert noise["tau_abs_max"] == pytest.approx(0.3)
    assert noise["tau_sd"] == pytest.approx(0.15275, abs=1e-4)
