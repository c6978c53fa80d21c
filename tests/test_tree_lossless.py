"""Tree decoding is distribution-identical to plain decoding (statistical test).

A toy autoregressive target over vocab 5 emits sequences of 3 tokens (125
sequences). Each round drafts a random tree from drafter logits unrelated to
the target (random per-request budgets and scheduler truncation), samples the
target's token at every node with ``sample_posterior`` and walks the tree,
until 3 tokens are out. The histogram over the 125 sequences must fit the
exact sequential distribution under the same processing (temperature, top-k,
top-p), and a deliberately wrong acceptance rule must not.
"""

import numpy as np
import pytest
import torch
from scipy import stats

from vllm_ddtree.core.tree import build_tree, sample_posterior, walk


pytestmark = pytest.mark.usefixtures("one_thread")

V, L, K, B = 5, 3, 3, 8
N = 20000
OFFSET = torch.tensor([0, 1, 1 + V, 1 + V + V * V])  # first table row of each prefix length
NUM_ROWS = 1 + V + V * V  # prefixes of length 0..2; row NUM_ROWS serves longer prefixes
TABLE = torch.cat([torch.randn(NUM_ROWS, V, generator=torch.Generator().manual_seed(7)) * 1.5, torch.zeros(1, V)])


def table_row(value, length):
    """Table row of the prefix with base-V value ``value`` and ``length`` tokens."""
    return OFFSET[length.clamp(max=L)] + torch.where(length < L, value, 0)


def expected_distribution(temperature, top_k, top_p):
    """Exact probability of each of the V**L sequences under sequential sampling."""

    def processed(row):
        x = TABLE[row].double().numpy() / temperature
        if top_k:
            x = np.where(x < np.sort(x)[::-1][top_k - 1], -np.inf, x)
        p = np.exp(x - x.max())
        p /= p.sum()
        if top_p < 1:
            order = np.argsort(p)
            cum = np.cumsum(p[order])
            assert np.abs(cum - (1 - top_p)).min() > 1e-4, "keep the top-p boundary unambiguous"
            drop = cum <= 1 - top_p
            drop[-1] = False
            p[order[drop]] = 0
            p /= p.sum()
        return p

    out = np.zeros(V**L)
    for code in range(V**L):
        seq = [(code // V ** (L - 1 - t)) % V for t in range(L)]
        prob, value = 1.0, 0
        for t, y in enumerate(seq):
            prob *= processed(int(OFFSET[t]) + value)[y]
            value = value * V + y
        out[code] = prob
    return out


def sampling_params(temperature, top_k, top_p):
    return (
        torch.full((N,), float(temperature)),
        torch.full((N,), top_k, dtype=torch.long),
        torch.full((N,), float(top_p)),
    )


def tree_decode(seed, temperature, top_k, top_p, rule="walk", post_params=None):
    """Emit N sequences of L tokens by drafting, verifying and walking trees."""
    torch.manual_seed(seed)
    temp, tk, tp = sampling_params(*(post_params or (temperature, top_k, top_p)))
    seq = torch.zeros(N, L, dtype=torch.long)
    length = torch.zeros(N, dtype=torch.long)
    value = torch.zeros(N, dtype=torch.long)
    for _ in range(L):  # every round emits at least one token
        budgets = torch.randint(1, B + 1, (N,))
        tree = build_tree(torch.randn(N, K, V) * 2, B, budgets)
        num_nodes = torch.minimum((torch.rand(N) * (budgets + 1)).long(), budgets)
        # prefix (base-V value, length) of every flat node
        par = torch.cat([torch.zeros(N, 1, dtype=torch.long), tree.parents], 1)
        tok = torch.cat([torch.zeros(N, 1, dtype=torch.long), tree.tokens], 1)
        dep = torch.cat([torch.zeros(N, 1, dtype=torch.long), tree.depth], 1)
        nval = torch.cat([value[:, None], torch.zeros(N, B, dtype=torch.long)], 1)
        nlen = torch.cat([length[:, None], torch.zeros(N, B, dtype=torch.long)], 1)
        for d in range(1, K + 1):
            at = dep == d
            nval = torch.where(at, nval.gather(1, par) * V + tok, nval)
            nlen = torch.where(at, nlen.gather(1, par) + 1, nlen)
        post = sample_posterior(TABLE[table_row(nval, nlen)], temp, tk, tp)
        if rule == "walk":
            res = walk(tree.tokens, tree.parents, post, num_nodes)
            out, count = res.output_tokens, res.num_accepted + 1
        else:  # wrong on purpose: accept the drafter's most probable child, then the bonus
            out = torch.stack([tree.tokens[:, 0], post[:, 1]], 1)
            count = torch.full((N,), 2)
        for t in range(L):
            j = t - length
            take = (j >= 0) & (j < count)
            seq[:, t] = torch.where(take, out.gather(1, j.clamp(0, out.shape[1] - 1)[:, None])[:, 0], seq[:, t])
        length = torch.clamp(length + count, max=L)
        value = torch.zeros(N, dtype=torch.long)
        for t in range(L):
            value = torch.where(t < length, value * V + seq[:, t], value)
    assert (length == L).all()
    return seq[:, 0] * V * V + seq[:, 1] * V + seq[:, 2]


def sequential_decode(seed, temperature, top_k, top_p):
    """Plain decoding: one token at a time from the processed target distribution."""
    torch.manual_seed(seed)
    temp, tk, tp = sampling_params(temperature, top_k, top_p)
    value = torch.zeros(N, dtype=torch.long)
    for t in range(L):
        rows = table_row(value, torch.full((N,), t))
        y = sample_posterior(TABLE[rows][:, None, :], temp, tk, tp)[:, 0]
        value = value * V + y
    return value


def fit_pvalue(codes, expected):
    """Chi-square goodness of fit; cells with expected count < 5 are pooled."""
    observed = np.bincount(codes.numpy(), minlength=V**L)
    if observed[expected == 0].sum() > 0:
        return 0.0  # a sequence the target can never produce
    exp = expected * len(codes)
    big = exp >= 5
    small = ~big & (exp > 0)
    o, e = observed[big], exp[big]
    if small.any():
        o, e = np.append(o, observed[small].sum()), np.append(e, exp[small].sum())
    return stats.chisquare(o, e * o.sum() / e.sum()).pvalue


CONFIGS = [(1.0, 0, 1.0), (0.7, 0, 0.9), (0.7, 2, 1.0)]


@pytest.mark.parametrize("temperature,top_k,top_p", CONFIGS)
def test_tree_decoding_matches_sequential_sampling(temperature, top_k, top_p):
    expected = expected_distribution(temperature, top_k, top_p)
    if top_k or top_p < 1:
        assert (expected == 0).sum() > 0, "the filters must bite"
    tree_codes = tree_decode(11, temperature, top_k, top_p)
    seq_codes = sequential_decode(12, temperature, top_k, top_p)
    p_tree = fit_pvalue(tree_codes, expected)
    p_seq = fit_pvalue(seq_codes, expected)
    assert p_tree > 1e-3 and p_seq > 1e-3, (p_tree, p_seq)
    # two-sample check between the two decoders as well
    table = np.stack([np.bincount(c.numpy(), minlength=V**L) for c in (tree_codes, seq_codes)])
    table = table[:, table.sum(0) > 0]
    assert stats.chi2_contingency(table).pvalue > 1e-3


def test_tree_decoding_accepts_drafts():
    """The walk must actually accept draft tokens, or the test above proves nothing."""
    torch.manual_seed(0)
    budgets = torch.full((N,), B)
    tree = build_tree(torch.randn(N, K, V) * 2, B, budgets)
    post = sample_posterior(TABLE[torch.zeros(N, B + 1, dtype=torch.long)], torch.ones(N))
    res = walk(tree.tokens, tree.parents, post, budgets)
    assert res.num_accepted.float().mean() > 0.5


def test_wrong_rule_is_detected():
    expected = expected_distribution(1.0, 0, 1.0)
    assert fit_pvalue(tree_decode(11, 1.0, 0, 1.0, rule="argmax_child"), expected) < 1e-3


def test_unprocessed_posterior_is_detected():
    expected = expected_distribution(0.7, 0, 0.9)
    codes = tree_decode(11, 0.7, 0, 0.9, post_params=(1.0, 0, 1.0))
    assert fit_pvalue(codes, expected) < 1e-3


def test_greedy_tree_decoding_is_greedy_decoding():
    value = torch.zeros(1, dtype=torch.long)
    for t in range(L):
        value = value * V + TABLE[table_row(value, torch.tensor([t]))].argmax(-1)
    codes = tree_decode(3, 0.0, 0, 1.0)
    assert (codes == value).all()
