"""Llama and gpt-oss targets made from the bundled Qwen3 target, without training.

    python -m benchmarks.tiny_pair.folded llama      # generate (once) and print its path
    python -m benchmarks.tiny_pair.folded gpt_oss

Both architectures lack Qwen3's per-head RMS norms on queries and keys, so
the bundled target cannot be copied into them exactly. It can be copied
closely: the q/k norm of head ``h`` maps a projection ``x`` to ``x / rms(x) *
w``, and over real text ``rms(x)`` of one head moves little, so the norm is
folded into the projection's rows as ``w * E[1 / rms(x)]`` (the expectation
measured on the bundled target over HumanEval prompts). Everything else is
copied: embeddings, head, layer norms, v/o projections and the MLPs. The
result computes nearly the bundled target's function, keeps most of the
bundled drafter's acceptance (the drafter reads the target's hidden states,
which stay close), and is a real instance of the other architecture, served
by vLLM's own model class:

``llama``    ``LlamaForCausalLM`` with llama3 RoPE scaling (Llama 3.1's
             parameters; with this head size only the lowest frequencies move).
``gpt_oss``  ``GptOssForCausalLM``: sliding-window layers alternating with full
             ones (window ``GPT_OSS_WINDOW``; several KV-cache groups; appended
             layers that add exactly zero balance the two kinds for vLLM's
             grouping with the drafter), per-head attention sinks
             (``GPT_OSS_SINK``), q/k/v/o biases (zero), YaRN RoPE at factor 1
             (the plain rotation), and a mixture of experts whose experts are
             all the bundled MLP rewritten for gpt-oss's clamped SwiGLU:
             ``glu(g') * (u' + 1)`` with ``g' = g / alpha`` equals
             ``silu(g) / alpha``, and ``u' = k * u - 1`` makes ``(u' + 1) = k * u``,
             so ``down' = down * alpha / k`` gives back ``silu(g) * u @ down``
             (``k`` keeps ``u'`` inside the clamp). The renormalised top-k
             routing weights sum to 1, so the router does not matter.

The targets are generated into the model cache
(``benchmarks/tiny_pair/model_cache.py``) with a copy of the drafter beside
each as ``<target>-dflash``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from benchmarks.tiny_pair.heavy import DEFAULT_DRAFTER, DEFAULT_TARGET, source_config
from benchmarks.tiny_pair.model_cache import cached_model, copy_drafter, copy_support_files

FORMAT = 4  # bump when the generator's output changes for the same parameters
ARCHS = ("llama", "gpt_oss")
CALIBRATION_PROMPTS = 32
GPT_OSS_WINDOW = 64
GPT_OSS_SINK = -1.0  # per head: exp(-1) joins every softmax denominator
GPT_OSS_EXPERTS, GPT_OSS_TOP_K = 4, 2
GPT_OSS_SILENT = 10  # appended layers that add exactly zero (see gpt_oss)
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0
UP_SCALE = 0.5  # k above: |k * u - 1| stays inside the clamp for |u| < 12
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


def _load(src: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return source_config(src), load_file(str(src / "model.safetensors"))


@torch.no_grad()
def inverse_rms(src: Path, num_prompts: int = CALIBRATION_PROMPTS) -> dict[str, torch.Tensor]:
    """``E[1 / rms]`` of every head's query and key projection on the bundled
    target over HumanEval prompts: ``{"layers.<i>.q": [heads], ...}``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.run_llm import humaneval_prompts

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(src))
    eps = model.config.rms_norm_eps
    hd = model.config.head_dim
    sums: dict[str, torch.Tensor] = {}
    count = 0
    hooks = []
    for i, layer in enumerate(model.model.layers):
        for kind in ("q", "k"):
            def hook(_mod, _inp, out, key=f"layers.{i}.{kind}"):
                x = out.reshape(-1, out.shape[-1] // hd, hd)
                inv = torch.rsqrt(x.pow(2).mean(-1) + eps).sum(0)
                sums[key] = sums.get(key, 0) + inv
            hooks.append(getattr(layer.self_attn, f"{kind}_proj").register_forward_hook(hook))
    try:
        for text in humaneval_prompts(num_prompts):
            ids = tok(text, return_tensors="pt").input_ids
            model(ids)
            count += ids.shape[1]
    finally:
        for h in hooks:
            h.remove()
    return {k: v / count for k, v in sums.items()}


def _fold(proj: torch.Tensor, norm: torch.Tensor, inv_rms: torch.Tensor) -> torch.Tensor:
    """``proj`` ([heads * hd, hidden]) with each head's rows scaled by the
    norm weight and that head's mean inverse RMS."""
    heads, hd = inv_rms.numel(), norm.numel()
    scale = norm[None, :] * inv_rms[:, None]  # [heads, hd]
    return (proj.view(heads, hd, -1) * scale[..., None]).reshape(heads * hd, -1)


def _attention(weights: dict, inv: dict, i: int, bias: bool) -> dict[str, torch.Tensor]:
    p = f"model.layers.{i}.self_attn."
    out = {f"{p}q_proj.weight": _fold(weights[f"{p}q_proj.weight"], weights[f"{p}q_norm.weight"],
                                      inv[f"layers.{i}.q"]),
           f"{p}k_proj.weight": _fold(weights[f"{p}k_proj.weight"], weights[f"{p}k_norm.weight"],
                                      inv[f"layers.{i}.k"]),
           f"{p}v_proj.weight": weights[f"{p}v_proj.weight"].clone(),
           f"{p}o_proj.weight": weights[f"{p}o_proj.weight"].clone()}
    if bias:
        for n in ("q", "k", "v", "o"):
            w = out[f"{p}{n}_proj.weight"]
            out[f"{p}{n}_proj.bias"] = torch.zeros(w.shape[0], dtype=w.dtype)
    return out


def _common(cfg: dict, weights: dict) -> dict[str, torch.Tensor]:
    keep = ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight")
    out = {k: weights[k].clone() for k in keep}
    for i in range(cfg["num_hidden_layers"]):
        for n in ("input_layernorm", "post_attention_layernorm"):
            k = f"model.layers.{i}.{n}.weight"
            out[k] = weights[k].clone()
    return out


_COPIED = ("bos_token_id", "eos_token_id", "pad_token_id", "head_dim", "hidden_size",
           "intermediate_size", "max_position_embeddings", "num_attention_heads",
           "num_hidden_layers", "num_key_value_heads", "rms_norm_eps", "tie_word_embeddings",
           "vocab_size", "initializer_range")


def llama(cfg: dict, weights: dict, inv: dict) -> tuple[dict, dict]:
    config = {k: cfg[k] for k in _COPIED if k in cfg}
    config.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                  attention_bias=False, mlp_bias=False, rope_parameters=dict(LLAMA3_ROPE),
                  dtype="float32")
    out = _common(cfg, weights)
    for i in range(cfg["num_hidden_layers"]):
        out.update(_attention(weights, inv, i, bias=False))
        for n in ("gate_proj", "up_proj", "down_proj"):
            k = f"model.layers.{i}.mlp.{n}.weight"
            out[k] = weights[k].clone()
    return config, out


def gpt_oss(cfg: dict, weights: dict, inv: dict, seed: int = 0) -> tuple[dict, dict]:
    n = cfg["num_hidden_layers"]
    config = {k: cfg[k] for k in _COPIED if k in cfg}
    config.update(
        architectures=["GptOssForCausalLM"], model_type="gpt_oss", attention_bias=True,
        # vLLM's gpt-oss slides on even layers and attends fully on odd ones.
        # Its KV-cache grouping puts the drafter's layers with the full ones
        # and splits a kind that has 1.5 times as many layers as the other,
        # which must not happen to the drafter's: GPT_OSS_SILENT appended
        # layers that add exactly zero make it 7 sliding against 7 + 3 full.
        num_hidden_layers=n + GPT_OSS_SILENT,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                     for i in range(n + GPT_OSS_SILENT)],
        sliding_window=GPT_OSS_WINDOW, num_local_experts=GPT_OSS_EXPERTS,
        num_experts_per_tok=GPT_OSS_TOP_K, swiglu_alpha=SWIGLU_ALPHA, swiglu_limit=SWIGLU_LIMIT,
        output_router_logits=False, router_aux_loss_coef=0.0, hidden_act="silu", dtype="float32",
        rope_parameters={"rope_type": "yarn", "rope_theta": cfg["rope_parameters"]["rope_theta"],
                         "factor": 1.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": cfg["max_position_embeddings"]})
    gen = torch.Generator().manual_seed(seed)
    out = _common(cfg, weights)
    e, h = GPT_OSS_EXPERTS, cfg["hidden_size"]
    for i in range(n):
        out.update(_attention(weights, inv, i, bias=True))
        p = f"model.layers.{i}."
        out[f"{p}self_attn.sinks"] = torch.full((cfg["num_attention_heads"],), GPT_OSS_SINK)
        gate = weights[f"{p}mlp.gate_proj.weight"].t() / SWIGLU_ALPHA  # [hidden, inter]
        up = weights[f"{p}mlp.up_proj.weight"].t() * UP_SCALE
        gate_up = torch.stack((gate, up), dim=-1).reshape(h, -1)  # interleaved: gate, up
        bias = torch.stack((torch.zeros(gate.shape[1]), -torch.ones(gate.shape[1])), -1)
        down = weights[f"{p}mlp.down_proj.weight"].t() * (SWIGLU_ALPHA / UP_SCALE)
        out[f"{p}mlp.experts.gate_up_proj"] = gate_up.expand(e, -1, -1).contiguous()
        out[f"{p}mlp.experts.gate_up_proj_bias"] = bias.reshape(-1).expand(e, -1).contiguous()
        out[f"{p}mlp.experts.down_proj"] = down.expand(e, -1, -1).contiguous()
        out[f"{p}mlp.experts.down_proj_bias"] = torch.zeros(e, h)
        out[f"{p}mlp.router.weight"] = torch.randn(e, h, generator=gen) * 0.02
        out[f"{p}mlp.router.bias"] = torch.zeros(e)
    for j in range(n, n + GPT_OSS_SILENT):  # copies of a layer whose outputs are zero
        src, dst = f"model.layers.{n - 1}.", f"model.layers.{j}."
        for k in [k for k in out if k.startswith(src)]:
            t = out[k].clone()
            if any(z in k for z in ("o_proj", "down_proj")):
                t.zero_()
            out[dst + k[len(src):]] = t
    return config, out


def write_target(arch: str, src: str | os.PathLike, dst: str | os.PathLike) -> dict:
    """Write the ``arch`` copy of the Qwen3 target ``src`` to ``dst``."""
    from safetensors.torch import save_file

    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r}: choose from {ARCHS}")
    src, dst = Path(src), Path(dst)
    cfg, weights = _load(src)
    if "q_norm" not in " ".join(weights):
        raise ValueError(f"{src}: not a Qwen3 target (no q/k norms to fold)")
    inv = inverse_rms(src)
    config, out = (llama if arch == "llama" else gpt_oss)(cfg, weights, inv)
    copy_support_files(src, dst)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: t.contiguous() for k, t in out.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    return {"parameters": sum(t.numel() for t in out.values()),
            "num_hidden_layers": config["num_hidden_layers"]}


def make_target(arch: str, cache_root: str | os.PathLike | None = None, *,
                source: str | os.PathLike = DEFAULT_TARGET,
                drafter: str | os.PathLike | None = DEFAULT_DRAFTER) -> Path:
    """The ``arch`` target's folder, generated on first use."""
    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r}: choose from {ARCHS}")
    source_config(Path(source))  # a readable Qwen3 config, or a clear error
    name = f"{Path(source).name}-{arch.replace('_', '')}"
    params = {"kind": arch, "format": FORMAT, "prompts": CALIBRATION_PROMPTS}
    sources = {"target": Path(source)}
    if drafter is not None:
        sources["drafter"] = Path(drafter)

    def build(entry: Path) -> dict:
        facts = write_target(arch, source, entry / name)
        if drafter is not None:
            copy_drafter(Path(drafter), entry / f"{name}-dflash",
                         num_target_layers=facts["num_hidden_layers"])
        return facts

    return cached_model(name, params, sources, build, cache_root)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("arch", choices=ARCHS)
    ap.add_argument("--source", default=str(DEFAULT_TARGET))
    ap.add_argument("--drafter", default=str(DEFAULT_DRAFTER),
                    help="copied beside the target ('' for none)")
    ap.add_argument("--cache-root", default=None)
    args = ap.parse_args()
    print(make_target(args.arch, args.cache_root, source=args.source,
                      drafter=args.drafter or None))


if __name__ == "__main__":
    main()
