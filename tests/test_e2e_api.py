"""OpenAI API parity, end to end: per-request logits transformations, logprobs
and structured output through DDTree equal plain decoding.

One plain engine and one DDTree engine (B = 16, fp32, the bundled pair) run
the same batch: three HumanEval prompts, each with every feature below (one
request per prompt and feature). Each node of a tree must be verified with
the distribution plain decoding would use after the node's path, so any
history-dependent feature applied with the wrong history (the root's, the
parent's, a sibling's) changes a greedy token somewhere in 48 tokens.

For every feature:
- DDTree's tokens equal plain decoding's;
- the feature bites: in plain decoding, the output differs from the same
  prompt without it (so an ignored parameter cannot pass);
- logprobs of the generated tokens (top 3) and prompt logprobs agree with
  plain decoding's within 1e-4, with the same top tokens;
- structured outputs parse / match, and the grammar check dropped tree nodes.

The DDTree engine records its walks (``tests/path_probe.py``): accepted paths
off the first branch must occur, so the histories of non-first children are
exercised.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import IN_PROCESS, run_job, token_id
from tests.shared_engines import PLAIN_ENGINES, plain_run
from tests.path_probe import ENV_LOG, totals

pytestmark = pytest.mark.engine

NEWLINE, EQUALS = token_id("\n"), token_id(" =")
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "count": {"type": "integer", "minimum": 0, "maximum": 999},
                         "ok": {"type": "boolean"}},
          "required": ["name", "count", "ok"], "additionalProperties": False}
REGEX = r"def [a-z_]{1,16}\(x\):\n    return x [+*] [0-9]{1,3}\n"
CHOICES = ["def foo():", "class Bar:", "import os", "return None"]
BASE = {"temperature": 0.0, "max_tokens": 48, "ignore_eos": True}
FEATURES = {
    "base": {},
    "repetition_penalty": {"repetition_penalty": 1.4},
    "frequency_presence": {"frequency_penalty": 1.2, "presence_penalty": 1.0},
    "min_tokens": {"min_tokens": 24, "stop_token_ids": [NEWLINE], "ignore_eos": False},
    "bad_words": {"bad_words": [" return False", " not", " >>>"]},
    "logit_bias": {"logit_bias": {NEWLINE: -4.0, EQUALS: 2.5}},
    "allowed_token_ids": {"allowed_token_ids": list(range(3, 1500))},
    "logprobs": {"logprobs": 3, "prompt_logprobs": 2},
    "json_schema": {"structured_outputs": {"json": SCHEMA},
                    "max_tokens": 40, "ignore_eos": False},
    "regex": {"structured_outputs": {"regex": REGEX}, "ignore_eos": False},
    "choice": {"structured_outputs": {"choice": CHOICES}, "ignore_eos": False},
}
NAMES = list(FEATURES)
NUM_PROMPTS = 3


def _job(tiny_pair, speculative=None, **extra):
    from benchmarks.run_llm import humaneval_prompts

    target, _ = tiny_pair
    prompts = [p for p in humaneval_prompts(NUM_PROMPTS) for _ in NAMES]
    sampling = [dict(BASE, **FEATURES[n]) for _ in range(NUM_PROMPTS) for n in NAMES]
    # Compact JSON (xgrammar's whitespace is an engine setting).
    job = {"model": target, "prompts": prompts, "sampling": sampling,
           "speculative_config": speculative,
           "llm": {"structured_outputs_config": {"backend": "xgrammar",
                                                 "disable_any_whitespace": True}}}
    job.update(extra)
    return job


def _outputs(result, name):
    i = NAMES.index(name)
    return [result["outputs"][p * len(NAMES) + i] for p in range(NUM_PROMPTS)]


# The plain reference is a run of the session's shared eager plain engine,
# which has this file's structured-output settings.
_PLAIN = _job((None, None))
assert all(PLAIN_ENGINES["eager"]["llm"][k] == v for k, v in _PLAIN["llm"].items())
plain_run("eager", "api_features", _PLAIN["prompts"], _PLAIN["sampling"])


@pytest.fixture(scope="module")
def plain(plain_reference):
    return plain_reference("eager", "api_features")


@pytest.fixture(scope="module")
def ddtree(tiny_pair, tmp_path_factory):
    work = tmp_path_factory.mktemp("api_ddtree")
    log = work / "paths.jsonl"
    _, drafter = tiny_pair
    spec = {"method": "ddtree", "model": drafter, "num_speculative_tokens": 16,
            "ddtree_adaptive": False}
    res = run_job(_job(tiny_pair, spec, setup="tests.path_probe:record_paths",
                       env=dict(IN_PROCESS, **{ENV_LOG: str(log)})), work)
    res["paths"] = totals(log)
    return res


@pytest.mark.parametrize("name", NAMES)
def test_greedy_equals_plain(plain, ddtree, name):
    got, want = _outputs(ddtree, name), _outputs(plain, name)
    for p, (a, b) in enumerate(zip(got, want)):
        first = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert a == b, f"{name}, prompt {p}: DDTree diverges from plain decoding at token {first}"
    if name not in ("base", "logprobs"):
        base = _outputs(plain, "base")
        assert any(o != b for o, b in zip(want, base)), \
            f"{name} does not change plain decoding's output: the check has no power"


def test_trees_branch_and_grammar_prunes(ddtree):
    paths = ddtree["paths"]
    assert paths["tree_requests"] > 50
    assert paths["off_branch"] > 0, paths
    assert paths["grammar_seen"] > 0 and paths["grammar_pruned"] > 0, paths
    assert ddtree["spec"]["tau"] > 1.5


def test_features_hold(plain, ddtree, tiny_pair):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_pair[0])
    for out in _outputs(ddtree, "min_tokens"):
        assert len(out) >= 24 and NEWLINE not in out[:24]
    for out in _outputs(ddtree, "allowed_token_ids"):
        assert all(3 <= t < 1500 for t in out)
    for out in _outputs(ddtree, "bad_words"):
        for word in FEATURES["bad_words"]["bad_words"]:
            # vLLM bans both spellings, with and without the leading space
            for spelling in (word.lstrip(), " " + word.lstrip()):
                seq = tok(spelling, add_special_tokens=False)["input_ids"]
                assert not any(out[i:i + len(seq)] == seq for i in range(len(out))), \
                    f"bad word {spelling!r} was generated"
    for out in _outputs(ddtree, "json_schema"):
        obj = json.loads(tok.decode(out, skip_special_tokens=True))
        assert set(obj) == {"name", "count", "ok"} and isinstance(obj["count"], int)
    for out in _outputs(ddtree, "regex"):
        assert re.fullmatch(REGEX, tok.decode(out, skip_special_tokens=True))
    for out in _outputs(ddtree, "choice"):
        assert tok.decode(out, skip_special_tokens=True) in CHOICES


def _close(a, b, what):
    assert a is not None and b is not None and len(a) == len(b), what
    for k, (x, y) in enumerate(zip(a, b)):
        if x is None or y is None:
            assert x is None and y is None, f"{what} position {k}"
            continue
        assert set(x) == set(y), f"{what} position {k}: top tokens {sorted(x)} vs {sorted(y)}"
        for t in x:
            assert abs(x[t] - y[t]) < 1e-4, f"{what} position {k} token {t}: {x[t]} vs {y[t]}"


def test_logprobs_equal_plain(plain, ddtree):
    i = NAMES.index("logprobs")
    for p in range(NUM_PROMPTS):
        row = p * len(NAMES) + i
        got, want = ddtree["logprobs"][row], plain["logprobs"][row]
        assert len(got) == 48 and all(len(pos) >= 3 for pos in got)
        _close(got, want, f"prompt {p} logprobs")
        _close(ddtree["prompt_logprobs"][row], plain["prompt_logprobs"][row],
               f"prompt {p} prompt_logprobs")


# --------------------------------------------------------------------------
# Sampling: distribution-identical to plain sampling, past the first two tokens
# --------------------------------------------------------------------------
# The same PIT test as tests/test_e2e_sampling.py (see tests/pit.py), with the
# distributions rescored under the request's own transformation at every
# position: the penalties with the sequence's own history (and min-p, which
# vLLM's other speculative methods refuse), and the grammar's mask after the
# sequence's own prefix (vLLM's xgrammar backend, so the mask is the one plain
# decoding uses).
SAMPLE_PROMPTS, SAMPLES, SAMPLE_TOKENS, FIRST = 4, 24, 32, 2
P_MIN = 1e-3
# processed logprobs agree with the rescored distribution within LOGPROB_TOL
# (transformers fp32 vs vLLM fp32: about 1e-5), except at filter-boundary
# ties (thresholds moved by NUDGE relative; see _nudged_filters), which must
# stay rare
LOGPROB_TOL, NUDGE, MAX_BOUNDARY_TIES = 2e-3, 1e-4, 3
PENALTIES = {"repetition_penalty": 2.0, "frequency_penalty": 1.0, "presence_penalty": 1.0}
ARMS = {
    "penalties": dict(PENALTIES, temperature=0.9, top_p=0.95, min_p=0.02,
                      max_tokens=SAMPLE_TOKENS, ignore_eos=True),
    "grammar": {"temperature": 1.0, "max_tokens": SAMPLE_TOKENS,
                "structured_outputs": {"json": SCHEMA}},
}


@pytest.fixture(scope="module")
def sampled(tiny_pair, tmp_path_factory):
    from benchmarks.run_llm import humaneval_prompts

    target, drafter = tiny_pair
    work = tmp_path_factory.mktemp("api_sampling")
    log = work / "paths.jsonl"
    prompts = [p for p in humaneval_prompts(SAMPLE_PROMPTS) for _ in ARMS]
    sampling = [dict(ARMS[a], n=SAMPLES, logprobs=1)
                for _ in range(SAMPLE_PROMPTS) for a in ARMS]
    spec = {"method": "ddtree", "model": drafter, "num_speculative_tokens": 16,
            "ddtree_adaptive": False}
    res = run_job({"model": target, "prompts": prompts, "sampling": sampling,
                   "speculative_config": spec, "setup": "tests.path_probe:record_paths",
                   "env": dict(IN_PROCESS, **{ENV_LOG: str(log)}),
                   "llm": {"structured_outputs_config": {"backend": "xgrammar",
                                                         "disable_any_whitespace": True},
                           "logprobs_mode": "processed_logprobs"}},
                  work)
    res["paths"] = totals(log)
    return res


def _grammar_factory(target):
    """Plain decoding's grammar for SCHEMA, from vLLM's xgrammar backend."""
    from types import SimpleNamespace

    from transformers import AutoConfig, AutoTokenizer
    from vllm.v1.structured_output.backend_types import StructuredOutputOptions
    from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

    tok = AutoTokenizer.from_pretrained(target)
    vocab = AutoConfig.from_pretrained(target).vocab_size
    config = SimpleNamespace(model_config=None, speculative_config=None,
                             structured_outputs_config=SimpleNamespace(
                                 disable_any_whitespace=True))
    backend = XgrammarBackend(config, tokenizer=tok, vocab_size=vocab)

    def make():
        return backend.compile_grammar(StructuredOutputOptions.JSON, json.dumps(SCHEMA),
                                       stop_token_ids={tok.eos_token_id})
    return make, backend


def _penalize(row, prompt, history):
    """Repetition, frequency and presence penalties, as OpenAI and vLLM define them."""
    import torch

    x = row.clone()
    counts = torch.bincount(torch.tensor(history, dtype=torch.long), minlength=x.shape[0]) \
        if history else torch.zeros(x.shape[0], dtype=torch.long)
    seen = counts > 0
    seen[torch.tensor(prompt, dtype=torch.long)] = True
    rep = PENALTIES["repetition_penalty"]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - PENALTIES["frequency_penalty"] * counts - PENALTIES["presence_penalty"] * (counts > 0)
    return x


def _rescore_arm(tiny_pair, res, arm):
    import numpy as np
    import torch
    import xgrammar as xgr
    from tests.pit import Rescored, load_target, randomized_pit, vllm_processed_probs

    target = tiny_pair[0]
    model = load_target(target)
    make_grammar, backend = _grammar_factory(target) if arm == "grammar" else (None, None)
    params = ARMS[arm]
    rng = np.random.default_rng(7)
    u_rank, u_id, ps, lp_err, ties = [], [], [], [], 0
    k_arm = list(ARMS).index(arm)
    for i in range(SAMPLE_PROMPTS):
        row = i * len(ARMS) + k_arm
        prompt = res["prompt_ids"][row]
        for comp, reported in zip(res["outputs"][row], res["logprobs"][row]):
            if len(comp) <= FIRST:
                continue
            ids = torch.tensor([prompt + comp])
            with torch.inference_mode():
                logits = model(input_ids=ids[:, :-1]).logits[0].float()
            grammar = make_grammar() if make_grammar else None
            mask = backend.allocate_token_bitmask(1) if backend else None
            rows = []
            for k in range(len(comp)):
                row = logits[len(prompt) + k - 1]
                if grammar is not None:
                    if not grammar.is_terminated():
                        grammar.fill_bitmask(mask, 0)
                        row = row.clone()[None]
                        xgr.apply_token_bitmask_inplace(row, mask)
                        row = row[0]
                    assert grammar.accept_tokens("rescore", [comp[k]])
                else:
                    row = _penalize(row, prompt, comp[:k])
                if k >= FIRST:
                    rows.append(row)
            x = torch.stack(rows)
            probs = vllm_processed_probs(x, params["temperature"], None, params.get("top_p"),
                                         params.get("min_p")).numpy()
            toks = np.array(comp[FIRST:])
            v = rng.random(len(toks))
            u_rank.append(randomized_pit(probs, toks, v, "rank"))
            u_id.append(randomized_pit(probs, toks, v, "id"))
            ps.append(probs[np.arange(len(toks)), toks])
            # processed_logprobs: the log-probability of each sampled token
            # under the distribution it was drawn from.
            got = np.array([reported[k][str(t)] for k, t in zip(range(FIRST, len(comp)), toks)])
            err = np.abs(got - np.log(ps[-1]))
            tied = np.zeros(len(toks), dtype=bool)
            for top_p, min_p in _nudged_filters(params):
                alt = vllm_processed_probs(x, params["temperature"], None, top_p, min_p).numpy()
                alt_err = np.abs(got - np.log(alt[np.arange(len(toks)), toks]))
                tied |= (err >= LOGPROB_TOL) & (alt_err < LOGPROB_TOL)
            lp_err.extend(np.where(tied, 0.0, err))
            ties += int(tied.sum())
    scored = Rescored(np.concatenate(u_rank), np.concatenate(u_id), np.concatenate(ps))
    scored.logprob_error = max(lp_err)
    scored.boundary_ties = ties
    return scored


def _nudged_filters(params):
    """The request's (top_p, min_p) with each threshold moved by NUDGE either way.

    vLLM's fp32 logits and the rescoring's differ by about 1e-5, so a token
    whose probability lies within that of the min-p threshold or the top-p
    boundary may be kept by one and dropped by the other; both are the same
    distribution up to that rounding. A reported logprob that matches one of
    these is such a boundary tie, not an error.
    """
    top_p, min_p = params.get("top_p"), params.get("min_p")
    for s in (1 - NUDGE, 1 + NUDGE):
        if top_p is not None:
            yield min(top_p * s, 1.0), min_p
        if min_p is not None:
            yield top_p, min_p * s


@pytest.mark.parametrize("arm", list(ARMS))
def test_sampling_matches_plain_distribution(tiny_pair, sampled, arm):
    paths = sampled["paths"]
    assert paths["off_branch"] > 0 and paths["grammar_pruned"] > 0, paths
    scored = _rescore_arm(tiny_pair, sampled, arm)
    assert scored.count > SAMPLE_PROMPTS * SAMPLES * 10
    assert scored.nucleus_misses == 0, scored.summary()
    assert scored.ks_p > P_MIN, f"{arm}: DDTree samples are not plain samples: {scored.summary()}"
    assert scored.ks_p_id > P_MIN, f"{arm}: {scored.summary()}"
    # processed logprobs (vLLM's --logprobs-mode processed_logprobs) agree with
    # the rescored distribution, up to rare filter-boundary ties
    assert scored.logprob_error < LOGPROB_TOL, scored.logprob_error
    assert scored.boundary_ties <= MAX_BOUNDARY_TIES, scored.boundary_ties
