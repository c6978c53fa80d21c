"""vLLM runs the drafter that was trained: the DFlash chain's acceptance in the
engine equals a plain-PyTorch run of the same exported weights
(``benchmarks/tiny_pair/chain_oracle.py``).

Greedy identity cannot see a wrong drafter (the target verifies every token),
so a drafter computed wrongly in vLLM only lowers acceptance, silently. This
happened: vLLM CPU's grouped K-norm gave every drafter layer after the first
the first layer's weights (``patches/cpu_dflash_k_norm.py``); the chain's
tau on 32 HumanEval prompts was 2.60 in the engine against 3.11 here. The
drafter is shared by the chain and DDTree, so the chain is the clean probe."""

from __future__ import annotations

import pytest

from tests.conftest import run_job

pytestmark = pytest.mark.engine

N_PROMPTS, MAX_TOKENS = 8, 128


def test_engine_chain_acceptance_equals_the_torch_oracle(tiny_pair, tmp_path):
    from benchmarks.run_llm import humaneval_prompts
    from benchmarks.tiny_pair.chain_oracle import chain_acceptance

    target, drafter = tiny_pair
    res = run_job({"model": target, "prompts": f"humaneval:{N_PROMPTS}",
                   "sampling": {"temperature": 0.0, "max_tokens": MAX_TOKENS,
                                "ignore_eos": True},
                   "speculative_config": {"method": "dflash", "model": drafter,
                                          "num_speculative_tokens": 15}}, tmp_path)
    oracle = chain_acceptance(target, drafter, humaneval_prompts(N_PROMPTS), MAX_TOKENS)
    spec = res["spec"]
    # fp32 on both sides: equal up to a near-tie in a drafter argmax (measured: equal)
    assert spec["drafts"] == pytest.approx(oracle["drafts"], rel=0.01), (spec, oracle)
    assert spec["accepted"] == pytest.approx(oracle["accepted"], rel=0.01), (spec, oracle)
    assert oracle["tau"] > 2.5, f"the bundled drafter lost its acceptance: {oracle}"
