"""Models generated from the bundled target without training
(benchmarks/tiny_pair/heavy.py, benchmarks/tiny_pair/moe.py): they compute the
bundled target's function, in transformers fp32, at a small size that takes the
same code path as the full one."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from benchmarks.tiny_pair import heavy
from tests.conftest import DRAFTER, TARGET

SMALL_LAYERS, SMALL_INTER = 6, 1024
PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path):\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(",
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("model-cache")


@pytest.fixture(scope="module")
def small_heavy(cache):
    return heavy.heavy_target(cache, num_layers=SMALL_LAYERS, intermediate_size=SMALL_INTER,
                              progress=False)


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def dense():
    return _load(TARGET)


@pytest.fixture(scope="module")
def prompt_ids():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TARGET)
    return [tok(p, return_tensors="pt").input_ids for p in PROMPTS]


def _tensors(path):
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@torch.no_grad()
def _run(model, ids):
    return model(input_ids=ids, output_hidden_states=True)


# --------------------------------------------------------------------------- heavy target
# In exact arithmetic the heavy target is the source's function (the padding's
# zeros are checked exactly below). In fp32 the padded MLP sums over a longer
# intermediate dimension, and a CPU GEMM may split that reduction into
# different blocks than the source's, so equality holds up to the order of the
# sum: about 1e-5 on logits of magnitude ~10. A padding unit that is not zero
# moves the logits by ~3e-3 or more (test_heavy_nonzero_padding_would_be_caught).
HEAVY_ATOL = 1e-4


def test_heavy_logits_equal_the_sources(small_heavy, dense, prompt_ids):
    padded = _load(small_heavy)
    for ids in prompt_ids:
        want, got = _run(dense, ids).logits, _run(padded, ids).logits
        torch.testing.assert_close(got, want, rtol=0, atol=HEAVY_ATOL)


def test_heavy_greedy_continuations_equal_the_sources(small_heavy, dense, prompt_ids):
    """What the drafter's acceptance depends on: the padded target picks the
    same tokens as the source, 48 steps past each prompt."""
    padded = _load(small_heavy)
    for ids in prompt_ids:
        kw = dict(max_new_tokens=48, do_sample=False, pad_token_id=0, eos_token_id=None,
                  attention_mask=torch.ones_like(ids))
        assert torch.equal(padded.generate(ids, **kw), dense.generate(ids, **kw))


def test_heavy_keeps_the_drafters_features(small_heavy, dense, prompt_ids):
    """The residual stream after each layer the drafter reads (HF's
    hidden_states[i + 1], what vLLM hands the drafter) is the source's, and the
    appended layers leave the stream bit for bit as the last trained one left
    it (their zero o_proj and down_proj add exact zeros, whatever the order)."""
    layer_ids = json.loads((DRAFTER / "config.json").read_text())["dflash_config"][
        "target_layer_ids"]
    assert max(layer_ids) < json.loads((TARGET / "config.json").read_text())["num_hidden_layers"]
    padded = _load(small_heavy)
    for ids in prompt_ids:
        want, got = _run(dense, ids).hidden_states, _run(padded, ids).hidden_states
        for i in layer_ids:
            torch.testing.assert_close(got[i + 1], want[i + 1], rtol=0, atol=HEAVY_ATOL,
                                       msg=lambda m, i=i: f"layer {i}: {m}")
        n_src = len(want) - 1
        for j in range(n_src + 1, SMALL_LAYERS):
            assert torch.equal(got[j], got[n_src]), f"appended layer {j - 1} changed the stream"


def test_heavy_parameter_count_follows_the_arguments(small_heavy):
    src = json.loads((TARGET / "config.json").read_text())
    h, v, hd = src["hidden_size"], src["vocab_size"], src["head_dim"]
    q, kv = src["num_attention_heads"] * hd, src["num_key_value_heads"] * hd
    per_layer = h * q + 2 * h * kv + q * h + 2 * hd + 3 * h * SMALL_INTER + 2 * h
    want = 2 * v * h + h + SMALL_LAYERS * per_layer  # untied embeddings and head
    assert sum(t.numel() for t in _tensors(small_heavy).values()) == want
    assert _load(small_heavy).num_parameters() == want
    cfg = json.loads((small_heavy / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["hidden_size"]) == (
        SMALL_LAYERS, SMALL_INTER, h)
    assert len(cfg["layer_types"]) == SMALL_LAYERS
    assert heavy.parameter_count(cfg) == want
    # the full-size defaults: about 80M parameters
    full = dict(src, num_hidden_layers=heavy.HEAVY_LAYERS,
                intermediate_size=heavy.HEAVY_INTERMEDIATE)
    assert 75e6 < heavy.parameter_count(full) < 85e6


def test_heavy_added_weights_are_random_and_the_outputs_zero(small_heavy):
    """The cost is real (random gate/up rows and q/k/v read every step) and
    what reaches the residual stream is exactly zero."""
    src, got = _tensors(TARGET), _tensors(small_heavy)
    n_src, i_src = 4, src["model.layers.0.mlp.gate_proj.weight"].shape[0]

    def looks_random(t):
        return t.abs().min(dim=-1).values.gt(0).all() and 0.01 < t.std().item() < 0.04

    for i in range(SMALL_LAYERS):
        p = f"model.layers.{i}."
        gate, up, down = (got[f"{p}mlp.{n}.weight"] for n in ("gate_proj", "up_proj", "down_proj"))
        assert gate.shape == up.shape == (SMALL_INTER, 192) and down.shape == (192, SMALL_INTER)
        if i < n_src:
            for n in ("gate_proj", "up_proj", "down_proj"):
                w, s = got[f"{p}mlp.{n}.weight"], src[f"{p}mlp.{n}.weight"]
                assert torch.equal(w[:, :i_src] if n == "down_proj" else w[:i_src], s)
            assert looks_random(gate[i_src:]) and looks_random(up[i_src:])
            assert not torch.equal(gate[i_src:], up[i_src:])
            assert torch.count_nonzero(down[:, i_src:]) == 0
        else:
            for n in ("q_proj", "k_proj", "v_proj"):
                assert looks_random(got[f"{p}self_attn.{n}.weight"]), (i, n)
            assert looks_random(gate) and looks_random(up)
            assert torch.count_nonzero(got[f"{p}self_attn.o_proj.weight"]) == 0
            assert torch.count_nonzero(down) == 0
            for n in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm",
                      "self_attn.k_norm"):
                assert torch.equal(got[f"{p}{n}.weight"], torch.ones_like(got[f"{p}{n}.weight"]))


@pytest.mark.parametrize("where", ["padded unit of a trained layer", "appended layer's o_proj",
                                   "appended layer's down_proj"])
def test_heavy_nonzero_padding_would_be_caught(small_heavy, dense, prompt_ids, where):
    """If the padding were not zero the logits would move well past the
    tolerance: the equality above is a real check, not a consequence of the
    padding being unused."""
    padded = _load(small_heavy)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        if where.startswith("padded"):
            w = padded.model.layers[1].mlp.down_proj.weight
            w[:, 700] = torch.randn(w.shape[0], generator=gen) * 0.02
        elif "o_proj" in where:
            w = padded.model.layers[SMALL_LAYERS - 1].self_attn.o_proj.weight
            w[:, 3] = torch.randn(w.shape[0], generator=gen) * 0.02
        else:
            w = padded.model.layers[SMALL_LAYERS - 2].mlp.down_proj.weight
            w[:, 5] = torch.randn(w.shape[0], generator=gen) * 0.02
    diff = max((_run(padded, ids).logits - _run(dense, ids).logits).abs().max().item()
               for ids in prompt_ids)
    assert diff > 10 * HEAVY_ATOL, where


def test_heavy_serving_folder(small_heavy):
    """Everything vLLM needs, and a copy of the drafter found beside it by name."""
    from vllm_ddtree.drafters import find_drafter

    names = {p.name for p in small_heavy.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "chat_template.jinja"} <= names
    found = find_drafter(str(small_heavy))
    assert found.model == str(small_heavy) + "-dflash"
    copy = json.loads((small_heavy.parent / "tiny-qwen3-heavy-dflash" / "config.json").read_text())
    bundled = json.loads((DRAFTER / "config.json").read_text())
    assert copy["dflash_config"] == bundled["dflash_config"]
    assert copy["num_target_layers"] == SMALL_LAYERS
    assert not (small_heavy.parent / "tiny-qwen3-heavy-dflash").is_symlink()
    manifest = json.loads((small_heavy.parent / "manifest.json").read_text())
    assert manifest["params"]["num_layers"] == SMALL_LAYERS
    assert manifest["parameters"] == heavy.parameter_count(
        json.loads((small_heavy / "config.json").read_text()))


def test_heavy_cache_reuses_and_regenerates(small_heavy, cache, tmp_path):
    weights = small_heavy / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    again = heavy.heavy_target(cache, num_layers=SMALL_LAYERS, intermediate_size=SMALL_INTER,
                               progress=False)
    assert again == small_heavy and weights.stat().st_mtime_ns == stamp
    # another seed is another entry
    other_seed = heavy.heavy_target(cache, num_layers=SMALL_LAYERS,
                                    intermediate_size=SMALL_INTER, seed=1, progress=False)
    assert other_seed != small_heavy
    a, b = _tensors(small_heavy), _tensors(other_seed)
    assert torch.equal(a["model.layers.0.self_attn.q_proj.weight"],
                       b["model.layers.0.self_attn.q_proj.weight"])
    assert not torch.equal(a["model.layers.5.self_attn.q_proj.weight"],
                           b["model.layers.5.self_attn.q_proj.weight"])
    # a changed source is another entry
    src = tmp_path / "tiny-qwen3"
    shutil.copytree(TARGET, src)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(dict(cfg, rms_norm_eps=1e-5)))
    changed = heavy.heavy_target(cache, source=src, num_layers=SMALL_LAYERS,
                                 intermediate_size=SMALL_INTER, progress=False)
    assert changed != small_heavy and changed.name == small_heavy.name
    # a renamed copy of the same source is the same entry
    same = tmp_path / "renamed"
    shutil.copytree(TARGET, same)
    assert heavy.heavy_target(cache, source=same, num_layers=SMALL_LAYERS,
                              intermediate_size=SMALL_INTER, progress=False).parent == \
        small_heavy.parent.with_name(small_heavy.parent.name.replace("tiny-qwen3", "renamed"))


def test_heavy_is_reproducible(tmp_path):
    a = heavy.write_heavy_target(TARGET, tmp_path / "a", seed=3, num_layers=5,
                                 intermediate_size=640, progress=False)
    b = heavy.write_heavy_target(TARGET, tmp_path / "b", seed=3, num_layers=5,
                                 intermediate_size=640, progress=False)
    assert a == b
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == \
        (tmp_path / "b" / "model.safetensors").read_bytes()


@pytest.mark.parametrize("kwargs,match", [
    ({"num_layers": 3}, r"num_layers=3: must be an int >= the source's 4"),
    ({"intermediate_size": 100}, r"intermediate_size=100: must be an int >= the source's 576"),
    ({"seed": -1}, r"seed=-1"),
])
def test_heavy_refuses_bad_sizes(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        heavy.heavy_target(tmp_path, progress=False, **kwargs)
    assert not any(tmp_path.iterdir())


def test_heavy_refuses_a_bad_source(tmp_path):
    with pytest.raises(FileNotFoundError, match="source: .* has no config.json"):
        heavy.heavy_target(tmp_path / "cache", source=tmp_path / "nothing", progress=False)
    with pytest.raises(ValueError, match="not a Qwen3ForCausalLM"):
        heavy.heavy_target(tmp_path / "cache", source=DRAFTER, progress=False)


# --------------------------------------------------------------------------- MoE target
MOE_LOGIT_ATOL = 1e-4  # observed max |diff| about 1e-5 on logits of magnitude ~10


@pytest.fixture(scope="module")
def small_moe(cache):
    from benchmarks.tiny_pair import moe

    return moe.make_moe_target(cache)


def test_moe_is_a_qwen3_moe_of_copied_experts(small_moe):
    from benchmarks.tiny_pair import moe

    cfg = json.loads((small_moe / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["model_type"] == "qwen3_moe"
    assert (cfg["num_experts"], cfg["num_experts_per_tok"]) == (moe.MOE_EXPERTS, moe.MOE_TOP_K)
    assert cfg["norm_topk_prob"] is True and cfg["mlp_only_layers"] == []
    assert cfg["decoder_sparse_step"] == 1
    src, got = _tensors(TARGET), _tensors(small_moe)
    for i in range(4):
        p = f"model.layers.{i}.mlp."
        for e in range(moe.MOE_EXPERTS):
            for n in ("gate_proj", "up_proj", "down_proj"):
                assert torch.equal(got[f"{p}experts.{e}.{n}.weight"], src[f"{p}{n}.weight"])
        router = got[f"{p}gate.weight"]
        assert router.shape == (moe.MOE_EXPERTS, 192) and 0.01 < router.std().item() < 0.04
    for k, t in src.items():
        if ".mlp." not in k:
            assert torch.equal(got[k], t), k
    model = _load(small_moe)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"


def test_moe_router_really_routes(small_moe, prompt_ids):
    """Different tokens pick different experts (every expert is used), so the
    equality below holds because the experts agree, not because one is always picked."""
    model = _load(small_moe)
    picked = set()
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda _m, _a, out: picked.update(out[2].flatten().tolist()))
        for layer in model.model.layers]
    try:
        for ids in prompt_ids:
            _run(model, ids)
    finally:
        for hk in hooks:
            hk.remove()
    assert picked == set(range(json.loads((small_moe / "config.json").read_text())["num_experts"]))


def test_moe_logits_match_the_dense_target(small_moe, dense, prompt_ids):
    layer_ids = json.loads((DRAFTER / "config.json").read_text())["dflash_config"][
        "target_layer_ids"]
    model = _load(small_moe)
    for ids in prompt_ids:
        want, got = _run(dense, ids), _run(model, ids)
        torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=MOE_LOGIT_ATOL)
        for i in layer_ids:
            torch.testing.assert_close(got.hidden_states[i + 1], want.hidden_states[i + 1],
                                       rtol=0, atol=MOE_LOGIT_ATOL)


def test_moe_greedy_continuations_equal_the_dense_targets(small_moe, dense, prompt_ids):
    model = _load(small_moe)
    for ids in prompt_ids:
        kw = dict(max_new_tokens=48, do_sample=False, pad_token_id=0, eos_token_id=None,
                  attention_mask=torch.ones_like(ids))
        assert torch.equal(model.generate(ids, **kw), dense.generate(ids, **kw))


def test_moe_tolerance_catches_an_expert_that_differs(small_moe, dense, prompt_ids):
    """One expert 1% off moves the logits well past the tolerance."""
    model = _load(small_moe)
    with torch.no_grad():
        model.model.layers[1].mlp.experts.down_proj[2] *= 1.01
    diff = max((_run(model, ids).logits - _run(dense, ids).logits).abs().max().item()
               for ids in prompt_ids)
    assert diff > 10 * MOE_LOGIT_ATOL


@pytest.mark.parametrize("kwargs,match", [
    ({"num_experts": 1}, r"num_experts=1: must be an int >= 2"),
    ({"top_k": 5}, r"top_k=5: must be an int in \[1, num_experts=4\]"),
    ({"seed": "a"}, r"seed='a'"),
])
def test_moe_refuses_bad_arguments(tmp_path, kwargs, match):
    from benchmarks.tiny_pair import moe

    with pytest.raises(ValueError, match=match):
        moe.make_moe_target(tmp_path, **kwargs)
