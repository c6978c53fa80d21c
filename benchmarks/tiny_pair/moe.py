"""A Mixture-of-Experts target made from the bundled dense one, without training.

    python -m benchmarks.tiny_pair.moe                   # generate (once) and print its path
    python -m benchmarks.tiny_pair.moe --experts 8 --top-k 2

The result is a ``Qwen3MoeForCausalLM`` (transformers' and vLLM's Qwen3-MoE)
whose attention, norms, embeddings and head are the dense target's, and whose
every MoE layer has ``num_experts`` experts that are all copies of the dense
layer's MLP, a random router and top-k routing with ``norm_topk_prob=True``.
Whichever experts the router picks, the renormalised top-k weights sum to 1,
so the layer computes ``sum_k w_k * MLP(x) = MLP(x)``: the dense target's
function up to float rounding (the weights sum to 1 within an ulp or two, and
the weighted sum adds its own rounding). The bundled DFlash drafter therefore
keeps its acceptance on it.

:func:`make_moe_target` generates it once into the model cache
(``benchmarks/tiny_pair/model_cache.py``), with a copy of the drafter beside it
as ``<target>-dflash``, and returns the target's path.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from benchmarks.tiny_pair.heavy import DEFAULT_DRAFTER, DEFAULT_TARGET, source_config
from benchmarks.tiny_pair.model_cache import cached_model, copy_drafter, copy_support_files

MOE_EXPERTS = 4
MOE_TOP_K = 2
MOE_SEED = 0
FORMAT = 1  # bump when the generator's output changes for the same parameters

# Keys of a dense Qwen3 config that a Qwen3-MoE config takes over unchanged.
_SHARED_KEYS = ("attention_bias", "attention_dropout", "bos_token_id", "eos_token_id",
                "pad_token_id", "head_dim", "hidden_act", "hidden_size", "initializer_range",
                "max_position_embeddings", "num_attention_heads", "num_hidden_layers",
                "num_key_value_heads", "rms_norm_eps", "rope_parameters", "sliding_window",
                "tie_word_embeddings", "use_cache", "use_sliding_window", "vocab_size",
                "dtype", "layer_types", "max_window_layers")


def moe_config(dense: dict, num_experts: int, top_k: int) -> dict:
    """The Qwen3-MoE config of the converted model: every layer sparse, experts
    as wide as the dense MLP, no shared expert."""
    cfg = {k: dense[k] for k in _SHARED_KEYS if k in dense}
    cfg.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
               num_experts=num_experts, num_experts_per_tok=top_k, norm_topk_prob=True,
               moe_intermediate_size=dense["intermediate_size"],
               intermediate_size=dense["intermediate_size"], decoder_sparse_step=1,
               mlp_only_layers=[], output_router_logits=False, router_aux_loss_coef=0.001)
    return cfg


def _check(num_experts: int, top_k: int, seed: int) -> None:
    if not isinstance(num_experts, int) or num_experts < 2:
        raise ValueError(f"num_experts={num_experts!r}: must be an int >= 2")
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k!r}: must be an int in [1, num_experts={num_experts}]")
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r}: must be a non-negative int")


def moe_weights(dense_cfg: dict, weights: dict[str, torch.Tensor], *, num_experts: int,
                seed: int) -> dict[str, torch.Tensor]:
    """The checkpoint tensors (Hugging Face Qwen3-MoE names, one tensor per
    expert projection, as published Qwen3-MoE checkpoints store them)."""
    gen = torch.Generator().manual_seed(seed)
    std = float(dense_cfg.get("initializer_range") or 0.02)
    h = dense_cfg["hidden_size"]
    out = {k: v for k, v in weights.items() if ".mlp." not in k}
    for i in range(dense_cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp."
        dtype = weights[f"{p}gate_proj.weight"].dtype
        out[f"{p}gate.weight"] = (torch.randn(num_experts, h, generator=gen) * std).to(dtype)
        for e in range(num_experts):
            for n in ("gate_proj", "up_proj", "down_proj"):
                out[f"{p}experts.{e}.{n}.weight"] = weights[f"{p}{n}.weight"].clone()
    return out


def write_moe_target(src: str | os.PathLike, dst: str | os.PathLike, *,
                     num_experts: int = MOE_EXPERTS, top_k: int = MOE_TOP_K,
                     seed: int = MOE_SEED) -> dict:
    """Write the MoE conversion of the dense Qwen3 target ``src`` to ``dst``."""
    from safetensors.torch import load_file, save_file

    _check(num_experts, top_k, seed)
    src, dst = Path(src), Path(dst)
    dense_cfg = source_config(src)
    weights = load_file(str(src / "model.safetensors"))
    out = moe_weights(dense_cfg, weights, num_experts=num_experts, seed=seed)
    copy_support_files(src, dst)
    (dst / "config.json").write_text(
        json.dumps(moe_config(dense_cfg, num_experts, top_k), indent=2) + "\n")
    save_file({k: t.contiguous() for k, t in out.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    return {"parameters": sum(t.numel() for t in out.values())}


def make_moe_target(cache_root: str | os.PathLike | None = None, *,
                    source: str | os.PathLike = DEFAULT_TARGET,
                    drafter: str | os.PathLike | None = DEFAULT_DRAFTER,
                    num_experts: int = MOE_EXPERTS, top_k: int = MOE_TOP_K,
                    seed: int = MOE_SEED) -> Path:
    """The MoE target's folder, generated on first use (see the module docstring)."""
    _check(num_experts, top_k, seed)
    dense_cfg = source_config(Path(source))
    name = f"{Path(source).name}-moe"
    params = {"kind": "moe", "format": FORMAT, "seed": seed, "num_experts": num_experts,
              "top_k": top_k}
    sources = {"target": Path(source)}
    if drafter is not None:
        sources["drafter"] = Path(drafter)

    def build(entry: Path) -> dict:
        facts = write_moe_target(source, entry / name, num_experts=num_experts, top_k=top_k,
                                 seed=seed)
        if drafter is not None:
            copy_drafter(Path(drafter), entry / f"{name}-dflash",
                         num_target_layers=dense_cfg["num_hidden_layers"])
        return facts

    return cached_model(name, params, sources, build, cache_root)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", default=str(DEFAULT_TARGET))
    ap.add_argument("--drafter", default=str(DEFAULT_DRAFTER),
                    help="copied beside the MoE target ('' for none)")
    ap.add_argument("--experts", type=int, default=MOE_EXPERTS)
    ap.add_argument("--top-k", type=int, default=MOE_TOP_K)
    ap.add_argument("--seed", type=int, default=MOE_SEED)
    ap.add_argument("--cache-root", default=None)
    args = ap.parse_args()
    print(make_moe_target(args.cache_root, source=args.source, drafter=args.drafter or None,
                          num_experts=args.experts, top_k=args.top_k, seed=args.seed))


if __name__ == "__main__":
    main()
