"""The bundled pair with attention heads padded from 48 to 64 dims, without training.

    python -m benchmarks.tiny_pair.head_pad            # generate (once), print the target

vLLM's CPU attention keeps an fp8 KV cache only for head sizes that are
multiples of 32 (``_get_attn_isa``), and the bundled pair's heads have 48
dims. This makes a target and a drafter whose heads have 64 and which compute
the bundled models' functions up to float rounding, so the drafter keeps its
acceptance:

* every head's 48 dims go to dims ``0..23`` and ``32..55`` (each half of the
  rotary pairs ``(i, i + d/2)`` where it was), the other 16 are zero in the
  q/k/v projections and in ``o_proj``'s columns: those dims stay zero, add
  nothing to ``q . k`` and write nothing to the output;
* ``rope_theta`` becomes ``theta ** (64 / 48)``, so that rotary frequency
  ``i < 24`` of 64 dims is frequency ``i`` of 48;
* ``k_norm``'s weights are multiplied by ``sqrt(48 / 64)``: the RMS over 64
  dims (16 of them zero) is ``sqrt(48 / 64)`` times the RMS over 48, so the
  normalized q comes out ``sqrt(64 / 48)`` times larger, and k unchanged; the
  logits ``q . k / sqrt(64)`` are then ``q . k / sqrt(48)`` of the original.

:func:`make_head64_pair` generates the pair once into the model cache
(``benchmarks/tiny_pair/model_cache.py``), the drafter beside the target as
``<target>-dflash``, and returns the target's path.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
from pathlib import Path

import torch

from benchmarks.tiny_pair.heavy import DEFAULT_DRAFTER, DEFAULT_TARGET, source_config
from benchmarks.tiny_pair.model_cache import cached_model, copy_support_files

NEW_HEAD_DIM = 64
FORMAT = 1  # bump when the generator's output changes for the same parameters


def _dim_map(old: int, new: int) -> torch.Tensor:
    """New index of each old head dim: the rotary halves stay halves."""
    if old % 2 or new % 2 or new < old:
        raise ValueError(f"head dims {old} -> {new}: both must be even and new >= old")
    j = torch.arange(old)
    return torch.where(j < old // 2, j, j - old // 2 + new // 2)


def pad_attention(weights: dict[str, torch.Tensor], prefix: str, num_heads: int,
                  num_kv_heads: int, old: int, new: int) -> None:
    """Pad one attention layer's tensors (``prefix`` + ``q_proj.weight`` ...)
    in place from ``old`` to ``new`` head dims (module docstring)."""
    idx = _dim_map(old, new)
    for name, heads in (("q_proj", num_heads), ("k_proj", num_kv_heads),
                        ("v_proj", num_kv_heads)):
        w = weights[f"{prefix}{name}.weight"]
        padded = w.new_zeros(heads, new, w.shape[1])
        padded[:, idx] = w.view(heads, old, w.shape[1])
        weights[f"{prefix}{name}.weight"] = padded.reshape(heads * new, w.shape[1])
        if f"{prefix}{name}.bias" in weights:
            raise ValueError(f"{prefix}{name}: biased projections are not handled")
    o = weights[f"{prefix}o_proj.weight"]
    padded = o.new_zeros(o.shape[0], num_heads, new)
    padded[:, :, idx] = o.view(o.shape[0], num_heads, old)
    weights[f"{prefix}o_proj.weight"] = padded.reshape(o.shape[0], num_heads * new)
    for name, factor in (("q_norm", 1.0), ("k_norm", math.sqrt(old / new))):
        w = weights[f"{prefix}{name}.weight"]
        padded = w.new_ones(new)
        padded[idx] = w * factor
        weights[f"{prefix}{name}.weight"] = padded


def _padded_config(cfg: dict, new: int) -> dict:
    old = cfg["head_dim"]
    cfg = dict(cfg, head_dim=new)
    if isinstance(cfg.get("rope_parameters"), dict):
        rope = dict(cfg["rope_parameters"])
        rope["rope_theta"] = rope["rope_theta"] ** (new / old)
        cfg["rope_parameters"] = rope
    else:
        cfg["rope_theta"] = cfg["rope_theta"] ** (new / old)
    return cfg


def write_padded(src: Path, dst: Path, layer_prefix: str, new: int = NEW_HEAD_DIM) -> dict:
    """Write the padded copy of the model folder ``src`` (its attention layers
    are ``<layer_prefix><i>.self_attn.``) to ``dst``."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((src / "config.json").read_text())
    old = cfg["head_dim"]
    weights = load_file(str(src / "model.safetensors"))
    for i in range(cfg["num_hidden_layers"]):
        pad_attention(weights, f"{layer_prefix}{i}.self_attn.", cfg["num_attention_heads"],
                      cfg["num_key_value_heads"], old, new)
    if layer_prefix.startswith("model."):
        copy_support_files(src, dst)
    else:  # a drafter folder: everything but the weights and config as is
        dst.mkdir(parents=True, exist_ok=True)
        for path in src.iterdir():
            if path.is_file() and path.name not in ("config.json", "model.safetensors"):
                shutil.copy2(path, dst / path.name)
    (dst / "config.json").write_text(json.dumps(_padded_config(cfg, new), indent=2) + "\n")
    save_file({k: t.contiguous() for k, t in weights.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    return {"head_dim": new}


def make_head64_pair(cache_root: str | os.PathLike | None = None, *,
                     source: str | os.PathLike = DEFAULT_TARGET,
                     drafter: str | os.PathLike = DEFAULT_DRAFTER) -> Path:
    """The padded target's folder (its drafter is ``<target>-dflash``),
    generated on first use."""
    source_config(Path(source))
    name = f"{Path(source).name}-head{NEW_HEAD_DIM}"
    params = {"kind": "head_pad", "format": FORMAT, "head_dim": NEW_HEAD_DIM}

    def build(entry: Path) -> dict:
        facts = write_padded(Path(source), entry / name, "model.layers.")
        write_padded(Path(drafter), entry / f"{name}-dflash", "layers.")
        return facts

    return cached_model(name, params, {"target": Path(source), "drafter": Path(drafter)},
                        build, cache_root)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", default=str(DEFAULT_TARGET))
    ap.add_argument("--drafter", default=str(DEFAULT_DRAFTER))
    ap.add_argument("--cache-root", default=None)
    args = ap.parse_args()
    print(make_head64_pair(args.cache_root, source=args.source, drafter=args.drafter))


if __name__ == "__main__":
    main()
