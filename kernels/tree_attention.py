"""Triton tree attention over a paged KV cache.

Same semantics and argument conventions as
:func:`vllm_ddtree.kernels.reference.tree_attention_reference` (see that
module's docstring): a ragged batch of causal requests and tree requests, the
latter masked over their own query span by a packed little-endian ancestor
mask, with the committed context fully visible; optionally a sliding window
over logical positions (a tree node's is ``ctx_len + depth``) and per-head
attention sinks.

K and V are addressed through explicit strides of logical
``[num_blocks, block_size, num_kv_heads, head_size]`` views, so the same kernel
reads CUDA's token-major paged layout and the CPU "vec" layout (K stored
``[head_size, block_size]`` per block and head).

One program handles BLOCK_M query rows (BLOCK_Q query tokens times the query
heads sharing one KV head) of one request against that KV head, streaming the
keys in BLOCK_N tiles with an online softmax in fp32. Keys visible to every row
of the tile (the context for a tree request; up to the tile's first query for a
causal one; with a window, only those inside every row's window) go through an
unmasked loop; the remaining tiles apply the causal or tree mask and the
window. Tiles below every row's window are not read. A sink seeds the online
softmax (running max = the sink, running sum = 1). The grid is sized from
shapes only (no host sync).

An fp8 cache (``kv_quant``: ``uint8`` codes, ``kernels/fp8.py``) is decoded
in registers with integer operations and a bitcast to half (exact; the same
values on a GPU and in the interpreter, whose own fp8 casts differ from the
hardware's at the NaN codes), then cast to the query dtype (exact too: every
fp8 value is representable in fp16 and bf16). ``k_scale`` joins the softmax
scale of the logits and ``v_scale`` multiplies the output, as in vLLM's CPU
attention op.

fp32 inputs use IEEE fp32 dot products (no TF32). On a machine without a GPU
the kernel runs in Triton's interpreter, which must be enabled with
``TRITON_INTERPRET=1`` before this module is imported (``INTERPRETED`` records
whether it was). The interpreter computes bf16 ``tl.dot`` incorrectly, so
there bf16 operands are upcast to fp32 for the dot products.
"""

from __future__ import annotations

import inspect

import torch
import triton
import triton.language as tl

from vllm_ddtree.kernels.fp8 import check_kv_quant
from vllm_ddtree.kernels.reference import check_sinks, check_sliding_window

__all__ = [
    "INTERPRETED",
    "check_tree_attention_args",
    "kernel_constexprs",
    "select_tile_sizes",
    "tree_attention",
]

INTERPRETED: bool = bool(triton.knobs.runtime.interpret)

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634
_KV_FP8 = {None: 0, "e4m3": 1, "e5m2": 2}  # the KV_FP8 constexpr, by kv_quant


@triton.jit
def _fp8_to_f32(code, KV_FP8: tl.constexpr):
    """fp32 values of uint8 fp8 codes (``kernels/fp8.py``). e4m3: the sign and
    the 7 low bits placed in a half, whose exponent bias is 15 instead of 7,
    times 2**8; e5m2: the high byte of a half."""
    c = code.to(tl.uint16)
    if KV_FP8 == 1:
        half = ((c & 0x80) << 8) | ((c & 0x7F) << 7)
        return half.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    else:
        return (c << 8).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _attend_tile(
    q,
    acc,
    m_i,
    l_i,
    start,
    k_ptr,
    v_ptr,
    bt_row_ptr,
    mask_ptr,
    depth_ptr,
    kv_head,
    tok,
    q_pos,
    q_lpos,
    row_valid,
    offs_d,
    d_valid,
    kv_end,
    ctx_len,
    q_start,
    q_len,
    is_tree,
    qk_scale,
    window,
    v_lo,
    stride_k_b,
    stride_k_t,
    stride_k_h,
    stride_k_d,
    stride_v_b,
    stride_v_t,
    stride_v_h,
    stride_v_d,
    stride_m_t,
    stride_m_w,
    stride_d,
    mask_words,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_TREE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_FP32: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    pos = start + tl.arange(0, BLOCK_N)
    in_range = pos < kv_end
    blk = tl.load(bt_row_ptr + pos // PAGE_SIZE, mask=in_range, other=0).to(tl.int64)
    off = (pos % PAGE_SIZE).to(tl.int64)

    k = tl.load(
        k_ptr
        + blk[None, :] * stride_k_b
        + off[None, :] * stride_k_t
        + kv_head * stride_k_h
        + offs_d[:, None] * stride_k_d,
        mask=d_valid[:, None] & in_range[None, :],
        other=0.0,
    )
    v = tl.load(
        v_ptr
        + blk[:, None] * stride_v_b
        + off[:, None] * stride_v_t
        + kv_head * stride_v_h
        + offs_d[None, :] * stride_v_d,
        mask=in_range[:, None] & d_valid[None, :],
        other=0.0,
    )
    if KV_FP8 != 0:
        k = _fp8_to_f32(k, KV_FP8).to(q.dtype)
        v = _fp8_to_f32(v, KV_FP8).to(q.dtype)
    if USE_WINDOW and MASKED:
        # Keys below v_lo are outside every row's window; their blocks may
        # have been freed and hold anything, which a zero weight would not
        # cancel (0 * NaN).
        v = tl.where((pos >= v_lo)[:, None], v, 0.0)
    if DOT_FP32:
        s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
    else:
        s = tl.dot(q, k)
    s = s * qk_scale

    if MASKED:
        visible = (pos[None, :] <= q_pos[:, None]) & in_range[None, :]
        if HAS_TREE:
            j = pos - ctx_len
            in_span = (j >= 0) & (j < q_len)
            jj = tl.maximum(j, 0)
            word_idx = jj // 32
            word = tl.load(
                mask_ptr + tok[:, None] * stride_m_t + word_idx[None, :] * stride_m_w,
                mask=row_valid[:, None] & (in_span & (word_idx < mask_words))[None, :],
                other=0,
            )
            bit = (word >> (jj % 32)[None, :]) & 1
            tree_visible = (pos[None, :] < ctx_len) | (in_span[None, :] & (bit != 0))
            visible = tl.where(is_tree, tree_visible, visible)
            if USE_WINDOW:
                # tree node j sits at logical position ctx_len + depth(j)
                key_depth = tl.load(
                    depth_ptr + (q_start + jj).to(tl.int64) * stride_d,
                    mask=in_span & in_range,
                    other=0,
                )
                k_lpos = tl.where(in_span & is_tree, ctx_len + key_depth, pos)
            else:
                k_lpos = pos
        else:
            k_lpos = pos
        if USE_WINDOW:
            visible = visible & ((q_lpos[:, None] - k_lpos[None, :]) < window)
        s = tl.where(visible, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if DOT_FP32:
        acc += tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc += tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def _tree_attention_kernel(
    out_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    block_table_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    mask_ptr,
    is_tree_ptr,
    depth_ptr,
    sinks_ptr,
    qk_scale,
    v_scale,
    window,
    num_reqs,
    mask_words,
    stride_q_t,
    stride_q_h,
    stride_q_d,
    stride_o_t,
    stride_o_h,
    stride_o_d,
    stride_k_b,
    stride_k_t,
    stride_k_h,
    stride_k_d,
    stride_v_b,
    stride_v_t,
    stride_v_h,
    stride_v_d,
    stride_bt_r,
    stride_m_t,
    stride_m_w,
    stride_d,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HAS_TREE: tl.constexpr,
    TREE_ONLY: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SINKS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    # Program (tile, kv_head). Request r owns tiles starting at
    # query_start_loc[r] // BLOCK_Q + r, which bounds its tile count from
    # above, so the grid is sized from shapes alone; surplus tiles exit.
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)

    lo: tl.int32 = 0
    hi: tl.int32 = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        mid_start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if mid_start <= tile:
            lo = mid + 1
        else:
            hi = mid
    req = lo - 1

    q_start = tl.load(query_start_loc_ptr + req)
    q_end = tl.load(query_start_loc_ptr + req + 1)
    q_len = q_end - q_start
    local_tile = tile - (q_start // BLOCK_Q + req)
    first_q = local_tile * BLOCK_Q
    if first_q >= q_len:
        return

    if HAS_TREE:
        tree_flag = tl.load(is_tree_ptr + req).to(tl.int32)
    else:
        tree_flag = q_len * 0
    if TREE_ONLY:
        if tree_flag == 0:
            return
    is_tree = tree_flag != 0

    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    q_local = first_q + offs_m // QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + offs_m % QUERIES_PER_KV
    row_valid = (offs_m < BLOCK_Q * QUERIES_PER_KV) & (q_local < q_len)
    tok = (q_start + q_local).to(tl.int64)
    q_pos = ctx_len + q_local

    offs_d = tl.arange(0, HEAD_PAD)
    d_valid = offs_d < HEAD_SIZE
    q = tl.load(
        q_ptr
        + tok[:, None] * stride_q_t
        + head[:, None] * stride_q_h
        + offs_d[None, :] * stride_q_d,
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    )

    if USE_SINKS:
        # The sink is one more logit (log2 units here, unscaled) with no
        # value: the running max starts at it and the running sum at 1.
        sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0).to(tl.float32)
        m_i = sink * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)

    last_q = tl.minimum(first_q + BLOCK_Q, q_len) - 1
    # Positions below full_end are visible to every row of this tile.
    full_end = tl.where(is_tree, ctx_len, ctx_len + first_q + 1)
    kv_end = tl.where(is_tree, seq_len, ctx_len + last_q + 1)
    split = (full_end // BLOCK_N) * BLOCK_N

    # Logical (RoPE) position of each row: a tree node's is ctx_len + depth.
    q_lpos = q_pos
    lo = q_len * 0
    v_lo = lo
    mid = lo
    if USE_WINDOW:
        if HAS_TREE:
            row_depth = tl.load(depth_ptr + tok * stride_d, mask=row_valid, other=0)
            q_lpos = tl.where(is_tree, ctx_len + row_depth, q_pos)
        # Keys below v_lo are outside every row's window (a tree's own span
        # is always walked); keys from full_lo on are inside all of them.
        v_lo = tl.maximum(tl.min(tl.where(row_valid, q_lpos, 1 << 30)) - window + 1, 0)
        v_lo = tl.where(is_tree, tl.minimum(v_lo, ctx_len), v_lo)
        full_lo = tl.maximum(tl.max(tl.where(row_valid, q_lpos, 0)) - window + 1, 0)
        lo = (v_lo // BLOCK_N) * BLOCK_N
        mid = tl.maximum(tl.cdiv(full_lo, BLOCK_N) * BLOCK_N, lo)
    hi = tl.maximum(split, mid)

    bt_row_ptr = block_table_ptr + req.to(tl.int64) * stride_bt_r

    # [lo, mid) and [hi, kv_end) are masked; [mid, hi) is visible to all rows.
    for start in range(lo, mid, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, start, k_ptr, v_ptr, bt_row_ptr, mask_ptr, depth_ptr,
            kv_head, tok, q_pos, q_lpos, row_valid, offs_d, d_valid, kv_end, ctx_len,
            q_start, q_len, is_tree, qk_scale, window, v_lo,
            stride_k_b, stride_k_t, stride_k_h, stride_k_d,
            stride_v_b, stride_v_t, stride_v_h, stride_v_d,
            stride_m_t, stride_m_w, stride_d, mask_words,
            BLOCK_N, PAGE_SIZE, True, HAS_TREE, USE_WINDOW, DOT_FP32, KV_FP8,
        )  # fmt: skip
    for start in range(mid, hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, start, k_ptr, v_ptr, bt_row_ptr, mask_ptr, depth_ptr,
            kv_head, tok, q_pos, q_lpos, row_valid, offs_d, d_valid, kv_end, ctx_len,
            q_start, q_len, is_tree, qk_scale, window, v_lo,
            stride_k_b, stride_k_t, stride_k_h, stride_k_d,
            stride_v_b, stride_v_t, stride_v_h, stride_v_d,
            stride_m_t, stride_m_w, stride_d, mask_words,
            BLOCK_N, PAGE_SIZE, False, HAS_TREE, USE_WINDOW, DOT_FP32, KV_FP8,
        )  # fmt: skip
    for start in range(hi, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, start, k_ptr, v_ptr, bt_row_ptr, mask_ptr, depth_ptr,
            kv_head, tok, q_pos, q_lpos, row_valid, offs_d, d_valid, kv_end, ctx_len,
            q_start, q_len, is_tree, qk_scale, window, v_lo,
            stride_k_b, stride_k_t, stride_k_h, stride_k_d,
            stride_v_b, stride_v_t, stride_v_h, stride_v_d,
            stride_m_t, stride_m_w, stride_d, mask_words,
            BLOCK_N, PAGE_SIZE, True, HAS_TREE, USE_WINDOW, DOT_FP32, KV_FP8,
        )  # fmt: skip

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    if KV_FP8 != 0:
        out = out * v_scale
    tl.store(
        out_ptr
        + tok[:, None] * stride_o_t
        + head[:, None] * stride_o_h
        + offs_d[None, :] * stride_o_d,
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & d_valid[None, :],
    )


def select_tile_sizes(
    queries_per_kv: int,
    head_size: int,
    max_query_len: int | None,
    dtype: torch.dtype = torch.float16,
) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_Q, BLOCK_N) for a launch; pure function of shapes.

    BLOCK_M query rows (BLOCK_Q tokens x the query heads of one KV head) per
    program: 16 for decode-sized queries, else 64. BLOCK_N keys per step:
    64, or 32 for wide heads and fp32 (shared-memory budget).
    """
    rows = queries_per_kv * (max_query_len if max_query_len is not None else 1 << 30)
    block_m = 16 if rows <= 16 else 64
    block_m = max(block_m, triton.next_power_of_2(queries_per_kv))
    block_q = block_m // queries_per_kv
    head_pad = max(16, triton.next_power_of_2(head_size))
    block_n = 32 if head_pad >= 256 or dtype == torch.float32 else 64
    return block_m, block_q, block_n


def kernel_constexprs(
    dtype: torch.dtype,
    head_size: int,
    queries_per_kv: int,
    page_size: int,
    has_tree: bool,
    tree_only: bool = False,
    max_query_len: int | None = None,
    use_window: bool = False,
    use_sinks: bool = False,
    kv_quant: str | None = None,
) -> dict:
    """The compile-time parameters of one launch."""
    block_m, block_q, block_n = select_tile_sizes(
        queries_per_kv, head_size, max_query_len, dtype
    )
    return dict(
        HEAD_SIZE=head_size,
        HEAD_PAD=max(16, triton.next_power_of_2(head_size)),
        QUERIES_PER_KV=queries_per_kv,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        PAGE_SIZE=page_size,
        HAS_TREE=has_tree,
        TREE_ONLY=tree_only,
        USE_WINDOW=use_window,
        USE_SINKS=use_sinks,
        DOT_FP32=_dot_in_fp32(dtype),
        KV_FP8=_KV_FP8[kv_quant],
    )


def _dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether the kernel's dot products run on fp32 operands (IEEE).

    Always for fp32 inputs (no TF32 rounding); also for bf16 under the
    interpreter, whose bf16 ``tl.dot`` is wrong.
    """
    return dtype == torch.float32 or (INTERPRETED and dtype == torch.bfloat16)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def check_tree_attention_args(*args, **kwargs) -> None:
    """Raise ``ValueError`` naming the first malformed argument of a
    :func:`tree_attention` launch; takes exactly that function's arguments.

    The launcher itself does not check (it runs for every layer of every
    step); tests and callers that build arguments by hand call this first.
    """
    bound = inspect.signature(tree_attention).bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    query, key_cache, value_cache = a["query"], a["key_cache"], a["value_cache"]
    block_table, query_start_loc, seq_lens = (a["block_table"], a["query_start_loc"],
                                              a["seq_lens"])
    tree_mask, is_tree, output = a["tree_mask"], a["is_tree"], a["output"]
    tree_only, max_query_len = a["tree_only"], a["max_query_len"]
    sinks, depth = a["sinks"], a["depth"]
    kv_quant = a["kv_quant"]
    _check(
        query.dtype in _SUPPORTED_DTYPES,
        f"query: dtype {query.dtype} not supported (fp16, bf16, fp32)",
    )
    _check(
        query.dim() == 3,
        f"query: expected [num_tokens, num_q_heads, head_size], got shape "
        f"{tuple(query.shape)}",
    )
    num_tokens, num_q_heads, head_size = query.shape
    check_kv_quant(kv_quant, a["k_scale"], a["v_scale"], key_cache.dtype)
    cache_dtype = query.dtype if kv_quant is None else torch.uint8
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        _check(
            cache.dtype == cache_dtype,
            f"{name}: dtype {cache.dtype}, expected {cache_dtype} (the query dtype, or "
            f"uint8 fp8 codes with kv_quant)",
        )
        _check(
            cache.dim() == 4,
            f"{name}: expected [num_blocks, block_size, num_kv_heads, "
            f"head_size], got shape {tuple(cache.shape)}",
        )
        _check(
            cache.device == query.device,
            f"{name}: on {cache.device}, query on {query.device}",
        )
    _check(
        key_cache.shape == value_cache.shape,
        f"value_cache: shape {tuple(value_cache.shape)} differs from key_cache "
        f"{tuple(key_cache.shape)}",
    )
    num_kv_heads, cache_head_size = key_cache.shape[2:]
    _check(
        cache_head_size == head_size,
        f"key_cache: head_size {cache_head_size} differs from query head_size "
        f"{head_size}",
    )
    _check(
        num_q_heads % num_kv_heads == 0,
        f"query: num_q_heads {num_q_heads} is not a multiple of key_cache "
        f"num_kv_heads {num_kv_heads}",
    )
    _check(
        seq_lens.dim() == 1 and seq_lens.dtype in (torch.int32, torch.int64),
        f"seq_lens: expected int32/int64 [num_reqs], got {seq_lens.dtype} "
        f"{tuple(seq_lens.shape)}",
    )
    num_reqs = seq_lens.shape[0]
    _check(
        query_start_loc.dim() == 1
        and query_start_loc.shape[0] == num_reqs + 1
        and query_start_loc.dtype in (torch.int32, torch.int64),
        f"query_start_loc: expected int32/int64 [{num_reqs + 1}], got "
        f"{query_start_loc.dtype} {tuple(query_start_loc.shape)}",
    )
    _check(
        block_table.dim() == 2
        and block_table.shape[0] >= num_reqs
        and block_table.dtype in (torch.int32, torch.int64),
        f"block_table: expected int32/int64 [num_reqs={num_reqs}, max_blocks], "
        f"got {block_table.dtype} {tuple(block_table.shape)}",
    )
    for name, t in (
        ("block_table", block_table),
        ("query_start_loc", query_start_loc),
        ("seq_lens", seq_lens),
    ):
        _check(t.device == query.device, f"{name}: on {t.device}, query on {query.device}")

    has_tree = tree_mask is not None and is_tree is not None
    _check(
        (tree_mask is None) == (is_tree is None),
        "tree_mask and is_tree must be given together",
    )
    if has_tree:
        assert tree_mask is not None and is_tree is not None
        _check(
            tree_mask.dtype == torch.int32 and tree_mask.dim() == 2,
            f"tree_mask: expected int32 [num_tokens, W], got {tree_mask.dtype} "
            f"{tuple(tree_mask.shape)}",
        )
        _check(
            tree_mask.shape[0] >= num_tokens,
            f"tree_mask: {tree_mask.shape[0]} rows for {num_tokens} query tokens",
        )
        _check(
            is_tree.dtype == torch.bool and is_tree.shape == (num_reqs,),
            f"is_tree: expected bool [{num_reqs}], got {is_tree.dtype} "
            f"{tuple(is_tree.shape)}",
        )
        _check(
            tree_mask.device == query.device and is_tree.device == query.device,
            f"tree_mask/is_tree: on {tree_mask.device}/{is_tree.device}, query "
            f"on {query.device}",
        )
        if max_query_len is not None:
            _check(
                tree_mask.shape[1] * 32 >= max_query_len,
                f"tree_mask: {tree_mask.shape[1]} words cannot hold a tree of "
                f"{max_query_len} nodes",
            )
    else:
        _check(not tree_only, "tree_only requires tree_mask and is_tree")

    window = check_sliding_window(a["sliding_window"])
    check_sinks(sinks, num_q_heads, query.device)
    if window is not None and has_tree:
        _check(
            depth is not None,
            "depth: a sliding window over tree requests needs each tree row's node "
            "depth (int32 [num_tokens]); pass TreeAttentionInfo.depth",
        )
    if depth is not None:
        _check(
            depth.dtype == torch.int32 and depth.dim() == 1
            and depth.shape[0] >= num_tokens,
            f"depth: expected int32 [num_tokens={num_tokens}], got {depth.dtype} "
            f"{tuple(depth.shape)}",
        )
        _check(depth.device == query.device, f"depth: on {depth.device}, query on "
               f"{query.device}")

    if output is not None:
        _check(
            output.shape == query.shape and output.dtype == query.dtype,
            f"output: expected {query.dtype} {tuple(query.shape)}, got "
            f"{output.dtype} {tuple(output.shape)}",
        )
        _check(output.device == query.device, f"output: on {output.device}")
    if query.device.type == "cpu":
        _check(
            INTERPRETED,
            "tree_attention on CPU tensors needs the Triton interpreter: set "
            "TRITON_INTERPRET=1 before vllm_ddtree.kernels.tree_attention is "
            "imported",
        )


def tree_attention(
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
    max_query_len: int | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    depth: torch.Tensor | None = None,
    kv_quant: str | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Launch the tree-attention kernel (no host sync, no autotuning, no
    argument checks: see :func:`check_tree_attention_args`).

    Arguments are those of ``tree_attention_reference``; ``key_cache`` and
    ``value_cache`` are ``[num_blocks, block_size, num_kv_heads, head_size]``
    views with any strides. ``max_query_len`` (a host int, optional) only picks
    a smaller query tile for decode-like batches. With ``tree_only`` the
    kernel writes the rows of tree requests only. ``sliding_window`` (a host
    int; None or -1: none), ``sinks`` (float ``[num_q_heads]``) and ``depth``
    (int32 ``[num_tokens]``, read only with a window and tree requests) as
    in the reference. With a window, tiles of keys outside every window of
    a query tile are skipped. ``kv_quant`` (None, "e4m3" or "e5m2") with
    host floats ``k_scale``/``v_scale``: the caches hold ``uint8`` fp8 codes
    and these per-tensor scales.
    """
    num_tokens, num_q_heads, head_size = query.shape
    num_reqs = seq_lens.shape[0]
    _, page_size, num_kv_heads, _ = key_cache.shape
    has_tree = tree_mask is not None
    if has_tree:
        mask_arg = tree_mask
        is_tree_arg = is_tree.view(torch.uint8)
        stride_m_t, stride_m_w = tree_mask.stride()
        mask_words = tree_mask.shape[1]
    else:
        mask_arg = is_tree_arg = query_start_loc
        stride_m_t = stride_m_w = mask_words = 0
    if output is None:
        output = torch.empty_like(query)
    window = check_sliding_window(sliding_window)
    use_window = window is not None
    if use_window and has_tree:
        if depth is None:
            raise ValueError("depth: a sliding window over tree requests needs each "
                             "tree row's node depth (int32 [num_tokens])")
        depth_arg, stride_d = depth, depth.stride(0)
    else:
        depth_arg, stride_d = query_start_loc, 0

    consts = kernel_constexprs(
        query.dtype,
        head_size,
        num_q_heads // num_kv_heads,
        page_size,
        has_tree,
        tree_only,
        max_query_len,
        use_window,
        sinks is not None,
        kv_quant,
    )
    grid = (num_tokens // consts["BLOCK_Q"] + num_reqs, num_kv_heads)
    if num_reqs == 0 or num_tokens == 0:
        return output

    _tree_attention_kernel[grid](
        output,
        query,
        key_cache,
        value_cache,
        block_table,
        query_start_loc,
        seq_lens,
        mask_arg,
        is_tree_arg,
        depth_arg,
        sinks if sinks is not None else query,
        float(scale) * _LOG2E if kv_quant is None else float(scale) * k_scale * _LOG2E,
        float(v_scale),
        window if use_window else 0,
        num_reqs,
        mask_words,
        *query.stride(),
        *output.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        block_table.stride(0),
        stride_m_t,
        stride_m_w,
        stride_d,
        **consts,
    )
    return output
