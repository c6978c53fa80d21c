"""Greedy DDTree is token-identical to plain decoding (CPU, fp32, tiny pair).

These runs pin the budget (``ddtree_adaptive: false``), so that every step
verifies B nodes per request; ``test_e2e_adaptive.py`` covers the adaptive
budget, and ``test_e2e_api.py`` a budget of 16 with per-request logits
transformations, logprobs and structured output."""

from __future__ import annotations

import pytest

from tests.conftest import run_job
from tests.shared_engines import GREEDY_128

pytestmark = pytest.mark.engine

PROMPTS = "humaneval:16"
SAMPLING = GREEDY_128


@pytest.fixture(scope="module")
def plain(plain_reference):
    return plain_reference("eager", "humaneval16")  # (declared in conftest)


@pytest.fixture(scope="module")
def plain_compiled(plain_reference):
    return plain_reference("compiled", "humaneval16")


def _ddtree(tiny_pair, tmp_path, budget, eager=True, multiprocess=False):
    target, drafter = tiny_pair
    return run_job({"model": target, "prompts": PROMPTS, "sampling": SAMPLING,
                    "llm": {"enforce_eager": eager},
                    "speculative_config": {"method": "ddtree", "model": drafter,
                                           "num_speculative_tokens": budget,
                                           "ddtree_adaptive": False}}, tmp_path,
                   multiprocess=multiprocess)


def _assert_identical(res, plain, what):
    assert len(res["outputs"]) == 16
    for i, (a, b) in enumerate(zip(res["outputs"], plain["outputs"])):
        assert a == b, f"prompt {i}: {what} diverges from plain decoding"


def test_greedy_compiled_identical_to_plain_compiled(plain_compiled, tiny_pair, tmp_path):
    """The default serving mode compiles the target into one graph, whose
    activation buffers are reused after each cache write: compaction must not
    depend on them. It runs in vLLM's default multiprocess layout (engine core
    and worker in processes of their own, the ddtree metrics read across them)."""
    res = _ddtree(tiny_pair, tmp_path, 32, eager=False, multiprocess=True)
    _assert_identical(res, plain_compiled, "compiled ddtree(B=32)")
    check_ddtree_metrics(res["spec"], 32)


@pytest.mark.parametrize("budget", [64])
def test_greedy_identical_to_plain(plain, tiny_pair, tmp_path, budget):
    res = _ddtree(tiny_pair, tmp_path, budget)
    _assert_identical(res, plain, f"ddtree(B={budget})")
    spec = res["spec"]
    assert spec["drafts"] > 0, "no speculative steps ran"
    # Each step verifies at most B nodes (the scheduler may truncate a tree to a
    # prefix of its flat order when the token budget is tight).
    assert spec["drafts"] * budget * 0.9 <= spec["draft_tokens"] <= spec["drafts"] * budget
    if budget >= 16:
        assert spec["tau"] > 2.0, f"implausibly low acceptance tau={spec['tau']}"
    check_ddtree_metrics(spec, budget)


def check_ddtree_metrics(spec: dict, budget: int) -> None:
    """The vllm:ddtree_* metrics agree with vLLM's own spec-decode counters."""
    dd = spec["ddtree"]
    assert dd is not None, "no vllm:ddtree_* metrics exported"
    assert dd["num_drafts"] == spec["drafts"]
    assert dd["num_nodes_verified"] == spec["draft_tokens"]
    assert dd["num_accepted_tokens"] == spec["accepted"]
    assert 0 < dd["num_tree_drafts"] <= dd["num_drafts"]
    assert dd["acceptance_length"] == pytest.approx(spec["tau"])
    hist = dd["accepted_depth"]
    assert hist["count"] == spec["drafts"] and hist["sum"] == spec["accepted"]
    # vLLM counts accepted tokens per position (= per depth): position d is
    # accepted in every draft whose path is longer than d.
    # Buckets stop at the drafter depth; no path is longer.
    depth = len(hist["buckets"]) - 2
    cum = [hist["buckets"].get(f"{float(d)}", hist["count"])
           for d in range(len(spec["accepted_per_pos"]))]
    assert [spec["drafts"] - c for c in cum] == spec["accepted_per_pos"]
    # The drafter's expectation is a sum of prefix probabilities: at most one
    # per verified node, and a path is at most `depth` long.
    assert 0 < dd["expected_accepted_tokens"] <= dd["num_nodes_verified"]
    assert 1 < dd["expected_acceptance_length"] <= 1 + min(budget, depth)
