"""Torch reference for tree-shaped Gated DeltaNet speculative decoding.

This module is the test oracle for the Triton kernels in ``gdn_tree.py``. It
imports neither vLLM nor Triton; arithmetic is fp32 (with the conv's roundings
below).
Each request holds exactly one tree: token 0 is its only root.

Batch layout
------------
Requests are packed along the token axis: request ``i`` owns tokens
``cu_seqlens[i] : cu_seqlens[i + 1]`` (``q_i`` tokens, possibly 0). Within a
request the tokens form a tree in *flat order*: local token 0 is the root and
every other token comes after its parent. ``parent[t]`` (one entry per packed
token) is the *local* index of the parent of token ``t`` inside its own
request, ``-1`` for the root. ``parent=None`` means a chain
(``parent[j] == j - 1``), which is vLLM's stock speculative-decode case.

Short causal convolution (per request, channel-wise, width ``W``)
-----------------------------------------------------------------
``conv_state[slot, dim, state_len]`` (``state_len >= W - 2 + q_i`` and
``>= num_accepted - 1 + W - 1``) is a rolling buffer of past inputs. With
``off = num_accepted[i] - 1`` the *prior window* is buffer columns
``[off, off + W - 1)`` (column ``off + W - 2`` is the most recent input).

* Token ``j``'s window is the last ``W`` entries of
  ``prior window ++ x[root .. j along the tree path]``; its output is
  ``act(bias + sum_k weight[:, k] * window[:, k])`` with ``act`` = SiLU
  (``y / (1 + exp(-y))``) or identity. Rounding follows vLLM's kernel: inputs
  are first rounded to the buffer dtype (so a value read back from the buffer
  later is the value used now), each product ``weight * window`` is rounded
  to the promoted dtype of buffer and weight, the sum (oldest tap first) is
  fp32, and the output is rounded to the buffer dtype, then to ``x``'s.
* Write-back: buffer columns ``[0, W - 2)`` receive old columns
  ``[off + 1, off + W - 1)`` (the prior window without its oldest column) and
  columns ``[W - 2, W - 2 + q_i)`` receive ``x_0 .. x_{q_i - 1}`` in flat
  order; later columns are untouched.

Gated delta rule (per request and value head)
---------------------------------------------
``ssm_state[slot, HV, V, K]``; ``state_indices[i, c]`` names the slot of
column ``c`` of request ``i``'s row (``S + 1`` columns). Per token::

    g    = -exp(A_log) * softplus(a + dt_bias)     (softplus(x) = x for x > 20)
    beta = sigmoid(b)
    q, k = l2norm(q), l2norm(k)                     (x * rsqrt(sum x^2 + 1e-6))
    q    = q * scale                                (default K ** -0.5)
    h    = h * exp(g)
    h    = h + ((v - h k) * beta) k^T
    o    = h q

Value head ``hv`` uses key head ``hv // (HV // H)``. The root starts from the
state in slot ``state_indices[i, num_accepted[i] - 1]``; token ``j`` starts from
its parent's state and its own state is stored (in the state dtype) to slot
``state_indices[i, j]``. Exactly as in the kernel, when ``parent[j] == j - 1``
the fp32 state carries over unrounded; on a branch the parent's state is
re-read from its stored slot (so with a bf16/fp16 state a branch sees the
rounded state). With an fp32 state every node equals a chain run along its
root-to-node path.

Null slots: a request whose conv slot (conv) or initial state slot
(recurrence) is negative or equals ``null_block_id`` is skipped (its output
rows are zero here, unspecified in the kernels); state columns whose slot is
null are not stored. Slots ``state_indices[i, 0 .. q_i - 1]`` must be valid
for a branching tree because branches re-read their parent's column.

Commit
------
Neither this module nor the kernels commit. After the tree walk the engine
commits with ``vllm_ddtree.core.gdn_tree.commit_columns`` / ``commit_layer``
(device-agnostic torch, shared by the CPU and CUDA paths): the accepted
node's state is copied into column 0 and the last ``W - 1`` inputs along the
accepted path into conv columns ``[0, W - 1)``, which leaves every request at
``num_accepted = 1`` for its next step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "chain_conv_update_ref",
    "chain_parent",
    "chain_recurrent_update_ref",
    "path_of",
    "tree_conv_update_ref",
    "tree_recurrent_update_ref",
    "validate_tree",
]

SOFTPLUS_THRESHOLD = 20.0
L2NORM_EPS = 1e-6


# --------------------------------------------------------------------------
# Tree helpers
# --------------------------------------------------------------------------


def path_of(parent: Sequence[int] | torch.Tensor, j: int) -> list[int]:
    """Local indices from the root to node ``j`` (both included).

    ``parent`` holds one request's local parent indices (root: ``-1``).
    """
    if isinstance(parent, torch.Tensor):
        parent = parent.tolist()
    path = [j]
    while parent[path[-1]] >= 0:
        path.append(parent[path[-1]])
    return path[::-1]


def chain_parent(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Parent array (int32, local indices) of a batch of chains."""
    cu = cu_seqlens.tolist()
    parts = [torch.arange(-1, cu[i + 1] - cu[i] - 1, dtype=torch.int32)
             for i in range(len(cu) - 1)]
    out = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int32)
    return out.to(cu_seqlens.device)


def validate_tree(parent: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    """Raise ``ValueError`` unless every request is one tree in flat order.

    Host-side (synchronises); the kernels do not check.
    """
    cu = cu_seqlens.tolist()
    if parent.dim() != 1 or parent.shape[0] != cu[-1]:
        raise ValueError(
            f"parent: expected [{cu[-1]}] entries, got {tuple(parent.shape)}")
    par = parent.tolist()
    for i in range(len(cu) - 1):
        bos, eos = cu[i], cu[i + 1]
        if eos < bos:
            raise ValueError(f"cu_seqlens: decreasing at request {i}")
        for j in range(eos - bos):
            p = par[bos + j]
            ok = p == -1 if j == 0 else 0 <= p < j
            if not ok:
                raise ValueError(
                    f"parent: request {i} token {j} has parent {p} (root must be "
                    f"-1, others in [0, {j}))")


def _local_parents(parent: torch.Tensor | None, cu_seqlens: torch.Tensor) -> list[int]:
    if parent is None:
        return chain_parent(cu_seqlens).tolist()
    validate_tree(parent, cu_seqlens)
    return parent.tolist()


def _is_null(slot: int, null_block_id: int | None) -> bool:
    return slot < 0 or (null_block_id is not None and slot == null_block_id)


def silu_flag(activation) -> bool:
    """Whether ``activation`` (None, True/False, 'silu' or 'swish') is SiLU."""
    if activation is None or activation is False:
        return False
    if activation is True or activation in ("silu", "swish"):
        return True
    raise ValueError(f"activation: expected None, 'silu' or 'swish', got {activation!r}")


# --------------------------------------------------------------------------
# Convolution
# --------------------------------------------------------------------------


def tree_conv_update_ref(
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
) -> torch.Tensor:
    """Tree causal conv1d update; returns ``out[T, dim]`` (dtype of ``x``) and
    rewrites ``conv_state`` as described in the module docstring."""
    silu = silu_flag(activation)
    num_tokens, dim = x.shape
    width = weight.shape[1]
    state_len = conv_state.shape[2]
    cu = cu_seqlens.tolist()
    par = _local_parents(parent, cu_seqlens)
    slots = conv_state_indices.tolist()
    n_acc = num_accepted.tolist()
    w = weight.float()
    prod_dtype = torch.promote_types(conv_state.dtype, weight.dtype)
    b = bias.float() if bias is not None else torch.zeros(dim, device=x.device)
    out = torch.zeros(num_tokens, dim, dtype=x.dtype, device=x.device)

    for i in range(len(cu) - 1):
        bos, eos = cu[i], cu[i + 1]
        n = eos - bos
        if n == 0 or _is_null(slots[i], null_block_id):
            continue
        off = n_acc[i] - 1
        if off < 0 or off + width - 1 > state_len or width - 2 + n > state_len:
            raise ValueError(
                f"request {i}: num_accepted={n_acc[i]}, {n} tokens and width "
                f"{width} do not fit a conv buffer of {state_len} columns")
        buf = conv_state[slots[i]]                         # [dim, state_len]
        prior = buf[:, off:off + width - 1].float()        # oldest first
        xs = x[bos:eos].to(conv_state.dtype).float()       # [n, dim]
        local = par[bos:eos]
        for j in range(n):
            path = path_of(local, j)
            seq = torch.cat([prior, xs[path].T], dim=1)
            window = seq[:, -width:]
            acc = b.clone()
            for c in range(width):
                acc = acc + (w[:, c] * window[:, c]).to(prod_dtype).float()
            if silu:
                acc = acc / (1 + torch.exp(-acc))
            out[bos + j] = acc.to(conv_state.dtype).to(out.dtype)
        kept = buf[:, off + 1:off + width - 1].clone()
        buf[:, :width - 2] = kept
        buf[:, width - 2:width - 2 + n] = xs.T.to(conv_state.dtype)
    return out


def chain_conv_update_ref(x, conv_state, weight, bias, activation, conv_state_indices,
                          num_accepted, cu_seqlens, *, null_block_id=0):
    """The stock (chain) speculative conv update: ``tree_conv_update_ref`` with
    ``parent[j] = j - 1``."""
    return tree_conv_update_ref(x, conv_state, weight, bias, activation,
                                conv_state_indices, num_accepted, None, cu_seqlens,
                                null_block_id=null_block_id)


# --------------------------------------------------------------------------
# Gated delta rule
# --------------------------------------------------------------------------


def _l2norm(t: torch.Tensor) -> torch.Tensor:
    return t * torch.rsqrt((t * t).sum(-1, keepdim=True) + L2NORM_EPS)


def _delta_step(h, q, k, v, a, b, neg_exp_a, dt_bias, scale, use_qk_l2norm, group):
    """One token for all value heads. h: [HV, V, K] fp32; q, k: [H, K];
    v: [HV, V]; a, b: [HV]. Returns (new h, o [HV, V])."""
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = (q * scale).repeat_interleave(group, 0)            # [HV, K]
    k = k.repeat_interleave(group, 0)
    x = a.float() + dt_bias
    softplus = torch.where(x <= SOFTPLUS_THRESHOLD, torch.log(1 + torch.exp(x)), x)
    g = neg_exp_a * softplus
    beta = torch.sigmoid(b.float())
    h = h * torch.exp(g)[:, None, None]
    v_new = (v.float() - (h * k[:, None, :]).sum(-1)) * beta[:, None]
    h = h + v_new[:, :, None] * k[:, None, :]
    o = (h * q[:, None, :]).sum(-1)
    return h, o


def tree_recurrent_update_ref(
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
) -> torch.Tensor:
    """Tree gated-delta-rule update; returns ``o[T, HV, V]`` (dtype of ``q``)
    and stores every token's state into ``ssm_state`` (module docstring)."""
    num_tokens, num_k_heads, head_k = q.shape
    num_v_heads, head_v = v.shape[1:]
    if num_v_heads % num_k_heads:
        raise ValueError(f"HV={num_v_heads} is not a multiple of H={num_k_heads}")
    group = num_v_heads // num_k_heads
    if scale is None:
        scale = head_k ** -0.5
    cu = cu_seqlens.tolist()
    par = _local_parents(parent, cu_seqlens)
    rows = state_indices.tolist()
    n_acc = num_accepted.tolist()
    neg_exp_a = -torch.exp(A_log.float())
    dtb = dt_bias.float()
    o = torch.zeros(num_tokens, num_v_heads, head_v, dtype=q.dtype, device=q.device)

    for i in range(len(cu) - 1):
        bos, eos = cu[i], cu[i + 1]
        n = eos - bos
        if n == 0:
            continue
        row = rows[i]
        if not 1 <= n_acc[i] <= len(row) or n > len(row):
            raise ValueError(
                f"request {i}: num_accepted={n_acc[i]} / {n} tokens do not fit a "
                f"row of {len(row)} state columns")
        if _is_null(row[n_acc[i] - 1], null_block_id):
            continue
        h = ssm_state[row[n_acc[i] - 1]].float()
        for j in range(n):
            p = par[bos + j]
            if j > 0 and p != j - 1:
                if _is_null(row[p], null_block_id):
                    raise ValueError(
                        f"request {i}: token {j} branches from column {p}, whose "
                        "slot is null")
                h = ssm_state[row[p]].float()
            t = bos + j
            h, o_t = _delta_step(h, q[t], k[t], v[t], a[t], b[t], neg_exp_a, dtb,
                                 scale, use_qk_l2norm, group)
            o[t] = o_t.to(o.dtype)
            if not _is_null(row[j], null_block_id):
                ssm_state[row[j]] = h.to(ssm_state.dtype)
    return o


def chain_recurrent_update_ref(q, k, v, a, b, A_log, dt_bias, ssm_state, state_indices,
                               num_accepted, cu_seqlens, scale=None, use_qk_l2norm=True,
                               *, null_block_id=0):
    """The stock (chain) speculative recurrence: ``tree_recurrent_update_ref``
    with ``parent[j] = j - 1``."""
    return tree_recurrent_update_ref(q, k, v, a, b, A_log, dt_bias, ssm_state,
                                     state_indices, num_accepted, None, cu_seqlens,
                                     scale, use_qk_l2norm, null_block_id=null_block_id)
