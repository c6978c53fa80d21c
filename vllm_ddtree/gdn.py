"""The vLLM side of tree verification on Gated DeltaNet layers.

The algorithm and its index plan are in ``vllm_ddtree/core/gdn_tree.py``. Here:

* :class:`GDNTreeStep`, one per verification step of a hybrid target: the
  local parent of every token row, the plan (built at the first GDN layer and
  shared by the rest), and what the commit and the first-step guard need;
* :func:`cpu_tree_spec_forward`, which replaces vLLM CPU's speculative GDN
  forward (``patches/gdn_tree.py``) while a step is active: one native call
  per layer (``kernels/tree_attention_cpu.c``, conv and recurrence along each
  node's parents) where the native kernels load; otherwise the torch path,
  the conv windows gathered along each node's path and run through the same
  ``F.conv1d`` as the stock path and the recurrence through vLLM's own C++
  kernel (``fused_sigmoid_gating_delta_rule_update_spec_cpu``), one call per
  wave;
* the CUDA path (``patches/gdn_tree_cuda.py``): :func:`cuda_layer` marks the
  GDN layer whose ``_forward_core`` is running during a tree step, and
  :func:`cuda_tree_conv` / :func:`cuda_tree_recurrent` take the place of the
  two speculative kernel calls inside it (vLLM's ``causal_conv1d_update`` and
  ``fused_sigmoid_gating_delta_rule_update`` with ``num_accepted_tokens``)
  with the parent-aware Triton kernels of ``kernels/gdn_tree.py``. The
  parents of the speculative tokens are gathered once per step, not per
  layer, and nothing reads a device tensor back;
* :func:`state_bytes_per_request`, the memory one request's GDN states take
  at a given budget.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from vllm_ddtree.core.gdn_tree import TreePlan, build_plan, commit_columns, commit_layer
from vllm_ddtree.kernels import cpu_native

__all__ = ["GDNTreeStep", "active_step", "cpu_tree_spec_forward", "cuda_layer",
           "cuda_tree_conv", "cuda_tree_recurrent", "state_bytes_per_request", "tree_layer_running",
           "tree_step"]


class GDNTreeStep:
    """One verification step's GDN bookkeeping."""

    def __init__(self, parent: Tensor, buffers: Any = None):
        self.parent = parent  # [num_tokens] local parent of every token row (-1: root)
        self.buffers = buffers  # core.tree_info.TreeStepBuffers: the guard's seen slots
        self.plan: TreePlan | None = None  # CPU: the wave plan
        self.width: int | None = None  # the conv kernel width
        self.layers: dict[str, tuple[Any, Any, Tensor]] = {}  # name -> conv, ssm, rows
        self.spec_rows: Tensor | None = None  # batch row of each spec sequence
        self._spec_parent: Tensor | None = None  # int32 parents of the spec tokens
        self._pending_conv: dict[str, Tensor] = {}  # CUDA: conv state seen, per layer

    def plan_for(self, md: Any, num_tokens: int, width: int) -> TreePlan:
        if self.plan is None:
            n = md.num_spec_decodes
            parent = self.spec_parent(md, num_tokens, width)
            num_spec = md.spec_state_indices_tensor.shape[1] - 1
            self.plan = build_plan(parent.tolist(), md.spec_query_start_loc[: n + 1].tolist(),
                                   width, num_spec, device=parent.device)
        return self.plan

    def spec_parent(self, md: Any, num_tokens: int, width: int) -> Tensor:
        """int32 ``[num_spec_tokens]``: the local parent of every speculative
        token of the step (-1: a root), in the order vLLM's speculative
        kernels see them. Gathered at the first GDN layer and shared by the
        others (and by the wave plan); no host sync."""
        if self._spec_parent is None:
            if md.num_prefills == 0 and md.num_decodes == 0:
                parent = self.parent[:num_tokens]
            else:
                parent = self.parent.index_select(0, md.spec_token_indx.long())
            self._spec_parent = parent.to(torch.int32).contiguous()
            self.width = width
            self.spec_rows = _spec_rows(md, md.num_spec_decodes, parent.device)
        return self._spec_parent

    def record(self, name: str, conv_state: Tensor, ssm_state: Tensor, rows: Tensor) -> None:
        """Layer ``name`` ran both halves of the tree path (a device-side mark
        too, which a captured CUDA graph repeats on replay)."""
        self.layers[name] = (conv_state, ssm_state, rows)
        if self.buffers is not None:
            self.buffers.mark_seen(name)

    def replayed(self, layers: dict[str, tuple[Any, Any, Tensor]], width: int) -> None:
        """The step's forward was a replayed CUDA graph of a uniform batch:
        the layers' caches and state rows are those recorded at capture."""
        self.layers, self.width = dict(layers), width

    def commit(self, path: Tensor, num_accepted: Tensor) -> None:
        """After the walk (``path`` ``[R, 1+B]`` and ``num_accepted`` ``[R]``
        by batch row): each spec sequence's accepted state to column 0 and
        its accepted conv window to columns ``0 .. W-2``, in every GDN layer."""
        if self.width is None or not self.layers:
            return
        rows = self.spec_rows
        if rows is None:  # a replayed uniform batch: every request is speculative
            rows = torch.arange(path.shape[0], device=path.device)
        state_col, conv_cols = commit_columns(path.index_select(0, rows),
                                              num_accepted.index_select(0, rows),
                                              self.width)
        n = rows.shape[0]
        for conv_state, ssm_state, idx in self.layers.values():
            commit_layer(conv_state, ssm_state, idx[:n], state_col, conv_cols)


def _spec_rows(md: Any, n: int, device) -> Tensor:
    """The batch row of each of the ``n`` speculative sequences, in order
    (a stable sort puts the masked rows first: no host sync)."""
    mask = md.spec_sequence_masks
    if mask is None or (md.num_prefills == 0 and md.num_decodes == 0):
        return torch.arange(n, device=device)
    return torch.argsort((~mask).to(torch.int8), stable=True)[:n]


_ACTIVE: GDNTreeStep | None = None


def active_step() -> GDNTreeStep | None:
    return _ACTIVE


@contextmanager
def tree_step(step: GDNTreeStep | None) -> Iterator[None]:
    """GDN layers run the tree path while this is active."""
    global _ACTIVE
    _ACTIVE = step
    try:
        yield
    finally:
        _ACTIVE = None


def cpu_tree_spec_forward(step: GDNTreeStep, layer: Any, md: Any, mixed_qkv: Tensor, b: Tensor,
                          a: Tensor, conv_buf: Tensor, ssm_state: Tensor, width: int,
                          conv_weight: Tensor, *, native: bool | None = None) -> Tensor:
    """The speculative tokens of one GDN layer as trees; same arguments and
    result as vLLM CPU's ``_spec_forward`` (``conv_buf`` ``[slots, dim,
    state_len]``, ``ssm_state`` ``[slots, HV, K, V]``), plus the unpacked
    ``[dim, W]`` conv weight.

    With the native CPU kernels (``native=None``: when they load) the whole
    layer is one call (``kernels/cpu_native.gdn_tree_native``); without them,
    or with ``native=False``, the torch path of :func:`_waves_forward`."""
    n, total = md.num_spec_decodes, mixed_qkv.shape[0]
    idx = md.spec_state_indices_tensor[:n]
    lib = None if native is False else cpu_native.load()
    if native and lib is None:
        raise RuntimeError("cpu_tree_spec_forward(native=True): the native CPU kernels are "
                           "unavailable")
    if lib is not None:
        parent = step.spec_parent(md, total, width)
        step.record(layer.prefix, conv_buf, ssm_state, idx)
        return cpu_native.gdn_tree_native(
            lib, mixed_qkv, conv_buf, conv_weight, layer.conv1d.bias, layer.activation == "silu",
            a, b, layer.A_log, layer.dt_bias, ssm_state, parent,
            md.spec_query_start_loc[: n + 1], idx, md.num_accepted_tokens[:n],
            layer.key_dim // layer.tp_size // layer.head_k_dim, layer.head_k_dim,
            layer.head_v_dim)
    return _waves_forward(step, layer, md, mixed_qkv, b, a, conv_buf, ssm_state, width,
                          conv_weight)


def _waves_forward(step: GDNTreeStep, layer: Any, md: Any, mixed_qkv: Tensor, b: Tensor,
                   a: Tensor, conv_buf: Tensor, ssm_state: Tensor, width: int,
                   conv_weight: Tensor) -> Tensor:
    """The torch path: the conv in ``F.conv1d`` and the recurrence through
    vLLM's own chain kernel, one call per wave of segments (bit for bit the
    stock chain along every path)."""
    import vllm._custom_ops as ops

    n, total = md.num_spec_decodes, mixed_qkv.shape[0]
    plan = step.plan_for(md, total, width)
    idx = md.spec_state_indices_tensor[:n]
    num_acc = md.num_accepted_tokens[:n].long()
    slots = idx[:, 0].long()
    step.record(layer.prefix, conv_buf, ssm_state, idx)

    # ---- convolution: each node's window along its own path
    dim = mixed_qkv.shape[-1]
    prior_cols = (num_acc - 1)[:, None] + torch.arange(width - 1, device=slots.device)
    prior = conv_buf[slots[:, None], :, prior_cols]  # [N, W-1, dim]
    x = mixed_qkv.to(conv_buf.dtype)
    windows = torch.cat([prior.reshape(-1, dim), x]).index_select(
        0, plan.conv_src.view(-1)).view(total, width, dim)
    out = F.conv1d(windows.transpose(1, 2), conv_weight.unsqueeze(1), layer.conv1d.bias,
                   groups=dim)[..., 0]
    if layer.activation == "silu":
        out = F.silu(out)
    conv_out = out.to(mixed_qkv.dtype)
    # rolling write-back: prior window minus its oldest input, then x_0 .. x_q-1
    keep = torch.arange(width - 2, device=slots.device)
    conv_buf[slots[:, None], :, keep[None, :]] = prior[:, 1:]
    conv_buf[slots.index_select(0, plan.tok_seq), :, plan.tok_col] = x

    # ---- recurrence: vLLM's chain kernel, one call per wave of segments
    query, key, value = layer.rearrange_mixed_qkv(conv_out)
    query, key, value = query.squeeze(0), key.squeeze(0), value.squeeze(0)
    result = None
    for wave in plan.waves:
        rows = idx.index_select(0, wave.seq).gather(1, wave.cols)
        nacc = torch.where(wave.from_root, num_acc.index_select(0, wave.seq), wave.length + 1)
        t = wave.tokens
        q_w, k_w, v_w, a_w, b_w = ((query, key, value, a, b) if t is None else
                                   (u.index_select(0, t) for u in (query, key, value, a, b)))
        o = ops.fused_sigmoid_gating_delta_rule_update_spec_cpu(
            A_log=layer.A_log, dt_bias=layer.dt_bias,
            q=q_w.contiguous(), k=k_w.contiguous(), v=v_w.contiguous(),
            a=a_w.contiguous(), b=b_w.contiguous(),
            initial_state_source=ssm_state,
            spec_state_indices=rows.to(torch.int32).contiguous(),
            num_accepted_tokens=nacc.to(torch.int32).contiguous(),
            cu_seqlens=wave.cu_seqlens, use_qk_l2norm_in_kernel=True)
        if t is None:
            return o
        if result is None:
            result = o.new_empty((total, *o.shape[1:]))
        result.index_copy_(0, t, o)
    return result


# ---------------------------------------------------------------------------
# CUDA: vLLM's GDN layer with the parent-aware Triton kernels
# ---------------------------------------------------------------------------

# (step, layer, metadata) of the GDN layer whose forward is running in a tree
# step, while it runs (``cuda_layer``).
_CUDA_LAYER: tuple[GDNTreeStep, Any, Any] | None = None


@contextmanager
def cuda_layer(layer: Any, md: Any) -> Iterator[bool]:
    """Around one GDN layer's ``_forward_core`` on CUDA: yields whether its
    speculative kernel calls take the tree path (a tree step is active and
    the layer's metadata has speculative sequences)."""
    global _CUDA_LAYER
    step = _ACTIVE
    if step is None or md is None or getattr(md, "spec_sequence_masks", None) is None:
        yield False
        return
    _CUDA_LAYER = (step, layer, md)
    try:
        yield True
    finally:
        _CUDA_LAYER = None


def tree_layer_running() -> bool:
    """Whether a GDN layer's speculative kernels take the tree path now."""
    return _CUDA_LAYER is not None


def cuda_tree_conv(x: Tensor, conv_state: Tensor, weight: Tensor, bias: Tensor | None,
                   activation: Any, conv_state_indices: Tensor, num_accepted_tokens: Tensor,
                   query_start_loc: Tensor, null_block_id: int | None) -> Tensor:
    """The speculative conv update of the running tree layer: vLLM's
    ``causal_conv1d_update`` arguments, each token's window along its own
    path (``kernels.gdn_tree.tree_conv_update``)."""
    from vllm_ddtree.kernels import gdn_tree as kernels

    step, layer, md = _CUDA_LAYER
    n = conv_state_indices.shape[0]
    parent = step.spec_parent(md, x.shape[0], weight.shape[1])
    # (vLLM passes column 0 of the state-index rows, a strided view)
    out = kernels.tree_conv_update(x, conv_state, weight, bias, activation,
                                   conv_state_indices.contiguous(), num_accepted_tokens,
                                   parent, query_start_loc[: n + 1],
                                   null_block_id=null_block_id)
    step._pending_conv[layer.prefix] = conv_state
    return out


def cuda_tree_recurrent(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor,
                        A_log: Tensor, dt_bias: Tensor, ssm_state: Tensor,
                        state_indices: Tensor, num_accepted_tokens: Tensor,
                        cu_seqlens: Tensor, scale: float | None,
                        use_qk_l2norm: bool) -> Tensor:
    """The speculative recurrence of the running tree layer: vLLM's
    ``fused_sigmoid_gating_delta_rule_update`` arguments (``[1, T, H, K]``
    q/k/v), every node's state from its parent's
    (``kernels.gdn_tree.tree_recurrent_update``); returns ``[1, T, HV, V]``."""
    from vllm_ddtree.kernels import gdn_tree as kernels

    step, layer, md = _CUDA_LAYER
    parent = step.spec_parent(md, q.shape[1], step.width or 0)
    o = kernels.tree_recurrent_update(q.squeeze(0), k.squeeze(0), v.squeeze(0), a, b, A_log,
                                      dt_bias, ssm_state, state_indices, num_accepted_tokens,
                                      parent, cu_seqlens, scale, use_qk_l2norm)
    conv_state = step._pending_conv.pop(layer.prefix, None)
    if conv_state is not None:  # both halves ran the tree path: the layer is done
        step.record(layer.prefix, conv_state, ssm_state, state_indices)
    return o.unsqueeze(0)


def state_bytes_per_request(num_layers: int, conv_dim: int, width: int, heads: int,
                            head_k: int, head_v: int, budget: int, conv_bytes: int,
                            ssm_bytes: int) -> int:
    """Bytes of GDN state one request holds with speculation at ``budget``:
    ``1 + budget`` state blocks per GDN layer, each with a conv buffer of
    ``width - 1 + budget`` columns and one recurrent state."""
    conv = conv_dim * (width - 1 + budget) * conv_bytes
    ssm = heads * head_k * head_v * ssm_bytes
    return num_layers * (1 + budget) * (conv + ssm)
