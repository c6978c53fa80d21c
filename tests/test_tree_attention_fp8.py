"""fp8 KV caches (``--kv-cache-dtype fp8`` / ``fp8_e4m3`` / ``fp8_e5m2``) in every
tree path: the decode against vLLM's CPU attention op and the IEEE formats,
each kernel against the reference, the reference against dequantize-then-dense
attention, compaction of a quantized cache as bytes, and what stays refused.

Caches "written the way vLLM writes them" come from vLLM's own CPU cache op
(``ops.cpu_attn_reshape_and_cache``, through the impl's ``do_kv_cache_update``);
those tests, and the ones that run vLLM's attention op, need an x86 CPU with
AVX-512 or AMX, like vLLM's fp8 KV cache itself, and are skipped elsewhere
with vLLM's own reason. The other tests use hand-made codes and run anywhere.
The scales are never 1 (0.37 and 1.9), so a path that ignored one fails.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from test_cpu_tree_backend import MIXED, Step, _sinks, _tree, _with_native  # noqa: E402
from test_tree_attention_utils import (  # noqa: E402
    FP8_TORCH_DTYPES,
    Req,
    build_batch,
    path_attention,
    quantize_batch,
)
from tests.conftest import cpu_fp8_kv_unavailable  # noqa: E402
from vllm import _custom_ops as ops  # noqa: E402
from vllm.v1.attention.backends import cpu_attn  # noqa: E402

from vllm_ddtree import attention as dda  # noqa: E402
from vllm_ddtree.core.compaction import KVCapture  # noqa: E402
from vllm_ddtree.kernels import cpu_native, fp8  # noqa: E402
from vllm_ddtree.kernels import tree_attention as ta  # noqa: E402
from vllm_ddtree.kernels.cache_layout import split_kv_cache_cpu_vec  # noqa: E402
from vllm_ddtree.kernels.reference import tree_attention_reference  # noqa: E402
from vllm_ddtree.kernels.tree_attention_cpu import (  # noqa: E402
    plan_tree_batch,
    tree_attention_batched,
)

K_SCALE, V_SCALE = 0.37, 1.9
KINDS = {"fp8": "e4m3", "fp8_e5m2": "e5m2"}  # the --kv-cache-dtype values tested


_NO_VLLM_FP8 = cpu_fp8_kv_unavailable()
needs_vllm_fp8 = pytest.mark.skipif(
    _NO_VLLM_FP8 is not None,
    reason=f"vLLM's CPU attention has no fp8 KV cache on this CPU: {_NO_VLLM_FP8}")


@pytest.fixture(autouse=True)
def _fake_vllm_config(monkeypatch):
    # The impl constructor only reads model_config.dtype from the config.
    cfg = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32))
    monkeypatch.setattr(cpu_attn, "get_current_vllm_config", lambda: cfg)
    monkeypatch.delenv(dda.ENV_CPU_ATTN, raising=False)


@pytest.fixture(scope="module")
def native():
    lib = cpu_native.load()
    if lib is None:
        pytest.fail("the native CPU kernels did not build on this machine")
    return lib


# ---------------------------------------------------------------------------
# The decode
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["e4m3", "e5m2"])
def test_decode_is_the_ieee_format_but_e4m3_has_no_nan(kind):
    codes = torch.arange(256, dtype=torch.uint8)
    got = fp8.dequantize(codes, kind)
    want = codes.view(FP8_TORCH_DTYPES[kind]).float()
    if kind == "e4m3":
        # float8_e4m3fn reads 0x7F/0xFF as NaN; vLLM's CPU op reads +-480
        assert got[0x7F].item() == 480.0 and got[0xFF].item() == -480.0
        want[0x7F], want[0xFF] = 480.0, -480.0
        assert torch.isfinite(got).all()
    else:
        assert got[0x7C].item() == math.inf and math.isnan(got[0x7D].item())
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_kv_cache_dtype_kinds_and_argument_errors():
    assert fp8.kv_quant_of("auto") is None and fp8.kv_quant_of("bfloat16") is None
    assert [fp8.kv_quant_of(d) for d in ("fp8", "fp8_e4m3", "fp8_e5m2")] == \
        ["e4m3", "e4m3", "e5m2"]
    with pytest.raises(ValueError, match="int8_per_token_head"):
        fp8.kv_quant_of("int8_per_token_head")
    u8, f32 = torch.uint8, torch.float32
    with pytest.raises(ValueError, match="kv_quant='e4m3' or 'e5m2'"):
        fp8.check_kv_quant(None, 1.0, 1.0, u8)
    with pytest.raises(ValueError, match="apply to a quantized KV cache only"):
        fp8.check_kv_quant(None, 0.5, 1.0, f32)
    with pytest.raises(ValueError, match="must hold the fp8 codes as uint8"):
        fp8.check_kv_quant("e4m3", 1.0, 1.0, f32)
    with pytest.raises(ValueError, match="kv_quant must be one of"):
        fp8.check_kv_quant("e4m3fnuz", 1.0, 1.0, u8)
    with pytest.raises(ValueError, match="v_scale: expected a positive finite float"):
        fp8.check_kv_quant("e5m2", 1.0, 0.0, u8)
    fp8.check_kv_quant("e5m2", K_SCALE, V_SCALE, u8)


def _one_key_probe(kind: str):
    """Every code as the single key's V of a one-token request: the output of
    each request is ``decode(V) * v_scale`` exactly (its softmax weight is 1)."""
    hd, bs = 32, 32
    reqs = 256 // hd
    cache = torch.zeros(reqs, 1, bs, 2 * hd, dtype=torch.uint8)
    k_view, v_view = split_kv_cache_cpu_vec(cache)
    codes = torch.arange(256, dtype=torch.uint8).view(reqs, hd)
    v_view[:, 0, 0] = codes
    k_view[:, 0, 0] = torch.randint(0, 0x70, (reqs, hd), dtype=torch.uint8,
                                    generator=torch.Generator().manual_seed(0))
    return SimpleNamespace(
        cache=cache, k_view=k_view, v_view=v_view, codes=codes.flatten(),
        query=torch.randn(reqs, 1, hd, generator=torch.Generator().manual_seed(1)),
        qsl=torch.arange(reqs + 1, dtype=torch.int32),
        seq_lens=torch.ones(reqs, dtype=torch.int32),
        block_table=torch.arange(reqs, dtype=torch.int32)[:, None],
        mask=torch.ones(reqs, 1, dtype=torch.int32), is_tree=torch.ones(reqs, dtype=torch.bool),
        scale=hd**-0.5, kind=kind)


def _probe_paths(p, native_lib):
    """The probe through every tree path: ``{name: [reqs, 1, hd]}``."""
    quant = dict(kv_quant=p.kind, k_scale=K_SCALE, v_scale=V_SCALE)
    reqs = p.qsl.shape[0] - 1
    out = {"reference": tree_attention_reference(
        p.query, p.k_view, p.v_view, p.block_table, p.qsl, p.seq_lens, p.scale, p.mask,
        p.is_tree, **quant)}
    plan = plan_tree_batch(p.qsl, p.seq_lens, p.block_table, 32, p.mask, range(reqs))
    out["batched"] = tree_attention_batched(p.query, p.cache, plan, p.scale,
                                            torch.zeros_like(p.query), **quant)
    out["native"] = cpu_native.tree_attention_native(
        native_lib, p.query, p.cache, p.block_table, p.qsl, p.seq_lens,
        torch.arange(reqs), p.mask, p.scale, torch.zeros_like(p.query), **quant)
    out["triton"] = ta.tree_attention(p.query, p.k_view, p.v_view, p.block_table, p.qsl,
                                      p.seq_lens, p.scale, p.mask, p.is_tree, **quant)
    return out


@pytest.mark.parametrize("kind", ["e4m3", "e5m2"])
def test_every_code_reads_as_its_decode_in_every_path(kind, native):
    p = _one_key_probe(kind)
    want = (fp8.dequantize(p.codes, kind) * V_SCALE).view(-1, 1, 32)
    for name, got in _probe_paths(p, native).items():
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True,
                                   msg=lambda m, name=name: f"{name}: {m}")


@needs_vllm_fp8
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_every_code_reads_as_vllms_cpu_op_reads_it(kv_cache_dtype, native):
    # The stock op on the same one-key requests: its output is its decode of
    # each code times v_scale, and every tree path reads the same values.
    p = _one_key_probe(fp8.kv_quant_of(kv_cache_dtype))
    kv = p.cache.view(p.cache.shape[0], 1, 64, 32)
    key_cache, value_cache = kv.chunk(2, dim=2)
    stock = torch.full_like(p.query, 7.0)
    reqs = p.qsl.shape[0] - 1
    ops.cpu_attention_with_kv_cache(
        query=p.query, key_cache=key_cache, value_cache=value_cache, output=stock,
        query_start_loc=p.qsl, seq_lens=p.seq_lens, scale=p.scale, causal=True,
        alibi_slopes=None, sliding_window=-1, block_table=p.block_table, softcap=0.0,
        scheduler_metadata=ops.cpu_attn_get_scheduler_metadata(
            num_reqs=reqs, num_heads=1, num_kv_heads=1, head_dim=32, seq_lens=p.seq_lens,
            dtype=torch.float32, query_start_loc=p.qsl, causal=True, sliding_window_size=-1,
            isa="vec", enable_kv_split=False, kv_cache_dtype=kv_cache_dtype),
        s_aux=None, k_scale=K_SCALE, v_scale=V_SCALE, kv_cache_dtype=kv_cache_dtype)
    for name, got in _probe_paths(p, native).items():
        torch.testing.assert_close(got, stock, rtol=0, atol=0, equal_nan=True,
                                   msg=lambda m, name=name: f"{name}: {m}")


# ---------------------------------------------------------------------------
# Hand-made codes: every kernel against the reference, the reference against
# dequantize-then-dense attention
# ---------------------------------------------------------------------------


def _fp8_batch(reqs, hq, hkv, hd, bs, kind, layout, seed=0):
    """A mixed batch whose cache holds fp8 codes (K_SCALE / V_SCALE)."""
    batch = build_batch(reqs, hq, hkv, hd, bs, torch.float32, layout, seed=seed,
                        pad_tokens=2)
    return quantize_batch(batch, layout, kind, K_SCALE, V_SCALE)


FP8_CASE = [Req(40, 8, _tree(8, 1)), Req(33, 1), Req(0, 9, _tree(9, 2)),
            Req(70, 33, _tree(33, 3))]  # fmt: skip


def _tree_rows(batch):
    rows = torch.zeros(batch.query.shape[0], dtype=torch.bool)
    qsl = batch.query_start_loc.tolist()
    for i, r in enumerate(batch.reqs):
        if r.parents is not None:
            rows[qsl[i]:qsl[i + 1]] = True
    return rows


@pytest.mark.parametrize("kind", ["e4m3", "e5m2"])
def test_reference_is_dequantize_then_dense_attention(kind):
    batch = _fp8_batch(FP8_CASE, 4, 2, 32, 16, kind, "cpu_vec", seed=3)
    quant = dict(kv_quant=kind, k_scale=K_SCALE, v_scale=V_SCALE)
    ref = tree_attention_reference(*batch.args(), **quant)
    for i, r in enumerate(batch.reqs):
        if r.parents is None:
            continue
        for node in range(r.q_len):
            got = ref[int(batch.query_start_loc[i]) + node].double()
            torch.testing.assert_close(got, path_attention(batch, i, node), atol=1e-5,
                                       rtol=1e-5)
    # the scales matter: read unscaled, or with the two swapped, it is another function
    rows = _tree_rows(batch)
    for k_scale, v_scale in ((1.0, 1.0), (V_SCALE, K_SCALE), (K_SCALE, 1.0), (1.0, V_SCALE)):
        other = tree_attention_reference(*batch.args(), kv_quant=kind, k_scale=k_scale,
                                         v_scale=v_scale)
        assert not torch.allclose(other[rows], ref[rows], atol=1e-3), (k_scale, v_scale)


@pytest.mark.parametrize("kind", ["e4m3", "e5m2"])
@pytest.mark.parametrize("path", ["batched", "native", "triton"])
@pytest.mark.parametrize("window", [None, 5])
def test_kernels_match_the_reference(kind, path, window, native):
    batch = _fp8_batch(FP8_CASE, 8, 2, 32, 16, kind, "cpu_vec", seed=5)
    sinks = _sinks(8, 3) if window else None
    quant = dict(kv_quant=kind, k_scale=K_SCALE, v_scale=V_SCALE)
    extra = dict(sliding_window=window, sinks=sinks, depth=batch.depth)
    rows = _tree_rows(batch)
    tree_reqs = [i for i, r in enumerate(batch.reqs) if r.parents is not None]
    sentinel = torch.full_like(batch.query, 7.0)
    if path == "batched":
        plan = plan_tree_batch(batch.query_start_loc, batch.seq_lens, batch.block_table, 16,
                               batch.tree_mask, tree_reqs, sliding_window=window,
                               depth=batch.depth)
        out = tree_attention_batched(batch.query, batch.kv_cache, plan, batch.scale,
                                     sentinel.clone(), sinks=sinks, **quant)
    elif path == "native":
        out = cpu_native.tree_attention_native(
            native, batch.query, batch.kv_cache, batch.block_table, batch.query_start_loc,
            batch.seq_lens, torch.tensor(tree_reqs), batch.tree_mask, batch.scale,
            sentinel.clone(), **extra, **quant)
    else:
        ta.check_tree_attention_args(*batch.args(), output=sentinel, tree_only=True,
                                     **extra, **quant)
        out = ta.tree_attention(*batch.args(), output=sentinel.clone(), tree_only=True,
                                **extra, **quant)
    ref = tree_attention_reference(*batch.args(), **extra, **quant)
    torch.testing.assert_close(out[rows], ref[rows], atol=2e-5, rtol=2e-5)
    assert torch.equal(out[~rows], sentinel[~rows])


def test_kernels_refuse_mismatched_quantization_arguments(native):
    batch = _fp8_batch([Req(3, 4, _tree(4, 0))], 2, 2, 16, 16, "e4m3", "cpu_vec")
    with pytest.raises(ValueError, match="kv_quant"):
        tree_attention_reference(*batch.args())
    with pytest.raises(ValueError, match="kv_quant"):
        ta.check_tree_attention_args(*batch.args())
    with pytest.raises(ValueError, match="k_scale"):
        ta.check_tree_attention_args(*batch.args(), kv_quant="e4m3", k_scale=-1.0)
    plan = plan_tree_batch(batch.query_start_loc, batch.seq_lens, batch.block_table, 16,
                           batch.tree_mask, [0])
    with pytest.raises(ValueError, match="kv_quant"):
        tree_attention_batched(batch.query, batch.kv_cache, plan, batch.scale,
                               batch.query.clone())
    with pytest.raises(ValueError, match="kv_quant"):
        cpu_native.tree_attention_native(
            native, batch.query, batch.kv_cache, batch.block_table, batch.query_start_loc,
            batch.seq_lens, torch.tensor([0]), batch.tree_mask, batch.scale,
            batch.query.clone())
    with pytest.raises(ValueError, match="must hold the fp8 codes as uint8"):
        cpu_native.tree_attention_native(
            native, batch.query, batch.kv_cache.float(), batch.block_table,
            batch.query_start_loc, batch.seq_lens, torch.tensor([0]), batch.tree_mask,
            batch.scale, batch.query.clone(), kv_quant="e5m2")


# ---------------------------------------------------------------------------
# Caches written by vLLM's CPU cache op, through the CPU impl
# ---------------------------------------------------------------------------


@needs_vllm_fp8
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("mode", ["native", "batched", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_on_a_vllm_written_cache(kv_cache_dtype, mode, dtype, monkeypatch):
    _with_native(mode, monkeypatch)
    step = Step(MIXED, 8, 2, 32, 32, dtype, "vec", seed=4, kv_cache_dtype=kv_cache_dtype,
                k_scale=K_SCALE, v_scale=V_SCALE)
    assert step.kv_cache.dtype == torch.uint8
    assert step.impl.tree_unsupported_reason() is None
    assert step.impl.tree_kv_quant == KINDS[kv_cache_dtype]
    stock = step.run(step.stock, tree=False)
    out = step.run(step.impl, tree=True)
    rows = step.tree_rows()
    other = torch.ones(step.num_tokens, dtype=torch.bool)
    other[rows] = False
    assert torch.equal(out[other], stock[other])  # non-tree rows: the stock op
    ref = step.reference()
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out[rows].float(), ref[rows].float(), atol=tol, rtol=tol)
    # the impl reads the layer's scales: with others, the same codes give other rows
    step.layer._k_scale_float, step.layer._v_scale_float = 1.0, 1.0
    unscaled = step.run(step.impl, tree=True)
    assert not torch.allclose(unscaled[rows].float(), out[rows].float(), atol=0.1)


@needs_vllm_fp8
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("mode", ["native", "batched", "triton"])
@pytest.mark.parametrize("window", [None, 3])
def test_chain_trees_equal_vllms_op_on_fp8(kv_cache_dtype, mode, window, monkeypatch):
    # A chain tree is causal attention, which vLLM's own op computes from the
    # same codes and scales: the tree paths dequantize as it does.
    _with_native(mode, monkeypatch)
    reqs = [Req(40, 8, _tree(8, 0, "chain")), Req(33, 1), Req(0, 9, _tree(9, 0, "chain")),
            Req(70, 33, _tree(33, 0, "chain"))]  # fmt: skip
    step = Step(reqs, 8, 2, 32, 32, torch.float32, "vec", seed=2, window=window,
                sinks=_sinks(8, 1) if window else None, kv_cache_dtype=kv_cache_dtype,
                k_scale=K_SCALE, v_scale=V_SCALE)
    stock = step.run(step.stock, tree=False)
    out = step.run(step.impl, tree=True)
    torch.testing.assert_close(out, stock, atol=2e-5, rtol=2e-5)


# ---------------------------------------------------------------------------
# Compaction: codes move as bytes
# ---------------------------------------------------------------------------


def _byte_caches(num_layers, num_blocks, hkv, bs, hd, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (num_blocks, hkv, bs, 2 * hd), dtype=torch.uint8,
                          generator=gen) for _ in range(num_layers)]


@pytest.mark.parametrize("native_mover", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_compaction_moves_fp8_codes_as_bytes(native_mover, kv_cache_dtype, monkeypatch):
    if not native_mover:
        monkeypatch.setattr(dda.cpu_native, "load", lambda: None)

    def requantize(*a, **k):
        raise AssertionError("a quantized cache was written through the cache write")

    monkeypatch.setattr(cpu_attn.CPUAttentionBackendImpl, "do_kv_cache_update", requantize)
    hkv, bs, hd = 2, 32, 32
    caches = _byte_caches(2, 6, hkv, bs, hd, seed=1)
    before = [c.clone() for c in caches]
    impl = dda.DDTreeCPUAttentionImpl(4, hd, hd**-0.5, hkv, None, None, kv_cache_dtype)
    names = ["layers.0.attn", "layers.1.attn"]
    cap = KVCapture()
    cap.start(names)
    for name, cache in zip(names, caches):
        layer = SimpleNamespace(layer_name=name, _k_scale_float=K_SCALE,
                                _v_scale_float=V_SCALE)
        cap.record(impl, layer, cache)
        cap.saw_tree(name)
    cap.stop()
    # an accepted path 5 -> 7 -> 9 -> 70 moving onto 6, 7, 8 (70 is in
    # block 2), plus the root onto itself; the moves overlap: slot 7 is read
    # (for 6) and written (from 9)
    src = torch.tensor([5, 7, 9, 70, 5])
    dst = torch.tensor([5, 6, 7, 8, 5])
    assert cap.compact(src, dst) == 2
    for cache, old in zip(caches, before):
        k_old, v_old = split_kv_cache_cpu_vec(old)
        k_new, v_new = split_kv_cache_cpu_vec(cache)
        assert torch.equal(k_new[dst // bs, dst % bs], k_old[src // bs, src % bs])
        assert torch.equal(v_new[dst // bs, dst % bs], v_old[src // bs, src % bs])
        keep = torch.ones(6 * bs, dtype=torch.bool)
        keep[dst] = False
        slots = keep.nonzero().flatten()
        assert torch.equal(k_new[slots // bs, slots % bs], k_old[slots // bs, slots % bs])
        assert torch.equal(v_new[slots // bs, slots % bs], v_old[slots // bs, slots % bs])
    assert cap.missing_layers() == {}


@needs_vllm_fp8
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_requantizing_the_moved_values_would_change_codes(kv_cache_dtype):
    # What the byte copy avoids: the dequantized values of real codes written
    # back through vLLM's cache write do not all come back as the same codes.
    kind = fp8.kv_quant_of(kv_cache_dtype)
    hd, bs = 32, 32
    codes = torch.randint(0, 256, (64, 1, hd), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(0))
    values = fp8.dequantize(codes, kind)
    finite = torch.isfinite(values).all(dim=(1, 2))
    codes, values = codes[finite], values[finite]
    cache = torch.zeros(4, 1, bs, 2 * hd, dtype=torch.uint8)
    kv = cache.view(4, 1, 2 * bs, hd)
    key_cache, value_cache = kv.chunk(2, dim=2)
    slots = torch.arange(codes.shape[0])
    ops.cpu_attn_reshape_and_cache(values * K_SCALE, values * V_SCALE, key_cache,
                                   value_cache, slots, "vec", k_scale=K_SCALE,
                                   v_scale=V_SCALE, kv_cache_dtype=kv_cache_dtype)
    k_view, v_view = split_kv_cache_cpu_vec(cache)
    again = k_view[slots // bs, slots % bs]
    assert not torch.equal(again, codes)
    assert not torch.equal(v_view[slots // bs, slots % bs], codes)


def test_move_slots_native_takes_one_byte_elements(native):
    caches = _byte_caches(3, 4, 2, 16, 16, seed=2)
    before = [c.clone() for c in caches]
    src, dst = torch.tensor([3, 17, 40]), torch.tensor([4, 5, 6])
    cpu_native.move_slots_native(native, caches, src, dst)
    for cache, old in zip(caches, before):
        k_old, v_old = split_kv_cache_cpu_vec(old)
        k_new, v_new = split_kv_cache_cpu_vec(cache)
        assert torch.equal(k_new[dst // 16, dst % 16], k_old[src // 16, src % 16])
        assert torch.equal(v_new[dst // 16, dst % 16], v_old[src // 16, src % 16])


# ---------------------------------------------------------------------------
# What stays refused
# ---------------------------------------------------------------------------


def test_cpu_impl_serves_the_per_tensor_fp8_formats_only():
    for d in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        impl = dda.DDTreeCPUAttentionImpl(4, 32, 0.1, 2, None, None, d)
        assert impl.tree_unsupported_reason() is None
    impl = dda.DDTreeCPUAttentionImpl(4, 32, 0.1, 2, None, None, "int8_per_token_head")
    assert impl.tree_unsupported_reason() == "kv_cache_dtype int8_per_token_head"
