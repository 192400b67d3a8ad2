"""The tests' wall-clock limits follow the machine's measured slowness (tests/machine_speed.py)."""
from __future__ import annotations

import pytest

import machine_speed
from machine_speed import scaled, slowness


def test_pyproject_limit_reaches_pytest_timeout_scaled(request: pytest.FixtureRequest,
                                                       pytestconfig: pytest.Config) -> None:
    given = pytestconfig.getoption("timeout", None)   # --timeout on the command line, else pyproject's
    limit = float(pytestconfig.getini("timeout") if given is None else given)
    assert request.node.get_closest_marker("timeout").args[0] == pytest.approx(limit * slowness())


@pytest.mark.timeout(40)
def test_a_tests_own_limit_reaches_pytest_timeout_scaled(request: pytest.FixtureRequest) -> None:
    assert request.node.get_closest_marker("timeout").args[0] == pytest.approx(40 * slowness())


def test_the_factor_comes_from_the_environment_once_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(machine_speed.ENV, "2.5")
    assert scaled(60) == 150
    monkeypatch.setenv(machine_speed.ENV, "0")
    with pytest.raises(ValueError, match="positive"):
        slowness()
    monkeypatch.delenv(machine_speed.ENV)
    assert slowness() >= 1.0   # measured again: a faster machine than the reference keeps the limits
