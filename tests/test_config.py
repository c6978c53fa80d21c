"""DDTree speculative-config validation: every bad config fails before the
engine starts, with a message naming the field and the fix."""

from __future__ import annotations

import json
import shutil

import pytest

from vllm_ddtree.core.config import DEFAULT_BUDGET, MAX_BUDGET, DDTreeConfig, DDTreeConfigError
from vllm_ddtree.plugin import register


@pytest.fixture(scope="module", autouse=True)
def _plugin():
    register()


def _engine_config(target, spec, **engine):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=target, speculative_config=spec, dtype="float32",
                      max_model_len=512, enforce_eager=True, **engine)
    return args.create_engine_config()


def test_ddtree_builds_as_dflash_with_options(tiny_pair):
    target, drafter = tiny_pair
    cfg = _engine_config(target, {"method": "ddtree", "model": drafter,
                                  "num_speculative_tokens": 24, "ddtree_max_depth": 7})
    spec = cfg.speculative_config
    assert spec.method == "dflash"
    assert spec.num_speculative_tokens == 24
    assert spec.ddtree.budget == 24 and spec.ddtree.depth == 7 and spec.ddtree.block_size == 16
    assert cfg.scheduler_config.async_scheduling is False


def test_default_budget_and_depth(tiny_pair):
    target, drafter = tiny_pair
    spec = _engine_config(target, {"method": "ddtree", "model": drafter}).speculative_config
    assert spec.ddtree.budget == DEFAULT_BUDGET == spec.num_speculative_tokens
    assert spec.ddtree.depth == 15
    assert spec.ddtree.adaptive is True


def test_fixed_budget_option(tiny_pair):
    target, drafter = tiny_pair
    spec = _engine_config(target, {"method": "ddtree", "model": drafter,
                                   "ddtree_adaptive": False}).speculative_config
    assert spec.ddtree.adaptive is False


@pytest.mark.parametrize("value", ["false", 0, None])
def test_adaptive_must_be_a_boolean(value):
    from vllm_ddtree.core.config import DDTreeConfig

    with pytest.raises(DDTreeConfigError, match=r"speculative_config\.ddtree_adaptive"):
        DDTreeConfig.from_speculative_dict({"method": "ddtree", "model": "m",
                                            "ddtree_adaptive": value})


def test_other_methods_untouched(tiny_pair):
    target, drafter = tiny_pair
    spec = _engine_config(target, {"method": "dflash", "model": drafter,
                                   "num_speculative_tokens": 15}).speculative_config
    assert spec.method == "dflash" and getattr(spec, "ddtree", None) is None


def test_no_drafting_slots_reserved(tiny_pair):
    """DDTree's drafter block runs in its own pass, so the scheduler keeps its
    whole token budget (vLLM 0.32 reserved B slots per request for DFlash)."""
    target, drafter = tiny_pair
    tree = _engine_config(target, {"method": "ddtree", "model": drafter,
                                   "num_speculative_tokens": 64})
    chain = _engine_config(target, {"method": "dflash", "model": drafter,
                                    "num_speculative_tokens": 15})
    assert tree.speculative_config.max_num_new_slots_for_drafting == 0
    assert (tree.scheduler_config.max_num_scheduled_tokens
            == tree.scheduler_config.max_num_batched_tokens)
    # the chain keeps vLLM's own reservation (0 from vLLM 0.33 on)
    from packaging.version import Version

    from vllm_ddtree.version import installed_vllm
    expect = 15 if installed_vllm()[1] < Version("0.33") else 0
    assert chain.speculative_config.max_num_new_slots_for_drafting == expect


def test_prefix_cache_hits_keep_their_last_block(tiny_pair):
    """DDTree keeps the whole prefix-cache hit (a DFlash drafter's context
    K/V of a token needs nothing past it); the chain keeps vLLM's drop, and a
    user's explicit choice stands."""
    target, drafter = tiny_pair
    tree = _engine_config(target, {"method": "ddtree", "model": drafter}).speculative_config
    chain = _engine_config(target, {"method": "dflash", "model": drafter,
                                    "num_speculative_tokens": 15}).speculative_config
    chosen = _engine_config(target, {"method": "ddtree", "model": drafter,
                                     "disable_eagle_block_drop": False}).speculative_config
    assert tree.use_eagle() and not tree.use_eagle_block_drop()
    assert chain.use_eagle_block_drop()
    assert chosen.use_eagle_block_drop()


@pytest.mark.parametrize("depth", [15, 7])
def test_token_budget_holds_a_drafting_step(tiny_pair, depth):
    """A drafting step has 1 + depth drafter query rows per request, whatever
    each request was scheduled, and DFlash sizes the drafter's input_ids by
    max_num_batched_tokens: defaults are fitted to that, the budget first."""
    target, drafter = tiny_pair
    tree = {"method": "ddtree", "model": drafter, "ddtree_max_depth": depth}
    rows = 1 + depth
    # max_num_seqs set, the token budget left to vLLM: the budget grows
    sched = _engine_config(target, tree, max_num_seqs=300).scheduler_config
    assert sched.max_num_seqs == 300 and sched.max_num_batched_tokens >= 300 * rows
    # the token budget set, max_num_seqs left to vLLM: max_num_seqs shrinks
    sched = _engine_config(target, tree, max_num_batched_tokens=512).scheduler_config
    assert sched.max_num_batched_tokens == 512 and sched.max_num_seqs == 512 // rows
    # values that fit stand; the chain is vLLM's
    sched = _engine_config(target, tree, max_num_batched_tokens=512,
                           max_num_seqs=512 // rows).scheduler_config
    assert (sched.max_num_batched_tokens, sched.max_num_seqs) == (512, 512 // rows)
    chain = {"method": "dflash", "model": drafter, "num_speculative_tokens": depth}
    sched = _engine_config(target, chain, max_num_batched_tokens=512).scheduler_config
    assert sched.max_num_seqs > 512 // rows


def test_explicit_token_budget_too_small_for_a_drafting_step(tiny_pair):
    target, drafter = tiny_pair
    with pytest.raises(DDTreeConfigError, match=r"max_num_batched_tokens.*16 drafter query rows"
                       r".*--max-num-batched-tokens >= 1024 or --max-num-seqs <= 32"):
        _engine_config(target, {"method": "ddtree", "model": drafter},
                       max_num_batched_tokens=512, max_num_seqs=64)


@pytest.mark.parametrize("budget", [0, -3])
def test_budget_must_be_positive(tiny_pair, budget):
    target, drafter = tiny_pair
    with pytest.raises(DDTreeConfigError, match=r"num_speculative_tokens.*\[1, 512\]"):
        _engine_config(target, {"method": "ddtree", "model": drafter,
                                "num_speculative_tokens": budget})


def test_budget_cap(tiny_pair):
    target, drafter = tiny_pair
    with pytest.raises(DDTreeConfigError, match="num_speculative_tokens"):
        _engine_config(target, {"method": "ddtree", "model": drafter,
                                "num_speculative_tokens": MAX_BUDGET + 1})


def test_budget_type():
    with pytest.raises(DDTreeConfigError, match="num_speculative_tokens.*integer"):
        DDTreeConfig.from_speculative_dict({"model": "x", "num_speculative_tokens": "64"})


def test_unknown_ddtree_key(tiny_pair):
    target, drafter = tiny_pair
    with pytest.raises(DDTreeConfigError, match=r"ddtree_budget_size.*Known options.*ddtree_max_depth"):
        _engine_config(target, {"method": "ddtree", "model": drafter, "ddtree_budget_size": 3})


@pytest.mark.parametrize("key,value", [("rejection_sample_method", "synthetic"),
                                       ("rejection_sample_method", "block"),
                                       ("draft_sample_method", "probabilistic")])
def test_walk_owned_keys_refused(tiny_pair, key, value):
    # The tree walk replaces vLLM's rejection sampler: another method would be
    # ignored silently (or, like 0.33's "fly", promise lossy outputs).
    target, drafter = tiny_pair
    with pytest.raises(DDTreeConfigError, match=rf"speculative_config.{key}.*{value!r}.*dflash"):
        _engine_config(target, {"method": "ddtree", "model": drafter, key: value})


def test_walk_owned_keys_default_accepted(tiny_pair):
    target, drafter = tiny_pair
    cfg = _engine_config(target, {"method": "ddtree", "model": drafter,
                                  "rejection_sample_method": "standard",
                                  "draft_sample_method": "greedy"})
    assert cfg.speculative_config.rejection_sample_method == "standard"


def test_missing_drafter():
    with pytest.raises(DDTreeConfigError, match="speculative_config.model"):
        DDTreeConfig.from_speculative_dict({"num_speculative_tokens": 8})


def test_drafter_must_be_dflash(tiny_pair):
    target, _ = tiny_pair
    with pytest.raises(Exception, match=r"speculative_config.model.*DFlash"):
        _engine_config(target, {"method": "ddtree", "model": target, "num_speculative_tokens": 8})


def test_drafter_block_size_at_least_two(tiny_pair, tmp_path):
    target, drafter = tiny_pair
    bad = tmp_path / "drafter-b1"
    shutil.copytree(drafter, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["block_size"] = 1
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DDTreeConfigError, match=r"block_size must be an integer >= 2.*got 1"):
        _engine_config(target, {"method": "ddtree", "model": str(bad)})


def test_max_depth_beyond_drafter(tiny_pair):
    target, drafter = tiny_pair
    with pytest.raises(DDTreeConfigError, match=r"ddtree_max_depth.*\[1, 15\]"):
        _engine_config(target, {"method": "ddtree", "model": drafter, "ddtree_max_depth": 16})


def test_async_scheduling_refused(tiny_pair):
    from vllm.engine.arg_utils import EngineArgs

    target, drafter = tiny_pair
    args = EngineArgs(model=target, dtype="float32", max_model_len=512, async_scheduling=True,
                      speculative_config={"method": "ddtree", "model": drafter})
    with pytest.raises(DDTreeConfigError, match="async_scheduling"):
        args.create_engine_config()


@pytest.mark.parametrize("kwargs,field", [
    ({"logprobs": -1}, "logprobs"),
    ({"logprob_token_ids": [1, 2]}, "logprob_token_ids"),
    ({"thinking_token_budget": 8}, "thinking_token_budget"),
])
def test_unsupported_request_params(tiny_pair, kwargs, field):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    target, drafter = tiny_pair
    spec = _engine_config(target, {"method": "ddtree", "model": drafter}).speculative_config
    SamplingParams(temperature=0.8)._validate_spec_decode(spec)  # fine
    with pytest.raises(VLLMValidationError, match=field) as err:
        SamplingParams(**kwargs)._validate_spec_decode(spec)
    assert "DDTree" in str(err.value)


def test_served_request_params(tiny_pair):
    """What vLLM refuses for its speculative methods (min_p, logit_bias) and
    what DDTree applies per tree node passes DDTree's check; the chain method
    keeps vLLM's refusal."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import StructuredOutputsParams

    target, drafter = tiny_pair
    spec = _engine_config(target, {"method": "ddtree", "model": drafter}).speculative_config
    for kwargs in ({"min_p": 0.1}, {"logit_bias": {3: 1.0}}, {"repetition_penalty": 1.2},
                   {"frequency_penalty": 0.5, "presence_penalty": -0.5}, {"logprobs": 2},
                   {"min_tokens": 3}, {"bad_words": ["x"]}, {"allowed_token_ids": [1, 2]},
                   {"structured_outputs": StructuredOutputsParams(json={"type": "object"})}):
        SamplingParams(**kwargs)._validate_spec_decode(spec)
    chain = _engine_config(target, {"method": "dflash", "model": drafter,
                                    "num_speculative_tokens": 4}).speculative_config
    with pytest.raises(VLLMValidationError, match="min_p"):
        SamplingParams(min_p=0.1)._validate_spec_decode(chain)


def test_proposer_refuses_a_buffer_a_drafting_step_overruns(tiny_pair):
    """The start-up guard behind fit_drafter_rows: a config whose scheduler
    admits more drafter rows than DFlash's input_ids holds never drafts."""
    import torch

    from vllm_ddtree.proposer import DDTreeProposer

    target, drafter = tiny_pair
    cfg = _engine_config(target, {"method": "ddtree", "model": drafter},
                         max_num_batched_tokens=512, max_num_seqs=32)
    DDTreeProposer(cfg, torch.device("cpu"))  # fits: 32 * 16 rows
    cfg.scheduler_config.max_num_seqs = 33
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=512 cannot hold a drafting "
                       r"step of max_num_seqs=33 .*\(528\).*max_num_seqs <= 32"):
        DDTreeProposer(cfg, torch.device("cpu"))
