"""Wiring of the CUDA ``DDTREE`` backend, checked without a GPU.

The impl's tree path runs the real Triton kernel (in the interpreter on CPU
tensors, in the CUDA layout); the stock Triton forward and cache write, which
cannot run here, are replaced by fakes.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("vllm")

from test_tree_attention_utils import (  # noqa: E402
    Req,
    build_batch,
    make_parents,
    quantize_batch,
)
from vllm.v1.attention.backend import AttentionCGSupport  # noqa: E402
from vllm.v1.attention.backends import triton_attn  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402

from vllm_ddtree import attention as dda  # noqa: E402
from vllm_ddtree.core.compaction import kv_capture  # noqa: E402
from vllm_ddtree.kernels import tree_attention as ta  # noqa: E402
from vllm_ddtree.kernels.cache_layout import split_kv_cache_nhd  # noqa: E402
from vllm_ddtree.kernels.reference import tree_attention_reference  # noqa: E402
from vllm_ddtree.core.tree_info import TreeAttentionInfo  # noqa: E402

if not torch.cuda.is_available() and not ta.INTERPRETED:
    pytest.skip("kernel imported without TRITON_INTERPRET=1", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _tree(n, seed):
    return make_parents(n, torch.Generator().manual_seed(seed))


def test_backend_class_wiring():
    backend = dda.DDTreeTritonAttentionBackend
    assert issubclass(backend, triton_attn.TritonAttentionBackend)
    assert backend.get_name() == "DDTREE"
    assert backend.get_impl_cls() is dda.DDTreeTritonAttentionImpl
    builder = backend.get_builder_cls()
    assert issubclass(builder, triton_attn.TritonAttentionMetadataBuilder)
    # full CUDA graphs of uniform verification batches (the tree info lives
    # in persistent buffers a captured graph reads on replay)
    assert builder.get_cudagraph_support(None, None) == AttentionCGSupport.UNIFORM_BATCH
    assert issubclass(dda.DDTreeTritonAttentionImpl, triton_attn.TritonAttentionImpl)
    assert "fp8_e5m2" not in backend.supported_kv_cache_dtypes
    assert backend.supports_head_size(128)


def test_register_backends_on_cuda(monkeypatch):
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    assert dda.register_backends() == ["DDTREE"]
    assert dda.register_backends() == ["DDTREE"]  # idempotent
    member = AttentionBackendEnum["DDTREE"]
    assert member.get_path() == dda.CUDA_BACKEND_PATH
    assert member.get_class() is dda.DDTreeTritonAttentionBackend
    assert AttentionBackendEnum[member.get_class().get_name()] is member


def _impl(hq, hkv, hd, window=None, sinks=None, kv_cache_dtype="auto"):
    return dda.DDTreeTritonAttentionImpl(hq, hd, hd**-0.5, hkv, None, window, kv_cache_dtype,
                                         sinks=sinks)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3"])
def test_fp8_e4m3_kv_cache_is_served_with_unquantized_queries(kv_cache_dtype, monkeypatch):
    monkeypatch.setattr(triton_attn.current_platform, "is_cuda", lambda: True)
    monkeypatch.setattr(triton_attn.current_platform, "has_device_capability", lambda c: True)
    impl = _impl(4, 2, 32, kv_cache_dtype=kv_cache_dtype)
    assert impl.tree_unsupported_reason() is None
    assert impl.tree_kv_quant == "e4m3"
    # vLLM's attention layer quantizes queries to fp8 only for impls that
    # ask for it; the tree kernel reads them in the model dtype
    assert impl.supports_quant_query_input is False
    assert kv_cache_dtype in dda.DDTreeTritonAttentionBackend.supported_kv_cache_dtypes
    assert _impl(4, 2, 32).supports_quant_query_input is True  # stock behaviour otherwise


def test_fp8_e5m2_kv_cache_is_refused_on_cuda():
    # vLLM's Triton backend reads every fp8 cache as e4m3
    reason = _impl(4, 2, 32, kv_cache_dtype="fp8_e5m2").tree_unsupported_reason()
    assert reason.startswith("kv_cache_dtype fp8_e5m2 on CUDA") and "fp8_e4m3" in reason
    assert "fp8_e5m2" not in dda.DDTreeTritonAttentionBackend.supported_kv_cache_dtypes


def _metadata(batch, tree: bool):
    md = SimpleNamespace(
        num_actual_tokens=int(batch.query_start_loc[-1]),
        max_query_len=batch.max_query_len,
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        block_table=batch.block_table,
        causal=True,
        mm_prefix_range_tensor=None,
    )
    md.ddtree = (TreeAttentionInfo.create(batch.tree_mask, batch.is_tree, depth=batch.depth)
                 if tree else None)
    return md


def test_forward_dispatch(monkeypatch):
    calls = []

    def fake_stock_forward(self, layer, query, key, value, kv_cache, md, output, *a):
        calls.append(md)
        return output.fill_(1.0)

    monkeypatch.setattr(triton_attn.TritonAttentionImpl, "forward", fake_stock_forward)
    reqs = [Req(20, 6, _tree(6, 0)), Req(17, 1), Req(0, 9, _tree(9, 1)), Req(3, 4)]
    batch = build_batch(reqs, 8, 2, 32, 16, torch.float32, "nhd", DEVICE, pad_tokens=2)
    impl = _impl(8, 2, 32)
    layer = SimpleNamespace(layer_name="layers.0.attn")
    key = value = torch.empty(0)

    out = torch.zeros_like(batch.query)
    md = _metadata(batch, tree=False)
    impl.forward(layer, batch.query, key, value, batch.kv_cache, md, out)
    assert calls == [md] and torch.all(out == 1.0)

    calls.clear()
    out = torch.full_like(batch.query, 5.0)
    impl.forward(layer, batch.query, key, value, batch.kv_cache, _metadata(batch, True), out)
    assert calls == []
    ref = tree_attention_reference(*batch.args())
    n = int(batch.query_start_loc[-1])
    torch.testing.assert_close(out[:n], ref[:n], atol=2e-5, rtol=2e-5)
    assert torch.all(out[n:] == 5.0)

    impl.logits_soft_cap = 30.0
    with pytest.raises(NotImplementedError, match="soft-capping"):
        impl.forward(layer, batch.query, key, value, batch.kv_cache,
                     _metadata(batch, True), out)  # fmt: skip


def test_forward_with_sliding_window_and_sinks(monkeypatch):
    # vLLM keeps a decoder layer's window as (window - 1, 0); the tree path
    # serves it, and the sinks, on the whole batch (causal rows included).
    monkeypatch.setattr(triton_attn.TritonAttentionImpl, "forward",
                        lambda *a, **k: pytest.fail("stock forward called"))
    reqs = [Req(37, 9, _tree(9, 2)), Req(20, 1), Req(29, 6), Req(50, 12, _tree(12, 3))]
    batch = build_batch(reqs, 8, 2, 32, 16, torch.float32, "nhd", DEVICE, pad_tokens=2)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(0)).to(DEVICE) * 2
    impl = _impl(8, 2, 32, window=4, sinks=sinks)
    assert impl.sliding_window == (3, 0)
    assert impl.tree_sliding_window() == 4
    assert impl.tree_unsupported_reason() is None
    layer = SimpleNamespace(layer_name="layers.0.attn")
    out = torch.full_like(batch.query, 5.0)
    md = _metadata(batch, True)
    impl.forward(layer, batch.query, torch.empty(0), torch.empty(0), batch.kv_cache, md, out)
    ref = tree_attention_reference(*batch.args(), sliding_window=4, sinks=sinks,
                                   depth=batch.depth)
    n = int(batch.query_start_loc[-1])
    torch.testing.assert_close(out[:n], ref[:n], atol=2e-5, rtol=2e-5)
    assert torch.all(out[n:] == 5.0)
    assert not torch.allclose(ref[:n], tree_attention_reference(*batch.args())[:n], atol=1e-2)
    assert _impl(8, 2, 32).tree_sliding_window() is None  # an unwindowed layer


def test_forward_on_an_fp8_cache(monkeypatch):
    # e4m3 codes with per-tensor scales in the CUDA layout: the tree path
    # decodes and scales them (the layer's host floats, as the CPU op reads)
    monkeypatch.setattr(triton_attn.TritonAttentionImpl, "forward",
                        lambda *a, **k: pytest.fail("stock forward called"))
    k_scale, v_scale = 0.37, 1.9
    reqs = [Req(37, 9, _tree(9, 4)), Req(20, 1), Req(50, 12, _tree(12, 5))]
    batch = build_batch(reqs, 8, 2, 32, 16, torch.float32, "nhd", DEVICE, pad_tokens=2)
    batch = quantize_batch(batch, "nhd", "e4m3", k_scale, v_scale)
    impl = _impl(8, 2, 32, kv_cache_dtype="fp8")
    layer = SimpleNamespace(layer_name="layers.0.attn", _k_scale_float=k_scale,
                            _v_scale_float=v_scale)
    out = torch.full_like(batch.query, 5.0)
    impl.forward(layer, batch.query, torch.empty(0), torch.empty(0), batch.kv_cache,
                 _metadata(batch, True), out)
    quant = dict(kv_quant="e4m3", k_scale=k_scale, v_scale=v_scale)
    ref = tree_attention_reference(*batch.args(), **quant)
    n = int(batch.query_start_loc[-1])
    torch.testing.assert_close(out[:n], ref[:n], atol=2e-5, rtol=2e-5)
    assert torch.all(out[n:] == 5.0)
    # the scales are read: unscaled codes are another function
    unscaled = tree_attention_reference(*batch.args(), kv_quant="e4m3")
    assert not torch.allclose(unscaled[:n], ref[:n], atol=1e-2)


def test_kv_capture_goes_through_the_stock_cache_write(monkeypatch):
    writes = []

    def fake_write(self, layer, key, value, kv_cache, slot_mapping):
        k_view, v_view = split_kv_cache_nhd(kv_cache, self.head_size)
        bs = k_view.shape[1]
        k_view[slot_mapping // bs, slot_mapping % bs] = key
        v_view[slot_mapping // bs, slot_mapping % bs] = value
        writes.append(slot_mapping)

    monkeypatch.setattr(triton_attn.TritonAttentionImpl, "do_kv_cache_update", fake_write)
    impl = _impl(4, 2, 32)
    layer = SimpleNamespace(layer_name="layers.0.attn")
    kv_cache = torch.zeros(4, 16, 2, 64).permute(0, 2, 1, 3)  # NHD physical
    key, value = torch.randn(6, 2, 32), torch.randn(6, 2, 32)
    slots = torch.arange(16, 22)

    kv_capture.start(["layers.0.attn"])
    try:
        impl.do_kv_cache_update(layer, key, value, kv_cache, slots)
        # the drafter's layers share the impl class; their writes are not kept
        impl.do_kv_cache_update(SimpleNamespace(layer_name="draft.attn"), key, value,
                                kv_cache, slots)
    finally:
        kv_capture.stop()
    assert len(writes) == 2 and len(kv_capture.records()) == 1
    # node rows 3 and 5 (slots 19, 21) move to slots 17 and 18, read back
    # from the cache through the impl's views and written by its cache write
    assert kv_capture.compact(torch.tensor([19, 21]), torch.tensor([17, 18])) == 1
    assert torch.equal(writes[-1], torch.tensor([17, 18]))
    k_view, v_view = split_kv_cache_nhd(kv_cache)
    assert torch.equal(k_view[1, 1:3], key[[3, 5]])
    assert torch.equal(v_view[1, 1:3], value[[3, 5]])
    kv_capture.clear()
