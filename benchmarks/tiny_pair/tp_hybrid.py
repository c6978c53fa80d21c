"""A tensor-parallel-ready copy of the bundled hybrid target, without training.

    python -m benchmarks.tiny_pair.tp_hybrid                 # generate (once) and print its path
    python -m benchmarks.tiny_pair.tp_hybrid --tp-size 4 --cache-root /tmp/c

vLLM splits a Gated DeltaNet (GDN) layer over tensor-parallel ranks by key
heads and value heads, so both counts must be divisible by the TP size. The
bundled ``tiny-qwen35`` has 1 key head and 3 value heads, which no TP size
above 1 divides. This generator rewrites every GDN layer to ``H'`` key heads
and ``HV'`` value heads (2 and 4 for TP = 2) and leaves the model's function
exactly as it was:

* **Key heads are duplicated.** Each source key head ``k`` becomes ``c``
  adjacent copies (``c`` the smallest count with ``c * H`` divisible by the TP
  size): its rows of the q and k blocks of ``in_proj_qkv`` and its conv1d
  channels are repeated. Qwen3.5 has no other per-key-head parameter (the
  gated RMSNorm weight has one entry per value-head channel, shared by every
  head).
* **Value heads are re-slotted, padded with silent heads.** transformers
  (``repeat_interleave`` of q/k over ``HV // H``) and vLLM (per-rank
  contiguous heads) both let value head ``v`` read key head ``v // (HV / H)``.
  The ``g = HV / H`` value heads of source key head ``k`` go, in order, into
  the first ``g`` of the ``c * g'`` value slots of ``k``'s copies
  (``g' = ceil(g / c)`` value heads per new key head), so each keeps reading
  the same q/k. A slot left over is a *silent* head: its ``v``/``z``/``a``/``b``
  rows, conv channels, ``A_log`` and ``dt_bias`` copy a real value head of the
  same key head, and its ``out_proj`` columns are zero. It therefore computes
  exactly what that real head computes (finite whenever the model's output
  is, so no ``0 * inf`` NaN can arise) and adds ``+-0`` to the residual stream.
* **Everything else is copied unchanged**: embeddings, head, norms, MLPs and
  the full-attention layers (vLLM replicates their single KV head under TP).

The checkpoint keeps Qwen3.5's non-interleaved layout, the one vLLM loads
with ``gqa_interleaved_layout=False``: ``in_proj_qkv`` rows are ``[q heads |
k heads | v heads]``, ``conv1d`` channels follow the same ``[q | k | v]``
order, ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a`` / ``A_log`` / ``dt_bias``
have one block per value head, and ``out_proj`` has one column block per
value head. Each block is head-contiguous, which is what vLLM's per-shard
loader slices per rank.

For TP = 2 the 1/3 source becomes 2/4: value heads 0, 1 read key head 0,
value head 2 reads key head 1 (the copy), and value head 3 is silent (a copy
of value head 0 under key head 1).

:func:`tp_hybrid_target` generates it once into the model cache
(``benchmarks/tiny_pair/model_cache.py``), with a copy of the drafter beside
it as ``<target>-dflash``, and returns the target's path.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import torch

from benchmarks.tiny_pair.model_cache import cached_model, copy_drafter, copy_support_files

REPO = Path(__file__).resolve().parents[2]
DEFAULT_TARGET = REPO / "models" / "tiny-qwen35"
DEFAULT_DRAFTER = REPO / "models" / "tiny-qwen35-dflash"
TP_SIZE = 2
FORMAT = 1  # bump when the generator's output changes for the same parameters

ARCHITECTURE = "Qwen3_5ForCausalLM"
# The GDN tensors of one Qwen3.5 layer (``model.layers.<i>.linear_attn.<name>``).
_GDN = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "A_log", "dt_bias",
        "norm", "out_proj")


def source_config(src: Path) -> dict:
    """The config of a saved text-only Qwen3.5 hybrid target, or a clear error."""
    cfg_path = Path(src) / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"source: {src} has no config.json; pass the folder of a saved "
                                f"{ARCHITECTURE} (e.g. models/tiny-qwen35)")
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("architectures") != [ARCHITECTURE]:
        raise ValueError(f"source: {src} is a {cfg.get('architectures')}, not a {ARCHITECTURE}; "
                         "pass a text-only Qwen3.5 hybrid target such as models/tiny-qwen35")
    if "linear_attention" not in (cfg.get("layer_types") or []):
        raise ValueError(f"source: {src} has no linear_attention layer in layer_types; there "
                         "are no GDN heads to re-split")
    return cfg


def _check(tp_size: int) -> None:
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size={tp_size!r}: must be an int >= 1 (the tensor-parallel size "
                         "the target is made for, e.g. 2)")


def _check_for(cfg: dict, tp_size: int) -> None:
    """The rest of the model must split over ``tp_size`` ranks as it is."""
    _check(tp_size)
    h, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    if hv % h:
        raise ValueError(f"source: linear_num_value_heads {hv} is not a multiple of "
                         f"linear_num_key_heads {h}; not a Qwen3.5 GDN layout")
    kv = cfg["num_key_value_heads"]
    if (kv % tp_size) if kv >= tp_size else (tp_size % kv):
        raise ValueError(f"tp_size={tp_size}: the full-attention layers' {kv} KV heads can be "
                         "neither split nor replicated evenly over that many ranks; pick a TP "
                         "size that divides or is a multiple of it")
    for key in ("num_attention_heads", "intermediate_size"):
        if cfg[key] % tp_size:
            raise ValueError(f"tp_size={tp_size}: the source's {key} {cfg[key]} is not "
                             f"divisible by it, so the model cannot run at that TP size even "
                             "after the GDN heads are re-split; pick a TP size that divides it")


def head_counts(num_key_heads: int, num_value_heads: int, tp_size: int) -> tuple[int, int, int]:
    """``(key copies c, new key heads H', new value heads HV')`` for ``tp_size``:
    the fewest key heads that are copies of the source's and divisible by
    ``tp_size``, and the fewest value heads per new key head that hold every
    source value head."""
    copies = tp_size // math.gcd(num_key_heads, tp_size)
    per_key = -(-(num_value_heads // num_key_heads) // copies)
    return copies, num_key_heads * copies, num_key_heads * copies * per_key


def head_maps(num_key_heads: int, num_value_heads: int, tp_size: int
              ) -> tuple[list[int], list[int], list[bool]]:
    """``(key_src, value_src, real)``: new key head ``j`` copies source key head
    ``key_src[j]``; new value head ``j`` copies source value head
    ``value_src[j]`` and is a real head (``real[j]``) or a silent one."""
    copies, new_h, new_hv = head_counts(num_key_heads, num_value_heads, tp_size)
    group, new_group = num_value_heads // num_key_heads, new_hv // new_h
    key_src = [j // copies for j in range(new_h)]
    value_src, real = [], []
    for j in range(new_hv):
        k = key_src[j // new_group]             # the source key head this slot reads
        slot = j - k * copies * new_group       # its index among k's c * g' slots
        value_src.append(k * group + slot % group)
        real.append(slot < group)
    # every slot reads (a copy of) the key head its source value head read
    assert all(key_src[j // new_group] == value_src[j] // group for j in range(new_hv))
    assert sorted(v for v, r in zip(value_src, real) if r) == list(range(num_value_heads))
    return key_src, value_src, real


def _rows(t: torch.Tensor, heads: list[int], size: int) -> torch.Tensor:
    """Blocks ``heads`` of ``size`` rows each, in that order (dim 0)."""
    idx = torch.tensor([h * size + i for h in heads for i in range(size)])
    return t.index_select(0, idx)


def split_layer(cfg: dict, gdn: dict[str, torch.Tensor], tp_size: int
                ) -> dict[str, torch.Tensor]:
    """One GDN layer's tensors (keys as in ``_GDN``) with the heads re-split."""
    h, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    key_src, value_src, real = head_maps(h, hv, tp_size)

    def qkv(t: torch.Tensor) -> torch.Tensor:  # [q | k | v] blocks along dim 0
        q, k, v = t.split([h * dk, h * dk, hv * dv])
        return torch.cat([_rows(q, key_src, dk), _rows(k, key_src, dk), _rows(v, value_src, dv)])

    out_cols = _rows(gdn["out_proj"].t(), value_src, dv).t()
    silent = torch.tensor([not r for r in real]).repeat_interleave(dv)
    out_cols = out_cols.masked_fill(silent, 0)
    return {
        "in_proj_qkv": qkv(gdn["in_proj_qkv"]),
        "conv1d": qkv(gdn["conv1d"]),
        "in_proj_z": _rows(gdn["in_proj_z"], value_src, dv),
        "in_proj_b": _rows(gdn["in_proj_b"], value_src, 1),
        "in_proj_a": _rows(gdn["in_proj_a"], value_src, 1),
        "A_log": _rows(gdn["A_log"], value_src, 1),
        "dt_bias": _rows(gdn["dt_bias"], value_src, 1),
        "norm": gdn["norm"],
        "out_proj": out_cols,
    }


def _gdn_name(layer: int, name: str) -> str:
    suffix = "" if name in ("A_log", "dt_bias") else ".weight"
    return f"model.layers.{layer}.linear_attn.{name}{suffix}"


def check_head_counts(cfg: dict, weights: dict[str, torch.Tensor], tp_size: int) -> None:
    """Raise AssertionError unless every GDN tensor has the shape ``cfg``'s
    head counts give and those counts split evenly over ``tp_size`` ranks."""
    h, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    hidden, width = cfg["hidden_size"], cfg["linear_conv_kernel_dim"]
    if h % tp_size or hv % tp_size or hv % h:
        raise AssertionError(f"GDN heads {h} key / {hv} value do not split over tp_size="
                             f"{tp_size} ranks with whole GQA groups")
    conv = 2 * h * dk + hv * dv
    want = {"in_proj_qkv": (conv, hidden), "in_proj_z": (hv * dv, hidden),
            "in_proj_b": (hv, hidden), "in_proj_a": (hv, hidden), "conv1d": (conv, 1, width),
            "A_log": (hv,), "dt_bias": (hv,), "norm": (dv,), "out_proj": (hidden, hv * dv)}
    for i, kind in enumerate(cfg["layer_types"]):
        if kind != "linear_attention":
            continue
        for name, shape in want.items():
            got = tuple(weights[_gdn_name(i, name)].shape)
            if got != shape:
                raise AssertionError(f"{_gdn_name(i, name)} has shape {got}; {h} key / {hv} "
                                     f"value heads need {shape}")


def tp_weights(cfg: dict, weights: dict[str, torch.Tensor], *, tp_size: int
               ) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(config, weights)`` of the re-split model; the source tensors are not modified."""
    _check_for(cfg, tp_size)
    out = dict(weights)
    for i, kind in enumerate(cfg["layer_types"]):
        if kind != "linear_attention":
            continue
        prefix = f"model.layers.{i}.linear_attn."
        names = {k for k in weights if k.startswith(prefix)}
        known = {_gdn_name(i, n) for n in _GDN}
        if names != known:
            raise ValueError(f"source: layer {i}'s GDN tensors are {sorted(names)}, expected "
                             f"{sorted(known)}; only the Qwen3.5 checkpoint layout (separate "
                             "in_proj_qkv / in_proj_z / in_proj_b / in_proj_a) is supported")
        new = split_layer(cfg, {n: weights[_gdn_name(i, n)] for n in _GDN}, tp_size)
        out.update({_gdn_name(i, n): t for n, t in new.items()})
    _, new_h, new_hv = head_counts(cfg["linear_num_key_heads"], cfg["linear_num_value_heads"],
                                   tp_size)
    new_cfg = dict(cfg, linear_num_key_heads=new_h, linear_num_value_heads=new_hv)
    check_head_counts(new_cfg, out, tp_size)
    return new_cfg, out


def write_tp_hybrid_target(src: str | os.PathLike, dst: str | os.PathLike, *,
                           tp_size: int = TP_SIZE) -> dict:
    """Write the re-split copy of the Qwen3.5 target ``src`` to ``dst`` (config,
    tokenizer files, ``model.safetensors``). Returns the manifest facts."""
    from safetensors.torch import load_file, save_file

    _check(tp_size)
    src, dst = Path(src), Path(dst)
    cfg = source_config(src)
    weights_file = src / "model.safetensors"
    if not weights_file.is_file():
        raise FileNotFoundError(f"source: {src} has no single model.safetensors (sharded "
                                "checkpoints are not supported); re-save it unsharded")
    new_cfg, out = tp_weights(cfg, load_file(str(weights_file)), tp_size=tp_size)
    copy_support_files(src, dst)
    (dst / "config.json").write_text(json.dumps(new_cfg, indent=2) + "\n")
    save_file({k: t.contiguous() for k, t in out.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    return {"parameters": sum(t.numel() for t in out.values()),
            "linear_num_key_heads": new_cfg["linear_num_key_heads"],
            "linear_num_value_heads": new_cfg["linear_num_value_heads"]}


def tp_hybrid_target(cache_root: str | os.PathLike | None = None, *,
                     source: str | os.PathLike = DEFAULT_TARGET,
                     drafter: str | os.PathLike | None = DEFAULT_DRAFTER,
                     tp_size: int = TP_SIZE) -> Path:
    """The re-split target's folder, generated on first use (see the module
    docstring). With ``drafter`` (default: the bundled one) a copy of it is
    placed beside the target as ``<target>-dflash``."""
    _check(tp_size)
    cfg = source_config(Path(source))
    _check_for(cfg, tp_size)
    name = f"{Path(source).name}-tp{tp_size}"
    params = {"kind": "tp_hybrid", "format": FORMAT, "tp_size": tp_size}
    sources = {"target": Path(source)}
    if drafter is not None:
        sources["drafter"] = Path(drafter)

    def build(entry: Path) -> dict:
        facts = write_tp_hybrid_target(source, entry / name, tp_size=tp_size)
        if drafter is not None:
            copy_drafter(Path(drafter), entry / f"{name}-dflash",
                         num_target_layers=cfg["num_hidden_layers"])
        return facts

    return cached_model(name, params, sources, build, cache_root)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", default=str(DEFAULT_TARGET))
    ap.add_argument("--drafter", default=str(DEFAULT_DRAFTER),
                    help="copied beside the re-split target ('' for none)")
    ap.add_argument("--tp-size", type=int, default=TP_SIZE)
    ap.add_argument("--cache-root", default=None)
    args = ap.parse_args()
    print(tp_hybrid_target(args.cache_root, source=args.source, drafter=args.drafter or None,
                           tp_size=args.tp_size))


if __name__ == "__main__":
    main()
