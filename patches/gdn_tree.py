"""Verify trees, not chains, on the Gated DeltaNet layers of hybrid targets (CPU).

Target: ``vllm.model_executor.layers.mamba.ops.cpu.gdn_attention:_spec_forward``,
the speculative half of vLLM CPU's GDN attention core
(``cpu_gdn_attention_core`` -> ``_cpu_gdn_attention_spec_aware`` ->
``_spec_forward``, looked up as a module global at each call).

Why: the stock function verifies each request's speculative tokens as one
chain: token ``t``'s conv window and recurrent state follow token ``t - 1``.
In a DDTree step the tokens are tree nodes, each of which must follow its own
parent. While the runner has a :class:`vllm_ddtree.gdn.GDNTreeStep` active
(the target forward of a DDTree verification step), the replacement runs
:func:`vllm_ddtree.gdn.cpu_tree_spec_forward` instead; at every other time
(drafter, dummy and profile runs) it calls the stock function unchanged.
Steps without drafts do not reach it: the runner sends their rows down vLLM's
non-speculative GDN path. The step records every GDN layer that took the tree
path, and the runner refuses to go on when one did not (``DDTreeSeamError``).

The replacement also reads ``_unpacked_conv_weight`` from the same module
(the plain ``[dim, W]`` conv weight, which AMX builds pack in place).

Upstream status: vLLM 0.32 has no tree (parent-aware) GDN op on any platform.
Drop this patch when vLLM's speculative GDN path takes per-token parents.
"""

from __future__ import annotations

import functools

from vllm_ddtree.patches.base import CPU_ONLY, Patch, on_cpu

_MODULE = "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention"


def _build(original):
    from importlib import import_module

    from vllm_ddtree import gdn

    stock = import_module(_MODULE)

    @functools.wraps(original)
    def _spec_forward(layer, attn_metadata_i, mixed_qkv_spec, b_spec, a_spec, conv_buf,
                      ssm_state, width, state_len):
        step = gdn.active_step()
        if step is None:
            return original(layer, attn_metadata_i, mixed_qkv_spec, b_spec, a_spec, conv_buf,
                            ssm_state, width, state_len)
        return gdn.cpu_tree_spec_forward(step, layer, attn_metadata_i, mixed_qkv_spec, b_spec,
                                         a_spec, conv_buf, ssm_state, width,
                                         stock._unpacked_conv_weight(layer))

    _spec_forward.ddtree_tree_gdn = True
    return _spec_forward


PATCH = Patch(
    name="cpu-gdn-tree",
    target=f"{_MODULE}:_spec_forward",
    why="Verify each speculative GDN token along its own tree path (parent-aware conv "
        "window and recurrence) during DDTree verification steps.",
    upstream="no tree GDN op in vLLM 0.32",
    vllm_versions=CPU_ONLY,
    build=_build,
    when=on_cpu,
)


def applied() -> bool:
    """Whether vLLM's CPU GDN path now runs through this patch."""
    from importlib import import_module

    fn = import_module(_MODULE)._spec_forward
    return bool(getattr(fn, "ddtree_tree_gdn", False))
