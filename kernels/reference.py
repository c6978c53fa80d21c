"""Torch reference for tree attention over a paged KV cache.

This module is the test oracle for the Triton kernel in
``tree_attention.py`` and for the CPU runtime path in
``tree_attention_cpu.py``. It has no vLLM dependency.

Semantics (shared with the Triton kernel)
-----------------------------------------
The batch is ragged: request ``r`` owns query rows
``query_start_loc[r] : query_start_loc[r + 1]`` (``q_len`` rows) and has
``seq_len = seq_lens[r]`` tokens in the cache, the last ``q_len`` of which are
this step's queries. Let ``ctx_len = seq_len - q_len``. All K/V, including this
step's, are read from the paged cache through ``block_table``.

* Non-tree request: causal. Query ``i`` sits at position ``ctx_len + i`` and
  sees positions ``0 .. ctx_len + i``.
* Tree request (``is_tree[r]``): the query is the tree span, flat node 0 is the
  root. Query ``i`` sees every context position ``< ctx_len`` plus exactly the
  tree nodes ``j`` (position ``ctx_len + j``) whose bit is set in row
  ``query_start_loc[r] + i`` of ``tree_mask``.

``tree_mask`` is ``int32 [num_tokens, W]``, little-endian packed: bit ``j % 32``
of word ``j // 32`` means "sees tree node j". Rows of non-tree requests are
ignored. A query row that sees no key at all produces zeros.

KV cache views
--------------
Both implementations take ``key_cache``/``value_cache`` as logical
``[num_blocks, block_size, num_kv_heads, head_size]`` tensors with arbitrary
strides, so one code path reads several physical layouts
(``cache_layout.py`` builds such views from vLLM's per-layer cache tensor).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["tree_attention_reference", "unpack_tree_mask"]


def unpack_tree_mask(mask_rows: torch.Tensor, n: int) -> torch.Tensor:
    """Unpack little-endian int32 words ``[rows, W]`` into bool ``[rows, n]``."""
    j = torch.arange(n, device=mask_rows.device)
    words = mask_rows[:, j // 32].to(torch.int64)
    return ((words >> (j % 32)) & 1).bool()


def _gather_request_kv(
    cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """Gather positions ``0..seq_len-1`` of one request: ``[seq_len, H, D]``."""
    bs = cache.shape[1]
    pos = torch.arange(seq_len, device=cache.device)
    blocks = block_table_row[pos // bs].long()
    return cache[blocks, pos % bs]


def tree_attention_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    tree_mask: torch.Tensor | None = None,
    is_tree: torch.Tensor | None = None,
    output: torch.Tensor | None = None,
    tree_only: bool = False,
) -> torch.Tensor:
    """Attention for a ragged batch with optional tree requests.

    Args:
        query: ``[num_tokens, num_q_heads, head_size]``.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads,
            head_size]`` views (any strides), already holding this step's K/V.
        block_table: ``[num_reqs, max_blocks]`` integer block ids.
        query_start_loc: ``[num_reqs + 1]`` integer offsets into ``query``.
        seq_lens: ``[num_reqs]`` context + query length per request.
        scale: softmax scale.
        tree_mask: int32 ``[num_tokens, W]`` packed ancestor mask, or None.
        is_tree: bool ``[num_reqs]``, or None (no tree requests).
        output: optional ``[num_tokens, num_q_heads, head_size]`` to write
            into; rows of requests that are not computed are left untouched.
        tree_only: compute only tree requests.

    Returns:
        ``output`` (allocated with ``query``'s dtype when not given).

    Every request is computed with one SDPA call in fp32 over its gathered
    K/V and an explicit bool mask, then cast to the output dtype.
    """
    if output is None:
        output = torch.zeros_like(query)
    num_reqs = seq_lens.shape[0]
    num_q_heads = query.shape[1]
    num_kv_heads = key_cache.shape[2]
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads "
            f"({num_kv_heads})"
        )
    group = num_q_heads // num_kv_heads

    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    if is_tree is None or tree_mask is None:
        tree_set: set[int] = set()
    else:
        tree_set = {i for i, f in enumerate(is_tree.tolist()) if f}
    reqs = sorted(tree_set) if tree_only else range(num_reqs)

    for r in reqs:
        q_start, q_end = qsl[r], qsl[r + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        seq_len = lens[r]
        ctx_len = seq_len - q_len
        if ctx_len < 0:
            raise ValueError(
                f"request {r}: seq_len {seq_len} is smaller than its query "
                f"length {q_len}"
            )
        k = _gather_request_kv(key_cache, block_table[r], seq_len)
        v = _gather_request_kv(value_cache, block_table[r], seq_len)

        pos = torch.arange(seq_len, device=query.device)
        if r in tree_set:
            assert tree_mask is not None
            if tree_mask.shape[1] * 32 < q_len:
                raise ValueError(
                    f"tree_mask: {tree_mask.shape[1]} words cannot hold request "
                    f"{r}'s tree of {q_len} nodes"
                )
            visible = pos[None, :] < ctx_len
            visible = visible.expand(q_len, seq_len).clone()
            visible[:, ctx_len:] = unpack_tree_mask(tree_mask[q_start:q_end], q_len)
        else:
            q_pos = ctx_len + torch.arange(q_len, device=query.device)
            visible = pos[None, :] <= q_pos[:, None]

        q = query[q_start:q_end].transpose(0, 1).float()  # [Hq, q_len, D]
        k = k.transpose(0, 1).float().repeat_interleave(group, dim=0)
        v = v.transpose(0, 1).float().repeat_interleave(group, dim=0)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale)
        out = torch.where(visible.any(dim=1)[None, :, None], out, 0.0)
        output[q_start:q_end] = out.transpose(0, 1).to(output.dtype)
    return output
