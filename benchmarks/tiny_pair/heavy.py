"""A cost-realistic ("heavy") target made from the bundled one, without training.

    python -m benchmarks.tiny_pair.heavy                 # generate (once) and print its path
    python -m benchmarks.tiny_pair.heavy --layers 6 --intermediate 1024 --cache-root /tmp/c

The bundled ``tiny-qwen3`` is so small that a decode step costs almost nothing
next to the engine's fixed per-step overhead, which hides what speculative
decoding saves. The heavy target computes the bundled target's
function but reads many more weights per step:

* every MLP gets extra intermediate units, with random ``gate_proj`` /
  ``up_proj`` rows and zero ``down_proj`` columns, so each extra unit's output
  is multiplied by zero before it reaches the residual stream;
* decoder layers are appended after the last trained one, with random
  ``q/k/v_proj`` and ``gate/up_proj``, unit norms (``input_layernorm``,
  ``post_attention_layernorm``, ``q_norm``, ``k_norm``) and zero ``o_proj``
  and ``down_proj``: attention and MLP run in full and add exactly zero.

Layers ``0 .. L-1`` of the source are unchanged in what they add to the
residual stream, so the hidden states a DFlash drafter is conditioned on
(``dflash_config.target_layer_ids``, all below the source's last layer) and the
logits are those of the source, and the bundled drafter keeps its acceptance.
(In fp32 "are those" means up to the order a GEMM sums the longer
intermediate dimension in: about 1e-5 on logits of magnitude ~10, with the same
greedy tokens; ``tests/test_model_surgery.py``.)
The defaults (16 layers, intermediate 8192, hidden 192) give about 79M
parameters.

:func:`heavy_target` generates it once into the model cache
(``benchmarks/tiny_pair/model_cache.py``) and returns the target's path; a
copy of the drafter sits beside it as ``<target>-dflash`` (a copy rather than
a symlink: the cache entry stays valid when the repository moves, and the
copy's ``num_target_layers`` describes the heavy target). The weights are
never committed.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.tiny_pair.model_cache import cached_model, copy_drafter, copy_support_files

REPO = Path(__file__).resolve().parents[2]
DEFAULT_TARGET = REPO / "models" / "tiny-qwen3"
DEFAULT_DRAFTER = REPO / "models" / "tiny-qwen3-dflash"
HEAVY_LAYERS = 16
HEAVY_INTERMEDIATE = 8192
HEAVY_SEED = 0
FORMAT = 1  # bump when the generator's output changes for the same parameters

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def source_config(src: Path) -> dict:
    """The config of a saved dense Qwen3 target, or a clear error."""
    cfg_path = Path(src) / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"source: {src} has no config.json; pass the folder of a saved "
                                "Qwen3ForCausalLM (e.g. models/tiny-qwen3)")
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("architectures") != ["Qwen3ForCausalLM"]:
        raise ValueError(f"source: {src} is a {cfg.get('architectures')}, not a "
                         "Qwen3ForCausalLM; pass a dense Qwen3 target such as models/tiny-qwen3")
    return cfg


def _load_source(src: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    cfg = source_config(src)
    weights = src / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"source: {src} has no single model.safetensors (sharded "
                                "checkpoints are not supported); re-save it unsharded")
    return cfg, load_file(str(weights))


def parameter_count(cfg: dict) -> int:
    """Parameters of a Qwen3ForCausalLM with this config (untied or tied head)."""
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    per_layer = (h * q + 2 * h * kv + q * h + 2 * hd  # q, k, v, o, q_norm, k_norm
                 + 3 * h * inter + 2 * h)               # gate, up, down, two layer norms
    head = 0 if cfg.get("tie_word_embeddings") else v * h
    return v * h + head + h + cfg["num_hidden_layers"] * per_layer


def _check_sizes(cfg: dict, num_layers: int, intermediate_size: int, seed: int) -> None:
    if not isinstance(num_layers, int) or num_layers < cfg["num_hidden_layers"]:
        raise ValueError(f"num_layers={num_layers!r}: must be an int >= the source's "
                         f"{cfg['num_hidden_layers']} layers (layers are only appended)")
    if not isinstance(intermediate_size, int) or intermediate_size < cfg["intermediate_size"]:
        raise ValueError(f"intermediate_size={intermediate_size!r}: must be an int >= the "
                         f"source's {cfg['intermediate_size']} (units are only added)")
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r}: must be a non-negative int")


def pad_weights(cfg: dict, weights: dict[str, torch.Tensor], *, num_layers: int,
                intermediate_size: int, seed: int, progress: bool = True
                ) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(config, weights)`` of the padded model; the source tensors are not modified.
    Random weights are normal with the source's ``initializer_range`` (0.02 if
    absent), drawn from one generator seeded with ``seed`` in a fixed order."""
    _check_sizes(cfg, num_layers, intermediate_size, seed)
    gen = torch.Generator().manual_seed(seed)
    std = float(cfg.get("initializer_range") or 0.02)
    h, n_src, i_src = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q_out, kv_out = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    dtype = weights["model.embed_tokens.weight"].dtype
    extra = intermediate_size - i_src

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    out = {k: v for k, v in weights.items() if not k.startswith("model.layers.")}
    for i in tqdm(range(num_layers), desc="padding layers", disable=not progress,
                  mininterval=2):
        p = f"model.layers.{i}."
        if i < n_src:
            for name, t in weights.items():
                if name.startswith(p) and ".mlp." not in name:
                    out[name] = t
            gate, up, down = (weights[f"{p}mlp.{n}.weight"] for n in _MLP)
            out[f"{p}mlp.gate_proj.weight"] = torch.cat([gate, rand(extra, h)])
            out[f"{p}mlp.up_proj.weight"] = torch.cat([up, rand(extra, h)])
            out[f"{p}mlp.down_proj.weight"] = torch.cat(
                [down, torch.zeros(h, extra, dtype=dtype)], dim=1)
            continue
        a = f"{p}self_attn."
        out[f"{a}q_proj.weight"] = rand(q_out, h)
        out[f"{a}k_proj.weight"] = rand(kv_out, h)
        out[f"{a}v_proj.weight"] = rand(kv_out, h)
        out[f"{a}o_proj.weight"] = torch.zeros(h, q_out, dtype=dtype)
        out[f"{a}q_norm.weight"] = torch.ones(hd, dtype=dtype)
        out[f"{a}k_norm.weight"] = torch.ones(hd, dtype=dtype)
        out[f"{p}input_layernorm.weight"] = torch.ones(h, dtype=dtype)
        out[f"{p}post_attention_layernorm.weight"] = torch.ones(h, dtype=dtype)
        out[f"{p}mlp.gate_proj.weight"] = rand(intermediate_size, h)
        out[f"{p}mlp.up_proj.weight"] = rand(intermediate_size, h)
        out[f"{p}mlp.down_proj.weight"] = torch.zeros(h, intermediate_size, dtype=dtype)
    new_cfg = dict(cfg, num_hidden_layers=num_layers, intermediate_size=intermediate_size)
    if isinstance(cfg.get("layer_types"), list):
        if set(cfg["layer_types"]) != {"full_attention"}:
            raise ValueError(f"source: layer_types {sorted(set(cfg['layer_types']))}; only "
                             "full-attention Qwen3 targets can be padded")
        new_cfg["layer_types"] = ["full_attention"] * num_layers
    return new_cfg, out


def write_heavy_target(src: str | os.PathLike, dst: str | os.PathLike, *, seed: int = HEAVY_SEED,
                       num_layers: int = HEAVY_LAYERS,
                       intermediate_size: int = HEAVY_INTERMEDIATE,
                       progress: bool = True) -> dict:
    """Write the padded copy of the Qwen3 target ``src`` to ``dst`` (config,
    tokenizer files, ``model.safetensors``). Returns ``{"parameters": n}``."""
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    cfg, weights = _load_source(src)
    new_cfg, padded = pad_weights(cfg, weights, num_layers=num_layers,
                                  intermediate_size=intermediate_size, seed=seed,
                                  progress=progress)
    n = sum(t.numel() for t in padded.values())
    if n != parameter_count(new_cfg):
        raise AssertionError(f"padded model has {n} parameters, its config says "
                             f"{parameter_count(new_cfg)}")
    copy_support_files(src, dst)
    (dst / "config.json").write_text(json.dumps(new_cfg, indent=2) + "\n")
    save_file({k: t.contiguous() for k, t in padded.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    return {"parameters": n}


def heavy_target(cache_root: str | os.PathLike | None = None, *,
                 source: str | os.PathLike = DEFAULT_TARGET,
                 drafter: str | os.PathLike | None = DEFAULT_DRAFTER, seed: int = HEAVY_SEED,
                 num_layers: int = HEAVY_LAYERS, intermediate_size: int = HEAVY_INTERMEDIATE,
                 progress: bool = True) -> Path:
    """The heavy target's folder, generated on first use (see the module
    docstring). With ``drafter`` (default: the bundled one) a copy of it is
    placed beside the target as ``<target>-dflash``."""
    cfg = source_config(Path(source))
    _check_sizes(cfg, num_layers, intermediate_size, seed)
    name = f"{Path(source).name}-heavy"
    params = {"kind": "heavy", "format": FORMAT, "seed": seed, "num_layers": num_layers,
              "intermediate_size": intermediate_size}
    sources = {"target": Path(source)}
    if drafter is not None:
        sources["drafter"] = Path(drafter)

    def build(entry: Path) -> dict:
        facts = write_heavy_target(source, entry / name, seed=seed, num_layers=num_layers,
                                   intermediate_size=intermediate_size, progress=progress)
        if drafter is not None:
            copy_drafter(Path(drafter), entry / f"{name}-dflash", num_target_layers=num_layers)
        return facts

    return cached_model(name, params, sources, build, cache_root)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", default=str(DEFAULT_TARGET))
    ap.add_argument("--drafter", default=str(DEFAULT_DRAFTER),
                    help="copied beside the heavy target ('' for none)")
    ap.add_argument("--layers", type=int, default=HEAVY_LAYERS)
    ap.add_argument("--intermediate", type=int, default=HEAVY_INTERMEDIATE)
    ap.add_argument("--seed", type=int, default=HEAVY_SEED)
    ap.add_argument("--cache-root", default=None)
    args = ap.parse_args()
    path = heavy_target(args.cache_root, source=args.source, drafter=args.drafter or None,
                        seed=args.seed, num_layers=args.layers,
                        intermediate_size=args.intermediate)
    print(path)


if __name__ == "__main__":
    main()
