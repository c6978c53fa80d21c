"""Per-layer K-norm of a DFlash drafter's context K/V on CPU.

Target: ``vllm.model_executor.models.qwen3_dflash:DFlashQwen3Model._normalize_context_k``.

Why: a DFlash drafter writes the K/V of its context (the target's hidden states)
into the cache of every drafter layer at once. ``_normalize_context_k`` applies
each layer's ``k_norm`` with one call of vLLM's ``rms_norm`` op, passing the
stacked weights ``[num_layers, head_dim]`` and relying on the op to pick the
weight row by the outermost index of ``all_k`` (``[num_layers, num_ctx,
kv_heads, head_dim]``). The CPU build's ``rms_norm`` does not: it applies row 0
to every layer. Every layer after the first then attends to context keys
normalised with the first layer's weights. Nothing fails and the output stays
lossless (the target verifies), but the drafter is not the model that was
trained, and acceptance drops. On the bundled 3-layer drafter the DFlash chain's
acceptance length on 32 HumanEval prompts was 2.60 with the stock op against
3.11 for the same weights in plain PyTorch (``docs/results.md``). One-layer
drafters are unaffected.

Fix: normalise layer by layer with the same op and a one-dimensional weight,
which is the op's ordinary use. The patch is applied on CPU only, and only when
a probe at start-up shows the grouped call is wrong (``grouped_rms_norm_ok``),
so a vLLM that fixes its op is left alone. It applies to every DFlash drafter
on CPU, the DFlash chain included.

Upstream status: present in vLLM 0.32.0's CPU build (``csrc/cpu`` rms_norm
takes a one-dimensional weight). Drop this patch when the CPU op honours
grouped weights.
"""

from __future__ import annotations

import functools

import torch

from vllm_ddtree.patches.base import CPU_ONLY, Patch, on_cpu

_TARGET = "vllm.model_executor.models.qwen3_dflash:DFlashQwen3Model._normalize_context_k"


@functools.lru_cache(maxsize=1)
def grouped_rms_norm_ok() -> bool:
    """Whether vLLM's ``rms_norm`` op picks one weight row per outermost index
    (what ``_normalize_context_k`` assumes), probed on a small CPU tensor."""
    from vllm import _custom_ops as ops

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 1, 8, generator=gen)
    w = torch.stack([torch.ones(8), torch.full((8,), 2.0)])
    out = torch.empty_like(x)
    ops.rms_norm(out, x, w, 1e-6)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w[:, None, None, :]
    return torch.allclose(out, want, rtol=1e-4, atol=1e-5)


def _needed() -> bool:
    return on_cpu() and not grouped_rms_norm_ok()


def _build(original):
    from vllm import _custom_ops as ops

    @functools.wraps(original)
    def _normalize_context_k(self, all_k: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(all_k)
        for layer in range(all_k.shape[0]):
            ops.rms_norm(out[layer], all_k[layer], self._k_norm_weights[layer],
                         self._rms_norm_eps)
        return out

    return _normalize_context_k


PATCH = Patch(
    name="cpu_dflash_k_norm",
    target=_TARGET,
    why="vLLM CPU's rms_norm applies weight row 0 to every layer of the DFlash drafter's "
        "grouped context K-norm; normalise per layer",
    upstream="not fixed in vLLM 0.32.0 (CPU op takes a 1-D weight)",
    vllm_versions=CPU_ONLY,
    build=_build,
    when=_needed,
)
