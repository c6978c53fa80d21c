"""The busy part of the engine's time between steps (core/step_clock.py)."""

import pytest

from vllm_ddtree.core.step_clock import BusyGap


def test_an_idle_gap_is_not_a_step_cost_and_barely_moves_the_mean():
    clock = BusyGap()
    for _ in range(200):
        assert clock.busy(1e-3) == pytest.approx(1e-3, rel=1e-6)
    before = clock.mean
    counted = clock.busy(120.0)  # the engine slept two minutes: no request to run
    assert counted <= 3 * before + 2e-3 + 1e-12
    assert counted < 6e-3
    assert clock.mean < 1.5 * before
    # back under load, the next gaps count in full again
    for _ in range(20):
        clock.busy(1e-3)
    assert clock.busy(1e-3) == pytest.approx(1e-3, rel=1e-6)


def test_persistently_longer_gaps_are_learnt_not_clipped_for_ever():
    # plain steps with 0.5 ms between them, then an arm whose steps leave
    # 20 ms of scheduling between them: after a few tens of steps its gaps
    # count in full (a clock that learns only from gaps under its cap would
    # count 3.5 ms of them for ever, and the arm would look cheaper than it is)
    clock = BusyGap()
    for _ in range(100):
        clock.busy(5e-4)
    counted = [clock.busy(20e-3) for _ in range(40)]
    assert counted[0] < 5e-3
    assert counted[-1] == pytest.approx(20e-3, rel=1e-6)
    assert sum(counted) > 0.8 * 40 * 20e-3 - 0.2


@pytest.mark.parametrize("kwargs", [{"slack": 0.5}, {"floor_s": 0.0}, {"weight": 0.0}, {"weight": 1.5}])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match="BusyGap"):
        BusyGap(**kwargs)


def test_a_negative_gap_is_refused():
    with pytest.raises(ValueError, match="negative"):
        BusyGap().busy(-1.0)
