"""Greedy DDTree is token-identical to plain decoding (CPU, fp32, tiny pair)."""

from __future__ import annotations

import pytest

from tests.conftest import run_job

pytestmark = pytest.mark.engine

PROMPTS = "humaneval:32"
SAMPLING = {"temperature": 0.0, "max_tokens": 128, "ignore_eos": True}


@pytest.fixture(scope="module")
def plain(tiny_pair, tmp_path_factory):
    target, _ = tiny_pair
    return run_job({"model": target, "prompts": PROMPTS, "sampling": SAMPLING},
                   tmp_path_factory.mktemp("plain"))


@pytest.mark.parametrize("budget", [1, 16, 64])
def test_greedy_identical_to_plain(plain, tiny_pair, tmp_path, budget):
    target, drafter = tiny_pair
    res = run_job({"model": target, "prompts": PROMPTS, "sampling": SAMPLING,
                   "speculative_config": {"method": "ddtree", "model": drafter,
                                          "num_speculative_tokens": budget}}, tmp_path)
    assert len(res["outputs"]) == 32
    for i, (a, b) in enumerate(zip(res["outputs"], plain["outputs"])):
        assert a == b, f"prompt {i}: ddtree(B={budget}) diverges from plain decoding"
    spec = res["spec"]
    assert spec["drafts"] > 0, "no speculative steps ran"
    # Each step verifies at most B nodes (the scheduler may truncate a tree to a
    # prefix of its flat order when the token budget is tight).
    assert spec["drafts"] * budget * 0.9 <= spec["draft_tokens"] <= spec["drafts"] * budget
    if budget >= 16:
        assert spec["tau"] > 2.0, f"implausibly low acceptance tau={spec['tau']}"
