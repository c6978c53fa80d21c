"""benchmarks/tuner_steps.py: the summary of what the rate tuner saw."""

from benchmarks.tuner_steps import runs_of, summary


def _step(arm, seconds, tokens=1.0, counted=True):
    return {"arm": arm, "reqs": 1, "tokens": tokens, "seconds": seconds, "gap": 1e-4,
            "counted": counted, "verified": 1, "drafted": arm != "plain"}


def test_runs_and_tables():
    steps = ([_step("plain", 2e-3)] * 20 + [_step("fixed8", 10e-3, tokens=5.0)] * 4
             + [_step("plain", 8e-3), _step("plain", 4e-3), _step("plain", 3e-3)]
             + [_step("plain", 2e-3)] * 20)
    runs = runs_of(steps)
    assert [(a, len(r)) for a, r in runs] == [("plain", 20), ("fixed8", 4), ("plain", 23)]
    text = summary(steps)
    # plain: the first step of each run is left out (it verifies the previous arm's drafts)
    assert "| plain | 41 | 2.00 | 0.10 | 1.00 | 500 |" in text
    assert "| fixed8 | 3 | 10.00 | 0.10 | 5.00 | 500 |" in text
    # the plain run after the tree arm, step by step (its first step not shown)
    assert "| 1 | 1 | 4.00 |" in text and "| 2 | 1 | 3.00 |" in text
    assert "| 3 | 1 | 2.00 |" in text


def test_per_batch_against_plain_on_the_same_text():
    def batch(b, steps):
        return [dict(s, batch=b) for s in steps]
    # batch 0: 11 plain steps at 500/s, then 3 tree steps at 1000/s; batch 1:
    # plain only, at 250/s (the first step of each run of an arm is left out
    # of that arm's rate, not out of what the default delivered)
    steps = (batch(0, [_step("plain", 2e-3)] * 11 + [_step("fixed8", 5e-3, tokens=5.0)] * 3)
             + batch(1, [_step("plain", 4e-3)] * 11))
    text = summary(steps)
    assert "| 0 | 14 | 703 | 500 | fixed8 1000 (2) |" in text
    assert "| 1 | 11 | 250 | 250 |  |" in text
    # plain alone: batch 0's 26 tokens at 500/s (0.052 s) + batch 1's 11 at
    # 250/s (0.044 s) = 0.096 s, against 0.037 + 0.044 s taken
    assert "on the same text" in text and ": 1.185x" in text
    assert "Per batch" not in summary([{k: v for k, v in s.items() if k != "batch"}
                                       for s in steps])


def test_phases_of_plain_steps_after_a_switch():
    """With the forward and the scheduler timed, the table shows them per step
    of the plain run: a slowdown of the whole process shows in both."""
    steps = ([dict(_step("fixed8", 10e-3, tokens=5.0), forward_us=1500.0, schedule_us=80.0)] * 3
             + [dict(_step("plain", 3e-3), forward_us=1200.0, schedule_us=75.0)] * 2
             + [dict(_step("plain", 2e-3), forward_us=800.0, schedule_us=45.0)])
    text = summary(steps)
    assert "| step of the plain run | steps | ms | target forward, us | schedule, us |" in text
    assert "| 1 | 1 | 3.00 | 1200 | 75 |" in text and "| 2 | 1 | 2.00 | 800 | 45 |" in text


def test_forced_alternation_cycles_plain_and_one_arm():
    import pytest

    from benchmarks.tuner_steps import _force_alternation
    from vllm_ddtree.core.tuner import RateTuner

    class Tuner(RateTuner):
        pass

    _force_alternation(Tuner, "fixed8", 3)
    tuner = Tuner(budget=16)
    names = [tuner.arm(1).name for _ in range(12)]
    assert names == ["plain"] * 2 + ["fixed8"] * 3 + ["plain"] * 3 + ["fixed8"] * 3 + ["plain"]
    _force_alternation(Tuner, "fixed5", 3)
    with pytest.raises(SystemExit, match="no arm 'fixed5'"):
        [tuner.arm(1) for _ in range(6)]
