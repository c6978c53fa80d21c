"""Plain GDN decode rows of a speculative engine on vLLM CPU's C++ conv kernel (CPU).

Target: ``vllm.model_executor.layers.mamba.ops.cpu.gdn_attention:_spec_aware_nonspec``,
the prefill/decode half of vLLM CPU's GDN attention when speculative decoding
is configured and a step has no speculative row (looked up as a module global
by ``_cpu_gdn_attention_spec_aware`` at each call).

Why: with speculative decoding configured, a GDN layer's conv state is a wide
rolling buffer (``W - 1 + S`` columns), and every step without speculative
rows goes through this function. DDTree sends all its plain steps there (the
adaptive budget's plain mode, ``vllm_ddtree/runner.py``). For decode rows the
stock function takes vLLM's C++ conv update only on AMX or Arm bf16 CPUs and a
vectorised torch update elsewhere, while a plain engine
(``_cpu_gdn_attention_nonspec``) takes the C++ update on every CPU for which
vLLM packs the conv weight at load (AVX-512 BF16 or Arm bf16). On an
AVX-512 BF16 CPU without AMX the torch update took 0.36 ms per layer for 64
rows against 0.02 ms for the C++ one, so a DDTree engine's plain steps cost
far more than a plain engine's. The C++ update reads the first ``W - 1``
columns of a wide buffer and rolls only those, exactly as the torch update on
its ``[:, :, :W - 1]`` view does (``tests/test_gdn_plain_decode.py`` checks
both against a torch reference).

The replacement: a batch of decode rows only (no prefill), on a layer whose
conv weight vLLM packed, where the stock function would take the torch
update: the conv through the C++ update and the recurrence through the same
fused kernel as the stock decode. Every other call runs the stock function.
Both get the plain rows' state indices as a dense tensor (vLLM's one-row
column view crashes its kernel).

Upstream status: vLLM 0.32 widened the plain path's conv predicate to
AVX-512 BF16 but not this one. Drop this patch when it does.
"""

from __future__ import annotations

import functools

import torch

from vllm_ddtree.patches.base import CPU_ONLY, Patch, on_cpu

_MODULE = "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention"


def packed_conv_weight(layer) -> bool:
    """Whether vLLM packed this GDN layer's conv weight for its C++ kernels
    at load (it keeps the unpacked copy beside it then)."""
    return getattr(layer.conv1d, "_cpu_unpacked_conv_weight", None) is not None


def _build(original):
    from importlib import import_module

    import vllm._custom_ops as ops

    stock = import_module(_MODULE)

    @functools.wraps(original)
    def _spec_aware_nonspec(layer, attn_metadata_i, mixed_qkv, b, a, core_attn_out, conv_buf,
                            ssm_state, width):
        md = attn_metadata_i
        rows = md.non_spec_state_indices_tensor
        if rows is not None and rows.dim() == 1 and rows.stride(0) != 1:
            # vLLM hands column 0 of the state block table, a strided view; for
            # one row .contiguous() keeps the stride and vLLM CPU's recurrent
            # kernel refuses it ("must be contiguous at last dimension"): a
            # dense copy, for the stock path too (the metadata is shared by
            # the step's GDN layers, so the first one makes it)
            md.non_spec_state_indices_tensor = rows.clone(memory_format=torch.contiguous_format)
        if (md.num_prefills or not md.num_decodes or not packed_conv_weight(layer)
                or torch.cpu._is_amx_tile_supported() or stock.is_arm_bf16()):
            return original(layer, attn_metadata_i, mixed_qkv, b, a, core_attn_out, conv_buf,
                            ssm_state, width)
        n, t = md.num_decodes, md.num_decode_tokens
        rows = md.non_spec_state_indices_tensor[:n]
        x = stock._causal_conv1d_update_cpu(
            x=mixed_qkv[:t], conv_states=conv_buf, weight=layer.conv1d.weight,
            bias=layer.conv1d.bias, silu_activation=layer.activation == "silu",
            conv_state_indices=rows, is_weight_packed=True)
        query, key, value = layer.rearrange_mixed_qkv(x)
        out = ops.fused_sigmoid_gating_delta_rule_update_cpu(
            A_log=layer.A_log, dt_bias=layer.dt_bias, q=query, k=key, v=value,
            a=a[:t], b=b[:t], initial_state_source=ssm_state, initial_state_indices=rows,
            cu_seqlens=md.non_spec_query_start_loc[: n + 1], use_qk_l2norm_in_kernel=True)
        core_attn_out[:t] = out.squeeze(1)

    _spec_aware_nonspec.ddtree_plain_decode = True
    return _spec_aware_nonspec


PATCH = Patch(
    name="cpu-gdn-plain-decode",
    target=f"{_MODULE}:_spec_aware_nonspec",
    why="Decode rows of a speculative engine's plain GDN steps on the C++ conv kernel "
        "wherever vLLM packed the conv weight for it, as a plain engine's decode does.",
    upstream="vLLM 0.32 takes the C++ conv for wide conv buffers on AMX and Arm only",
    vllm_versions=CPU_ONLY,
    build=_build,
    when=on_cpu,
)
