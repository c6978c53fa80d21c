"""The CPU_ATTN override: stock parity, tree rows, KV layout, KV capture."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from test_tree_attention_utils import (  # noqa: E402
    Req,
    ancestor_sets,
    make_parents,
    node_depths,
    pack_words,
    path_attention,
    root_path,
)
from vllm import _custom_ops as ops  # noqa: E402
from vllm.v1.attention.backends import cpu_attn  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import (  # noqa: E402
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
)

from vllm_ddtree import attention as dda  # noqa: E402
from vllm_ddtree.core.compaction import kv_capture  # noqa: E402
from vllm_ddtree.kernels.cache_layout import split_kv_cache_cpu_vec  # noqa: E402
from vllm_ddtree.kernels.reference import tree_attention_reference  # noqa: E402
from vllm_ddtree.core.tree_info import TreeAttentionInfo, TreeStepBuffers  # noqa: E402


@pytest.fixture(autouse=True)
def _fake_vllm_config(monkeypatch):
    # The impl constructor only reads model_config.dtype from the config.
    cfg = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32))
    monkeypatch.setattr(cpu_attn, "get_current_vllm_config", lambda: cfg)
    monkeypatch.delenv(dda.ENV_CPU_ATTN, raising=False)


class Step:
    """A hand-built CPU_ATTN step: cache filled through the impl, metadata.
    ``kv_cache_dtype`` "fp8"/"fp8_e4m3"/"fp8_e5m2" makes it a uint8 fp8
    cache written (quantized) by vLLM's cache op with ``k_scale``/``v_scale``."""

    def __init__(self, reqs, hq, hkv, hd, bs, dtype, isa, seed=0, table_seed=None,
                 window=None, sinks=None, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0):
        gen = torch.Generator().manual_seed(seed)
        table_gen = torch.Generator().manual_seed(seed if table_seed is None else table_seed)
        self.reqs, self.dtype = reqs, dtype
        self.scale = hd**-0.5
        self.window, self.sinks = window, sinks
        self.kv_cache_dtype = kv_cache_dtype
        self.stock = CPUAttentionBackendImpl(hq, hd, self.scale, hkv, None, window,
                                             kv_cache_dtype, sinks=sinks)
        self.impl = dda.DDTreeCPUAttentionImpl(hq, hd, self.scale, hkv, None, window,
                                               kv_cache_dtype, sinks=sinks)
        self.layer = SimpleNamespace(
            isa=isa, _k_scale_float=k_scale, _v_scale_float=v_scale,
            layer_name="layers.0.attn"
        )
        n_blocks = [math.ceil(r.seq_len / bs) for r in reqs]
        num_blocks = sum(n_blocks) + 2
        perm = torch.randperm(num_blocks, generator=table_gen)
        self.block_table = torch.zeros(len(reqs), max(n_blocks) + 1, dtype=torch.int32)
        used = 0
        for i, nb in enumerate(n_blocks):
            self.block_table[i, :nb] = perm[used : used + nb].int()
            used += nb
        self.kv_cache = torch.zeros(num_blocks, hkv, bs, 2 * hd,
                                    dtype=dtype if kv_cache_dtype == "auto" else torch.uint8)
        self.keys = [torch.randn(r.seq_len, hkv, hd, generator=gen).to(dtype) for r in reqs]
        self.values = [torch.randn(r.seq_len, hkv, hd, generator=gen).to(dtype) for r in reqs]
        self.bs = bs

        # context K/V as earlier steps would have written them
        ctx_slots = torch.cat([self.slots(i, range(r.ctx)) for i, r in enumerate(reqs)])
        ctx_k = torch.cat([k[: r.ctx] for k, r in zip(self.keys, reqs)])
        ctx_v = torch.cat([v[: r.ctx] for v, r in zip(self.values, reqs)])
        self.impl.do_kv_cache_update(self.layer, ctx_k, ctx_v, self.kv_cache, ctx_slots)

        q_lens = [r.q_len for r in reqs]
        self.qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
        self.num_tokens = int(self.qsl[-1])
        self.query = torch.randn(self.num_tokens, hq, hd, generator=gen).to(dtype)
        self.key = torch.cat([k[r.ctx :] for k, r in zip(self.keys, reqs)])
        self.value = torch.cat([v[r.ctx :] for v, r in zip(self.values, reqs)])
        self.slot_mapping = torch.cat(
            [self.slots(i, range(r.ctx, r.seq_len)) for i, r in enumerate(reqs)]
        )
        self.seq_lens = torch.tensor([r.seq_len for r in reqs], dtype=torch.int32)
        self.metadata = CPUAttentionMetadata(
            num_actual_tokens=self.num_tokens,
            max_query_len=max(q_lens),
            query_start_loc=self.qsl,
            max_seq_len=max(r.seq_len for r in reqs),
            seq_lens=self.seq_lens,
            block_table=self.block_table,
            slot_mapping=self.slot_mapping,
            scheduler_metadata=ops.cpu_attn_get_scheduler_metadata(
                num_reqs=len(reqs), num_heads=hq, num_kv_heads=hkv, head_dim=hd,
                seq_lens=self.seq_lens, dtype=dtype, query_start_loc=self.qsl,
                causal=True, sliding_window_size=-1 if window is None else window, isa=isa,
                enable_kv_split=False, kv_cache_dtype=kv_cache_dtype,
            ),  # fmt: skip
            causal=True,
        )
        # this step's K/V are written before attention, as in vLLM
        self.impl.do_kv_cache_update(
            self.layer, self.key, self.value, self.kv_cache, self.slot_mapping
        )
        max_tree = max([r.q_len for r in reqs if r.parents], default=1)
        self.num_words = max(1, math.ceil(max_tree / 32))
        mask = torch.randint(-(2**31), 2**31 - 1, (self.num_tokens, self.num_words),
                             generator=gen, dtype=torch.int32)  # fmt: skip
        for i, r in enumerate(reqs):
            if r.parents:
                mask[self.qsl[i] : self.qsl[i + 1]] = pack_words(
                    ancestor_sets(r.parents), self.num_words
                )
        self.mask = mask
        self.is_tree = torch.tensor([bool(r.parents) for r in reqs])
        self.depth = torch.zeros(self.num_tokens, dtype=torch.int32)
        for i, r in enumerate(reqs):
            if r.parents:
                self.depth[self.qsl[i] : self.qsl[i + 1]] = torch.tensor(node_depths(r.parents))

    def slots(self, i, positions):
        pos = torch.tensor(list(positions), dtype=torch.long)
        return self.block_table[i, pos // self.bs].long() * self.bs + pos % self.bs

    def run(self, impl, tree: bool):
        md = self.metadata
        md.ddtree = (TreeAttentionInfo.create(self.mask, self.is_tree, depth=self.depth)
                     if tree else None)
        out = torch.full_like(self.query, float("nan"))
        impl.forward(self.layer, self.query, self.key, self.value, self.kv_cache, md, out)
        return out

    def tree_rows(self):
        rows = []
        for i, r in enumerate(self.reqs):
            if r.parents:
                rows += range(int(self.qsl[i]), int(self.qsl[i + 1]))
        return torch.tensor(rows, dtype=torch.long)

    def reference(self):
        k_view, v_view = split_kv_cache_cpu_vec(self.kv_cache)
        k_scale, v_scale = self.impl.tree_kv_scales(self.layer)
        return tree_attention_reference(self.query, k_view, v_view, self.block_table,
                                        self.qsl, self.seq_lens, self.scale, self.mask,
                                        self.is_tree, sliding_window=self.window,
                                        sinks=self.sinks, depth=self.depth,
                                        kv_quant=self.impl.tree_kv_quant, k_scale=k_scale,
                                        v_scale=v_scale)  # fmt: skip

    def path_check(self, out, atol):
        """Tree rows against fp64 attention over context + root path."""
        batch = SimpleNamespace(
            reqs=self.reqs, keys=self.keys, values=self.values, query=self.query,
            query_start_loc=self.qsl, scale=self.scale,
        )  # fmt: skip
        for i, r in enumerate(self.reqs):
            if not r.parents:
                continue
            for node in range(r.q_len):
                got = out[int(self.qsl[i]) + node].double()
                want = path_attention(batch, i, node)
                torch.testing.assert_close(got, want, atol=atol, rtol=atol)


def _tree(n, seed, shape="random"):
    return make_parents(n, torch.Generator().manual_seed(seed), shape)


MIXED = [Req(40, 8, _tree(8, 1)), Req(33, 1), Req(0, 9, _tree(9, 2)), Req(5, 20),
         Req(70, 33, _tree(33, 3))]  # fmt: skip


@pytest.mark.parametrize(
    "hq,hkv,hd,bs,isa",
    [(4, 2, 32, 32, "vec"), (8, 8, 64, 32, "vec"), (5, 1, 80, 32, "vec16"),
     (4, 4, 32, 16, "vec16")],
)  # fmt: skip
def test_cache_layout_is_readable_through_strides(hq, hkv, hd, bs, isa):
    # K/V written by the C++ cache op, read back through the strided view.
    for dtype in (torch.float32, torch.bfloat16):
        step = Step(MIXED, hq, hkv, hd, bs, dtype, isa)
        k_view, v_view = split_kv_cache_cpu_vec(step.kv_cache)
        for i, r in enumerate(step.reqs):
            slots = step.slots(i, range(r.seq_len))
            assert torch.equal(k_view[slots // bs, slots % bs], step.keys[i])
            assert torch.equal(v_view[slots // bs, slots % bs], step.values[i])


def test_no_tree_is_bit_identical_to_stock():
    reqs = [Req(40, 8), Req(33, 1), Req(0, 9), Req(5, 20)]
    step = Step(reqs, 4, 2, 64, 32, torch.float32, "vec")
    stock = step.run(step.stock, tree=False)
    assert torch.isfinite(stock).all()
    assert torch.equal(step.run(step.impl, tree=False), stock)
    # tree info whose requests are all non-tree: still stock
    step.is_tree = torch.zeros(len(reqs), dtype=torch.bool)
    assert torch.equal(step.run(step.impl, tree=True), stock)
    # stock causal semantics agree with the reference's
    k_view, v_view = split_kv_cache_cpu_vec(step.kv_cache)
    ref = tree_attention_reference(step.query, k_view, v_view, step.block_table,
                                   step.qsl, step.seq_lens, step.scale)  # fmt: skip
    torch.testing.assert_close(ref, stock, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["torch", "triton"])
def test_mixed_batch(dtype, mode, monkeypatch):
    monkeypatch.setenv(dda.ENV_CPU_ATTN, mode)
    step = Step(MIXED, 8, 2, 32, 32, dtype, "vec", seed=4)
    stock = step.run(step.stock, tree=False)
    out = step.run(step.impl, tree=True)
    rows = step.tree_rows()
    other = torch.ones(step.num_tokens, dtype=torch.bool)
    other[rows] = False
    assert torch.equal(out[other], stock[other])
    assert not torch.allclose(out[rows].float(), stock[rows].float(), atol=1e-2)

    k_view, v_view = split_kv_cache_cpu_vec(step.kv_cache)
    ref = tree_attention_reference(step.query, k_view, v_view, step.block_table,
                                   step.qsl, step.seq_lens, step.scale, step.mask,
                                   step.is_tree)  # fmt: skip
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out[rows].float(), ref[rows].float(), atol=tol, rtol=tol)
    if dtype == torch.float32:
        step.path_check(out, atol=1e-5)


def _sinks(hq, seed=0):
    sinks = torch.randn(hq, generator=torch.Generator().manual_seed(seed)) * 2
    sinks[0] = 5.0
    return sinks


CAUSAL = [Req(40, 8), Req(33, 1), Req(0, 9), Req(5, 20), Req(70, 3)]


@pytest.mark.parametrize("window", [1, 5, 33, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stock_op_follows_the_reference_rule(window, dtype):
    # vLLM's own CPU op with a window and sinks (causal requests) agrees with
    # the rule the reference implements: q - k < window, sinks unscaled.
    step = Step(CAUSAL, 8, 2, 32, 32, dtype, "vec", seed=window, window=window,
                sinks=_sinks(8))
    stock = step.run(step.stock, tree=False)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(stock.float(), step.reference().float(), atol=tol, rtol=tol)


def _with_native(mode, monkeypatch):
    """'native' and 'batched' are the torch mode with and without the native
    kernel; 'triton' runs the Triton kernel in the interpreter."""
    monkeypatch.setenv(dda.ENV_CPU_ATTN, "triton" if mode == "triton" else "torch")
    if mode == "batched":
        monkeypatch.setattr(dda.cpu_native, "load", lambda: None)


@pytest.mark.parametrize("mode", ["native", "batched", "triton"])
@pytest.mark.parametrize("window", [1, 3, 41, 1000])
def test_chain_trees_with_window_and_sinks_equal_stock(window, mode, monkeypatch):
    # A chain tree's node j sits at ctx + j, so with a window and sinks its
    # rows are exactly what vLLM's causal op computes for the same tokens.
    _with_native(mode, monkeypatch)
    reqs = [Req(40, 8, _tree(8, 0, "chain")), Req(33, 1), Req(0, 9, _tree(9, 0, "chain")),
            Req(70, 33, _tree(33, 0, "chain"))]  # fmt: skip
    step = Step(reqs, 8, 2, 32, 32, torch.float32, "vec", seed=2, window=window,
                sinks=_sinks(8, 1))
    stock = step.run(step.stock, tree=False)
    out = step.run(step.impl, tree=True)
    torch.testing.assert_close(out, stock, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("mode", ["native", "batched", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_windowed_mixed_batch_with_sinks(dtype, mode, monkeypatch):
    _with_native(mode, monkeypatch)
    step = Step(MIXED, 8, 2, 32, 32, dtype, "vec", seed=4, window=3, sinks=_sinks(8, 2))
    assert step.impl.tree_unsupported_reason() is None
    stock = step.run(step.stock, tree=False)
    out = step.run(step.impl, tree=True)
    rows = step.tree_rows()
    other = torch.ones(step.num_tokens, dtype=torch.bool)
    other[rows] = False
    assert torch.equal(out[other], stock[other])
    ref = step.reference()
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out[rows].float(), ref[rows].float(), atol=tol, rtol=tol)
    # the window and the sinks changed the tree rows
    plain = Step(MIXED, 8, 2, 32, 32, dtype, "vec", seed=4)
    assert not torch.allclose(out[rows].float(), plain.run(plain.impl, tree=True)[rows].float(),
                              atol=1e-2)


def test_windowed_layer_needs_node_depths():
    step = Step([Req(3, 4, _tree(4, 0)), Req(2, 1)], 4, 4, 32, 32, torch.float32, "vec",
                window=2)
    step.depth = None
    with pytest.raises(RuntimeError, match="depth"):
        step.run(step.impl, tree=True)


def test_all_tree_batch_skips_the_stock_op(monkeypatch):
    step = Step([Req(12, 5, _tree(5, 0)), Req(0, 3, _tree(3, 1))], 4, 4, 32, 32,
                torch.float32, "vec")  # fmt: skip

    def boom(*a, **k):
        raise AssertionError("stock op called")

    monkeypatch.setattr(CPUAttentionBackendImpl, "forward", boom)
    out = step.run(step.impl, tree=True)
    step.path_check(out, atol=1e-5)


def test_triton_mode_requires_interpreter(monkeypatch):
    step = Step([Req(3, 4, _tree(4, 0))], 4, 4, 32, 32, torch.float32, "vec")
    monkeypatch.setenv(dda.ENV_CPU_ATTN, "triton")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET") as err:
        step.run(step.impl, tree=True)
    assert dda.ENV_CPU_ATTN in str(err.value)
    monkeypatch.setenv(dda.ENV_CPU_ATTN, "cuda")
    with pytest.raises(ValueError, match=dda.ENV_CPU_ATTN):
        step.run(step.impl, tree=True)


def test_tree_rows_refuse_unreadable_layouts():
    step = Step([Req(3, 4, _tree(4, 0)), Req(2, 1)], 4, 4, 32, 32, torch.float32, "vec")
    step.layer.isa = "amx"
    with pytest.raises(RuntimeError, match="amx"):
        step.run(step.impl, tree=True)
    step.layer.isa = "vec"
    step.impl.alibi_slopes = torch.ones(4)
    with pytest.raises(NotImplementedError, match="ALiBi"):
        step.run(step.impl, tree=True)


def test_tree_cpu_isa():
    assert dda.tree_cpu_isa("amx", True) == "vec"
    assert dda.tree_cpu_isa("amx", False) == "amx"
    assert dda.tree_cpu_isa("vec16", True) == "vec16"
    assert dda.tree_cpu_isa("neon", False) == "neon"
    with pytest.raises(NotImplementedError, match="neon"):
        dda.tree_cpu_isa("neon", True)


@pytest.mark.parametrize("ddtree_on", [False, True])
def test_builder_forces_vec_layout_with_ddtree(ddtree_on, monkeypatch):
    layers = {"a": SimpleNamespace(isa=None), "b": SimpleNamespace(isa=None)}

    def fake_init(self, kv_cache_spec, layer_names, vllm_config, device):
        self.isa = "amx"
        self._set_isa_to_layers(layer_names)

    def fake_set(self, layer_names):
        for name in layer_names:
            layers[name].isa = self.isa

    monkeypatch.setattr(cpu_attn.CPUAttentionMetadataBuilder, "__init__", fake_init)
    monkeypatch.setattr(cpu_attn.CPUAttentionMetadataBuilder, "_set_isa_to_layers", fake_set)
    spec = SimpleNamespace(ddtree=object()) if ddtree_on else SimpleNamespace()
    cfg = SimpleNamespace(speculative_config=spec)
    builder = dda.DDTreeCPUAttentionMetadataBuilder(None, ["a", "b"], cfg, "cpu")
    want = "vec" if ddtree_on else "amx"
    assert builder.isa == want
    assert layers["a"].isa == want and layers["b"].isa == want


@pytest.mark.parametrize("native", [True, False], ids=["native", "cache-write"])
def test_kv_capture_moves_path_into_contiguous_slots(native, monkeypatch):
    if not native:  # the fallback: every layer through the impl's own cache write
        monkeypatch.setattr(dda.cpu_native, "load", lambda: None)
    parents = _tree(12, 7)
    node = max(range(12), key=lambda i: len(root_path(parents, i)))
    path = root_path(parents, node)
    assert len(path) >= 3
    reqs = [Req(7, 2), Req(37, 12, parents)]
    # two layers of one KV cache group: same block table, different K/V
    steps = [
        Step(reqs, 4, 2, 32, 32, torch.float32, "vec", seed=s, table_seed=0) for s in (0, 1)
    ]
    assert not torch.equal(steps[0].key, steps[1].key)
    steps[1].layer.layer_name = "layers.1.attn"

    cap = kv_capture
    names = ["layers.0.attn", "layers.1.attn"]
    cap.start(names + ["layers.2.attn"])
    try:
        for st in steps:
            st.impl.do_kv_cache_update(st.layer, st.key, st.value, st.kv_cache,
                                       st.slot_mapping)  # fmt: skip
            st.run(st.impl, tree=True)  # the tree path reports itself
    finally:
        cap.stop()
    assert len(cap.records()) == 2
    assert [r.layer.layer_name for r in cap.records()] == names
    # a target layer that neither wrote nor applied its mask is named
    assert cap.missing_layers() == {"kv_capture": ["layers.2.attn"],
                                    "tree_mask": ["layers.2.attn"]}
    # writes while stopped are not recorded
    steps[0].impl.do_kv_cache_update(steps[0].layer, steps[0].key, steps[0].value,
                                     steps[0].kv_cache, steps[0].slot_mapping)  # fmt: skip
    assert len(cap.records()) == 2

    q0 = int(steps[0].qsl[1])
    src_rows = torch.tensor([q0 + j for j in path[1:]])
    src_slots = steps[0].slot_mapping[src_rows]
    dst_slots = steps[0].slots(1, range(38, 38 + len(path) - 1))
    # the moves overlap (a source slot of one is the destination of another)
    assert set(src_slots.tolist()) & set(dst_slots.tolist())
    before = [split_kv_cache_cpu_vec(st.kv_cache.clone()) for st in steps]
    assert cap.compact(src_slots, dst_slots) == 2
    assert len(cap.records()) == 2
    for st, (k_before, v_before) in zip(steps, before):
        k_view, v_view = split_kv_cache_cpu_vec(st.kv_cache)
        blk, off = dst_slots // 32, dst_slots % 32
        assert torch.equal(k_view[blk, off], st.key[src_rows])
        assert torch.equal(v_view[blk, off], st.value[src_rows])
        # the accepted path now reads as a chain after the root
        for k, j in enumerate(path):
            slot = st.slots(1, [37 + k])
            assert torch.equal(k_view[slot // 32, slot % 32][0], st.keys[1][37 + j])
        # nothing else moved
        changed = (k_view != k_before).flatten(2).any(-1) | (v_view != v_before).flatten(2).any(-1)
        moved = set(zip(*[t.tolist() for t in torch.nonzero(changed, as_tuple=True)]))
        assert moved <= set(zip(blk.tolist(), off.tolist()))
    cap.clear()
    assert cap.records() == []
    assert cap.compact(src_slots, dst_slots) == 0


def test_register_backends_on_cpu():
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    member = AttentionBackendEnum.CPU_ATTN
    had = member.is_overridden()
    previous = member.get_path()
    try:
        assert dda.register_backends() == ["CPU_ATTN"]
        assert dda.register_backends() == ["CPU_ATTN"]
        assert member.get_class() is dda.DDTreeCPUAttentionBackend
        selected = current_platform.get_attn_backend_cls(
            None, SimpleNamespace(use_sparse=False, use_mla=False)
        )
        assert selected == dda.CPU_BACKEND_PATH
        backend = dda.DDTreeCPUAttentionBackend
        assert backend.get_name() == "CPU_ATTN"
        assert backend.get_impl_cls() is dda.DDTreeCPUAttentionImpl
        assert backend.get_builder_cls() is dda.DDTreeCPUAttentionMetadataBuilder
        assert AttentionBackendEnum[backend.get_name()] is member
    finally:
        if had:
            from vllm.v1.attention.backends.registry import register_backend

            register_backend(member, previous)
        else:
            member.clear_override()


def test_tree_path_marks_the_guard_slot_and_stock_does_not():
    """The replay-safe guard: the DDTree impl's tree path marks its layer's
    slot for the step, the stock impl leaves it stale."""
    reqs = [Req(9, 5, make_parents(5, torch.Generator().manual_seed(1))), Req(4, 1)]
    step = Step(reqs, 4, 2, 32, 32, torch.float32, "vec")
    names = ["layers.0.attn", "layers.1.attn"]
    buffers = TreeStepBuffers(64, 4, 8, names, "cpu")
    buffers.begin_step()
    md = step.metadata
    for name, impl in zip(names, (step.impl, step.stock)):
        step.layer.layer_name = name
        md.ddtree = TreeAttentionInfo.create(step.mask, step.is_tree, (0,), 6, buffers=buffers)
        impl.forward(step.layer, step.query, step.key, step.value, step.kv_cache, md,
                     torch.empty_like(step.query))
    assert buffers.unseen_layers(set(names)) == ["layers.1.attn"]
