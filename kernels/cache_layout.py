"""Strided K/V views of vLLM's per-layer paged KV cache (no vLLM imports).

The tree-attention kernel, its torch reference and the CPU batched path all
read K and V as logical ``[num_blocks, block_size, num_kv_heads, head_size]``
tensors with arbitrary strides. These helpers build such views from the
cache tensor vLLM binds to an attention layer, for the layouts DDTree reads.
"""

from __future__ import annotations

import torch

__all__ = ["split_kv_cache_cpu_vec", "split_kv_cache_nhd"]


def split_kv_cache_nhd(
    kv_cache: torch.Tensor, head_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V views of a ``[num_blocks, num_kv_heads, block_size, 2*head]``
    cache whose block interiors are token-addressable (the CUDA Triton/Flash
    layout, any physical permutation). Returns two
    ``[num_blocks, block_size, num_kv_heads, head_size]`` strided views."""
    if kv_cache.dim() != 4:
        raise ValueError(
            f"kv_cache must be 4-D [num_blocks, num_kv_heads, block_size, "
            f"2*head_size], got shape {tuple(kv_cache.shape)}"
        )
    hs = head_size if head_size is not None else kv_cache.shape[-1] // 2
    if kv_cache.shape[-1] != 2 * hs:
        raise ValueError(
            f"kv_cache last dim {kv_cache.shape[-1]} != 2 * head_size ({hs})"
        )
    key_cache, value_cache = kv_cache.transpose(1, 2).split(hs, dim=-1)
    return key_cache, value_cache


def split_kv_cache_cpu_vec(
    kv_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V views of vLLM's CPU_ATTN cache in the "vec"/"vec16" layout.

    The per-layer cache is ``[num_blocks, num_kv_heads, block_size,
    2*head_size]``; within each (block, head) the first ``block_size *
    head_size`` elements hold K stored ``[head_size, block_size]`` (token index
    fastest) and the next ``block_size * head_size`` hold V stored
    ``[block_size, head_size]``. The AMX layout is tile-packed and cannot be
    expressed with strides. Returns two ``[num_blocks, block_size,
    num_kv_heads, head_size]`` strided views.
    """
    if kv_cache.dim() != 4:
        raise ValueError(
            f"kv_cache must be 4-D [num_blocks, num_kv_heads, block_size, "
            f"2*head_size], got shape {tuple(kv_cache.shape)}"
        )
    nb, nh, bs, two_hs = kv_cache.shape
    hs = two_hs // 2
    try:
        per_head = kv_cache.view(nb, nh, bs * two_hs)
    except RuntimeError as e:
        raise ValueError(
            "kv_cache must have contiguous [block_size, 2*head_size] block "
            f"interiors for the CPU vec layout (strides {kv_cache.stride()})"
        ) from e
    key_cache = per_head[..., : bs * hs].unflatten(-1, (hs, bs)).permute(0, 3, 1, 2)
    value_cache = per_head[..., bs * hs :].unflatten(-1, (bs, hs)).permute(0, 2, 1, 3)
    return key_cache, value_cache
