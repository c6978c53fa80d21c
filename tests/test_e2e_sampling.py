"""Sampling with DDTree draws every token from the target's own distribution.

DDTree runs through vLLM (B = 16, fp32) at temperature 0.8, top-k 5, top-p
0.95, ``ignore_eos``: 4 HumanEval prompts x 32 samples x 40 tokens. The
target is then rescored independently in transformers (fp32). For every
generated token from the third on (the first comes from the prefill, the
second is the first tree's root sample, so neither depends on tree nodes) the
request's sampling distribution is recomputed as plain vLLM sampling does it
(temperature, then vLLM's torch top-k/top-p) and the randomized PIT value
``u = F(t-1) + V p(t)`` is taken, tokens ordered by descending probability
(``tests/pit.py``). If DDTree is lossless the ``u`` are i.i.d. U(0, 1):

* a KS test must not reject at p = 1e-3 (also with tokens in id order);
* tokens outside the rescored nucleus (``p(t) = 0``, possible only at a
  top-k/top-p boundary tie broken differently by ~1e-5 fp32 differences
  between vLLM's and transformers' forwards) must be at most 0.2%;
* the ddtree metrics must show that a good share of the tokens came from
  accepted nodes at depth >= 2, i.e. were decided by tree nodes (their masks,
  RoPE positions, compacted KV), not by the root sample.

Power, on the same token count: two deliberately broken DDTree runs
(``tests/broken_paths.py``) must be rejected at p < 1e-3:

* ``root_only_mask``: every node attends to the root and itself only (wrong
  masks at depth >= 2; the root sample stays right);
* ``accept_first_draft`` (fewer samples): the walk always accepts the
  drafter's first node (a wrong root sample).

Measured on the first bundled pair (v1, see docs/results.md; engine seed 1234;
4864 PIT tokens per arm, the wrong walk 1216)::

    arm              KS p (probability / id order)   outside nucleus   depth >= 2
    ddtree           0.089 / 0.96                    0                 593 (tau 1.82)
    root-only mask   5.3e-7 / 0.19                   178 (3.7%)        517 (tau 1.76)
    wrong walk       3.8e-38 / 1.1e-9                215 (17.7%)       220 (tau 2.41)

("depth >= 2": accepted draft nodes at depth >= 2, vLLM's per-position counts.)

With engine seeds 1, 2, 3 the ddtree arm gave KS p 0.11, 0.83, 0.89 and the
root-only mask 5.1e-9, 1.4e-6, 6.5e-7 (probability order). The file takes
about 4.5 min on a 2-core host shared with other engine runs (generation:
52 s per full arm), about 3.3 min of CPU time.

Token-id order alone has no power against the wrong mask at this size: the
tokens a wrong node distribution gets wrong are scattered over [0, 1] by
arbitrary ids. Probability order maps every token outside the target's
support to ``u = 1`` and every too-unlikely token towards 1, in all contexts.
Without top-k (top-p 0.95 only) the drafter's acceptance is lower and too few
tokens fall outside the support for either order to detect the wrong mask
with this many tokens (p about 0.3 at 3840 tokens).
"""

from __future__ import annotations

import pytest

from tests.conftest import IN_PROCESS, run_job
from tests.pit import Rescored, load_target, rescore

pytestmark = pytest.mark.engine

NUM_PROMPTS = 4
SAMPLES = 32  # per prompt
MAX_TOKENS = 40
FIRST = 2  # the first two generated tokens never depend on tree nodes
TEMPERATURE, TOP_K, TOP_P = 0.8, 5, 0.95
BUDGET = 16
P_MIN = 1e-3  # KS rejection level
MAX_MISS_FRACTION = 0.002  # tokens outside the rescored nucleus, ddtree arm
MIN_DEEP_FRACTION = 0.08  # accepted nodes at depth >= 2, per PIT token
PIT_SEED = 20240601


@pytest.fixture(scope="module")
def prompts(tiny_pair) -> list[list[int]]:
    from transformers import AutoTokenizer

    from benchmarks.run_llm import humaneval_prompts

    tok = AutoTokenizer.from_pretrained(tiny_pair[0])
    return [tok(p)["input_ids"] for p in humaneval_prompts(NUM_PROMPTS)]


@pytest.fixture(scope="module")
def target(tiny_pair):
    return load_target(tiny_pair[0])


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("sampling")


def _run(tiny_pair, prompts, workdir, seed, samples=SAMPLES, adaptive=False, **job) -> dict:
    target, drafter = tiny_pair
    sampling = {"temperature": TEMPERATURE, "top_k": TOP_K, "top_p": TOP_P,
                "max_tokens": MAX_TOKENS, "ignore_eos": True, "n": samples}
    base = {"model": target, "prompts": prompts, "sampling": sampling,
            "speculative_config": {"method": "ddtree", "model": drafter,
                                   "num_speculative_tokens": BUDGET,
                                   "ddtree_adaptive": adaptive},
            "llm": {"max_num_seqs": 256, "seed": seed}}
    result = run_job(dict(base, **job), workdir)
    for comps in result["outputs"]:
        assert len(comps) == samples and all(len(c) == MAX_TOKENS for c in comps)
    return result


def _rescore(target, prompts, result) -> Rescored:
    return rescore(target, prompts, result["outputs"], start=FIRST, temperature=TEMPERATURE,
                   top_k=TOP_K, top_p=TOP_P, seed=PIT_SEED)


def _deep_accepted(result) -> int:
    """Accepted draft nodes at depth >= 2 (vLLM's per-position acceptance counts)."""
    per_pos = result["spec"]["accepted_per_pos"] or []
    return int(sum(per_pos[1:]))


@pytest.fixture(scope="module")
def ddtree(tiny_pair, prompts, workdir, target):
    result = _run(tiny_pair, prompts, workdir, seed=1234)
    return result, _rescore(target, prompts, result)


@pytest.fixture(scope="module")
def adaptive(tiny_pair, prompts, workdir, target):
    """The adaptive budget with a pinned cost model under which trees pay
    for this batch of 128 sequences and budgets differ per request and step
    (a node pays when its value exceeds about 0.02)."""
    result = _run(tiny_pair, prompts, workdir, seed=4321, adaptive=True,
                  env={"VLLM_DDTREE_COST_MODEL": "100,0.01,1"})
    return result, _rescore(target, prompts, result)


@pytest.fixture(scope="module")
def root_only_mask(tiny_pair, prompts, workdir, target):
    result = _run(tiny_pair, prompts, workdir, seed=1234,
                  setup="tests.broken_paths:root_only_mask", env=IN_PROCESS)
    return result, _rescore(target, prompts, result)


@pytest.fixture(scope="module")
def wrong_walk(tiny_pair, prompts, workdir, target):
    result = _run(tiny_pair, prompts, workdir, seed=1234, samples=SAMPLES // 4,
                  setup="tests.broken_paths:accept_first_draft", env=IN_PROCESS)
    return result, _rescore(target, prompts, result)


def test_ddtree_tokens_come_from_deep_tree_nodes(ddtree):
    result, scored = ddtree
    spec = result["spec"]
    assert spec["drafts"] > 0
    assert scored.count == NUM_PROMPTS * SAMPLES * (MAX_TOKENS - FIRST)
    deep = _deep_accepted(result)
    print(f"\nddtree: tau {spec['tau']:.3f}, accepted per depth {spec['accepted_per_pos']}")
    assert deep >= MIN_DEEP_FRACTION * scored.count, (
        f"only {deep} accepted nodes at depth >= 2 for {scored.count} tokens: the test "
        "would not exercise tree nodes")


def test_ddtree_sampling_matches_the_target(ddtree):
    _, scored = ddtree
    print(f"\nddtree: {scored.summary()}")
    assert scored.miss_fraction <= MAX_MISS_FRACTION, (
        f"too many tokens outside the target's nucleus: {scored.summary()}")
    assert scored.ks_p > P_MIN, f"ddtree tokens are not target samples: {scored.summary()}"
    assert scored.ks_p_id > P_MIN, f"ddtree tokens are not target samples: {scored.summary()}"


def test_adaptive_budget_sampling_matches_the_target(adaptive):
    result, scored = adaptive
    spec = result["spec"]
    print(f"\nadaptive: {scored.summary()}, tau {spec['tau']:.3f}, "
          f"{spec['draft_tokens'] / spec['drafts']:.1f} nodes per draft")
    assert 1 < spec["draft_tokens"] / spec["drafts"] < BUDGET - 1, "budgets did not adapt"
    assert _deep_accepted(result) >= MIN_DEEP_FRACTION * scored.count
    assert scored.miss_fraction <= MAX_MISS_FRACTION, scored.summary()
    assert scored.ks_p > P_MIN, f"adaptive ddtree tokens are not target samples: {scored.summary()}"
    assert scored.ks_p_id > P_MIN, f"adaptive ddtree tokens are not target samples: " \
                                   f"{scored.summary()}"


def test_root_only_mask_is_detected(root_only_mask):
    result, scored = root_only_mask
    print(f"\nroot-only mask: {scored.summary()}; "
          f"accepted at depth >= 2: {_deep_accepted(result)}")
    assert scored.count == NUM_PROMPTS * SAMPLES * (MAX_TOKENS - FIRST)
    assert scored.ks_p < P_MIN, f"a wrong tree mask went undetected: {scored.summary()}"


def test_wrong_walk_is_detected(wrong_walk):
    _, scored = wrong_walk
    print(f"\nwrong walk: {scored.summary()}")
    assert scored.ks_p < P_MIN, f"a wrong walk went undetected: {scored.summary()}"
