"""DDTree under pressure: preemption and prompts at the edge of max_model_len,
in one engine per arm (plain and DDTree)."""

from __future__ import annotations

import pytest

from tests.conftest import run_job

pytestmark = pytest.mark.engine

MAX_LEN = 384
GREEDY = {"temperature": 0.0, "max_tokens": 64, "ignore_eos": True}
NUM_HUMANEVAL = 8


@pytest.fixture(scope="module")
def runs(tiny_pair, tmp_path_factory):
    """8 HumanEval prompts and 8 prompts 1..8 tokens short of max_model_len, 8
    at a time, in a KV cache of 40 blocks x 32 tokens: a near-limit prompt
    alone takes 12 blocks, so requests are preempted."""
    from transformers import AutoTokenizer

    from benchmarks.run_llm import humaneval_prompts

    target, drafter = tiny_pair
    tok = AutoTokenizer.from_pretrained(target)
    ids = tok(open(__file__).read() * 8)["input_ids"]
    near = [ids[: MAX_LEN - gap] for gap in range(1, 9)]
    prompts = humaneval_prompts(NUM_HUMANEVAL) + near
    base = {"model": target, "prompts": prompts, "sampling": GREEDY,
            "llm": {"max_model_len": MAX_LEN, "max_num_seqs": 8, "num_gpu_blocks_override": 40,
                    "block_size": 32, "enable_prefix_caching": False}}
    work = tmp_path_factory.mktemp("limits")
    plain = run_job(base, work)
    tree = run_job(dict(base, speculative_config={"method": "ddtree", "model": drafter,
                                                  "num_speculative_tokens": 64,
                                                  "ddtree_adaptive": False}), work)
    return prompts, plain, tree


def test_preemption_keeps_greedy_identical(runs):
    _, plain, tree = runs
    assert tree["preemptions"] > 0, "the test did not force any preemption"
    assert tree["outputs"] == plain["outputs"]


def test_prompts_near_max_model_len(runs):
    """They finish, within the limit, as plain decoding does."""
    prompts, plain, tree = runs
    for p, out in zip(prompts[NUM_HUMANEVAL:], tree["outputs"][NUM_HUMANEVAL:]):
        assert 1 <= len(out) and len(p) + len(out) <= MAX_LEN
    assert tree["outputs"] == plain["outputs"]
