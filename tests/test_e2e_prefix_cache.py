"""Prefix-cache hits on blocks filled by compacted tree nodes give plain decoding's output.

Turn 1 greedy-generates with DDTree; every accepted node's K/V is moved from
its tree slot to its sequence slot (compaction), so the full blocks that hold
generated tokens were written by that compaction. Turn 2, in the same engine,
sends turn 1's prompt + output + a few tokens: with prefix caching on, those
blocks are hits and their K/V is read instead of recomputed. If compaction left
a wrong K/V in a cached block, turn 2 diverges from plain decoding doing the
same two turns.
"""

from __future__ import annotations

import pytest

from tests.conftest import IN_PROCESS, run_job

pytestmark = pytest.mark.engine

BLOCK = 32  # CPU_ATTN needs a multiple of 32
TURN1 = {"temperature": 0.0, "max_tokens": 96, "ignore_eos": True}
TURN2 = {"temperature": 0.0, "max_tokens": 48, "ignore_eos": True}
SUFFIX = "\n    "


@pytest.fixture(scope="module")
def two_turns(tiny_pair, tmp_path_factory):
    target, drafter = tiny_pair
    base = {"model": target, "prompts": "humaneval:4", "sampling": TURN1, "env": IN_PROCESS,
            "llm": {"enable_prefix_caching": True, "block_size": BLOCK},
            "followup": {"suffix": SUFFIX, "sampling": TURN2}}
    plain = run_job(base, tmp_path_factory.mktemp("plain"))
    tree = run_job(dict(base, speculative_config={"method": "ddtree", "model": drafter,
                                                  "num_speculative_tokens": 32,
                                                  "ddtree_adaptive": False}),
                   tmp_path_factory.mktemp("ddtree"))
    return plain, tree


def test_turn1_matches_plain(two_turns):
    plain, tree = two_turns
    assert tree["spec"]["drafts"] > 0 and tree["spec"]["accepted"] > 0
    assert tree["outputs"] == plain["outputs"]


def test_turn2_hits_generated_blocks(two_turns):
    """Turn 2 read the K/V of turn 1's generated tokens from the prefix cache."""
    for run in two_turns:
        fu = run["followup"]
        assert all(len(o) == TURN1["max_tokens"] for o in run["outputs"])
        first = [len(p) - len(o) - len(fu["suffix"])  # turn 1's prompt lengths
                 for p, o in zip(fu["prompts"], run["outputs"])]
        per_prompt = fu["prefix_cache"]["per_prompt"]
        # vLLM's counter (vllm:prefix_cache_hits) saw exactly these hits.
        assert fu["prefix_cache"]["hits"] == sum(per_prompt) > 0
        # Every request's hit reaches past its turn-1 prompt into generated tokens.
        assert all(h > n for h, n in zip(per_prompt, first)), (per_prompt, first)
    plain, tree = two_turns
    # Plain decoding caches every block turn 1 computed in full (its last
    # sampled token is never fed).
    fu = plain["followup"]
    full = [(len(p) - len(fu["suffix"]) - 1) // BLOCK * BLOCK for p in fu["prompts"]]
    assert fu["prefix_cache"]["per_prompt"] == full
    # DDTree keeps the last matched block (vLLM drops it for EAGLE-style
    # drafters, DFlash among them; patches/spec_config.py), so a hit reaches
    # as far as plain decoding's, except that the tokens accepted in a
    # request's final step are never cached: one block less where they
    # crossed a block boundary. With vLLM's drop no hit could reach `full`.
    hits = tree["followup"]["prefix_cache"]["per_prompt"]
    assert all(h in (f, f - BLOCK) for h, f in zip(hits, full)), (hits, full)
    assert any(h == f for h, f in zip(hits, full)), (hits, full)


def test_turn2_matches_plain(two_turns):
    plain, tree = two_turns
    assert tree["followup"]["prompts"] == plain["followup"]["prompts"]
    assert tree["followup"]["spec"]["drafts"] > 0, "turn 2 ran without DDTree drafts"
    assert tree["followup"]["outputs"] == plain["followup"]["outputs"]
