"""DDTree under tensor and data parallelism (vLLM CPU, 2 ranks, one core each).

vLLM CPU runs tensor parallelism with its own communicator. Its automatic
thread binding refuses two workers on one NUMA node, so each rank is bound to
one core by hand (``VLLM_CPU_OMP_THREADS_BIND="0|1"``). Every rank drafts,
walks and compacts its own KV heads; they agree by construction
(``vllm_ddtree/parallel.py``), and a per-step fingerprint check proves it:

* greedy at TP = 2 equals plain decoding at TP = 1 (fp32), with a fixed
  budget and with the adaptive default (rank 0's decisions broadcast);
* sampling at TP = 2 is lossless: the randomized PIT test on tokens past the
  first two, rescored in fp32 (``tests/pit.py``);
* the hybrid (a function-preserving copy of the tiny hybrid whose Gated
  DeltaNet heads split over two ranks) at TP = 2 equals plain decoding at
  TP = 1 except at near-ties;
* a rank whose random stream is deliberately one draw ahead
  (``tests/tp_fault``) is caught: the engine refuses the step;
* DP = 2 through the OpenAI server: two engines, each with its own policy
  and counters, and ``/metrics`` labels the ddtree metrics per engine.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.conftest import run_job
from tests.pit import load_target, rescore

pytestmark = pytest.mark.engine

TP2 = {"tensor_parallel_size": 2}
BIND = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
NUM_PROMPTS, MAX_TOKENS = 8, 64
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
PIT = dict(prompts=4, samples=16, tokens=40, first=2, temperature=0.8, top_k=5, top_p=0.95)
P_MIN = 1e-3


@pytest.fixture(scope="module")
def plain(plain_reference):
    """Plain decoding at TP = 1: the shared 16 x 128 greedy reference, cut to
    the first prompts and tokens (greedy fp32 is batch-invariant here)."""
    ref = plain_reference("eager", "humaneval16")
    return [o[:MAX_TOKENS] for o in ref["outputs"][:NUM_PROMPTS]]


@pytest.fixture(scope="module")
def prompts(tiny_pair) -> list[list[int]]:
    from transformers import AutoTokenizer

    from benchmarks.run_llm import humaneval_prompts

    tok = AutoTokenizer.from_pretrained(tiny_pair[0])
    return [tok(p)["input_ids"] for p in humaneval_prompts(NUM_PROMPTS)]


def _tp_job(model, drafter, prompts, sampling, spec=None, env=None, **job):
    spec = dict({"method": "ddtree", "model": drafter}, **(spec or {}))
    return dict({"model": model, "prompts": prompts, "sampling": sampling,
                 "llm": dict(TP2, seed=1234), "speculative_config": spec,
                 "env": dict(BIND, **(env or {}))}, **job)


@pytest.fixture(scope="module")
def adaptive_tp2(tiny_pair, prompts, tmp_path_factory):
    """One TP = 2 engine with the default (adaptive) budget: the PIT samples,
    then the greedy run."""
    target, drafter = tiny_pair
    sampling = {"temperature": PIT["temperature"], "top_k": PIT["top_k"],
                "top_p": PIT["top_p"], "max_tokens": PIT["tokens"], "ignore_eos": True,
                "n": PIT["samples"]}
    job = _tp_job(target, drafter, prompts[: PIT["prompts"]], sampling,
                  env={"VLLM_DDTREE_COST_MODEL": "100,0.01,1"},
                  runs={"greedy": {"prompts": prompts, "sampling": GREEDY}})
    job["llm"]["max_num_seqs"] = 64
    return run_job(job, tmp_path_factory.mktemp("tp2_adaptive"), timeout=1200)


def test_tp2_fixed_budget_greedy_equals_plain(tiny_pair, prompts, plain, tmp_path):
    target, drafter = tiny_pair
    res = run_job(_tp_job(target, drafter, prompts, GREEDY,
                          spec={"num_speculative_tokens": 16, "ddtree_adaptive": False}),
                  tmp_path, timeout=1200)
    assert res["outputs"] == plain
    spec = res["spec"]
    assert spec["drafts"] > 0 and spec["tau"] > 2.0, spec
    # counted once per engine, not once per rank
    dd = spec["ddtree"]
    assert dd["num_accepted_tokens"] == spec["accepted"]
    assert dd["num_nodes_verified"] == spec["draft_tokens"]


def test_tp2_adaptive_greedy_equals_plain(adaptive_tp2, plain):
    assert adaptive_tp2["runs"]["greedy"]["outputs"] == plain


def test_tp2_sampling_is_lossless(adaptive_tp2, tiny_pair, prompts):
    spec = adaptive_tp2["spec"]
    per_pos = spec["accepted_per_pos"] or []
    scored = rescore(load_target(tiny_pair[0]), prompts[: PIT["prompts"]],
                     adaptive_tp2["outputs"], start=PIT["first"],
                     temperature=PIT["temperature"], top_k=PIT["top_k"], top_p=PIT["top_p"],
                     seed=7)
    print(f"\nTP=2 sampling: {scored.summary()}, tau {spec['tau']:.2f}, "
          f"accepted per depth {per_pos}")
    assert sum(per_pos[1:]) >= 0.05 * scored.count, "too few tokens came from deep nodes"
    assert scored.ks_p >= P_MIN, scored.summary()
    assert scored.miss_fraction <= 0.002, scored.summary()


def test_tp2_desynchronised_rank_is_refused(tiny_pair, prompts, tmp_path):
    """Rank 1's random stream one draw ahead: the first sampled tree step
    whose draws differ is refused, naming the ranks' accepted counts."""
    target, drafter = tiny_pair
    fault = str(Path(__file__).with_name("tp_fault"))
    root = str(Path(__file__).resolve().parents[1])
    sampling = {"temperature": 1.0, "max_tokens": 32, "ignore_eos": True}
    job = _tp_job(target, drafter, prompts[:4], sampling,
                  spec={"num_speculative_tokens": 16, "ddtree_adaptive": False},
                  env={"DDTREE_TEST_FAULT": "desync_rank1", "PYTHONPATH": f"{fault}:{root}"})
    with pytest.raises(RuntimeError, match=r"tensor-parallel ranks accepted different tree "
                                           r"paths"):
        run_job(job, tmp_path, timeout=1200)


@pytest.mark.server
def test_dp2_server_serves_with_metrics_per_engine(tiny_pair, plain, tmp_path, monkeypatch):
    """``vllm serve --data-parallel-size 2``: two engines (and, by vLLM's
    default, two API servers), each with its own runner and counters; greedy
    completions equal plain decoding, and /metrics carries the ddtree counters
    per engine, counted once (equal to vLLM's own spec-decode counters)."""
    import re
    from concurrent.futures import ThreadPoolExecutor

    import requests

    from benchmarks.run_llm import humaneval_prompts
    from tests.test_server import serving

    target, drafter = tiny_pair
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    # a fixed budget: every engine verifies trees (the adaptive default may
    # run plain throughout an engine's share of a short workload)
    spec = {"method": "ddtree", "model": drafter, "num_speculative_tokens": 16,
            "ddtree_adaptive": False}
    with serving(target, "tiny", spec, tmp_path / "server.log", "--dtype", "float32",
                 "--enforce-eager", "--data-parallel-size", "2") as base:
        def complete(prompt):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS,
                    "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
            r = requests.post(f"{base}/v1/completions", json=body, timeout=600)
            r.raise_for_status()
            return r.json()["choices"][0]["token_ids"]

        with ThreadPoolExecutor(NUM_PROMPTS) as pool:
            outputs = list(pool.map(complete, humaneval_prompts(NUM_PROMPTS)))
        deadline = time.time() + 30  # metrics follow the engines' outputs
        while True:
            text = requests.get(f"{base}/metrics", timeout=30).text
            values = {}
            for m in re.finditer(r'^vllm:(ddtree_num_drafts|ddtree_num_accepted_tokens|'
                                 r'spec_decode_num_drafts|spec_decode_num_accepted_tokens)'
                                 r'_total\{engine="(\d)"[^}]*\} ([\d.e+]+)$', text, re.M):
                values[(m.group(1), m.group(2))] = float(m.group(3))
            done = all(values.get((f"{k}", e), 0) == values.get((f"spec_decode_{k[7:]}", e), -1)
                       for k in ("ddtree_num_drafts", "ddtree_num_accepted_tokens")
                       for e in "01")
            if done or time.time() > deadline:
                break
            time.sleep(2)
    assert outputs == plain
    for e in "01":
        assert values[("spec_decode_num_drafts", e)] > 0, f"engine {e} verified nothing"
        assert values[("ddtree_num_drafts", e)] == values[("spec_decode_num_drafts", e)]
        assert (values[("ddtree_num_accepted_tokens", e)]
                == values[("spec_decode_num_accepted_tokens", e)])


def test_tp2_hybrid_equals_plain_except_near_ties(tiny_hybrid, tmp_path):
    """The tiny hybrid with its Gated DeltaNet heads made splittable (2 key /
    4 value heads, the same function: ``benchmarks/tiny_pair/tp_hybrid.py``),
    DDTree at TP = 2 against plain decoding at TP = 1 (bf16): each prompt's
    first divergence, if any, is a near-tie under an fp32 rescoring."""
    from benchmarks.tiny_pair.tp_hybrid import tp_hybrid_target
    from tests.near_ties import describe, first_divergences
    from tests.test_e2e_hybrid import LLM, NEAR_TIE

    target = tp_hybrid_target(tmp_path / "models")
    drafter = f"{target}-dflash"
    greedy = dict(GREEDY, max_tokens=48)
    plain = run_job({"model": str(target), "prompts": "humaneval:8", "sampling": greedy,
                     "llm": LLM}, tmp_path)
    prompts = plain["prompt_ids"]
    tree = run_job(dict(_tp_job(str(target), drafter, prompts, greedy,
                                spec={"num_speculative_tokens": 16, "ddtree_adaptive": False}),
                        llm=dict(LLM, **TP2)), tmp_path, timeout=1200)
    assert tree["spec"]["drafts"] > 0 and tree["spec"]["tau"] > 1.5, tree["spec"]
    divs = first_divergences(load_target(tiny_hybrid[0]), prompts, plain["outputs"],
                             tree["outputs"])
    print(f"\nhybrid TP=2: {8 - len(divs)}/8 identical; first divergences: {describe(divs)}")
    assert len(divs) <= 4, describe(divs)
    assert all(d.near_tie(NEAR_TIE) for d in divs), describe(divs)
