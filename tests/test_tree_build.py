"""build_tree: optimality against brute force and a best-first heap, structure."""

import heapq
import itertools

import numpy as np
import pytest
import torch

from vllm_ddtree.core.tree import build_tree


pytestmark = pytest.mark.usefixtures("one_thread")


def node_prefixes(tree, r):
    """Token prefix of every valid node of request r, following parents."""
    tokens = tree.tokens[r].tolist()
    parents = tree.parents[r].tolist()
    valid = tree.valid[r].tolist()
    prefixes = [()]  # flat index 0 = root
    for j in range(len(tokens)):
        if not valid[j]:
            break
        p = parents[j]
        assert 0 <= p <= j, "parent must precede its child"
        prefixes.append(prefixes[p] + (tokens[j],))
    return prefixes[1:]


def check_structure(tree, r, lp):
    """Topological order, depth, prefix-closure, distinct siblings, exact logq."""
    prefixes = node_prefixes(tree, r)
    n = len(prefixes)
    assert tree.valid[r, :n].all() and not tree.valid[r, n:].any(), "valid must be a prefix"
    assert len(set(prefixes)) == n, "duplicate prefixes"
    kept = set(prefixes)
    for j, u in enumerate(prefixes):
        assert tree.depth[r, j].item() == len(u)
        assert len(u) == 1 or u[:-1] in kept
        # logq is the fp32 left-to-right sum of the prefix's log-probs
        s = np.float32(lp[r, 0, u[0]])
        for d in range(1, len(u)):
            s = np.float32(s + lp[r, d, u[d]])
        assert tree.logq[r, j].item() == s
    scores = tree.logq[r, :n]
    assert (scores[1:] <= scores[:-1]).all(), "nodes must be sorted by logq"
    tail = slice(n, tree.tokens.shape[1])
    assert (tree.tokens[r, tail] == 0).all() and (tree.parents[r, tail] == 0).all()
    assert (tree.depth[r, tail] == 1).all() and torch.isneginf(tree.logq[r, tail]).all()
    return prefixes


def brute_force_scores(lp_r):
    """fp32 score of every prefix of length 1..K, accumulated left to right."""
    K, V = lp_r.shape
    scores = {}
    for d in range(1, K + 1):
        for u in itertools.product(range(V), repeat=d):
            s = np.float32(lp_r[0, u[0]]) if d == 1 else np.float32(scores[u[:-1]] + lp_r[d - 1, u[-1]])
            scores[u] = s
    return scores


def random_logits(rng, b, K, V, mode):
    if mode == "normal":
        x = rng.normal(size=(b, K, V)) * 2
    elif mode == "ties":  # few distinct values: many exact ties
        x = rng.integers(0, 3, size=(b, K, V)).astype(np.float64)
    elif mode == "near_one":  # log-prob exactly 0.0 in fp32 for one token
        x = rng.normal(size=(b, K, V))
        x[np.arange(b)[:, None], np.arange(K)[None, :], rng.integers(0, V, size=(b, K))] = 40.0
    elif mode == "zero_prob":  # -inf logits: zero-probability prefixes
        x = rng.normal(size=(b, K, V))
        x[rng.random(size=(b, K, V)) < 0.4] = -np.inf
        x[:, :, 0] = np.where(np.isinf(x[:, :, 0]), 0.5, x[:, :, 0])  # one finite token
    else:  # mixture of the above per level
        x = rng.integers(0, 2, size=(b, K, V)).astype(np.float64) * 40.0
        x[rng.random(size=(b, K, V)) < 0.2] = -np.inf
        x[:, :, -1] = 0.0
    return torch.tensor(x, dtype=torch.float32)


CASES = [
    (seed, mode)
    for seed in range(40)
    for mode in ("normal", "ties", "near_one", "zero_prob", "mixed")
]


@pytest.mark.parametrize("seed,mode", CASES)
def test_optimal_against_brute_force(seed, mode):
    rng = np.random.default_rng(seed)
    V = int(rng.integers(1, 7))
    K = int(rng.integers(1, 5))
    B = int(rng.integers(1, 31))
    b = 3
    logits = random_logits(rng, b, K, V, mode)
    budgets = torch.tensor([B, int(rng.integers(0, B + 1)), int(rng.integers(1, B + 1))])
    tree = build_tree(logits, B, budgets)
    assert tree.tokens.shape == (b, B) and tree.tokens.dtype == torch.int64
    assert tree.logq.dtype == torch.float32 and tree.valid.dtype == torch.bool
    lp = torch.log_softmax(logits, -1).numpy()
    for r in range(b):
        brute = brute_force_scores(lp[r])
        m = min(int(budgets[r]), len(brute))
        prefixes = check_structure(tree, r, lp)
        assert len(prefixes) == m
        best = np.sort(np.array(list(brute.values()), dtype=np.float32))[::-1][:m]
        got = np.array([brute[u] for u in prefixes], dtype=np.float32)
        # the chosen set is a valid top-m set: same multiset of scores
        np.testing.assert_array_equal(np.sort(got)[::-1], best)
        assert abs(np.exp(got.astype(np.float64)).sum() - np.exp(best.astype(np.float64)).sum()) < 1e-6
        # and matches the tree's own logq
        np.testing.assert_array_equal(tree.logq[r, :m].numpy(), got)


def test_parent_child_exact_tie_keeps_parent_first():
    # Token 0 has log-prob exactly 0 at every depth: the chain 0,00,000 ties.
    V, K, B = 4, 3, 6
    logits = torch.full((1, K, V), -1e4)
    logits[:, :, 0] = 100.0
    assert (torch.log_softmax(logits, -1)[:, :, 0] == 0).all()
    tree = build_tree(logits, B)
    prefixes = check_structure(tree, 0, torch.log_softmax(logits, -1).numpy())
    assert prefixes[:3] == [(0,), (0, 0), (0, 0, 0)]
    assert tree.parents[0, :3].tolist() == [0, 1, 2]


def test_more_budget_than_prefixes():
    V, K, B = 2, 2, 10  # only 2 + 4 = 6 prefixes exist
    logits = torch.randn(2, K, V)
    tree = build_tree(logits, B)
    assert tree.valid.sum(-1).tolist() == [6, 6]
    for r in range(2):
        prefixes = check_structure(tree, r, torch.log_softmax(logits, -1).numpy())
        assert set(prefixes) == {(a,) for a in range(2)} | set(itertools.product(range(2), repeat=2))


def test_half_precision_input_is_computed_in_fp32():
    logits = torch.randn(2, 4, 50) * 3
    t16 = build_tree(logits.to(torch.bfloat16), 32)
    t32 = build_tree(logits.to(torch.bfloat16).float(), 32)
    for a, b in zip(t16, t32):
        assert torch.equal(a, b)


def heap_top_prefixes(lp_r, B):
    """Best-first search: pop the most probable prefix, push its best child and next sibling."""
    K, V = lp_r.shape
    order = np.argsort(-lp_r, axis=1, kind="stable")
    sorted_lp = np.take_along_axis(lp_r, order, axis=1).astype(np.float32)
    counter = itertools.count()
    # entry: (-score, tiebreak, depth index, rank, parent prefix, parent score)
    heap = [(-sorted_lp[0, 0], next(counter), 0, 0, (), None)]
    out = []
    while heap and len(out) < B:
        neg, _, d, j, parent, pscore = heapq.heappop(heap)
        score = np.float32(-neg)
        u = parent + (int(order[d, j]),)
        out.append((u, score))
        if j + 1 < V:
            sib = sorted_lp[0, j + 1] if d == 0 else np.float32(pscore + sorted_lp[d, j + 1])
            heapq.heappush(heap, (-sib, next(counter), d, j + 1, parent, pscore))
        if d + 1 < K:
            child = np.float32(score + sorted_lp[d + 1, 0])
            heapq.heappush(heap, (-child, next(counter), d + 1, 0, u, score))
    return out


@pytest.mark.parametrize("B", [1, 8, 64, 256, 1024])
def test_agrees_with_best_first_heap(B):
    torch.manual_seed(B)
    V, K = 1000, 15
    logits = torch.randn(2, K, V) * 2.5
    tree = build_tree(logits, B)
    lp = torch.log_softmax(logits, -1).numpy()
    for r in range(2):
        ref = heap_top_prefixes(lp[r], B)
        got = check_structure(tree, r, lp)
        assert len(got) == len(ref) == B
        ref_scores = np.array([s for _, s in ref], dtype=np.float32)
        got_scores = tree.logq[r].numpy()
        np.testing.assert_array_equal(np.sort(got_scores), np.sort(ref_scores))
        # Same prefixes, except possibly among exact ties at the boundary score.
        boundary = ref_scores.min()
        ref_set = {u for u, s in ref if s > boundary}
        got_set = {u for u, s in zip(got, got_scores) if s > boundary}
        assert got_set == ref_set
        assert len(set(got) ^ {u for u, _ in ref}) == 0 or (ref_scores == boundary).sum() > 1
        sum_ref = np.exp(ref_scores.astype(np.float64)).sum()
        sum_got = np.exp(got_scores.astype(np.float64)).sum()
        assert abs(sum_ref - sum_got) < 1e-6
        assert max(len(u) for u in got) > (1 if B > 8 else 0)  # deep trees are exercised


def test_rows_are_independent_of_batch():
    torch.manual_seed(3)
    logits = torch.randn(5, 6, 40)
    budgets = torch.tensor([20, 3, 0, 17, 20])
    full = build_tree(logits, 20, budgets)
    for r in range(5):
        one = build_tree(logits[r : r + 1], 20, budgets[r : r + 1])
        for a, b in zip(full, one):
            assert torch.equal(a[r : r + 1], b)
    assert full.valid.sum(-1).tolist() == [20, 3, 0, 17, 20]


def test_order_key_breaks_ties_by_position_and_treats_signed_zeros_alike():
    from vllm_ddtree.core.tree import _descending_key

    vals = [0.0, -0.0, -1e-45, -3.5, float("-inf"), -0.0, 0.0, -3.5, -1e-30, float("-inf"), -2.0]
    x = torch.tensor([vals], dtype=torch.float32)
    order = _descending_key(x).argsort(dim=1)[0].tolist()
    expected = sorted(range(len(vals)), key=lambda i: (-vals[i], i))
    assert order == expected
    assert len(set(_descending_key(x)[0].tolist())) == len(vals)


def test_native_build_matches_torch():
    """The CPU engine builds its trees with the native kernel: the same trees
    as build_tree (random logits have no exact score ties)."""
    from vllm_ddtree.kernels import cpu_native

    lib = cpu_native.load()
    assert lib is not None, "the native CPU kernels did not build on this machine"
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        b, K, V, B = (int(torch.randint(lo, hi, (1,), generator=g))
                      for lo, hi in ((1, 5), (1, 8), (1, 50), (1, 70)))
        logits = torch.randn(b, K, V, generator=g) * 3
        budgets = torch.randint(0, B + 1, (b,), generator=g)
        want = build_tree(logits, B, budgets)
        got = cpu_native.build_tree_native(lib, torch.log_softmax(logits, -1), B, budgets)
        for name, w, h in zip(want._fields, want, got):
            assert torch.equal(w, h), (name, b, K, V, B)


@pytest.mark.parametrize("native", [False, True])
def test_smaller_budget_builds_the_first_nodes_of_a_larger_tree(native):
    """The adaptive budget's fixed arm builds only the nodes it verifies, and
    the rate tuner's shadow counts read a smaller budget's tree as the first
    nodes of a larger one: without exact score ties (fp32 drafter logits),
    the tree of budget b is the first b nodes of the tree of any larger
    budget, node for node. (Exact ties may be broken differently at another
    budget; either tree is lossless.)"""
    from vllm_ddtree.core.tree import DraftTree
    from vllm_ddtree.kernels import cpu_native

    lib = cpu_native.load() if native else None
    if native:
        assert lib is not None, "the native CPU kernels did not build on this machine"

    def build(logits, budget):
        if native:
            return DraftTree(*cpu_native.build_tree_native(lib, torch.log_softmax(logits, -1),
                                                           budget))
        return build_tree(logits, budget)

    g = torch.Generator().manual_seed(5)
    for trial in range(60):
        K = int(torch.randint(2, 8, (1,), generator=g))
        logits = torch.randn(3, K, 30, generator=g) * 3
        full = build(logits, 64)
        assert full.valid.all()
        for small in (1, 2, 4, 8, 16, 32):
            part = build(logits, small)
            for name, w, h in zip(full._fields, full, part):
                assert torch.equal(w[:, :small], h), (name, trial, small)
