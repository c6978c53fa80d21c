"""The adaptive tree budget (vllm_ddtree/core/budget.py): the batch-optimal choice,
the calibration and the cost model, against brute force and known answers."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from vllm_ddtree.core.budget import (CAL_BINS, AdaptivePolicy, Calibration, CostModel,
                                PiecewiseLinear, choose_budgets, isotonic_decreasing, ladder,
                                parse_pinned_cost)
from vllm_ddtree.core.tree import build_tree


def _linear_cost(num_reqs, width, a, b, d):
    t = torch.arange(num_reqs, num_reqs + num_reqs * width + 1, dtype=torch.float64)
    return a + b * t + d, a + b * num_reqs


def _brute_force(values, tree_s, plain_s):
    """Best rate over every per-request prefix choice (tiny cases)."""
    num_reqs, width = values.shape
    best = (num_reqs / plain_s, (0,) * num_reqs)
    for counts in itertools.product(range(width + 1), repeat=num_reqs):
        n = sum(counts)
        if n == 0:
            continue
        gain = sum(float(values[r, :c].sum()) for r, c in enumerate(counts))
        rate = (num_reqs + gain) / float(tree_s[n])
        if rate > best[0] + 1e-12:
            best = (rate, counts)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_choice_is_the_brute_force_optimum(seed):
    g = torch.Generator().manual_seed(seed)
    num_reqs, width = int(torch.randint(1, 4, (1,), generator=g)), 4
    values = torch.rand(num_reqs, width, generator=g, dtype=torch.float64)
    values = values.sort(dim=1, descending=True).values * torch.rand(num_reqs, 1, generator=g,
                                                                    dtype=torch.float64)
    a, b, d = (float(x) for x in torch.rand(3, generator=g))
    tree_s, plain_s = _linear_cost(num_reqs, width, a, b * 0.3, d * 0.5)
    budgets, nodes, rate = choose_budgets(values, tree_s, plain_s)
    best_rate, _ = _brute_force(values, tree_s, plain_s)
    assert float(rate) == pytest.approx(best_rate, rel=1e-9)
    assert int(nodes) == int(budgets.sum())
    got = (num_reqs + sum(float(values[r, :c].sum()) for r, c in enumerate(budgets.tolist())))
    if int(nodes):
        assert got / float(tree_s[int(nodes)]) == pytest.approx(best_rate, rel=1e-9)
    else:
        assert best_rate == pytest.approx(num_reqs / plain_s)


def test_choice_regimes():
    values = torch.tensor([[0.9, 0.8, 0.5, 0.1], [0.3, 0.05, 0.01, 0.0]], dtype=torch.float64)
    # Flat cost (a GPU far from compute-bound): every node with value pays.
    tree_s, plain_s = _linear_cost(2, 4, 10.0, 0.0, 0.0)
    budgets, nodes, _ = choose_budgets(values, tree_s, plain_s)
    assert budgets.tolist() == [4, 3] and int(nodes) == 7
    # Expensive drafter and steep tokens: plain decoding wins, nothing is verified.
    tree_s, plain_s = _linear_cost(2, 4, 1.0, 1.0, 5.0)
    budgets, nodes, rate = choose_budgets(values, tree_s, plain_s)
    assert budgets.tolist() == [0, 0] and int(nodes) == 0
    assert float(rate) == pytest.approx(2 / plain_s)
    # In between: the confident request gets the nodes.
    tree_s, plain_s = _linear_cost(2, 4, 4.0, 1.0, 0.5)
    budgets, _, _ = choose_budgets(values, tree_s, plain_s)
    assert budgets[0] > budgets[1] and budgets.sum() > 0
    # Exploration: at least min_nodes even when plain decoding would pay more.
    tree_s, plain_s = _linear_cost(2, 4, 1.0, 1.0, 5.0)
    budgets, nodes, _ = choose_budgets(values, tree_s, plain_s, min_nodes=3)
    assert int(nodes) == 3 and budgets.tolist() == [3, 0]  # the three best nodes


def test_chosen_nodes_are_prefixes_of_real_trees():
    """The choice over real trees (ties included) is a prefix of each
    request's flat order, so the trees it leaves are valid."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 5, 40, generator=g) * 3
    logits[2] = 0.0  # uniform drafter: many equal q
    tree = build_tree(logits, 24)
    cal = Calibration("cpu")
    values = cal.value(tree.logq) * tree.valid
    for b in (0.0, 0.01, 0.05, 0.2):
        tree_s, plain_s = _linear_cost(6, 24, 1.0, b, 0.3)
        budgets, _, _ = choose_budgets(values, tree_s, plain_s)
        for r, n in enumerate(budgets.tolist()):
            if n:
                assert (tree.parents[r, :n] <= torch.arange(n)).all()
                # the chosen set is the n most valuable nodes of the request
                rest = values[r, n:]
                assert not rest.numel() or values[r, :n].min() >= rest.max() - 1e-12


def test_isotonic_and_calibration_learns_the_realised_rate():
    assert isotonic_decreasing([0.5, 0.7, 0.2, 0.3], [1, 1, 1, 1]) == pytest.approx(
        [0.6, 0.6, 0.25, 0.25])
    cal = Calibration("cpu", decay=1.0)
    # Before data a node is worth its q.
    lq = torch.tensor([[-0.25, -1.25, -3.25]])
    assert cal.value(lq)[0].tolist() == pytest.approx([math.exp(-0.25), math.exp(-1.25),
                                                    math.exp(-3.25)], rel=1e-6)
    # The drafter under-predicts: nodes at q ~ 0.3 are accepted 60% of the time.
    g = torch.Generator().manual_seed(1)
    logq = torch.full((200, 8), math.log(0.3))
    acc = torch.rand(200, 8, generator=g) < 0.6
    cal.observe(logq, torch.ones(200, 8, dtype=torch.bool), acc)
    table = cal.refresh()
    k = int(-math.log(0.3) / 0.5)
    assert table[k] == pytest.approx(0.6, abs=0.05)
    assert all(a >= b for a, b in zip(table, table[1:])), "not monotone in q"
    # Unseen bins follow q scaled by the realised/expected ratio (about 2).
    assert table[6] == pytest.approx(min(1.0, math.exp(-3.25) * 2), rel=0.2)
    v = cal.value(torch.linspace(0, -15, 61))
    assert (v[:-1] >= v[1:] - 1e-12).all()
    assert len(table) == CAL_BINS


def test_cost_model_refines_towards_measurements():
    curve = PiecewiseLinear(ladder(64), [1.0] * 7)
    assert ladder(64) == [1, 2, 4, 8, 16, 32, 64] and ladder(5) == [1, 2, 4, 5]
    cost = CostModel(curve, PiecewiseLinear([1, 8], [0.5, 0.5]))
    for _ in range(60):  # the truth: 1 + 0.05 T seconds, drafter 0.2 s
        for t in (1, 4, 16, 32):
            cost.observe(1, t, 1.0 + 0.05 * t + 0.2, 0.2)
    for t in (1, 4, 16, 32):  # each knot learns the steps of its own cell
        assert cost.verify(t) == pytest.approx(1 + 0.05 * t, rel=0.03)
    assert cost.verify(40) == pytest.approx(1 + 0.05 * 40, rel=0.15)
    assert cost.draft(1) == pytest.approx(0.2, rel=0.01)
    # Non-decreasing whatever the noise.
    assert all(a <= b for a, b in zip(cost.verify.ys, cost.verify.ys[1:]))
    t = torch.tensor([1.0, 3.0, 100.0], dtype=torch.float64)
    assert cost.verify.at(t).tolist() == pytest.approx([cost.verify(1), cost.verify(3),
                                                        cost.verify(100)])


def test_unmeasured_sizes_follow_the_measured_level():
    """A profile taken on a busy machine (3x slow): steps measured at one size
    pull the whole curve down in proportion; a measured knot keeps its own
    value."""
    xs = ladder(64)
    truth = [1e-3 * (2 + 0.1 * x) for x in xs]
    curve = PiecewiseLinear(xs, [3 * t for t in truth])
    for _ in range(40):
        curve.update(64, truth[-1], 0.3)
    assert curve(64) == pytest.approx(truth[-1], rel=0.02)
    assert curve(1) == pytest.approx(truth[0], rel=0.1)
    assert curve.confidence(64) > 10 and curve.confidence(1) == 0
    for _ in range(40):
        curve.update(1, 2 * truth[0], 0.3)  # a different level at small sizes
    assert curve(1) == pytest.approx(2 * truth[0], rel=0.05)
    assert curve(64) == pytest.approx(truth[-1], rel=0.05)
    assert truth[0] < curve(8) < 2 * truth[3]


def test_pinned_cost_model():
    cost = parse_pinned_cost("2,0.5,3", 100, 8)
    assert cost.plain_step(4) == pytest.approx((2 + 0.5 * 4) / 1e3)
    assert float(cost.tree_steps(4, 8, "cpu")[8]) == pytest.approx((2 + 0.5 * 12 + 3) / 1e3)
    cost.observe(4, 12, 1.0, 0.5)  # pinned: never refined
    assert cost.plain_step(4) == pytest.approx((2 + 0.5 * 4) / 1e3)
    for bad in ("1,2", "a,b,c", "-1,1,1"):
        with pytest.raises(ValueError, match="VLLM_DDTREE_COST_MODEL"):
            parse_pinned_cost(bad, 100, 8)


def test_policy_goes_plain_and_probes():
    """Expensive trees: the policy uses the trees it drafted, then stops
    drafting (plain mode), drafts every probe_every steps (verifying a few
    nodes per request), and returns to trees when they pay."""
    cost = parse_pinned_cost("1,1,5", 1000, 64)
    pol = AdaptivePolicy(8, cost, "cpu", probe_every=4)
    logq = torch.log(torch.tensor([[0.5, 0.3, 0.2, 0.1, 0.05, 0.05, 0.01, 0.01]]))
    valid = torch.ones_like(logq, dtype=torch.bool)
    assert pol.should_draft(1)  # nothing known yet
    d = pol.choose(logq, valid)
    # Among tree steps (the drafter ran anyway) a small tree beats none:
    # e.g. (1 + 0.5 + 0.3) / (1 + 1 * 3 + 5) > 1 / (1 + 1 + 5).
    assert 1 <= int(d.nodes) <= 3 and not d.probe
    pol.decided(int(d.nodes))
    skipped = 0
    while not pol.should_draft(1):
        pol.skipped()
        skipped += 1
    assert pol.plain and skipped == 4
    d = pol.choose(logq, valid)
    assert d.probe and int(d.nodes) == 4
    pol.decided(4)
    assert not pol.should_draft(1)  # still plain
    # Cheap trees: the prediction alone brings the drafter back.
    pol.cost = parse_pinned_cost("10,0.01,0.1", 1000, 64)
    pol._prediction = None  # noqa: SLF001 (the cost changed under the cache)
    assert pol.should_draft(1) and not pol.plain
    d = pol.choose(logq, valid)
    assert int(d.nodes) == 8


def test_policy_measures_plain_steps_while_trees_pay():
    """Trees every step leave the plain step's cost unmeasured; one decision
    in probe_every verifies nothing until it has been measured."""
    xs = ladder(64)
    cost = CostModel(PiecewiseLinear(xs, [1e-3] * len(xs)),  # flat: trees always pay
                     PiecewiseLinear([1, 64], [1e-4, 1e-4]))
    pol = AdaptivePolicy(4, cost, "cpu", probe_every=3)
    logq = torch.log(torch.tensor([[0.9, 0.8, 0.7, 0.6]]))
    valid = torch.ones_like(logq, dtype=torch.bool)
    chosen = []
    for _ in range(8):
        d = pol.choose(logq, valid)
        chosen.append(int(d.nodes))
        pol.decided(int(d.nodes))
        if int(d.nodes) == 0:  # the plain step is measured at its size
            cost.observe(1, 1, 1e-3, 0.0)
    assert chosen == [4, 4, 4, 0, 4, 4, 4, 4], chosen
