"""DDTree under pressure: preemption and prompts at the edge of max_model_len."""

from __future__ import annotations

import pytest

from tests.conftest import run_job

pytestmark = pytest.mark.engine

GREEDY = {"temperature": 0.0, "max_tokens": 96, "ignore_eos": True}


def test_preemption_keeps_greedy_identical(tiny_pair, tmp_path):
    """A KV cache of 40 blocks x 32 tokens for 8 concurrent requests forces preemptions."""
    target, drafter = tiny_pair
    base = {"model": target, "prompts": "humaneval:8", "sampling": GREEDY,
            "llm": {"max_num_seqs": 8, "num_gpu_blocks_override": 40, "block_size": 32, "max_model_len": 1024,
                    "enable_prefix_caching": False}}
    plain = run_job(base, tmp_path)
    tree = run_job(dict(base, speculative_config={"method": "ddtree", "model": drafter,
                                                  "num_speculative_tokens": 32,
                                                  "ddtree_adaptive": False}), tmp_path)
    assert tree["preemptions"] > 0, "the test did not force any preemption"
    assert tree["outputs"] == plain["outputs"]


def test_prompts_near_max_model_len(tiny_pair, tmp_path):
    """Prompts 1..8 tokens short of max_model_len finish, within the limit."""
    from transformers import AutoTokenizer

    target, drafter = tiny_pair
    max_len = 384
    tok = AutoTokenizer.from_pretrained(target)
    text = open(__file__).read() * 4
    ids = tok(text)["input_ids"]
    prompts = [ids[: max_len - gap] for gap in range(1, 9)]
    base = {"model": target, "prompts": prompts, "sampling": {**GREEDY, "max_tokens": 64},
            "llm": {"max_model_len": max_len, "max_num_seqs": 8}}
    plain = run_job(base, tmp_path)
    tree = run_job(dict(base, speculative_config={"method": "ddtree", "model": drafter,
                                                  "num_speculative_tokens": 64,
                                                  "ddtree_adaptive": False}), tmp_path)
    for p, out in zip(prompts, tree["outputs"]):
        assert 1 <= len(out) and len(p) + len(out) <= max_len
    assert tree["outputs"] == plain["outputs"]
