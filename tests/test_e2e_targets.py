"""Target architectures beyond the bundled dense Qwen3, through the engine (CPU, fp32).

* Sliding-window attention (the bundled target with a 48-token window in
  every layer, so every request's context outgrows it; vLLM's Qwen3 serves a
  window in all layers or none): the tree kernels apply the window from each
  node's own depth position. Greedy DDTree equals plain decoding. (Targets
  that mix window and full layers put them in two KV-cache groups, each
  compacted by its own slots: the gpt-oss target below.)
* A Mixture-of-Experts target (``Qwen3MoeForCausalLM``, made from the bundled
  target without training: ``benchmarks/tiny_pair/moe.py``): greedy DDTree
  equals plain decoding, and the bundled drafter keeps its acceptance.
* An fp8 KV cache (``kv_cache_dtype="fp8"``), on the bundled pair with its
  heads padded from 48 to 64 dims (``benchmarks/tiny_pair/head_pad.py``: vLLM
  CPU keeps fp8 only for head sizes that are multiples of 32). Greedy DDTree
  against plain decoding with the same fp8 cache: the tree's K/V come from
  other matmul shapes, so a last-bit difference can move a value across an
  fp8 rounding boundary; every prompt's first divergence must be a near-tie
  under an fp32 rescoring, at the scale that stock fp8 itself moves the
  target's choices (plain fp8 against plain fp32, ``tests/near_ties.py``).
* A Llama target (``LlamaForCausalLM``, no q/k norms, llama3 RoPE scaling)
  and a gpt-oss target (``GptOssForCausalLM``: sliding-window layers
  alternating with full ones, so KV-cache groups compacted each by its
  own slots; attention sinks; q/k/v/o biases; a mixture of experts with
  gpt-oss's clamped SwiGLU), both made from the bundled target without
  training (``benchmarks/tiny_pair/folded.py``: the q/k norms folded into the
  projections), close enough to it that the bundled drafter's accepted paths
  reach depth 2 and beyond. Greedy DDTree equals plain decoding.
"""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import cpu_fp8_kv_unavailable, run_job

pytestmark = pytest.mark.engine

GREEDY = {"temperature": 0.0, "max_tokens": 96, "ignore_eos": True}
PROMPTS = "humaneval:8"
WINDOW = 48
FP8_NEAR_TIE = 0.5  # fp32 logits; see test_fp8_kv_cache


def _plain_and_tree(target: str, drafter: str, tmp_path, **llm) -> tuple[dict, dict]:
    job = {"model": target, "prompts": PROMPTS, "sampling": GREEDY, "llm": llm}
    plain = run_job(job, tmp_path)
    tree = run_job(dict(job, speculative_config={
        "method": "ddtree", "model": drafter, "num_speculative_tokens": 16,
        "ddtree_adaptive": False}), tmp_path)
    return plain, tree


def _assert_identical(plain: dict, tree: dict, what: str) -> None:
    assert tree["spec"]["drafts"] > 0, f"{what}: no tree was verified"
    for i, (a, b) in enumerate(zip(plain["outputs"], tree["outputs"])):
        assert a == b, f"{what}, prompt {i}: DDTree diverges from plain decoding"


def test_sliding_window_target(tiny_pair, tmp_path):
    target, drafter = tiny_pair
    variant = tmp_path / "tiny-qwen3-swa"
    shutil.copytree(target, variant)
    cfg = json.loads((variant / "config.json").read_text())
    cfg.update(use_sliding_window=True, sliding_window=WINDOW,
               max_window_layers=cfg["num_hidden_layers"],
               layer_types=["sliding_attention"] * cfg["num_hidden_layers"])
    (variant / "config.json").write_text(json.dumps(cfg))
    plain, tree = _plain_and_tree(str(variant), drafter, tmp_path)
    assert min(len(p) for p in plain["prompt_ids"]) > WINDOW  # the window is reached
    _assert_identical(plain, tree, "sliding window")
    # the window changes the function: this is not the full-attention target
    full = run_job({"model": target, "prompts": PROMPTS, "sampling": GREEDY}, tmp_path)
    assert full["outputs"] != plain["outputs"], "the window never mattered"
    assert tree["spec"]["tau"] > 2.0, tree["spec"]


def test_mixture_of_experts_target(tiny_pair, tmp_path):
    from benchmarks.tiny_pair.moe import make_moe_target

    _, drafter = tiny_pair
    target = make_moe_target(tmp_path / "models")
    plain, tree = _plain_and_tree(str(target), drafter, tmp_path)
    _assert_identical(plain, tree, "MoE target")
    # the experts compute the dense target's function: the drafter still fits it
    assert tree["spec"]["tau"] > 2.5, tree["spec"]


def test_fp8_kv_cache(tmp_path):
    from benchmarks.tiny_pair.head_pad import make_head64_pair
    from tests.near_ties import describe, first_divergences
    from tests.pit import load_target

    if cpu_fp8_kv_unavailable(64):
        pytest.skip(f"vLLM's CPU attention has no fp8 KV cache here: "
                    f"{cpu_fp8_kv_unavailable(64)}")
    target = make_head64_pair(tmp_path / "models")
    plain, tree = _plain_and_tree(str(target), f"{target}-dflash", tmp_path,
                                  kv_cache_dtype="fp8")
    assert tree["spec"]["drafts"] > 0 and tree["spec"]["tau"] > 2.0, tree["spec"]
    fp32 = run_job({"model": str(target), "prompts": PROMPTS, "sampling": GREEDY}, tmp_path)
    model = load_target(str(target))
    prompts = plain["prompt_ids"]
    noise = first_divergences(model, prompts, fp32["outputs"], plain["outputs"])
    divs = first_divergences(model, prompts, plain["outputs"], tree["outputs"])
    print(f"\nplain fp8 against plain fp32: {describe(noise)}"
          f"\nDDTree fp8 against plain fp8 ({len(prompts) - len(divs)}/{len(prompts)} "
          f"identical, tau {tree['spec']['tau']:.2f}): {describe(divs)}")
    bad = [d for d in divs if not d.near_tie(FP8_NEAR_TIE)]
    assert not bad, f"DDTree diverges where the target is not at a near-tie: {describe(bad)}"
    assert len(prompts) - len(divs) >= len(prompts) // 2, "too few identical prompts"


def _assert_deep_acceptance(tree: dict, what: str) -> None:
    per_pos = tree["spec"]["accepted_per_pos"]
    assert per_pos and len(per_pos) > 2 and per_pos[1] > 0, f"{what}: {tree['spec']}"
    assert tree["spec"]["tau"] > 1.8, f"{what}: {tree['spec']}"


def test_llama_target(tmp_path):
    from benchmarks.tiny_pair.folded import make_target

    target = make_target("llama", tmp_path / "models")
    cfg = json.loads((target / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["rope_parameters"]["rope_type"] == "llama3"
    plain, tree = _plain_and_tree(str(target), f"{target}-dflash", tmp_path)
    _assert_identical(plain, tree, "Llama target")
    _assert_deep_acceptance(tree, "Llama target")


def test_gpt_oss_target(tmp_path):
    from benchmarks.tiny_pair.folded import GPT_OSS_WINDOW, make_target

    target = make_target("gpt_oss", tmp_path / "models")
    cfg = json.loads((target / "config.json").read_text())
    assert cfg["architectures"] == ["GptOssForCausalLM"]
    assert set(cfg["layer_types"]) == {"sliding_attention", "full_attention"}
    plain, tree = _plain_and_tree(str(target), f"{target}-dflash", tmp_path)
    # every request's context outgrows the window of the sliding layers
    assert min(len(p) for p in plain["prompt_ids"]) > GPT_OSS_WINDOW
    _assert_identical(plain, tree, "gpt-oss target")
    _assert_deep_acceptance(tree, "gpt-oss target")
