"""The PIT/KS helpers of the end-to-end sampling test, on synthetic samples (no engine).

Tokens drawn from the distributions used to score them give uniform PIT values
in both token orders; tokens drawn from other distributions are rejected.
"""

import numpy as np
import pytest
import torch

from tests.pit import Rescored, randomized_pit, rescore, vllm_processed_probs

P_MIN = 1e-3
V = 40
N = 4000


def _contexts(seed: int, n: int = N) -> np.ndarray:
    """``[n, V]`` logits, one sharp-ish distribution per context."""
    return np.random.default_rng(seed).normal(size=(n, V)) * 2.5


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _draw(probs: np.ndarray, rng) -> np.ndarray:
    cdf = np.cumsum(probs, axis=1)
    u = rng.random(len(probs)) * cdf[:, -1]
    return np.minimum((cdf < u[:, None]).sum(axis=1), probs.shape[1] - 1)


def _ks(probs, tokens, order, seed=1):
    v = np.random.default_rng(seed).random(len(tokens))
    return Rescored(randomized_pit(probs, tokens, v, order), randomized_pit(probs, tokens, v, "id"),
                    probs[np.arange(len(tokens)), tokens])


@pytest.mark.parametrize("seed", range(3))
def test_pit_of_true_samples_is_uniform(seed):
    p = _softmax(_contexts(seed))
    p[:, :5] = 0  # zero-probability tokens are never drawn and never break uniformity
    p /= p.sum(axis=1, keepdims=True)
    tokens = _draw(p, np.random.default_rng(100 + seed))
    r = _ks(p, tokens, "rank")
    assert r.nucleus_misses == 0
    assert r.ks_p > P_MIN and r.ks_p_id > P_MIN, r.summary()


@pytest.mark.parametrize("seed", range(3))
def test_pit_rejects_samples_from_another_distribution(seed):
    logits = _contexts(seed)
    p = _softmax(logits / 0.8)
    rng = np.random.default_rng(100 + seed)
    # a too flat sampler (temperature 1.2 instead of 0.8)
    assert _ks(p, _draw(_softmax(logits / 1.2), rng), "rank").ks_p < P_MIN
    # right on 90% of the tokens, and drawn from another context on 10%
    other = _softmax(_contexts(seed + 50) / 0.8)
    mixed = np.where(rng.random((N, 1)) < 0.1, other, p)
    assert _ks(p, _draw(mixed, rng), "rank").ks_p < P_MIN
    # a sampler that ignores top-k (k = 3) on 25% of the tokens: misses map to u = 1
    sorted_p = np.sort(p, axis=1)
    p_k = np.where(p >= sorted_p[:, -3:-2], p, 0)
    p_k /= p_k.sum(axis=1, keepdims=True)
    leaky = np.where(rng.random((N, 1)) < 0.25, p, p_k)
    r = _ks(p_k, _draw(leaky, rng), "rank")
    assert r.nucleus_misses > 0 and r.ks_p < P_MIN, r.summary()


def test_rank_order_ties_and_bounds():
    probs = np.array([[0.25, 0.25, 0.5, 0.0]] * 4)
    tokens = np.array([2, 0, 1, 3])
    v = np.array([0.5, 0.5, 0.5, 0.5])
    # order: token 2 (0.5), then 0 and 1 (tie, by id), then 3 (outside the support)
    np.testing.assert_allclose(randomized_pit(probs, tokens, v, "rank"), [0.25, 0.625, 0.875, 1.0])
    np.testing.assert_allclose(randomized_pit(probs, tokens, v, "id"), [0.75, 0.125, 0.375, 1.0])


class _Bigram:
    """A stand-in causal LM whose next-token logits depend on the last token only."""

    def __init__(self, table: torch.Tensor):
        self.table = table

    def __call__(self, input_ids):
        return type("Out", (), {"logits": self.table[input_ids]})()


def test_rescore_scores_each_token_given_its_own_prefix():
    """Samples of a bigram chain under the sampler's steps: PIT uniform. Scored
    one position off (the logits of the token itself): rejected."""
    g = torch.Generator().manual_seed(0)
    table = torch.randn(V, V, generator=g) * 3
    temperature, top_k, top_p = 0.8, 6, 0.9
    probs = vllm_processed_probs(table, temperature, top_k, top_p)
    prompts = [[1, 2, 3], [4, 5]]
    completions = []
    for prompt in prompts:
        comps = []
        for _ in range(60):
            seq, last = [], prompt[-1]
            for _ in range(20):
                last = int(torch.multinomial(probs[last].float(), 1, generator=g))
                seq.append(last)
            comps.append(seq)
        completions.append(comps)
    kw = dict(start=2, temperature=temperature, top_k=top_k, top_p=top_p)
    good = rescore(_Bigram(table), prompts, completions, **kw)
    assert good.count == 2 * 60 * 18
    assert good.nucleus_misses == 0
    assert good.ks_p > P_MIN and good.ks_p_id > P_MIN, good.summary()
    shifted = _Bigram(torch.cat([table[1:], table[:1]]))  # wrong row for every token
    bad = rescore(shifted, prompts, completions, **kw)
    assert bad.ks_p < P_MIN, bad.summary()
