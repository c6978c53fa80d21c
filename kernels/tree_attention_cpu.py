"""Tree attention on CPU in torch, batched over the tree requests of a step.

The same semantics as :func:`vllm_ddtree.kernels.reference.tree_attention_reference`
(tree requests only), computed with one gather and one SDPA call per layer
instead of a Python loop over requests: the tree requests are padded to the
longest query (``Q`` rows) and the longest sequence (``L`` keys).

Everything that depends only on the step, not on the layer (row and key
indices, the visibility mask), is a :class:`TreeBatchPlan`, built once per step
and reused by every layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vllm_ddtree.kernels.reference import unpack_tree_mask

__all__ = ["TreeBatchPlan", "plan_tree_batch", "tree_attention_batched"]


@dataclass(frozen=True)
class TreeBatchPlan:
    q_rows: torch.Tensor  # [R, Q] query row of each padded slot (clamped into the request)
    q_valid: torch.Tensor  # [R, Q] bool: a real query row
    out_rows: torch.Tensor  # [n] the real query rows, in q_valid order
    kv_block: torch.Tensor  # [R, L] cache block of each key position
    kv_offset: torch.Tensor  # [R, L] offset within the block
    visible: torch.Tensor  # [R, 1, Q, L] bool
    blind: torch.Tensor  # [n] bool: a real row that sees no key (its output is zero)


def plan_tree_batch(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    tree_mask: torch.Tensor,
    tree_reqs: Sequence[int],
) -> TreeBatchPlan:
    """Indices and mask for the tree requests ``tree_reqs`` of one step."""
    dev = query_start_loc.device
    idx = torch.as_tensor(list(tree_reqs), device=dev, dtype=torch.long)
    starts = query_start_loc[idx].long()
    q_len = query_start_loc[idx + 1].long() - starts
    seq = seq_lens[idx].long()
    ctx = seq - q_len
    if bool((ctx < 0).any()):
        raise ValueError("seq_lens must be at least each request's query length")
    num_q, num_k = int(q_len.max()), int(seq.max())
    if tree_mask.shape[1] * 32 < num_q:
        raise ValueError(f"tree_mask: {tree_mask.shape[1]} words cannot hold a tree of "
                         f"{num_q} nodes")

    qi = torch.arange(num_q, device=dev)
    q_valid = qi[None, :] < q_len[:, None]
    q_rows = starts[:, None] + torch.where(q_valid, qi[None, :], 0)

    pos = torch.arange(num_k, device=dev)
    k_valid = pos[None, :] < seq[:, None]
    posc = torch.where(k_valid, pos[None, :], 0)
    kv_block = block_table[idx].long().gather(1, posc // block_size)
    kv_offset = posc % block_size

    # Context positions are visible to every node; tree position ctx + j is
    # visible to node i when bit j of row i is set.
    bits = unpack_tree_mask(tree_mask[q_rows.flatten()], num_q).view(len(idx), num_q, num_q)
    j = pos[None, :] - ctx[:, None]  # [R, L] tree node index of each key position
    in_tree = (j >= 0) & (j < q_len[:, None])
    tree_bit = bits.gather(2, j.clamp(0, num_q - 1)[:, None, :].expand(-1, num_q, -1))
    visible = (pos[None, :] < ctx[:, None])[:, None, :] | (in_tree[:, None, :] & tree_bit)
    # Rows that see nothing (padding, or an empty mask row) see key 0 so that
    # the softmax stays finite; padding is never written, empty rows get zeros.
    blind = ~(visible & q_valid[:, :, None]).any(-1)
    visible = torch.where(blind[:, :, None], pos[None, None, :] == 0, visible)
    return TreeBatchPlan(q_rows, q_valid, q_rows[q_valid], kv_block, kv_offset,
                         visible[:, None], blind[q_valid])


def tree_attention_batched(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: TreeBatchPlan,
    scale: float,
    output: torch.Tensor,
) -> torch.Tensor:
    """Write the tree requests' rows of ``output`` (other rows are untouched).

    ``query``/``output``: ``[num_tokens, Hq, D]``; ``key_cache``/``value_cache``:
    ``[num_blocks, block_size, Hk, D]`` views holding this step's K/V.
    Computed in fp32, like the reference.
    """
    num_q_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads})")
    q = query[plan.q_rows].float().transpose(1, 2)  # [R, Hq, Q, D]
    k = key_cache[plan.kv_block, plan.kv_offset].float().transpose(1, 2)  # [R, Hk, L, D]
    v = value_cache[plan.kv_block, plan.kv_offset].float().transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.visible, scale=scale,
                                         enable_gqa=num_q_heads != num_kv_heads)
    out = out.transpose(1, 2)[plan.q_valid]  # [n, Hq, D]
    out = out.masked_fill(plan.blind[:, None, None], 0.0)
    output[plan.out_rows] = out.to(output.dtype)
    return output
