"""Node histories and the grammar walk over trees (``vllm_ddtree/core/node_history.py``)."""

from __future__ import annotations

import random

import pytest
import torch

from vllm_ddtree.core.node_history import (keep_nodes, node_depths, node_paths, path_token_counts,
                                      prune_tree, renumber, row_index, walk_grammar)
from vllm_ddtree.core.tree import DraftTree


def random_tree(rng: random.Random, n: int, vocab: int) -> tuple[list[int], list[int]]:
    parents = [rng.randrange(j) for j in range(1, n + 1)]  # node j's parent is < j
    tokens = [rng.randrange(vocab) for _ in range(n)]
    return parents, tokens


def test_paths_and_depths():
    parents, tokens = [0, 0, 1, 3, 2], [10, 11, 12, 13, 14]
    assert node_depths(parents) == [0, 1, 1, 2, 3, 2]
    assert node_paths(parents, tokens) == [[], [10], [11], [10, 12], [10, 12, 13], [11, 14]]
    req, node = row_index([2, 0, 1])
    assert req.tolist() == [0, 0, 0, 1, 2, 2] and node.tolist() == [0, 1, 2, 0, 0, 1]


@pytest.mark.parametrize("seed", range(4))
def test_path_token_counts_match_the_paths(seed):
    rng = random.Random(seed)
    vocab, budget, counts = 7, 9, [9, 0, 5, 3]
    trees = [random_tree(rng, budget, vocab) for _ in counts]
    tokens = torch.tensor([t for _, t in trees])
    parents = torch.tensor([p for p, _ in trees])
    req, node = row_index(counts)
    got = path_token_counts(tokens, parents, req, node, vocab, max_depth=budget)
    row = 0
    for (par, tok), n in zip(trees, counts):
        for path in node_paths(par[:n], tok[:n]):
            want = torch.bincount(torch.tensor(path, dtype=torch.long), minlength=vocab)
            assert torch.equal(got[row], want)
            row += 1
    # Too small a depth bound misses tokens: the bound matters.
    short = path_token_counts(tokens, parents, req, node, vocab, max_depth=1)
    assert not torch.equal(short, got)


class PrefixGrammar:
    """Accepts the prefixes of a set of token sequences; terminates at a full one.
    Mirrors vLLM's grammar interface, state kept as the accepted tokens."""

    def __init__(self, words):
        self.words = [tuple(w) for w in words]
        self.state: list[int] = []
        self.calls = 0

    def _ok(self, seq):
        return any(w[: len(seq)] == tuple(seq) for w in self.words)

    def is_terminated(self):
        return tuple(self.state) in self.words

    def validate_tokens(self, tokens):
        self.calls += 1
        out = []
        for t in tokens:
            if self.is_terminated() or not self._ok([*self.state, *out, t]):
                break
            out.append(t)
        return out

    def accept_tokens(self, request_id, tokens):
        for t in tokens:
            if not self._ok([*self.state, t]):
                return False
            self.state.append(t)
        return True

    def rollback(self, n):
        del self.state[len(self.state) - n:]


def brute_force_ok(grammar, parents, tokens):
    ok = []
    for path in node_paths(parents, tokens)[1:]:
        good = all(grammar._ok(path[: k + 1]) and tuple(path[:k]) not in grammar.words
                   for k in range(len(path)))
        ok.append(good)
    return ok


@pytest.mark.parametrize("seed", range(6))
def test_grammar_walk_keeps_exactly_the_valid_paths(seed):
    rng = random.Random(seed)
    words = [[rng.randrange(3) for _ in range(rng.randint(2, 5))] for _ in range(4)]
    parents, tokens = random_tree(rng, 24, 3)
    g = PrefixGrammar(words)
    g.state = []
    visited = []
    ok = walk_grammar(g, "r", parents, tokens, visit=lambda j: visited.append((j, list(g.state))))
    assert ok == brute_force_ok(g, parents, tokens)
    assert g.state == []  # the grammar is left as it was
    paths = node_paths(parents, tokens)
    # every accepted node is visited once, in the state after its own path
    assert sorted(j for j, _ in visited) == [0] + [j for j, good in enumerate(ok, 1) if good]
    assert all(state == paths[j] for j, state in visited)

    kept = prune_tree(g, "r", parents, tokens)
    if all(ok):
        assert kept is None
        return
    assert kept == [j for j, good in enumerate(ok, 1) if good]
    new_parents = renumber(parents, kept)
    new_tokens = [tokens[j - 1] for j in kept]
    assert all(p < i for i, p in enumerate(new_parents, 1))
    assert node_paths(new_parents, new_tokens)[1:] == [paths[j] for j in kept]


def test_renumber_refuses_an_orphan():
    with pytest.raises(ValueError, match="not kept"):
        renumber([0, 1, 2], [1, 3])


def test_keep_nodes_cuts_rows():
    b, budget = 2, 5
    tree = DraftTree(tokens=torch.arange(10).view(b, budget) + 100,
                     parents=torch.tensor([[0, 1, 1, 0, 4], [0, 0, 1, 2, 3]]),
                     depth=torch.tensor([[1, 2, 2, 1, 2], [1, 1, 2, 2, 3]]),
                     logq=torch.full((b, budget), -1.0),
                     valid=torch.ones(b, budget, dtype=torch.bool))
    kept = [1, 3, 4, 5]
    out = keep_nodes(tree, {0: (kept, renumber(tree.parents[0].tolist(), kept))})
    assert out.tokens[0].tolist() == [100, 102, 103, 104, -1]
    assert out.parents[0].tolist() == [0, 1, 0, 3, 0]
    assert out.depth[0].tolist() == [1, 2, 1, 2, 1]
    assert out.valid[0].tolist() == [True, True, True, True, False]
    assert out.logq[0, 4] == float("-inf")
    for field in DraftTree._fields:  # the other row is untouched
        assert torch.equal(getattr(out, field)[1], getattr(tree, field)[1])
