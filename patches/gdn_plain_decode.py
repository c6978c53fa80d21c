"""Plain GDN rows of a speculative engine on vLLM CPU's C++ conv kernels (CPU).

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

Prefill rows the same: the stock function convolves them with a torch loop
where a plain engine takes vLLM's C++ conv (``_causal_conv1d_fwd_cpu``), 2-4x
the GDN layer's time for a batch of prompts on the tiny hybrid (3.0 ms
against 1.5 ms per layer for four 140-token prompts), which a DDTree
engine's plain mode paid on every prompt it admitted.

The replacement, on a layer whose conv weight vLLM packed, where the stock
function would take the torch conv: decode rows through the C++ update and
the same fused recurrence as the stock decode, prefill rows through the C++
conv over the buffer's first ``W - 1`` columns and the same gating and
chunked recurrence as the stock prefill. Every other call runs the stock
function. Both get the plain rows' state indices as a dense tensor (vLLM's
one-row column view crashes its kernel).

``SUBSET`` (``cpu-gdn-prefill-subset``) does the same for the prefill rows of
a step that also verifies drafts (target ``_spec_aware_nonspec_subset``,
looked up the same way): a verification step that admits new prompts,
DDTree's or the DFlash chain's.

Upstream status: vLLM 0.32 widened the plain path's conv predicate to
AVX-512 BF16 but not these. Drop the patches when it does.
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
        if not _cpp_conv(layer, stock):
            return original(layer, attn_metadata_i, mixed_qkv, b, a, core_attn_out, conv_buf,
                            ssm_state, width)
        n, t = md.num_decodes, md.num_decode_tokens
        if n:
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
        if md.num_prefills:
            first, count = md.num_decodes, md.num_prefills
            end = t + md.num_prefill_tokens
            core_attn_out[t:end] = _prefill_rows(
                stock, ops, layer, mixed_qkv[t:end], b[t:end], a[t:end], conv_buf, ssm_state,
                width, md.non_spec_state_indices_tensor[first: first + count],
                md.non_spec_query_start_loc[first: first + count + 1] - t,
                md.has_initial_state[first: first + count])

    _spec_aware_nonspec.ddtree_plain_decode = True
    return _spec_aware_nonspec


def _prefill_rows(stock, ops, layer, x, b, a, conv_buf, ssm_state, width, rows, starts,
                  continues):
    """Prefill rows (``x``, ``b``, ``a`` theirs alone; ``starts`` their query
    start offsets from 0): the conv on vLLM's C++ kernel over the wide
    buffer's first ``W - 1`` columns (the window a plain engine's buffer
    holds), then vLLM's gating and chunked recurrence, each prefill starting
    from a zero state unless it continues one (chunked prefill). Returns the
    rows' outputs."""
    conv = stock._causal_conv1d_fwd_cpu(
        x=x.transpose(0, 1), weight=layer.conv1d.weight, bias=layer.conv1d.bias,
        conv_states=conv_buf[:, :, : width - 1], query_start_loc=starts, cache_indices=rows,
        has_initial_state=continues, silu_activation=layer.activation == "silu",
        is_weight_packed=True).transpose(0, 1)
    query, key, value = layer.rearrange_mixed_qkv(conv)
    g, beta = ops.fused_gdn_gating_cpu(A_log=layer.A_log, a=a, b=b, dt_bias=layer.dt_bias)
    fresh = rows[~continues]
    if fresh.numel():
        ssm_state[fresh] = 0
    out, _ = ops.chunk_gated_delta_rule_cpu(
        query=query, key=key, value=value, g=g, beta=beta, initial_state=ssm_state,
        output_final_state=True, cu_seqlens=starts, head_first=False,
        use_qk_l2norm_in_kernel=True, initial_state_indices=rows)
    return out.squeeze(0)


def _cpp_conv(layer, stock) -> bool:
    """Whether the patches take this layer: vLLM packed its conv weight, and
    the stock functions would not take the C++ kernels themselves."""
    return (packed_conv_weight(layer) and not torch.cpu._is_amx_tile_supported()
            and not stock.is_arm_bf16())


def _build_subset(original):
    from importlib import import_module

    import vllm._custom_ops as ops

    stock = import_module(_MODULE)

    @functools.wraps(original)
    def _spec_aware_nonspec_subset(layer, attn_metadata_i, mixed_qkv, b, a, conv_buf,
                                   ssm_state, width):
        if not _cpp_conv(layer, stock):
            return original(layer, attn_metadata_i, mixed_qkv, b, a, conv_buf, ssm_state, width)
        md = attn_metadata_i
        return _prefill_rows(stock, ops, layer, mixed_qkv, b, a, conv_buf, ssm_state, width,
                             md.prefill_state_indices.contiguous(), md.prefill_query_start_loc,
                             md.has_initial_state)

    _spec_aware_nonspec_subset.ddtree_prefill_subset = True
    return _spec_aware_nonspec_subset


PATCH = Patch(
    name="cpu-gdn-plain-decode",
    target=f"{_MODULE}:_spec_aware_nonspec",
    why="Decode and prefill rows of a speculative engine's plain GDN steps on the C++ conv "
        "kernels wherever vLLM packed the conv weight for them, as a plain engine's do.",
    upstream="vLLM 0.32 takes the C++ conv for wide conv buffers on AMX and Arm only",
    vllm_versions=CPU_ONLY,
    build=_build,
    when=on_cpu,
)


SUBSET = Patch(
    name="cpu-gdn-prefill-subset",
    target=f"{_MODULE}:_spec_aware_nonspec_subset",
    why="Prefill rows beside speculative ones (a verification step that admits prompts) on "
        "the C++ conv kernel wherever vLLM packed the conv weight for it, as a plain "
        "engine's prefill does.",
    upstream="vLLM 0.32 takes the C++ conv for wide conv buffers on AMX and Arm only",
    vllm_versions=CPU_ONLY,
    build=_build_subset,
    when=on_cpu,
)
