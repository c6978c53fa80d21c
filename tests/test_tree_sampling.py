"""process_logits / sample_posterior: greedy rows, seeds, temperature, min-p, top-k, top-p."""

import numpy as np
import pytest
import torch
from scipy import stats

from vllm_ddtree.core.tree import process_logits, sample_posterior


pytestmark = pytest.mark.usefixtures("one_thread")

PROBS = [0.5, 0.3, 0.15, 0.05]


def logits_of(probs, rows=1, nodes=1):
    x = torch.tensor(probs, dtype=torch.float32).log()
    return x.expand(rows, nodes, len(probs)).clone()


def support(x):
    return torch.isfinite(x).nonzero()[:, -1].tolist()


def params(b, t=1.0, k=None, p=None, mp=None):
    temp = torch.full((b,), t)
    top_k = None if k is None else torch.full((b,), k, dtype=torch.long)
    top_p = None if p is None else torch.full((b,), p)
    min_p = None if mp is None else torch.full((b,), mp)
    return temp, top_k, top_p, min_p


@pytest.mark.parametrize(
    "kw,expected",
    [
        (dict(k=2), [0, 1]),
        (dict(k=3), [0, 1, 2]),
        (dict(p=0.75), [0, 1]),  # ascending cumsum 0.05, 0.2 <= 0.25 dropped
        (dict(p=0.85), [0, 1, 2]),  # only 0.05 <= 0.15 dropped
        (dict(p=0.4), [0]),
        (dict(p=0.0), [0]),  # top-p always keeps the most probable token
        (dict(mp=0.5), [0, 1]),  # threshold 0.25
        (dict(mp=0.2), [0, 1, 2]),  # threshold 0.1
        (dict(t=0.5, mp=0.25), [0, 1]),  # min-p after temperature (before: 0, 1, 2)
        (dict(k=2, p=0.5), [0]),  # top-p renormalises over top-k survivors
        (dict(k=3, p=0.8, mp=0.2), [0, 1]),
    ],
)
def test_filters_on_hand_made_distribution(kw, expected):
    temp, top_k, top_p, min_p = params(1, **kw)
    out = process_logits(logits_of(PROBS), temp, top_k, top_p, min_p)
    assert support(out[0, 0]) == expected
    # survivors keep their relative (tempered) probabilities
    t = kw.get("t", 1.0)
    ref = np.array(PROBS) ** (1 / t)
    ref = np.where(np.isin(np.arange(4), expected), ref, 0)
    np.testing.assert_allclose(out.softmax(-1)[0, 0].numpy(), ref / ref.sum(), atol=1e-6)


def test_top_k_keeps_ties_at_threshold():
    x = torch.tensor([[[1.0, 1.0, 1.0, 0.0, 2.0]]])
    temp, top_k, _, _ = params(1, k=2)
    assert support(process_logits(x, temp, top_k)[0, 0]) == [0, 1, 2, 4]


@pytest.mark.parametrize("off", [dict(k=0), dict(k=-1), dict(k=4), dict(k=100), dict(p=1.0), dict(mp=0.0)])
def test_off_values_change_nothing(off):
    temp, top_k, top_p, min_p = params(1, t=0.7, **off)
    x = logits_of(PROBS)
    torch.testing.assert_close(process_logits(x, temp, top_k, top_p, min_p), x / 0.7)


def test_per_row_parameters_and_greedy_rows_use_unit_temperature():
    x = logits_of(PROBS, rows=4, nodes=3)
    temp = torch.tensor([0.0, 0.5, 1.0, 1.0])
    top_k = torch.tensor([0, 0, 2, 0])
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.4])
    min_p = torch.tensor([0.0, 0.25, 0.0, 0.0])
    out = process_logits(x, temp, top_k, top_p, min_p)
    assert [support(out[r, 1]) for r in range(4)] == [[0, 1, 2, 3], [0, 1], [0, 1], [0]]
    torch.testing.assert_close(out[0], x[0])  # T=0 rows are divided by 1, as in vLLM


def test_greedy_rows_are_argmax():
    torch.manual_seed(0)
    x = torch.randn(6, 9, 50) * 3
    temp = torch.tensor([0.0, 1.0, 1e-6, 0.8, 0.0, 2.0])
    post = sample_posterior(x, temp, torch.tensor([1, 0, 3, 0, 5, 0]), torch.full((6,), 0.9), torch.full((6,), 0.1))
    assert post.shape == (6, 9) and post.dtype == torch.int64
    greedy = x.argmax(-1)
    for r in (0, 2, 4):
        assert torch.equal(post[r], greedy[r])
    assert not torch.equal(post[[1, 3, 5]], greedy[[1, 3, 5]])


def test_greedy_argmax_takes_first_index_on_ties():
    x = torch.tensor([[[0.0, 2.0, 2.0, 1.0], [3.0, 3.0, 3.0, 3.0]]])
    post = sample_posterior(x, torch.zeros(1))
    assert post.tolist() == [[1, 0]]


def test_seeded_rows_are_reproducible_and_batch_independent():
    torch.manual_seed(0)
    x = torch.randn(3, 17, 30)
    temp = torch.ones(3)

    def run(global_seed, rows, gen_rows):
        torch.manual_seed(global_seed)
        gens = {i: torch.Generator().manual_seed(1234 + r) for i, r in enumerate(rows) if r in gen_rows}
        return sample_posterior(x[rows], temp[rows], generators=gens)

    a = run(1, [0, 1, 2], {1})
    b = run(2, [0, 1, 2], {1})
    c = run(3, [1], {1})
    assert torch.equal(a[1], b[1]) and torch.equal(a[1], c[0])
    assert not torch.equal(a[0], b[0])  # unseeded rows follow the global RNG
    d = run(4, [0, 1, 2], {0, 1, 2})  # every row seeded
    e = run(5, [0, 1, 2], {0, 1, 2})
    assert torch.equal(d, e) and torch.equal(d[1], a[1])
    f = sample_posterior(x[[1]], temp[[1]], generators={0: torch.Generator().manual_seed(999)})
    assert not torch.equal(f[0], c[0])  # the seed matters


def test_samples_follow_processed_distribution():
    torch.manual_seed(0)
    n = 40000
    x = torch.randn(3, 1, 6).expand(3, n, 6).contiguous()  # n nodes share a distribution
    temp = torch.tensor([1.0, 0.7, 1.3])
    top_k = torch.tensor([0, 4, 0])
    top_p = torch.tensor([1.0, 1.0, 0.9])
    min_p = torch.tensor([0.05, 0.0, 0.0])
    post = sample_posterior(x, temp, top_k, top_p, min_p)
    probs = process_logits(x[:, :1], temp, top_k, top_p, min_p).softmax(-1)[:, 0].double().numpy()
    for r in range(3):
        counts = np.bincount(post[r].numpy(), minlength=6)
        zero = probs[r] == 0
        assert zero.any() or r == 0
        assert counts[zero].sum() == 0
        p = stats.chisquare(counts[~zero], probs[r][~zero] / probs[r][~zero].sum() * n).pvalue
        assert p > 1e-3, (r, counts, probs[r] * n)
    # and the test has power: sampling the unprocessed distribution fails it
    wrong = np.bincount(sample_posterior(x[1:2], torch.ones(1))[0].numpy(), minlength=6)
    assert wrong[probs[1] == 0].sum() > 0 or stats.chisquare(wrong, probs[1] * n).pvalue < 1e-3


def test_exact_zero_noise_never_picks_a_removed_token(monkeypatch):
    # An exact zero draw for a removed token would make p / E = 0 / 0 = NaN.
    x = torch.log(torch.tensor([[[0.9, 0.1, 1e-30]]]))
    temp, top_k, _, _ = params(1, k=1)
    monkeypatch.setattr(torch.Tensor, "exponential_", lambda self, *a, **k: self.zero_())
    assert sample_posterior(x, temp, top_k).item() == 0
