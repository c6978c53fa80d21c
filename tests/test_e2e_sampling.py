"""Sampling with DDTree is distribution-identical to plain sampling.

T = 0.8, top-p 0.95, 4 code prompts x 500 samples per arm. The first generated
token comes from the prefill; the second from the first tree verification, so
the pair (t1, t2) exercises the tree walk's sample-and-match rule. A two-sample
chi-square test over the joint (prompt, t1, t2) categories must not reject at
p = 1e-3; a deliberately wrong walk (always accept the drafter's argmax) must.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from scipy.stats import chi2_contingency

from tests.conftest import run_job

pytestmark = pytest.mark.engine

PROMPTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n\ndef main(",
           "class Stack:\n    def __init__(self):\n        self.", "    for i in range("]
N = 500
SAMPLING = {"temperature": 0.8, "top_p": 0.95, "max_tokens": 2, "ignore_eos": True, "n": N}
P_MIN = 1e-3


def _pairs(result) -> Counter:
    c = Counter()
    for p, comps in enumerate(result["outputs"]):
        assert len(comps) == N
        for toks in comps:
            assert len(toks) == 2
            c[(p, toks[0], toks[1])] += 1
    return c


def chi_square_p(a: Counter, b: Counter) -> float:
    """Two-sample chi-square; categories with < 10 pooled counts are merged."""
    keys = sorted(set(a) | set(b))
    small = [k for k in keys if a[k] + b[k] < 10]
    big = [k for k in keys if a[k] + b[k] >= 10]
    table = [[a[k] for k in big], [b[k] for k in big]]
    if small:
        table[0].append(sum(a[k] for k in small))
        table[1].append(sum(b[k] for k in small))
    return float(chi2_contingency(np.array(table))[1])


@pytest.fixture(scope="module")
def arms(tiny_pair, tmp_path_factory):
    target, drafter = tiny_pair
    tmp = tmp_path_factory.mktemp("sampling")
    spec = {"method": "ddtree", "model": drafter, "num_speculative_tokens": 16}
    base = {"model": target, "prompts": PROMPTS, "sampling": SAMPLING,
            "llm": {"max_num_seqs": 128, "seed": 1234}}
    plain = run_job(base, tmp)
    ddtree = run_job(dict(base, speculative_config=spec, llm={"max_num_seqs": 128, "seed": 99}),
                     tmp)
    wrong = run_job(dict(base, speculative_config=spec, setup="tests.wrong_walk:install",
                         env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
                         llm={"max_num_seqs": 128, "seed": 7}), tmp)
    return plain, ddtree, wrong


def test_ddtree_sampling_matches_plain(arms):
    plain, ddtree, _ = arms
    assert ddtree["spec"]["drafts"] > 0
    p = chi_square_p(_pairs(plain), _pairs(ddtree))
    assert p > P_MIN, f"ddtree sampling differs from plain sampling (p={p:.3g})"


def test_wrong_walk_is_detected(arms):
    plain, _, wrong = arms
    p = chi_square_p(_pairs(plain), _pairs(wrong))
    assert p < P_MIN, f"the chi-square test cannot tell a wrong walk apart (p={p:.3g})"
