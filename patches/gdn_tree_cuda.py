"""Verify trees, not chains, on the Gated DeltaNet layers of hybrid targets (CUDA).

Targets, all in ``vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn``:

* ``QwenGatedDeltaNetAttention._forward_core`` (``FORWARD_CORE``): the layer's
  conv + recurrence core, which the CUDA forward reaches through the
  ``vllm::qwen_gdn_attention_core`` op. While the runner has a
  :class:`vllm_ddtree.gdn.GDNTreeStep` active and the layer's metadata has
  speculative sequences, the replacement marks the layer as running a tree
  (:func:`vllm_ddtree.gdn.cuda_layer`) around the stock method;
* ``causal_conv1d_update`` (``CONV``) and
  ``fused_sigmoid_gating_delta_rule_update`` (``RECURRENT``), the module
  globals the stock method calls: inside a marked layer, the speculative call
  (the one that passes ``num_accepted_tokens``) runs the parent-aware Triton
  kernel of ``kernels/gdn_tree.py`` with the same arguments instead. The
  non-speculative calls in the same layer (plain decodes and prefills mixed
  into the step) stay stock.

So vLLM's own metadata, state layout, prefill and plain-decode paths are
untouched; only the two speculative kernel launches follow each node's parent
instead of the flat order. The step records every layer that took the tree
path in both halves, and the runner refuses to go on when one did not
(``DDTreeSeamError``), as on CPU. vLLM's fused CUDA spec-decode kernel
(``VLLM_GDN_DECODE_KERNEL=cuda``, ``fused_gdn_decode_post_conv_mtp``) verifies
chains and bypasses these calls; the runner turns it off on every GDN layer of
a DDTree target at start-up (``runner.check_tree_capable_gdn_layers``).

Upstream status: vLLM has no parent-aware GDN kernels (0.32, 0.33). Drop this
patch when its speculative GDN path takes per-token parents.
"""

from __future__ import annotations

import functools
import inspect

from vllm_ddtree.patches.base import ALL_PLATFORMS, Patch, on_cuda

_MODULE = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"
_LAYER = f"{_MODULE}:QwenGatedDeltaNetAttention"

# fused_sigmoid_gating_delta_rule_update's softplus parameters that the tree
# kernel implements (vLLM's defaults; the speculative call keeps them).
_SOFTPLUS = {"beta": 1.0, "threshold": 20.0}


def _build_forward_core(original):
    from importlib import import_module

    from vllm_ddtree import gdn

    stock = import_module(_MODULE)

    @functools.wraps(original)
    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        if gdn.active_step() is None:
            return original(self, mixed_qkv, b, a, core_attn_out)
        metadata = stock.get_forward_context().attn_metadata
        md = metadata.get(self.prefix) if isinstance(metadata, dict) else None
        with gdn.cuda_layer(self, md):
            return original(self, mixed_qkv, b, a, core_attn_out)

    _forward_core.ddtree_tree_gdn = True
    return _forward_core


def _build_conv(original):
    from vllm_ddtree import gdn

    sig = inspect.signature(original)

    @functools.wraps(original)
    def causal_conv1d_update(*args, **kwargs):
        if not gdn.tree_layer_running():
            return original(*args, **kwargs)
        p = sig.bind(*args, **kwargs)
        p.apply_defaults()
        p = p.arguments
        if p["num_accepted_tokens"] is None:  # a plain decode in the same layer
            return original(*args, **kwargs)
        if p.get("out") is not None or p.get("block_idx_last_scheduled_token") is not None:
            raise NotImplementedError(
                "DDTree: the speculative GDN conv call asked for an output buffer or "
                "prefix-cache block indices, which the tree kernel does not take")
        return gdn.cuda_tree_conv(p["x"], p["conv_state"], p["weight"], p["bias"],
                                  p["activation"], p["conv_state_indices"],
                                  p["num_accepted_tokens"], p["query_start_loc"],
                                  p["null_block_id"])

    causal_conv1d_update.ddtree_tree_gdn = True
    return causal_conv1d_update


def _build_recurrent(original):
    from vllm_ddtree import gdn

    sig = inspect.signature(original)

    @functools.wraps(original)
    def fused_sigmoid_gating_delta_rule_update(*args, **kwargs):
        if not gdn.tree_layer_running():
            return original(*args, **kwargs)
        p = sig.bind(*args, **kwargs)
        p.apply_defaults()
        p = p.arguments
        if p["num_accepted_tokens"] is None:  # a plain decode in the same layer
            return original(*args, **kwargs)
        odd = [k for k, v in _SOFTPLUS.items() if p[k] != v]
        if odd or not p["inplace_final_state"] or p.get("is_kda"):
            raise NotImplementedError(
                f"DDTree: the speculative GDN recurrence was called with "
                f"{', '.join(odd) or 'a separate final state or KDA gating'}, which the tree "
                f"kernel does not implement")
        o = gdn.cuda_tree_recurrent(p["q"], p["k"], p["v"], p["a"], p["b"], p["A_log"],
                                    p["dt_bias"], p["initial_state"], p["ssm_state_indices"],
                                    p["num_accepted_tokens"], p["cu_seqlens"], p["scale"],
                                    p["use_qk_l2norm_in_kernel"])
        return o, p["initial_state"]

    fused_sigmoid_gating_delta_rule_update.ddtree_tree_gdn = True
    return fused_sigmoid_gating_delta_rule_update


_UPSTREAM = "no parent-aware GDN kernels in vLLM 0.32 or 0.33"

FORWARD_CORE = Patch(
    name="cuda-gdn-tree-layer",
    target=f"{_LAYER}._forward_core",
    why="Mark the GDN layer running in a DDTree verification step, so that its two "
        "speculative kernel calls take the parent-aware tree kernels.",
    upstream=_UPSTREAM,
    vllm_versions=ALL_PLATFORMS,
    build=_build_forward_core,
    when=on_cuda,
)

CONV = Patch(
    name="cuda-gdn-tree-conv",
    target=f"{_MODULE}:causal_conv1d_update",
    why="In a marked GDN layer, the speculative conv update follows each node's parent "
        "(kernels/gdn_tree.py: tree_conv_update).",
    upstream=_UPSTREAM,
    vllm_versions=ALL_PLATFORMS,
    build=_build_conv,
    when=on_cuda,
)

RECURRENT = Patch(
    name="cuda-gdn-tree-recurrent",
    target=f"{_MODULE}:fused_sigmoid_gating_delta_rule_update",
    why="In a marked GDN layer, the speculative recurrence starts every node from its "
        "parent's state (kernels/gdn_tree.py: tree_recurrent_update).",
    upstream=_UPSTREAM,
    vllm_versions=ALL_PLATFORMS,
    build=_build_recurrent,
    when=on_cuda,
)

PATCHES = (FORWARD_CORE, CONV, RECURRENT)


def applied() -> bool:
    """Whether vLLM's CUDA GDN layer now runs through all three replacements."""
    from importlib import import_module

    mod = import_module(_MODULE)
    return all(getattr(fn, "ddtree_tree_gdn", False) for fn in (
        mod.QwenGatedDeltaNetAttention._forward_core, mod.causal_conv1d_update,
        mod.fused_sigmoid_gating_delta_rule_update))
