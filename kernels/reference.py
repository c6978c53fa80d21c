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

Sliding window
--------------
``sliding_window`` is the number of most recent logical positions a query
sees, itself included (the model config's ``sliding_window``); None or -1
means no window. Every position has a logical (RoPE) position: a context
key and every query of a causal request sit at their flat position, while
tree node ``j`` is stored at flat slot ``ctx_len + j`` but sits at logical
position ``ctx_len + depth[query_start_loc[r] + j]`` (``depth`` is an int32
``[num_tokens]`` tensor holding each tree row's node depth, root 0; rows of
causal requests are ignored). A key that the rules above make visible stays
visible iff ``query_logical - key_logical < sliding_window``. So tree node
``i`` sees the context positions ``p >= ctx_len + depth_i -
sliding_window + 1`` and the ancestors ``j`` with ``depth_i - depth_j <
sliding_window``; a causal query at ``q`` sees ``q - sliding_window < p <=
q``. This is vLLM 0.32's rule, in both stock backends:

* Triton (``v1/attention/backends/triton_attn.py:479-484``): a decoder
  layer's ``sliding_window`` is stored as ``(sliding_window - 1, 0)``;
  ``v1/attention/ops/triton_unified_attention.py:1141`` passes
  ``SLIDING_WINDOW = 1 + window_size[0]`` to the kernel, and
  ``v1/attention/ops/triton_attention_helpers.py:359,373,381`` keep key
  ``k`` for query ``q`` iff ``k <= q and q - k < SLIDING_WINDOW``.
* CPU (``v1/attention/backends/cpu_attn.py:321-324,450``): the impl keeps
  ``sliding_window`` as given (-1 for none) and passes it to the C++ op,
  whose scheduler turns a causal window ``w != -1`` into a left window of
  ``w - 1`` and a right window of 0 (``csrc/cpu/cpu_attn_impl.hpp``,
  ``calcu_sliding_window_size``; not shipped in the wheel). The test suite
  checks this rule against the installed op.

Attention sinks
---------------
``sinks`` is a float ``[num_q_heads]`` tensor: head ``h``'s sink is one more
logit, ``sinks[h]`` as given (not multiplied by ``scale``), that enters the
softmax denominator and carries no value:
``out = sum_k exp(s_k) v_k / (exp(sinks[h]) + sum_k exp(s_k))`` with
``s_k = scale * q.k`` over the visible keys. A row that sees no key still
produces zeros. vLLM 0.32 does the same: the Triton kernel seeds its online
softmax with ``M = sinks[h]``, ``L = 1`` (``triton_unified_attention.py:377-380``,
``triton_attention_helpers.py:137``) and then accumulates ``exp(S - M)``
with ``S = scale * q.k`` in natural-log space (``triton_unified_attention.py:547``,
``triton_attention_helpers.py:477,483``); the CPU op receives the same
tensor as ``s_aux`` (``cpu_attn.py:435-439,454``; bf16 or fp32) and seeds its
running max with it and its running sum with 1.

KV cache views
--------------
Both implementations take ``key_cache``/``value_cache`` as logical
``[num_blocks, block_size, num_kv_heads, head_size]`` tensors with arbitrary
strides, so one code path reads several physical layouts
(``cache_layout.py`` builds such views from vLLM's per-layer cache tensor).

fp8 caches
----------
With ``kv_quant`` ("e4m3" or "e5m2") the views hold ``uint8`` fp8 codes and
attention runs over ``K = decode(code) * k_scale`` and ``V = decode(code) *
v_scale`` (per-tensor scales, the layer's ``_k_scale_float`` /
``_v_scale_float``); ``kernels/fp8.py`` defines the decode, the one vLLM
0.32's CPU attention op applies. This reference dequantizes first and then
attends; the kernels fold the scales into the logits and the output, as that
op does.
"""

from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F

from vllm_ddtree.kernels.fp8 import check_kv_quant, dequantize

__all__ = ["check_sinks", "check_sliding_window", "tree_attention_reference",
           "unpack_tree_mask"]


def unpack_tree_mask(mask_rows: torch.Tensor, n: int) -> torch.Tensor:
    """Unpack little-endian int32 words ``[rows, W]`` into bool ``[rows, n]``."""
    j = torch.arange(n, device=mask_rows.device)
    words = mask_rows[:, j // 32].to(torch.int64)
    return ((words >> (j % 32)) & 1).bool()


def check_sliding_window(sliding_window: int | None) -> int | None:
    """The window as a positive number of positions, or None for no window
    (``None`` or -1, vLLM's two spellings of "no window")."""
    if sliding_window is None or sliding_window == -1:
        return None
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, numbers.Integral) \
            or sliding_window < 1:
        raise ValueError(
            f"sliding_window must be a positive number of positions (the model's "
            f"window), or None/-1 for no window; got {sliding_window!r}"
        )
    return int(sliding_window)


def check_sinks(sinks: torch.Tensor | None, num_q_heads: int, device) -> None:
    """Raise ``ValueError`` unless ``sinks`` is None or a floating ``[num_q_heads]``
    tensor on ``device``."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point() \
            or sinks.shape != (num_q_heads,):
        raise ValueError(
            f"sinks: expected a float tensor [num_q_heads={num_q_heads}] (one logit "
            f"per query head), got {getattr(sinks, 'dtype', type(sinks))} "
            f"{tuple(getattr(sinks, 'shape', ()))}"
        )
    if sinks.device != torch.device(device):
        raise ValueError(f"sinks: on {sinks.device}, query on {device}; move it there")


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
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    depth: torch.Tensor | None = None,
    kv_quant: str | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
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
        sliding_window: positions a query sees, itself included; None or -1
            for no window (see the module docstring).
        sinks: float ``[num_q_heads]`` sink logits, or None.
        depth: int32 ``[num_tokens]`` node depth of every tree row; needed
            with a window when there are tree requests.
        kv_quant: None, or the fp8 kind ("e4m3", "e5m2") of ``uint8`` caches.
        k_scale, v_scale: the per-tensor scales of an fp8 cache.

    Returns:
        ``output`` (allocated with ``query``'s dtype when not given).

    Every request is computed with one SDPA call in fp32 over its gathered
    K/V and an explicit bool mask, then cast to the output dtype. Sinks
    join that call as one extra key with zero K and V whose logit is set by
    an additive mask. With a window, K/V of keys no row of the request sees
    are zeroed first: vLLM frees cache blocks that fall out of every
    window, so they may hold anything.
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
    window = check_sliding_window(sliding_window)
    check_sinks(sinks, num_q_heads, query.device)
    check_kv_quant(kv_quant, k_scale, v_scale, key_cache.dtype)
    if value_cache.dtype != key_cache.dtype:
        raise ValueError(f"value_cache: dtype {value_cache.dtype} differs from key_cache "
                         f"{key_cache.dtype}")

    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    if is_tree is None or tree_mask is None:
        tree_set: set[int] = set()
    else:
        tree_set = {i for i, f in enumerate(is_tree.tolist()) if f}
    reqs = sorted(tree_set) if tree_only else range(num_reqs)
    if window is not None and tree_set:
        if depth is None or depth.dim() != 1 or depth.shape[0] < query.shape[0]:
            raise ValueError(
                f"depth: a sliding window over tree requests needs each tree row's "
                f"node depth as an int [num_tokens={query.shape[0]}] tensor, got "
                f"{None if depth is None else tuple(depth.shape)}"
            )

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
        if kv_quant is not None:
            k = dequantize(k, kv_quant) * k_scale
            v = dequantize(v, kv_quant) * v_scale

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
            if window is not None:
                assert depth is not None
                node_pos = ctx_len + depth[q_start:q_end].to(pos.device, torch.long)
                q_pos, k_pos = node_pos, torch.cat([pos[:ctx_len], node_pos])
        else:
            q_pos = ctx_len + torch.arange(q_len, device=query.device)
            visible = pos[None, :] <= q_pos[:, None]
            k_pos = pos
        if window is not None:
            visible &= q_pos[:, None] - k_pos[None, :] < window
            seen = visible.any(dim=0)[:, None, None]
            k = torch.where(seen, k, 0)
            v = torch.where(seen, v, 0)

        q = query[q_start:q_end].transpose(0, 1).float()  # [Hq, q_len, D]
        k = k.transpose(0, 1).float().repeat_interleave(group, dim=0)
        v = v.transpose(0, 1).float().repeat_interleave(group, dim=0)
        if sinks is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale)
        else:
            bias = torch.zeros(visible.shape, device=q.device).masked_fill_(~visible,
                                                                            float("-inf"))
            sink = sinks.float()[:, None, None].expand(-1, q_len, 1)
            bias = torch.cat([bias.expand(num_q_heads, -1, -1), sink], dim=2)
            zero = k.new_zeros(num_q_heads, 1, k.shape[2])
            out = F.scaled_dot_product_attention(q, torch.cat([k, zero], 1),
                                                 torch.cat([v, zero], 1),
                                                 attn_mask=bias, scale=scale)
        out = torch.where(visible.any(dim=1)[None, :, None], out, 0.0)
        output[q_start:q_end] = out.transpose(0, 1).to(output.dtype)
    return output
