"""The DFlash drafter's context K/V projection on oneDNN (patches/cpu_dflash_context_gemm.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_ddtree.patches import cpu_dflash_context_gemm as patch_mod

pytestmark = pytest.mark.skipif(not patch_mod.on_cpu(), reason="a patch of vLLM's CPU build")

LAYERS, HEADS, DIM, HIDDEN = 3, 2, 48, 192


def _drafter(bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    kv = HEADS * DIM
    return SimpleNamespace(
        _fused_kv_weight=torch.randn(2 * LAYERS * kv, HIDDEN, generator=gen) * 0.1,
        _fused_kv_bias=torch.randn(2 * LAYERS * kv, generator=gen) if bias else None,
        _hidden_norm_weight=0.5 + torch.rand(HIDDEN, generator=gen),
        _rms_norm_eps=1e-6)


def _reference(model, x):
    """K and V, [layers, n, heads, dim], in fp64 from the fused weight's row
    order [layer, K/V, head, dim]."""
    h = x.double()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + model._rms_norm_eps)
    h = h * model._hidden_norm_weight.double()
    bias = model._fused_kv_bias
    out = h @ model._fused_kv_weight.double().t()
    if bias is not None:
        out = out + bias.double()
    out = out.view(x.shape[0], LAYERS, 2, HEADS, DIM).permute(2, 1, 0, 3, 4)
    return out[0], out[1]


def _patched():
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    from vllm_ddtree import plugin

    plugin.register()
    assert patch_mod.PATCH.applied
    fn = DFlashQwen3Model._project_context_kv
    assert getattr(fn, "ddtree_context_gemm", False)
    return fn


def test_the_probe_finds_onednn_writing_into_a_given_output():
    """The patch's path is taken on this build (else it would be stock everywhere
    and the test below would compare the stock function with itself)."""
    assert patch_mod.onednn_into_ok()


@pytest.mark.parametrize("bias", [False, True])
def test_patched_projection_equals_the_stock_one(bias):
    fn = _patched()
    model = _drafter(bias)
    x = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(3))
    k, v = fn(model, x, 37, LAYERS, HEADS, DIM)
    stock_k, stock_v = patch_mod.PATCH._original(model, x, 37, LAYERS, HEADS, DIM)
    want_k, want_v = _reference(model, x)
    for got, stock, want in ((k, stock_k, want_k), (v, stock_v, want_v)):
        assert got.shape == (LAYERS, 37, HEADS, DIM) and got.is_contiguous()
        assert torch.allclose(got.double(), want, atol=1e-4, rtol=1e-4)
        assert torch.allclose(got, stock, atol=1e-4, rtol=1e-4)
    assert isinstance(model._ddtree_context_gemm, patch_mod.ContextGemm)


def test_bf16_drafter_projects_like_the_stock_function_on_any_cpu():
    """A bf16 drafter: oneDNN where this CPU has a bf16 matmul (AVX-512),
    else the stock projection; never an error at the first drafting step."""
    fn = _patched()
    model = _drafter(bias=True)
    for name in ("_fused_kv_weight", "_fused_kv_bias", "_hidden_norm_weight"):
        setattr(model, name, getattr(model, name).to(torch.bfloat16))
    x = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    k, v = fn(model, x, 37, LAYERS, HEADS, DIM)
    want_k, want_v = _reference(model, x)
    for got, want in ((k, want_k), (v, want_v)):
        assert got.dtype == torch.bfloat16 and got.shape == (LAYERS, 37, HEADS, DIM)
        assert torch.allclose(got.double(), want, atol=0.05, rtol=0.02)
    used = isinstance(getattr(model, "_ddtree_context_gemm", None), patch_mod.ContextGemm)
    assert used == patch_mod.onednn_into_ok(torch.bfloat16)


def test_packed_weights_follow_a_replaced_weight():
    """The packed copy is remade when the drafter's fused weight changes (a
    weight reload), never served stale."""
    fn = _patched()
    model = _drafter(bias=False)
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(4))
    fn(model, x, 5, LAYERS, HEADS, DIM)
    first = model._ddtree_context_gemm
    model._fused_kv_weight.mul_(2.0)  # in place: same storage, new version
    k, _ = fn(model, x, 5, LAYERS, HEADS, DIM)
    assert model._ddtree_context_gemm is not first
    assert torch.allclose(k.double(), _reference(model, x)[0], atol=1e-4, rtol=1e-4)


def test_without_a_fused_weight_the_stock_function_runs():
    calls = []

    def original(self, *args):
        calls.append(args)
        return "stock"

    fn = patch_mod.PATCH.build(original)
    model = _drafter(bias=False)
    model._fused_kv_weight = None
    assert fn(model, torch.zeros(2, HIDDEN), 2, LAYERS, HEADS, DIM) == "stock"
    assert len(calls) == 1
