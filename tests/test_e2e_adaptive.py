"""The adaptive tree budget through the engine (CPU, fp32, tiny pair).

* Greedy output is token-identical to plain decoding with the adaptive
  policy on: with its own profiled cost model, and with pinned cost models
  (``VLLM_DDTREE_COST_MODEL``) that force the two regimes it must handle:
  per-request budgets that differ inside one step, and plain steps (the
  drafter's block skipped) with periodic probes.
* Plain steps keep the drafter in sync: a tree drafted after plain steps is
  the tree an always-drafting engine proposes at the same position (and a
  plain mode that drops the drafter's context K/V fails that check), also
  on prefix-cache hits of blocks a finished request filled in plain mode.
* The budget metrics agree with vLLM's own spec-decode counters.
"""

from __future__ import annotations

import json

import pytest

from tests.adaptive_probe import ENV_LOG, ENV_SHADOW_LOG, ENV_STEP_LOG
from tests.conftest import IN_PROCESS, run_job

pytestmark = pytest.mark.engine

PROMPTS = "humaneval:16"
SAMPLING = {"temperature": 0.0, "max_tokens": 96, "ignore_eos": True}
BUDGET = 16
# ms: A + B * tokens, plus D with the drafter.
COST_MIXED = "10,0.05,1"  # cheap tokens: budgets differ by the drafter's confidence
COST_PLAIN = "1,1,5"  # trees never pay: plain steps, a probe every 32 steps
SYNC_SAMPLING = dict(SAMPLING, max_tokens=128)  # 3 probes per request in plain mode


@pytest.fixture(scope="module")
def plain(plain_reference):
    """The shared 128-token greedy reference, cut to 96 tokens: the 16 requests
    decode in lockstep, so its first 96 steps are exactly a 96-token run's."""
    ref = plain_reference("eager", "humaneval16")
    assert ref["prompt_ids"] and len(ref["outputs"]) == 16
    return {"outputs": [o[: SAMPLING["max_tokens"]] for o in ref["outputs"]]}


def _ddtree(tiny_pair, tmp_path, adaptive=True, env=None, **job):
    target, drafter = tiny_pair
    spec = {"method": "ddtree", "model": drafter, "num_speculative_tokens": BUDGET}
    if not adaptive:
        spec["ddtree_adaptive"] = False
    return run_job(dict({"model": target, "prompts": PROMPTS, "sampling": SAMPLING,
                         "speculative_config": spec, "env": env or {}}, **job), tmp_path)


def _assert_identical(res, plain, what):
    assert len(res["outputs"]) == len(plain["outputs"])
    for i, (a, b) in enumerate(zip(res["outputs"], plain["outputs"])):
        assert a == b, f"prompt {i}: {what} diverges from plain decoding"


def _budget_counts(res) -> dict:
    dd = res["spec"]["ddtree"]
    assert dd is not None and dd.get("budget_decisions"), "no adaptive-budget metrics"
    return dd


def test_adaptive_profiled_greedy_identical(plain, tiny_pair, tmp_path):
    # Short trials: the tuner's cold start (every arm once) ends within the
    # run's 96 steps however fast this machine's steps are (a 0.3 s plain
    # trial outlasts the run where a step takes under 3 ms).
    shadows = tmp_path / "shadows.jsonl"
    res = _ddtree(tiny_pair, tmp_path,
                  setup="tests.adaptive_probe:record_shadows_and_draft_calls",
                  env=dict(IN_PROCESS, VLLM_DDTREE_TRIAL_SECONDS="0.02",
                           **{ENV_SHADOW_LOG: str(shadows)}))
    _assert_identical(res, plain, "adaptive ddtree (profiled cost)")
    # Fixed trees' steps report what every smaller budget of the ladder would
    # have committed (the tuner's shadow comparisons): no more than the step
    # did, rising with the budget; and some
    # fell short of the step's own count (deep nodes were accepted).
    lines = [json.loads(line) for line in shadows.read_text().splitlines()]
    # Every step's drafts rode on its output: the engine core never asked
    # the executor for them (patches/step_drafts.py), yet it verified trees.
    calls = [s for s in lines if "executor_take" in s]
    assert not calls, f"the engine core fetched drafts in {len(calls)} calls of its own"
    lines = [s for s in lines if "executor_take" not in s]
    steps = [s for s in lines if "built" not in s]
    # A fixed arm builds trees of its own budget only (the first nodes of the
    # full tree); the model arm builds the full budget and cuts it.
    built = [s for s in lines if "built" in s]
    assert any(s["arm"] == "model" for s in built), built
    assert any(s["arm"].startswith("fixed") and s["budget"] < 16 for s in built), built
    for s in built:
        assert s["built"] == (s["budget"] if s["arm"].startswith("fixed") else 16), s
    shadowed = [s for s in steps if s["shadow"] is not None]
    assert shadowed, "no step reported shadow counts"
    ladder = [2, 4, 8]  # below BUDGET = 16
    short = 0
    for s in shadowed:
        got = [s["shadow"][str(b)] for b in ladder]
        assert list(s["shadow"]) == [str(b) for b in ladder]
        assert 0 <= got[0] and got == sorted(got) and got[-1] <= s["tokens"], s
        short += got[0] < s["tokens"]
    assert short > 0, "no fixed tree step accepted a node past budget 2"
    dd = _budget_counts(res)
    spec = res["spec"]
    # Nodes are verified one step after they are chosen; requests that finish
    # leave their last choice unverified.
    assert spec["draft_tokens"] <= dd["budget_chosen_nodes"]
    assert dd["budget_plain_steps"] <= dd["budget_decisions"]
    if spec["drafts"]:
        assert dd["num_nodes_verified"] == spec["draft_tokens"]
        assert dd["num_accepted_tokens"] == spec["accepted"]
    cal = dd["budget_calibration"]
    assert len(cal) == 32 and all(0 <= v <= 1 for v in cal.values())
    values = [cal[k] for k in sorted(cal, key=lambda k: -float(k))]
    assert values == sorted(values, reverse=True), "calibration not monotone in q"
    cost = dd["budget_cost_seconds"]
    assert 0 < cost["plain_step"] <= cost["tree_step"] and cost["draft"] > 0
    # the delivered-rate tuner ran several arms and measured them
    arms = dd["budget_arm_steps"]
    assert sum(v > 0 for v in arms.values()) >= 2, arms
    assert max(dd["budget_arm_request_rate"].values()) > 0


def test_adaptive_mixed_budgets_greedy_identical(plain, tiny_pair, tmp_path):
    """Per-request budgets differ within a step; every choice is verified as a
    prefix of its tree and the output stays plain decoding's."""
    res = _ddtree(tiny_pair, tmp_path, env={"VLLM_DDTREE_COST_MODEL": COST_MIXED})
    _assert_identical(res, plain, "adaptive ddtree (mixed budgets)")
    spec, dd = res["spec"], _budget_counts(res)
    assert spec["drafts"] > 0 and spec["accepted"] > 0
    per_draft = spec["draft_tokens"] / spec["drafts"]
    assert 1 < per_draft < BUDGET - 1, f"budgets did not adapt: {per_draft:.1f} nodes per draft"
    # Steps chose different totals (the histogram spans several buckets).
    buckets = dd["budget_nodes_per_step"]["buckets"]
    counts = [buckets[k] for k in sorted(buckets, key=lambda k: float(k))]
    assert sum(1 for a, b in zip([0] + counts, counts) if b > a) >= 3
    assert spec["tau"] > 2.0


def test_padded_trees_greedy_identical(plain, tiny_pair, tmp_path):
    """Cut trees padded back to the full budget (what full CUDA graphs run,
    forced here with VLLM_DDTREE_PAD_TREES=1): every verification batch is
    uniform, the walk accepts only the chosen nodes, and the tokens are
    plain decoding's."""
    res = _ddtree(tiny_pair, tmp_path, prompts="humaneval:8",
                  env={"VLLM_DDTREE_COST_MODEL": COST_MIXED, "VLLM_DDTREE_PAD_TREES": "1"})
    _assert_identical(res, {"outputs": plain["outputs"][:8]}, "adaptive ddtree (padded)")
    spec, dd = res["spec"], _budget_counts(res)
    assert spec["drafts"] > 0 and spec["accepted"] > 0
    # vLLM verified full trees; the walk used only the policy's nodes
    assert spec["draft_tokens"] == spec["drafts"] * BUDGET
    per_draft = dd["num_nodes_verified"] / spec["drafts"]
    assert 1 < per_draft < BUDGET - 1, f"nothing was padded: {per_draft:.1f} usable nodes"
    assert dd["num_accepted_tokens"] == spec["accepted"]


@pytest.fixture(scope="module")
def always_drafting(tiny_pair, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("always")
    log = tmp / "trees.jsonl"
    res = _ddtree(tiny_pair, tmp, adaptive=False, env=dict(IN_PROCESS, **{ENV_LOG: str(log)}),
                  setup="tests.adaptive_probe:record_trees", prompts="humaneval:2",
                  sampling=SYNC_SAMPLING)
    return res, _trees(log)


def _trees(path) -> dict:
    out = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        out[(tuple(rec["prompt"]), rec["root"])] = rec
    return out


def _plain_mode(tiny_pair, tmp_path, hook, env=None):
    log = tmp_path / "trees.jsonl"
    env = dict(IN_PROCESS, **{ENV_LOG: str(log), "VLLM_DDTREE_COST_MODEL": COST_PLAIN},
               **(env or {}))
    res = _ddtree(tiny_pair, tmp_path, env=env, setup=f"tests.adaptive_probe:{hook}",
                  prompts="humaneval:2", sampling=SYNC_SAMPLING)
    return res, _trees(log)


def _compare_after_plain(trees, reference):
    """(matching, total) trees drafted after plain steps, against the
    always-drafting engine's tree at the same root position."""
    after = [(k, t) for k, t in trees.items() if t["after_plain"] and k in reference]
    same = 0
    for key, t in after:
        ref = reference[key]
        close = max(abs(a - b) for a, b in zip(t["logq"], ref["logq"])) < 1e-3
        same += close and t["tokens"] == ref["tokens"]
    return same, len(after)


def test_plain_steps_keep_the_drafter_in_sync(always_drafting, tiny_pair, tmp_path):
    """... and run as a plain engine's steps: without vLLM's speculative
    metadata or its drafting hook, their tokens kept for the drafter."""
    ref_res, reference = always_drafting
    steps = tmp_path / "steps.log"
    res, trees = _plain_mode(tiny_pair, tmp_path, "record_trees_and_steps",
                             {ENV_STEP_LOG: str(steps)})
    assert res["outputs"] == ref_res["outputs"], "plain mode changed the greedy output"
    dd = _budget_counts(res)
    assert dd["budget_plain_steps"] > 0.8 * dd["budget_decisions"], "trees were chosen"
    events = steps.read_text().split("\n")[:-1]
    kept = [i for i, e in enumerate(events) if e == "kept"]
    assert len(kept) >= 0.8 * dd["budget_decisions"] - 1, (len(kept), dd)
    for i in kept:  # since the step's metadata: no drafting hook, no spec metadata
        last_meta = max(j for j in range(i) if events[j].startswith("meta"))
        assert events[last_meta] == "meta plain" and "propose" not in events[last_meta:i]
    assert "meta spec" in events and "propose" in events  # the probes' and trees' steps
    assert res["spec"]["drafts"] > 0, "no probe verified a tree"
    same, total = _compare_after_plain(trees, reference)
    assert total >= 2, f"only {total} trees drafted after plain steps"
    assert same == total, f"{total - same} of {total} trees after plain steps differ"


def test_missing_context_after_plain_steps_is_detected(always_drafting, tiny_pair, tmp_path):
    _, reference = always_drafting
    res, trees = _plain_mode(tiny_pair, tmp_path, "record_trees_without_context")
    same, total = _compare_after_plain(trees, reference)
    assert total >= 1
    assert same <= total // 2, "the sync check cannot see a drafter without context"


# Two turns with prefix caching: turn 2 sends turn 1's prompt + output, and
# hits the full blocks whose drafter context plain mode kept pending until
# the request finished (stored then; the partial last block's rows dropped).
TURN_BLOCK = 32  # small blocks: the rows pending at a finish complete one
TWO_TURNS = {"llm": {"enable_prefix_caching": True, "block_size": TURN_BLOCK},
             "followup": {"suffix": "\n    ",
                          "sampling": dict(SYNC_SAMPLING, max_tokens=64)}}


def _two_turns(tiny_pair, tmp_path, hook, adaptive=True, cost=COST_PLAIN):
    log = tmp_path / "trees.jsonl"
    env = dict(IN_PROCESS, **{ENV_LOG: str(log)})
    if adaptive:
        env["VLLM_DDTREE_COST_MODEL"] = cost
    res = _ddtree(tiny_pair, tmp_path, adaptive=adaptive, env=env,
                  setup=f"tests.adaptive_probe:{hook}", prompts="humaneval:2",
                  sampling=SYNC_SAMPLING, **TWO_TURNS)
    trees = _trees(log)
    start = {tuple(p[:16]): len(p) - 1 for p in res["followup"]["prompts"]}
    turn2 = {k: t for k, t in trees.items() if k[1] >= start[k[0]]}
    return res, turn2


@pytest.fixture(scope="module")
def always_drafting_two_turns(tiny_pair, tmp_path_factory):
    return _two_turns(tiny_pair, tmp_path_factory.mktemp("always2"), "record_trees",
                      adaptive=False)


def test_prefix_hits_after_plain_mode_keep_the_drafter_in_sync(always_drafting_two_turns,
                                                               tiny_pair, tmp_path):
    """Turn 2's trees drafted on blocks that turn 1 filled in plain mode are
    the always-drafting engine's trees at the same positions."""
    ref_res, reference = always_drafting_two_turns
    res, turn2 = _two_turns(tiny_pair, tmp_path, "record_trees")
    assert res["outputs"] == ref_res["outputs"]
    fu = res["followup"]
    assert fu["outputs"] == ref_res["followup"]["outputs"], "turn 2 diverged"
    turn1_lengths = [len(p) - len(o) - len(fu["suffix"])
                     for p, o in zip(fu["prompts"], res["outputs"])]
    # the hits reach into blocks of tokens turn 1 generated in plain mode
    assert all(h > n + TURN_BLOCK for h, n in zip(fu["prefix_cache"]["per_prompt"],
                                                  turn1_lengths)), fu["prefix_cache"]
    same, total = _compare_after_plain(turn2, reference)
    assert total >= 2, f"only {total} turn-2 trees drafted after plain steps"
    assert same == total, f"{total - same} of {total} turn-2 trees differ"


def test_dropped_rows_of_cached_blocks_are_detected(always_drafting_two_turns, tiny_pair,
                                                   tmp_path):
    """The check above sees a release that drops the rows of cached blocks."""
    _, reference = always_drafting_two_turns
    _, turn2 = _two_turns(tiny_pair, tmp_path, "record_trees_dropping_released_rows")
    same, total = _compare_after_plain(turn2, reference)
    assert total >= 2
    assert same < total, "the sync check cannot see the rows of cached blocks dropped"
