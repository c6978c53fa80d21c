"""Tree attention on CPU in torch, batched over the tree requests of a step.

The same semantics as :func:`vllm_ddtree.kernels.reference.tree_attention_reference`
(tree requests only), reading vLLM's CPU KV cache in its "vec" layout
(``kernels/cache_layout.py``) in place of a per-token gather: each (block,
head) of that layout already holds ``K^T`` ``[head_size, block_size]`` and
``V`` ``[block_size, head_size]`` contiguously, so per layer the work is

* one ``index_select`` of whole cache blocks (a block copy) for the tree
  requests, padded to the step's longest sequence in whole blocks;
* one batched matmul ``Q K^T`` per block, the mask, a softmax across blocks,
  one batched matmul with ``V`` per block, summed over blocks;
* one ``index_select`` of the queries and one ``index_copy_`` of the output.

Grouped-query heads share their K/V head without repeating it. Tree
requests are padded to the longest tree query (``Q`` rows). A sliding window
(over logical positions: a tree node's is ``ctx_len + depth``) is part of the
visibility mask; keys outside every node's window also get V = 0, since
vLLM may have freed their blocks. Sinks (per query head) join the softmax
denominator.

An fp8 cache (``kv_quant``, ``uint8`` codes, ``kernels/fp8.py``) is decoded
to fp32 as its blocks are gathered; ``k_scale`` joins the softmax scale of
the logits and ``v_scale`` multiplies the output, as in vLLM's CPU op.

Everything that depends only on the step, not on the layer (row and block
indices, the visibility mask), is a :class:`TreeBatchPlan`, built once per
step and reused by every layer. Given the step's host-side sizes
(``num_q``, ``max_seq_len``) building it reads nothing back from the tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm_ddtree.kernels.fp8 import check_kv_quant, dequantize
from vllm_ddtree.kernels.reference import check_sinks, check_sliding_window, unpack_tree_mask

__all__ = ["TreeBatchPlan", "plan_tree_batch", "tree_attention_batched"]


@dataclass(frozen=True)
class TreeBatchPlan:
    num_reqs: int  # R tree requests
    num_q: int  # Q padded query rows per request
    num_blocks: int  # nblk cache blocks per request
    q_rows: torch.Tensor  # [R * Q] query row of each padded slot (clamped into the request)
    blocks: torch.Tensor  # [R * nblk] cache block of each key block
    hidden: torch.Tensor  # [R, nblk, 1, Q, 1, bs] bool: the key is not visible to the row
    dead: torch.Tensor  # [R, nblk, 1, bs, 1] bool: past the sequence, or outside every window
    keep: torch.Tensor  # [n, 1, 1] bool: False for a real row that sees no key
    valid: torch.Tensor  # [n] padded slot (r * Q + i) of every real query row
    out_rows: torch.Tensor  # [n] the real query rows, in ``valid`` order


def plan_tree_batch(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    tree_mask: torch.Tensor,
    tree_reqs: Sequence[int],
    num_q: int | None = None,
    max_seq_len: int | None = None,
    sliding_window: int | None = None,
    depth: torch.Tensor | None = None,
) -> TreeBatchPlan:
    """Indices and mask for the tree requests ``tree_reqs`` of one step.

    ``num_q`` (the longest tree query) and ``max_seq_len`` (an upper bound of
    the tree requests' sequence lengths) are host-side sizes the runner
    knows; without them they are read from the tensors, and the inputs are
    checked on the way. ``sliding_window`` (None or -1: none) and ``depth``
    (int ``[num_tokens]`` node depth per row, required with a window) as in
    :func:`~vllm_ddtree.kernels.reference.tree_attention_reference`."""
    dev = query_start_loc.device
    idx = torch.as_tensor(list(tree_reqs), device=dev, dtype=torch.long)
    starts = query_start_loc[idx].long()
    q_len = query_start_loc[idx + 1].long() - starts
    seq = seq_lens[idx].long()
    ctx = seq - q_len
    if num_q is None or max_seq_len is None:
        if bool((ctx < 0).any()):
            raise ValueError("seq_lens must be at least each request's query length")
        num_q, max_seq_len = int(q_len.max()), int(seq.max())
    if tree_mask.shape[1] * 32 < num_q:
        raise ValueError(f"tree_mask: {tree_mask.shape[1]} words cannot hold a tree of "
                         f"{num_q} nodes")
    window = check_sliding_window(sliding_window)
    if window is not None and (depth is None or depth.dim() != 1
                               or depth.shape[0] < tree_mask.shape[0]):
        raise ValueError(f"depth: a sliding window needs each tree row's node depth as an "
                         f"int [num_tokens={tree_mask.shape[0]}] tensor, got "
                         f"{None if depth is None else tuple(depth.shape)}")
    num_reqs = len(idx)
    nblk = max(1, -(-max_seq_len // block_size))
    num_k = nblk * block_size

    qi = torch.arange(num_q, device=dev)
    q_valid = qi[None, :] < q_len[:, None]  # [R, Q]
    q_rows = starts[:, None] + torch.minimum(qi[None, :], (q_len - 1).clamp(min=0)[:, None])
    blocks = block_table[idx, :nblk].long()  # [R, nblk]

    # Context keys are visible to every node; tree key ctx + j is visible to
    # node i when bit j of row i is set; keys at or past seq_len never are.
    pos = torch.arange(num_k, device=dev)
    bits = unpack_tree_mask(tree_mask[q_rows.flatten()], num_q).view(num_reqs, num_q, num_q)
    j = pos[None, :] - ctx[:, None]  # [R, L] tree node index of each key position
    in_tree = (j >= 0) & (j < q_len[:, None])
    tree_bit = bits.gather(2, j.clamp(0, num_q - 1)[:, None, :].expand(-1, num_q, -1))
    visible = (pos[None, :] < ctx[:, None])[:, None, :] | (in_tree[:, None, :] & tree_bit)
    dead = pos[None, :] >= seq[:, None]  # [R, L]
    if window is not None:
        # Node i sits at ctx + depth(i) (padding rows repeat the last node).
        node_pos = ctx[:, None] + depth[q_rows].long()  # [R, Q]
        key_pos = torch.where(in_tree, node_pos.gather(1, j.clamp(0, num_q - 1)), pos[None, :])
        visible &= node_pos[:, :, None] - key_pos[:, None, :] < window
        dead |= ~visible.any(1)
    # Rows that see nothing (padding, or an empty mask row) see key 0 so that
    # the softmax stays finite; padding is never written, empty rows get zeros.
    blind = ~visible.any(-1)  # [R, Q]
    visible = visible | (blind[:, :, None] & (pos == 0))
    hidden = (~visible).view(num_reqs, num_q, nblk, block_size).transpose(1, 2)
    valid = q_valid.flatten().nonzero().flatten()
    return TreeBatchPlan(
        num_reqs, num_q, nblk, q_rows.flatten(), blocks.flatten(),
        hidden[:, :, None, :, None, :].contiguous(),
        dead.view(num_reqs, nblk, 1, block_size, 1),
        (~blind).flatten()[valid][:, None, None], valid, q_rows.flatten()[valid])


def tree_attention_batched(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: TreeBatchPlan,
    scale: float,
    output: torch.Tensor,
    sinks: torch.Tensor | None = None,
    kv_quant: str | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Write the tree requests' rows of ``output`` (other rows are untouched).

    ``query``/``output``: ``[num_tokens, Hq, D]``; ``kv_cache``: one layer's
    CPU cache in the "vec" layout, ``[num_blocks, Hk, block_size, 2 * D]``
    (see :func:`~vllm_ddtree.kernels.cache_layout.split_kv_cache_cpu_vec`),
    holding this step's K/V; ``sinks``: float ``[Hq]`` sink logits, or None;
    ``kv_quant`` (None, "e4m3" or "e5m2") with ``k_scale``/``v_scale``: a
    ``uint8`` fp8 cache and its per-tensor scales. Computed in fp32, like the
    reference.
    """
    num_q_heads, head_size = query.shape[1], query.shape[2]
    num_blocks_total, num_kv_heads, block_size, _ = kv_cache.shape
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads})")
    group = num_q_heads // num_kv_heads
    check_sinks(sinks, num_q_heads, query.device)
    check_kv_quant(kv_quant, k_scale, v_scale, kv_cache.dtype)
    r, nq, nblk = plan.num_reqs, plan.num_q, plan.num_blocks
    kd = block_size * head_size
    # Whole blocks, K^T and V per (block, head) as vLLM stores them.
    raw = kv_cache.reshape(num_blocks_total, num_kv_heads, 2 * kd).index_select(0, plan.blocks)
    raw = raw.view(r, nblk, num_kv_heads, 2 * kd)
    if kv_quant is None:
        raw, qk_scale = raw.float(), scale
    else:
        raw, qk_scale = dequantize(raw, kv_quant), scale * k_scale
    k_t = raw[..., :kd].view(r, nblk, num_kv_heads, head_size, block_size)
    v = raw[..., kd:].view(r, nblk, num_kv_heads, block_size, head_size)
    # Slots past a sequence's end, or outside every window, hold stale (or
    # never written, or freed) values: they get zero weight, and V is zeroed
    # there so that not even a NaN leaks.
    v.masked_fill_(plan.dead, 0.0)  # raw is this call's own copy
    # [R, 1, Hk, Q * G, D]: query head h = kv * G + g reads kv head h // G.
    q = (query.index_select(0, plan.q_rows).view(r, nq, num_kv_heads, group, head_size)
         .transpose(1, 2).reshape(r, 1, num_kv_heads, nq * group, head_size).float() * qk_scale)
    scores = torch.matmul(q, k_t)  # [R, nblk, Hk, Q * G, bs]
    scores = scores.view(r, nblk, num_kv_heads, nq, group, block_size).masked_fill_(
        plan.hidden, float("-inf")).view(r, nblk, num_kv_heads, nq * group, block_size)
    # softmax over all keys of a row: across blocks (dim 1) and within (dim 4)
    top = scores.amax(dim=(1, 4), keepdim=True)
    if sinks is not None:  # one more logit per query head, without a value
        sink = (sinks.float().view(1, 1, num_kv_heads, 1, group, 1)
                .expand(-1, -1, -1, nq, -1, -1).reshape(1, 1, num_kv_heads, nq * group, 1))
        top = torch.maximum(top, sink)
    p = (scores - top).exp_()
    denom = p.sum(dim=(1, 4))  # [R, Hk, Q * G]
    if sinks is not None:
        denom += (sink - top).exp_().view(r, num_kv_heads, nq * group)
    out = torch.matmul(p, v).sum(1) / denom[..., None]  # [R, Hk, Q * G, D]
    if kv_quant is not None:
        out *= v_scale
    out = (out.view(r, num_kv_heads, nq, group, head_size).transpose(1, 2)
           .reshape(r * nq, num_q_heads, head_size))
    out = out.index_select(0, plan.valid).where(plan.keep, 0.0)
    output.index_copy_(0, plan.out_rows, out.to(output.dtype))
    return output
