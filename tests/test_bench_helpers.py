"""The benchmarks' own arithmetic: what their tables report must be what
they measured (paired step ratios, the default's steps per arm)."""

from __future__ import annotations

import json

import pytest

from benchmarks.bench_default import _shares, markdown
from benchmarks.bench_step import paired_step_ratio, step_arms
from benchmarks.interleave import _TunerArms
from vllm_ddtree.core.stats import CounterWriter, stats_file


def _run(*steps):
    return {"steps": [{"step": s} for s in steps]}


def test_paired_step_ratio_is_the_median_of_within_round_ratios():
    plain = [_run(1.0, 1.0, 3.0), _run(2.0, 2.0), _run(1.0)]
    mode = [_run(1.2, 1.1, 1.1), _run(2.0, 2.4), _run(1.5)]
    # rounds: 1.1 / 1.0, 2.2 / 2.0, 1.5 / 1.0 -> 1.1, 1.1, 1.5
    assert paired_step_ratio(plain, mode) == pytest.approx(1.1)
    assert paired_step_ratio([_run()], [_run(1.0)]) is None  # no steps: no ratio


def test_shares_of_the_default_steps():
    assert _shares({"plain": 90.0, "fixed4": 6.0, "model": 4.0}) == "plain 90% fixed4 6% model 4%"
    assert _shares({"plain": 999.0, "fixed8": 1.0}) == "plain 100%"  # under 0.5 %: left out
    assert _shares({}) == "-"


def test_the_table_shows_how_far_the_rounds_spread():
    """Per cell: the default over the best other arm in each round (its
    range), and the best other arm's fastest round over its slowest."""
    cell = {"tok_s": {"plain": 100.0, "default": 95.0}, "best_other": "plain",
            "default_over_best": 0.95, "paired_ratio": 0.95,
            "default_arm_steps": {"plain": 10.0},
            "rounds": {"plain": [100.0, 80.0, 120.0], "default": [95.0, 88.0, 96.0]}}
    rows = {line.split(" | ")[0]: line for line in markdown(
        {"config": "x", "cells": {"1": cell}}).splitlines() if line.startswith("| ")}
    assert rows["| same, per round (range)"].endswith("| 0.80-1.10 |")
    assert rows["| best other, fastest / slowest round"].endswith("| 1.50x |")


def test_with_plain_sync_the_table_also_judges_without_it():
    """plain_sync is a diagnosis arm: the table adds the default over the
    best of the other arms without it."""
    cell = {"tok_s": {"plain": 100.0, "plain_sync": 120.0, "default": 105.0},
            "best_other": "plain_sync", "default_over_best": 105.0 / 120.0}
    rows = {line.split(" | ")[0]: line for line in markdown(
        {"config": "x", "cells": {"1": cell}}).splitlines() if line.startswith("| ")}
    assert rows["| default / best other"].endswith("| 0.88x |")
    assert rows["| default / best other but plain_sync"].endswith("| 1.05x |")
    del cell["tok_s"]["plain_sync"]
    assert "but plain_sync" not in markdown({"config": "x", "cells": {"1": cell}})


def test_tuner_arm_steps_come_from_the_engine_counters(tmp_path):
    names = ["plain", "fixed2", "model"]
    arms = _TunerArms(stats_file(str(tmp_path), 0), names)
    assert arms.steps().tolist() == [0, 0, 0]  # no file yet
    w = CounterWriter(stats_file(str(tmp_path), 0))
    before = arms.steps()
    for index in (0, 0, 2):
        w.add_arm(index)
    assert (arms.steps() - before).tolist() == [2, 0, 1]
    w.close()


def test_plain_sync_turns_async_scheduling_off_for_the_plain_engine_only():
    from types import SimpleNamespace

    args = SimpleNamespace(plain_mode=True, plain_sync=True, drafter="d", k=15, held=0,
                           max_budget=64)
    arms = step_arms(args)
    assert arms["plain"]["llm"] == {"async_scheduling": False}
    assert "llm" not in arms["ddtree_plain_mode"]
    assert "llm" not in step_arms(SimpleNamespace(**{**vars(args), "plain_sync": False}))["plain"]
    with pytest.raises(SystemExit, match="--plain-mode"):
        step_arms(SimpleNamespace(**{**vars(args), "plain_mode": False}))


def test_held_compares_a_fixed_engine_with_the_default_held_at_that_arm():
    from types import SimpleNamespace

    args = SimpleNamespace(plain_mode=False, plain_sync=False, drafter="d", k=15, held=4,
                           max_budget=64)
    arms = step_arms(args)
    assert list(arms) == ["fixed", "default_held"]
    assert arms["fixed"]["spec"]["num_speculative_tokens"] == 4
    assert arms["fixed"]["spec"]["ddtree_adaptive"] is False
    assert arms["default_held"]["spec"]["num_speculative_tokens"] == 64
    assert "ddtree_adaptive" not in arms["default_held"]["spec"]  # the default: adaptive
    assert arms["default_held"]["hold"] == 4
    with pytest.raises(SystemExit, match="not an arm"):
        step_arms(SimpleNamespace(**{**vars(args), "held": 5}))
    with pytest.raises(SystemExit, match="two different comparisons"):
        step_arms(SimpleNamespace(**{**vars(args), "plain_mode": True}))


def test_held_tuner_runs_the_held_arm_and_still_closes_trials():
    from benchmarks.bench_step import _hold_tuner
    from vllm_ddtree.core.tuner import RateTuner

    real = RateTuner.arm
    try:
        _hold_tuner(8)
        tuner = RateTuner(64)
        for _ in range(200):
            assert tuner.arm(4).name == "fixed8"
            tuner.observe(4, 4 * 3.0, 0.01, verified=4 * 9, drafted=True)
        assert tuner.closed > 0
        assert {t.arm for t in tuner.history} == {"fixed8"}
    finally:
        RateTuner.arm = real


def test_bench_default_plain_sync_arm_is_plain_without_async_scheduling():
    from benchmarks.bench_default import arms, configuration

    jobs = arms(configuration("dense"), plain_sync=True)
    assert jobs["plain_sync"]["llm"]["async_scheduling"] is False
    assert jobs["plain_sync"]["speculative_config"] is None
    assert "async_scheduling" not in jobs["plain"]["llm"]
    assert "plain_sync" not in arms(configuration("dense"))


def test_tuner_sim_orders_the_fixed_arms_as_its_regimes_say_and_reports_the_default(tmp_path,
                                                                                     capsys):
    """The simulated engines behind ``benchmarks/tuner_sim.py``: where tree
    steps cost many plain steps, plain beats every fixed budget; on the
    weight-bound regime with easy text, large budgets beat small ones. The
    script writes one ratio per seed and regime."""
    from benchmarks.tuner_sim import REGIMES, main, simulate

    def rate(name, b):
        return simulate(REGIMES[name], seed=1, fixed=b, horizon=3.0, start=0.5)[0]

    assert all(rate("dense_c16", 0) > 1.5 * rate("dense_c16", b) for b in (4, 16, 64))
    assert rate("easy_c1", 32) > 1.3 * rate("easy_c1", 4) > 1.3 * rate("easy_c1", 0)
    out = tmp_path / "sim.json"
    main(["--regimes", "dense_c16", "--seeds", "2", "--horizon", "2", "--start", "0.5",
          "--out", str(out)])
    assert "default / best" in capsys.readouterr().out
    ratios = json.loads(out.read_text())["regimes"]["dense_c16"]["default_over_best"]
    assert len(ratios) == 2 and all(0.3 < r < 1.2 for r in ratios)
