"""The DFlash drafter's per-layer context K-norm on CPU (patches/cpu_dflash_k_norm.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_ddtree.patches import cpu_dflash_k_norm as patch_mod

pytestmark = pytest.mark.skipif(not patch_mod.on_cpu(), reason="a patch of vLLM's CPU build")


def _reference(all_k, weights, eps):
    x = all_k.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weights[:, None, None, :]


def _case():
    gen = torch.Generator().manual_seed(1)
    layers, ctx, heads, dim = 3, 7, 2, 48
    all_k = torch.randn(layers, ctx, heads, dim, generator=gen).contiguous()
    weights = (0.5 + torch.rand(layers, dim, generator=gen)).contiguous()
    return all_k, SimpleNamespace(_k_norm_weights=weights, _rms_norm_eps=1e-6)


def test_stock_grouped_k_norm_is_wrong_on_this_cpu_build():
    """Why the patch exists, and the probe that gates it. If this fails, vLLM's
    CPU rms_norm honours grouped weights: the patch no longer applies (its probe
    says so) and can be dropped."""
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    all_k, model = _case()
    stock = patch_mod.PATCH._original or DFlashQwen3Model._normalize_context_k
    got = stock(model, all_k)
    want = _reference(all_k, model._k_norm_weights, model._rms_norm_eps)
    assert torch.allclose(got[0], want[0], atol=1e-5)  # layer 0 is right
    assert not torch.allclose(got[1:], want[1:], atol=1e-3)  # later layers are not
    assert not patch_mod.grouped_rms_norm_ok()


def test_patched_k_norm_normalises_each_layer_with_its_own_weights():
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    from vllm_ddtree import plugin

    plugin.register()
    assert patch_mod.PATCH.applied
    assert DFlashQwen3Model._normalize_context_k is not patch_mod.PATCH._original
    all_k, model = _case()
    got = DFlashQwen3Model._normalize_context_k(model, all_k)
    want = _reference(all_k, model._k_norm_weights, model._rms_norm_eps)
    assert got.shape == all_k.shape
    assert torch.allclose(got, want, atol=1e-5)
