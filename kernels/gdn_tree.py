"""Triton kernels for tree-shaped Gated DeltaNet speculative decoding.

Parent-aware counterparts of vLLM's speculative-decode GDN kernels
(``causal_conv1d_update`` with ``num_accepted_tokens`` and
``fused_sigmoid_gating_delta_rule_update`` with ``ssm_state_indices``): the
``1 + n`` tokens a request verifies form a tree instead of a chain. The exact
semantics, argument layout and null-slot rule are documented in
``gdn_tree_reference`` (the torch oracle); both functions here take the same
arguments as their references:

* :func:`tree_conv_update` -- ``x[T, dim]``, ``conv_state[slots, dim,
  state_len]`` (any strides, e.g. the transposed view of vLLM's
  ``[slots, state_len, dim]`` storage), ``weight[dim, W]`` (``W`` in 2..4),
  per request ``conv_state_indices[N]`` and ``num_accepted[N]``, per token
  ``parent[T]`` (local parent index, ``-1`` for the root; ``None`` for
  chains) and ``cu_seqlens[N + 1]``.
* :func:`tree_recurrent_update` -- ``q, k[T, H, K]``, ``v[T, HV, V]``,
  ``a, b[T, HV]``, ``A_log, dt_bias[HV]``, ``ssm_state[slots, HV, V, K]``,
  ``state_indices[N, S + 1]``, ``num_accepted``, ``parent``, ``cu_seqlens``.

Kernels. The conv runs one program per (request, block of channels) and the
recurrence one per (request, value head, block of V); each program walks its
request's tokens in flat order. The conv keeps the prior window in registers
and finds a token's window by following parent pointers ``W - 1`` steps (past
the root it continues into the prior window); the buffer is rewritten after
the walk. The recurrence keeps the state in fp32 registers and re-reads it
from the parent's stored slot only when ``parent[j] != j - 1`` (a branch), so
a chain is computed operation for operation as by the stock kernel's loop (bit
for bit equal in the interpreter) and a branch sees its parent's state as
stored. Arithmetic is fp32, except that the conv rounds each tap's product to
the promoted dtype of buffer and weight, as vLLM's kernel does. Inputs may be
fp32, fp16 or bf16, the states fp32, fp16 or bf16.

The launchers do not synchronise or validate (use
``gdn_tree_reference.validate_tree`` on the host when building inputs by
hand). Tokens of a request must fit its buffers: ``q_i <= S + 1`` and
``W - 2 + q_i <= state_len``.

The commit after the tree walk is not here: it is
``vllm_ddtree.core.gdn_tree.commit_columns`` / ``commit_layer``, device-agnostic
torch shared by the CPU and CUDA paths, which copies the accepted node's state
into column 0 and the accepted path's last ``W - 1`` inputs into conv columns
``[0, W - 1)`` and so leaves every request at ``num_accepted = 1``.

On a machine without a GPU the kernels run in Triton's interpreter, which
must be enabled with ``TRITON_INTERPRET=1`` before this module is imported
(``INTERPRETED`` records whether it was).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_ddtree.kernels.gdn_tree_reference import silu_flag

__all__ = [
    "INTERPRETED",
    "conv_constexprs",
    "recurrent_constexprs",
    "tree_conv_update",
    "tree_recurrent_update",
]

INTERPRETED: bool = bool(triton.knobs.runtime.interpret)

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16,
             torch.float32: tl.float32}
_SOFTPLUS_THRESHOLD = 20.0
_L2NORM_EPS = 1e-6


# --------------------------------------------------------------------------
# Convolution
# --------------------------------------------------------------------------


@triton.jit
def _conv_next(cur, parent_ptr, bos, HAS_PARENT: tl.constexpr):
    """One step towards the root; past the root, one column back in the prior
    window (-1 is its newest column, -2 the one before, ...)."""
    if HAS_PARENT:
        par = tl.load(parent_ptr + bos + cur, mask=cur >= 0, other=0).to(tl.int64)
        nxt = tl.where(cur >= 0, par, cur - 1)
    else:
        nxt = cur - 1
    return nxt


@triton.jit
def _conv_value(cur, x_row_ptr, bos, stride_x_t, feat_mask, prior0, prior1, prior2,
                WIDTH: tl.constexpr, STATE_DTYPE: tl.constexpr):
    """Input of token ``cur`` (rounded to the buffer dtype) or, for a negative
    ``cur``, the matching prior-window column (held in registers)."""
    # (tl.where rather than ``feat_mask & (cur >= 0)``: the interpreter turns a
    # block-and-scalar ``&`` into an int32 mask, which tl.load rejects.)
    xv = tl.load(x_row_ptr + (bos + cur) * stride_x_t,
                 mask=tl.where(cur >= 0, feat_mask, False), other=0.0)
    xv = xv.to(STATE_DTYPE).to(tl.float32)
    col = WIDTH - 1 + cur
    pv = tl.where(col == 0, prior0, tl.where(col == 1, prior1, prior2))
    return tl.where(cur >= 0, xv, pv)


@triton.jit
def _tree_conv_update_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    state_ptr,
    slot_ptr,
    n_acc_ptr,
    parent_ptr,
    cu_ptr,
    o_ptr,
    dim,
    null_block_id,
    stride_x_t,
    stride_x_d,
    stride_w_d,
    stride_w_k,
    stride_s_n,
    stride_s_d,
    stride_s_c,
    stride_o_t,
    stride_o_d,
    WIDTH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    HAS_PARENT: tl.constexpr,
    HAS_NULL: tl.constexpr,
    PROD_DTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    req = tl.program_id(0)
    bos = tl.load(cu_ptr + req).to(tl.int64)
    n_tok = tl.load(cu_ptr + req + 1).to(tl.int64) - bos
    slot = tl.load(slot_ptr + req).to(tl.int64)
    skip = (n_tok <= 0) | (slot < 0)
    if HAS_NULL:
        skip = skip | (slot == null_block_id)
    if skip:
        return
    STATE_DTYPE = state_ptr.dtype.element_ty

    feats = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    fmask = feats < dim
    off = tl.load(n_acc_ptr + req).to(tl.int64) - 1

    # Prior window: buffer columns off .. off + WIDTH - 2 (oldest first).
    s_row = state_ptr + slot * stride_s_n + feats.to(tl.int64) * stride_s_d
    zero = tl.zeros([BLOCK_N], dtype=tl.float32)
    prior0 = tl.load(s_row + off * stride_s_c, mask=fmask, other=0.0).to(tl.float32)
    prior1 = zero
    prior2 = zero
    if WIDTH >= 3:
        prior1 = tl.load(s_row + (off + 1) * stride_s_c, mask=fmask, other=0.0).to(
            tl.float32)
    if WIDTH >= 4:
        prior2 = tl.load(s_row + (off + 2) * stride_s_c, mask=fmask, other=0.0).to(
            tl.float32)

    w_row = w_ptr + feats * stride_w_d
    w0 = tl.load(w_row, mask=fmask, other=0.0).to(tl.float32)
    w1 = tl.load(w_row + stride_w_k, mask=fmask, other=0.0).to(tl.float32)
    w2 = zero
    w3 = zero
    if WIDTH >= 3:
        w2 = tl.load(w_row + 2 * stride_w_k, mask=fmask, other=0.0).to(tl.float32)
    if WIDTH >= 4:
        w3 = tl.load(w_row + 3 * stride_w_k, mask=fmask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc0 = tl.load(bias_ptr + feats, mask=fmask, other=0.0).to(tl.float32)
    else:
        acc0 = zero

    x_row = x_ptr + feats * stride_x_d
    o_row = o_ptr + feats * stride_o_d
    for t in range(n_tok):
        # v0 = this token's input, v1 = its parent's (or prior), and so on.
        v0 = _conv_value(t, x_row, bos, stride_x_t, fmask, prior0, prior1, prior2,
                         WIDTH, STATE_DTYPE)
        c1 = _conv_next(t, parent_ptr, bos, HAS_PARENT)
        v1 = _conv_value(c1, x_row, bos, stride_x_t, fmask, prior0, prior1, prior2,
                         WIDTH, STATE_DTYPE)
        # Oldest tap first; each product rounded to PROD_DTYPE (see wrapper).
        acc = acc0
        if WIDTH == 2:
            acc += (w0 * v1).to(PROD_DTYPE).to(tl.float32)
            acc += (w1 * v0).to(PROD_DTYPE).to(tl.float32)
        else:
            c2 = _conv_next(c1, parent_ptr, bos, HAS_PARENT)
            v2 = _conv_value(c2, x_row, bos, stride_x_t, fmask, prior0, prior1,
                             prior2, WIDTH, STATE_DTYPE)
            if WIDTH == 3:
                acc += (w0 * v2).to(PROD_DTYPE).to(tl.float32)
                acc += (w1 * v1).to(PROD_DTYPE).to(tl.float32)
                acc += (w2 * v0).to(PROD_DTYPE).to(tl.float32)
            else:
                c3 = _conv_next(c2, parent_ptr, bos, HAS_PARENT)
                v3 = _conv_value(c3, x_row, bos, stride_x_t, fmask, prior0, prior1,
                                 prior2, WIDTH, STATE_DTYPE)
                acc += (w0 * v3).to(PROD_DTYPE).to(tl.float32)
                acc += (w1 * v2).to(PROD_DTYPE).to(tl.float32)
                acc += (w2 * v1).to(PROD_DTYPE).to(tl.float32)
                acc += (w3 * v0).to(PROD_DTYPE).to(tl.float32)
        if SILU:
            acc = acc / (1 + tl.exp(-acc))
        out = acc.to(STATE_DTYPE).to(o_ptr.dtype.element_ty)
        tl.store(o_row + (bos + t) * stride_o_t, out, mask=fmask)

    # Write-back: [prior window minus its oldest column, x_0 .. x_{n-1}].
    tl.debug_barrier()
    if WIDTH >= 3:
        tl.store(s_row, prior1.to(STATE_DTYPE), mask=fmask)
    if WIDTH >= 4:
        tl.store(s_row + stride_s_c, prior2.to(STATE_DTYPE), mask=fmask)
    for t in range(n_tok):
        xv = tl.load(x_row + (bos + t) * stride_x_t, mask=fmask, other=0.0)
        tl.store(s_row + (WIDTH - 2 + t) * stride_s_c, xv.to(STATE_DTYPE), mask=fmask)


def _check_inputs(fn: str, *tensors: torch.Tensor) -> None:
    """Cheap host-side checks (no synchronisation): dtypes and, for CPU
    tensors, that the interpreter is on."""
    for t in tensors:
        if t.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"{fn}: dtype {t.dtype} not supported (fp16, bf16, fp32)")
    if tensors[0].device.type == "cpu" and not INTERPRETED:
        raise RuntimeError(
            f"{fn} on CPU tensors needs the Triton interpreter: set "
            "TRITON_INTERPRET=1 before vllm_ddtree.kernels.gdn_tree is imported")


def tree_conv_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    conv_state_indices: torch.Tensor,
    num_accepted: torch.Tensor,
    parent: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    *,
    null_block_id: int | None = 0,
    block_n: int | None = None,
) -> torch.Tensor:
    """Tree causal conv1d update (see ``tree_conv_update_ref``).

    Returns a new ``out[T, dim]`` in ``x``'s dtype (it cannot be computed in
    place: later tokens read their ancestors' inputs). ``block_n`` overrides
    the channel tile (a power of two).
    """
    _check_inputs("tree_conv_update", x, conv_state, weight)
    silu = silu_flag(activation)
    num_tokens, dim = x.shape
    width = weight.shape[1]
    if not 2 <= width <= 4:
        raise ValueError(f"weight: conv width {width} not supported (2..4)")
    num_reqs = cu_seqlens.shape[0] - 1
    out = torch.empty_like(x)
    if num_reqs <= 0 or num_tokens == 0:
        return out
    consts = conv_constexprs(conv_state.dtype, weight.dtype, dim, width,
                             bias is not None, silu, parent is not None,
                             null_block_id is not None, block_n)
    block_n = consts["BLOCK_N"]
    grid = (num_reqs, triton.cdiv(dim, block_n))
    _tree_conv_update_kernel[grid](
        x,
        weight,
        bias if bias is not None else weight,
        conv_state,
        conv_state_indices,
        num_accepted,
        parent if parent is not None else cu_seqlens,
        cu_seqlens,
        out,
        dim,
        null_block_id if null_block_id is not None else 0,
        *x.stride(),
        *weight.stride(),
        *conv_state.stride(),
        *out.stride(),
        **consts,
        num_warps=4 if block_n >= 256 else 2 if block_n >= 64 else 1,
    )
    return out


def conv_constexprs(state_dtype, weight_dtype, dim, width, has_bias, silu, has_parent,
                    has_null, block_n=None) -> dict:
    """Compile-time arguments of ``_tree_conv_update_kernel`` for a launch."""
    if block_n is None:
        block_n = min(256, triton.next_power_of_2(dim))
    return dict(
        WIDTH=width,
        HAS_BIAS=has_bias,
        SILU=silu,
        HAS_PARENT=has_parent,
        HAS_NULL=has_null,
        PROD_DTYPE=_TL_DTYPE[torch.promote_types(state_dtype, weight_dtype)],
        BLOCK_N=block_n,
    )


# --------------------------------------------------------------------------
# Gated delta rule
# --------------------------------------------------------------------------


@triton.jit
def _tree_recurrent_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    a_ptr,
    b_ptr,
    A_log_ptr,
    dt_bias_ptr,
    h_ptr,
    idx_ptr,
    n_acc_ptr,
    parent_ptr,
    cu_ptr,
    o_ptr,
    scale,
    null_block_id,
    K,
    V,
    stride_q_t,
    stride_q_h,
    stride_q_d,
    stride_k_t,
    stride_k_h,
    stride_k_d,
    stride_v_t,
    stride_v_h,
    stride_v_d,
    stride_a_t,
    stride_a_h,
    stride_b_t,
    stride_b_h,
    stride_h_n,
    stride_h_h,
    stride_h_v,
    stride_h_k,
    stride_i_n,
    stride_i_c,
    stride_o_t,
    stride_o_h,
    stride_o_d,
    GROUP: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_L2NORM: tl.constexpr,
    HAS_PARENT: tl.constexpr,
    HAS_NULL: tl.constexpr,
    SOFTPLUS_THRESHOLD: tl.constexpr,
    L2NORM_EPS: tl.constexpr,
):
    req = tl.program_id(0)
    hv = tl.program_id(1)
    hk = hv // GROUP
    bos = tl.load(cu_ptr + req).to(tl.int64)
    n_tok = tl.load(cu_ptr + req + 1).to(tl.int64) - bos
    idx_row = idx_ptr + req * stride_i_n
    init_col = tl.load(n_acc_ptr + req).to(tl.int64) - 1
    init_slot = tl.load(idx_row + init_col * stride_i_c).to(tl.int64)
    skip = (n_tok <= 0) | (init_slot < 0)
    if HAS_NULL:
        skip = skip | (init_slot == null_block_id)
    if skip:
        return

    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < V
    mask_h = mask_v[:, None] & mask_k[None, :]
    h_tile = (hv * stride_h_h + offs_v[:, None].to(tl.int64) * stride_h_v
              + offs_k[None, :] * stride_h_k)

    h = tl.load(h_ptr + init_slot * stride_h_n + h_tile, mask=mask_h, other=0.0).to(
        tl.float32)
    neg_exp_a = -tl.exp(tl.load(A_log_ptr + hv).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + hv).to(tl.float32)

    for t in range(n_tok):
        tok = bos + t
        if HAS_PARENT:
            par = tl.load(parent_ptr + tok).to(tl.int64)
            if (t > 0) & (par >= 0) & (par != t - 1):
                # A branch: restart from the parent's state as stored (it was
                # written by this program, with this tile layout).
                src = tl.load(idx_row + par * stride_i_c).to(tl.int64)
                tl.debug_barrier()
                h = tl.load(h_ptr + src * stride_h_n + h_tile, mask=mask_h,
                            other=0.0).to(tl.float32)

        b_q = tl.load(q_ptr + tok * stride_q_t + hk * stride_q_h + offs_k * stride_q_d,
                      mask=mask_k, other=0.0).to(tl.float32)
        b_k = tl.load(k_ptr + tok * stride_k_t + hk * stride_k_h + offs_k * stride_k_d,
                      mask=mask_k, other=0.0).to(tl.float32)
        b_v = tl.load(v_ptr + tok * stride_v_t + hv * stride_v_h + offs_v * stride_v_d,
                      mask=mask_v, other=0.0).to(tl.float32)
        x = (tl.load(a_ptr + tok * stride_a_t + hv * stride_a_h).to(tl.float32)
             + dt_bias)
        softplus = tl.where(x <= SOFTPLUS_THRESHOLD, tl.log(1 + tl.exp(x)), x)
        decay = tl.exp(neg_exp_a * softplus)
        beta = tl.sigmoid(tl.load(b_ptr + tok * stride_b_t + hv * stride_b_h).to(
            tl.float32))
        if USE_L2NORM:
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + L2NORM_EPS)
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + L2NORM_EPS)
        b_q = b_q * scale

        h *= decay
        b_v = (b_v - tl.sum(h * b_k[None, :], 1)) * beta
        h += b_v[:, None] * b_k[None, :]
        b_o = tl.sum(h * b_q[None, :], 1)
        tl.store(o_ptr + tok * stride_o_t + hv * stride_o_h + offs_v * stride_o_d,
                 b_o.to(o_ptr.dtype.element_ty), mask=mask_v)

        dst = tl.load(idx_row + t * stride_i_c).to(tl.int64)
        store = dst >= 0
        if HAS_NULL:
            store = store & (dst != null_block_id)
        if store:
            tl.store(h_ptr + dst * stride_h_n + h_tile, h.to(h_ptr.dtype.element_ty),
                     mask=mask_h)


def tree_recurrent_update(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    num_accepted: torch.Tensor,
    parent: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    *,
    null_block_id: int | None = 0,
    block_v: int | None = None,
) -> torch.Tensor:
    """Tree gated-delta-rule update (see ``tree_recurrent_update_ref``).

    Returns a new ``o[T, HV, V]`` in ``q``'s dtype (rows of skipped requests
    are left unwritten) and stores every token's state into ``ssm_state``.
    vLLM's ``[1, T, H, K]`` q/k/v views can be passed with ``.squeeze(0)``.
    ``block_v`` overrides the V tile (a power of two, default
    ``min(32, next_pow2(V))``).
    """
    _check_inputs("tree_recurrent_update", q, k, v, ssm_state)
    num_tokens, num_k_heads, head_k = q.shape
    _, num_v_heads, head_v = v.shape
    if num_v_heads % num_k_heads:
        raise ValueError(f"v: HV={num_v_heads} is not a multiple of H={num_k_heads}")
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError("a, b: expected [T, HV]")
    num_reqs = cu_seqlens.shape[0] - 1
    if scale is None:
        scale = head_k ** -0.5
    o = torch.empty(num_tokens, num_v_heads, head_v, dtype=q.dtype, device=q.device)
    if num_reqs <= 0 or num_tokens == 0:
        return o
    consts = recurrent_constexprs(head_k, head_v, num_v_heads // num_k_heads,
                                  use_qk_l2norm, parent is not None,
                                  null_block_id is not None, block_v)
    grid = (num_reqs, num_v_heads, triton.cdiv(head_v, consts["BV"]))
    _tree_recurrent_kernel[grid](
        q,
        k,
        v,
        a,
        b,
        A_log,
        dt_bias,
        ssm_state,
        state_indices,
        num_accepted,
        parent if parent is not None else cu_seqlens,
        cu_seqlens,
        o,
        float(scale),
        null_block_id if null_block_id is not None else 0,
        head_k,
        head_v,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *a.stride(),
        *b.stride(),
        *ssm_state.stride(),
        *state_indices.stride(),
        *o.stride(),
        **consts,
        num_warps=4,
    )
    return o


def recurrent_constexprs(head_k, head_v, group, use_qk_l2norm, has_parent, has_null,
                         block_v=None) -> dict:
    """Compile-time arguments of ``_tree_recurrent_kernel`` for a launch."""
    return dict(
        GROUP=group,
        BK=triton.next_power_of_2(head_k),
        BV=block_v if block_v is not None else min(32, triton.next_power_of_2(head_v)),
        USE_L2NORM=use_qk_l2norm,
        HAS_PARENT=has_parent,
        HAS_NULL=has_null,
        SOFTPLUS_THRESHOLD=_SOFTPLUS_THRESHOLD,
        L2NORM_EPS=_L2NORM_EPS,
    )
