"""DDTree's counters: the shared file (stats.py) and the /metrics logger (metrics.py)."""

from __future__ import annotations

import multiprocessing as mp
import os
from types import SimpleNamespace

import numpy as np
import pytest

from vllm_ddtree.core import stats
from vllm_ddtree.core.stats import (
    HIST_BINS,
    CounterReader,
    CounterWriter,
    Snapshot,
    new_stats_dir,
    stats_file,
)


def _write_steps(path: str, steps: list) -> None:
    w = CounterWriter(path)
    for step in steps:
        w.add(*step)
    w.close()


STEPS = [
    # (num_nodes, num_accepted, expected, is_tree) per verify step
    ([16, 16, 3], [2, 0, 3], [1.5, 0.25, 2.0], [True, True, False]),
    ([16], [15], [4.0], [True]),
]


def test_reader_sees_writer_in_another_process(tmp_path):
    path = stats_file(str(tmp_path), 3)
    assert path.endswith("engine-3.bin")
    reader = CounterReader(path)
    assert reader.read() is None  # no engine yet
    proc = mp.get_context("spawn").Process(target=_write_steps, args=(path, STEPS))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    snap = reader.read()
    assert (snap.steps, snap.drafts, snap.tree_drafts) == (2, 4, 3)
    assert (snap.nodes, snap.accepted) == (51, 20)
    assert snap.expected == pytest.approx(7.75)
    expected_hist = np.zeros(HIST_BINS)
    expected_hist[[0, 2, 3, 15]] = 1
    np.testing.assert_array_equal(snap.depth_hist, expected_hist)
    assert snap.acceptance_length == pytest.approx(1 + 20 / 4)
    assert snap.expected_acceptance_length == pytest.approx(1 + 7.75 / 4)
    assert snap.nodes_per_draft == pytest.approx(51 / 4)


def test_snapshot_difference_is_the_interval(tmp_path):
    w = CounterWriter(stats_file(str(tmp_path), 0))
    w.add(*STEPS[0])
    first = w.snapshot()
    w.add(*STEPS[1])
    delta = w.snapshot() - first
    assert (delta.steps, delta.drafts, delta.nodes, delta.accepted) == (1, 1, 16, 15)
    assert delta.depth_hist[15] == 1 and delta.depth_hist.sum() == 1
    assert Snapshot().acceptance_length is None  # no drafts: no tau, not a division error
    w.close()


def test_writer_rejects_impossible_acceptance_and_clamps_histogram(tmp_path):
    w = CounterWriter(stats_file(str(tmp_path), 0))
    with pytest.raises(ValueError, match="accepted"):
        w.add([4], [5], [1.0], [True])
    with pytest.raises(ValueError, match="accepted"):
        w.add([4], [-1], [1.0], [True])
    w.add([100], [100], [1.0], [True])
    assert w.snapshot().depth_hist[HIST_BINS - 1] == 1
    w.add([], [], [], [])  # a step without drafts changes nothing
    assert w.snapshot().steps == 1
    w.close()


def test_reader_never_returns_a_half_written_step(tmp_path):
    path = stats_file(str(tmp_path), 0)
    w = CounterWriter(path)
    w._a[2] += 1  # a step in progress that never completes
    with pytest.raises(RuntimeError, match="mid-update"):
        CounterReader(path).read(retries=3)
    w._a[2] += 1
    assert CounterReader(path).read().steps == 0
    w.close()


def test_reader_refuses_a_foreign_file(tmp_path):
    path = tmp_path / "engine-0.bin"
    path.write_bytes(np.ones(stats._SIZE).tobytes())  # noqa: SLF001
    with pytest.raises(RuntimeError, match="not a DDTree stats file"):
        CounterReader(str(path)).read()
    short = tmp_path / "engine-1.bin"
    short.write_bytes(b"\0" * 16)
    assert CounterReader(str(short)).read() is None  # still being created


def test_stats_dir_is_fresh_per_configuration():
    a, b = new_stats_dir(), new_stats_dir()
    assert a != b and os.path.isdir(a) and os.path.isdir(b)


def test_stats_dir_is_inherited_by_the_processes_a_deployment_starts(tmp_path):
    """An API server that builds the configuration again (``vllm serve`` with
    several of them) reads the directory its parent made for the engines."""
    import subprocess
    import sys

    made = new_stats_dir()
    code = ("from vllm_ddtree.core.stats import new_stats_dir; print(new_stats_dir())")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=dict(os.environ), check=True).stdout.strip()
    assert child == made
    alone = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={k: v for k, v in os.environ.items()
                                if not k.startswith("VLLM_DDTREE_STATS")},
                           check=True).stdout.strip()
    assert alone != made


def test_tuner_arms_round_trip(tmp_path):
    """Decisions per arm are counted; the rates are the latest gauges."""
    path = str(tmp_path / "engine-0.bin")
    w = stats.CounterWriter(path)
    r = stats.CounterReader(path)
    before = r.read()
    w.add_arm(3, [0.0, 10.0, 20.0, 30.0])
    w.add_arm(3, [0.0, 10.0, 20.0, 31.0])
    w.add_arm(0, [5.0])
    d = r.read() - before
    assert d.arm_steps[:4].tolist() == [1, 0, 0, 2] and d.arm_steps.sum() == 3
    assert d.arm_rate[:2].tolist() == [5.0, 0.0]
    w.add_arm(1)  # rates unchanged since the last decision: the gauges stay
    d = r.read() - before
    assert d.arm_steps[:2].tolist() == [1, 1] and r.read().arm_rate[:2].tolist() == [5.0, 0.0]
    with pytest.raises(ValueError, match="arm index"):
        w.add_arm(stats.ARM_SLOTS, [])
    w.close()


# ---------------------------------------------------------------- /metrics logger
def _sample(name: str, labels: dict | None = None) -> float | None:
    import prometheus_client

    return prometheus_client.REGISTRY.get_sample_value(name, labels or {})


def test_stat_logger_exports_increments_once(tmp_path):
    pytest.importorskip("vllm")
    from vllm_ddtree.core.config import DDTreeRuntime
    from vllm_ddtree.metrics import DDTreeStatLogger

    runtime = DDTreeRuntime(budget=16, depth=15, block_size=16, stats_dir=str(tmp_path))
    cfg = SimpleNamespace(speculative_config=SimpleNamespace(ddtree=runtime),
                          model_config=SimpleNamespace(served_model_name="m"))
    stat_logger = DDTreeStatLogger(cfg, [0])
    stat_logger.record(None, None, engine_idx=0)  # before the engine writes: nothing
    labels = {"model_name": "m", "engine": "0"}
    assert _sample("vllm:ddtree_num_drafts_total", labels) == 0

    w = CounterWriter(stats_file(str(tmp_path), 0))
    w.add(*STEPS[0])
    stat_logger.record(None, None, engine_idx=0)
    stat_logger.record(None, None, engine_idx=0)  # no new step: no double counting
    w.add(*STEPS[1])
    stat_logger.record(None, None, engine_idx=0)
    assert _sample("vllm:ddtree_num_drafts_total", labels) == 4
    assert _sample("vllm:ddtree_num_tree_drafts_total", labels) == 3
    assert _sample("vllm:ddtree_num_nodes_verified_total", labels) == 51
    assert _sample("vllm:ddtree_num_accepted_tokens_total", labels) == 20
    assert _sample("vllm:ddtree_expected_accepted_tokens_total", labels) == pytest.approx(7.75)
    assert _sample("vllm:ddtree_accepted_depth_count", labels) == 4
    assert _sample("vllm:ddtree_accepted_depth_sum", labels) == 20
    assert _sample("vllm:ddtree_accepted_depth_bucket", dict(labels, le="2.0")) == 2
    assert _sample("vllm:ddtree_accepted_depth_bucket", dict(labels, le="14.0")) == 3
    assert _sample("vllm:ddtree_acceptance_length", labels) == pytest.approx(6.0)
    assert _sample("vllm:ddtree_expected_acceptance_length", labels) == \
        pytest.approx(1 + 7.75 / 4)

    lines = []
    import vllm_ddtree.metrics as metrics_mod

    orig = metrics_mod.logger.info
    metrics_mod.logger.info = lambda msg, *args: lines.append(msg % args)
    try:
        stat_logger.log()
        stat_logger.log()  # nothing new since the last line: silent
    finally:
        metrics_mod.logger.info = orig
    assert len(lines) == 1
    assert "mean acceptance length 6.00" in lines[0] and "drafter expected 2.94" in lines[0]
    assert "12.8 nodes verified per draft" in lines[0] and "median 2 / p90 15" in lines[0]

    # A second engine in this process (a new LLM) starts its series from zero.
    DDTreeStatLogger(cfg, [0])
    assert _sample("vllm:ddtree_num_drafts_total", labels) == 0
    w.close()


def test_stat_logger_exports_under_load_at_intervals_and_in_full_when_idle(tmp_path):
    """Under load the counters are exported every REFRESH_SECONDS, not every
    step (reading them costs a few percent of a small model's step); the
    steps in between are counted at the next export, and a step after which
    nothing runs exports at once."""
    pytest.importorskip("vllm")
    from vllm.v1.metrics.stats import SchedulerStats

    from vllm_ddtree.core.config import DDTreeRuntime
    from vllm_ddtree.metrics import DDTreeStatLogger

    runtime = DDTreeRuntime(budget=16, depth=15, block_size=16, stats_dir=str(tmp_path))
    cfg = SimpleNamespace(speculative_config=SimpleNamespace(ddtree=runtime),
                          model_config=SimpleNamespace(served_model_name="m"))
    stat_logger = DDTreeStatLogger(cfg, [0])
    labels = {"model_name": "m", "engine": "0"}
    w = CounterWriter(stats_file(str(tmp_path), 0))
    busy, idle = SchedulerStats(num_running_reqs=3), SchedulerStats()
    w.add(*STEPS[0])
    stat_logger.record(busy, None, engine_idx=0)  # the first record exports
    first = _sample("vllm:ddtree_num_drafts_total", labels)
    assert 0 < first < 4
    w.add(*STEPS[1])
    stat_logger.record(busy, None, engine_idx=0)  # within the interval: deferred
    assert _sample("vllm:ddtree_num_drafts_total", labels) == first
    stat_logger.record(idle, None, engine_idx=0)  # drained: everything, once
    assert _sample("vllm:ddtree_num_drafts_total", labels) == 4
    assert _sample("vllm:ddtree_accepted_depth_count", labels) == 4
    stat_logger.last_refresh -= 1.0  # the interval passed
    stat_logger.record(busy, None, engine_idx=0)
    assert _sample("vllm:ddtree_num_drafts_total", labels) == 4
    w.close()


def test_device_totals_add_what_the_per_request_lists_add(tmp_path):
    """The runner sums a step on the device (StepCounts.totals) and adds the
    totals at once; the counters must equal the per-request path."""
    import torch

    from vllm_ddtree.core.round import StepCounts

    a = CounterWriter(str(tmp_path / "a.bin"))
    b = CounterWriter(str(tmp_path / "b.bin"))
    steps = [([4, 0, 7, 2], [1, 0, 7, 70], [1.5, 0.0, 2.25, 0.5], [True, False, True, False]),
             ([0, 0], [0, 0], [0.0, 0.0], [False, False])]
    for nodes, acc, exp, tree in steps:
        counts = StepCounts(torch.tensor(nodes), torch.tensor(acc).clamp(max=torch.tensor(nodes)),
                            torch.tensor(exp, dtype=torch.float64), torch.tensor(tree))
        walked = [i for i, n in enumerate(nodes) if n > 0]
        a.add([nodes[i] for i in walked], [min(acc[i], nodes[i]) for i in walked],
              [exp[i] for i in walked], [tree[i] for i in walked])
        b.add_totals(counts.totals().tolist())
    sa, sb = a.snapshot(), b.snapshot()
    for k in vars(sa):
        assert np.array_equal(getattr(sa, k), getattr(sb, k)), k
    assert sb.steps == 1 and sb.drafts == 3 and sb.accepted == 1 + 7 + 2
    with pytest.raises(ValueError, match="totals expected"):
        b.add_totals([1.0, 2.0])


def test_adaptive_budget_choices_round_trip(tmp_path):
    """Decisions, the chosen-nodes histogram and the gauges reach the reader;
    a snapshot difference counts decisions but keeps the latest gauges."""
    path = str(tmp_path / "engine-0.bin")
    w = stats.CounterWriter(path)
    r = stats.CounterReader(path)
    before = r.read()
    cal = np.linspace(0.9, 0.0, stats.CAL_BINS)
    for n in (0, 0, 1, 3, 100):
        w.add_choice(n, cal, (1e-3, 5e-3, 2e-3, 1e-5))
    snap = r.read()
    d = snap - before
    assert (d.decided_steps, d.plain_steps, d.chosen_nodes) == (5, 2, 104)
    assert d.nodes_per_decision == pytest.approx(104 / 5)
    assert d.chosen_hist[:3].tolist() == [2, 1, 1] and d.chosen_hist[7] == 1
    assert d.calibration.tolist() == pytest.approx(cal.tolist())
    assert d.cost.tolist() == pytest.approx([1e-3, 5e-3, 2e-3, 1e-5])
    with pytest.raises(ValueError):
        w.add_choice(-1)
    w.close()
