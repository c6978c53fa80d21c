"""Sliding windows and attention sinks on the tree-attention path.

The torch reference is checked against an independent dense softmax built
here from explicit logical positions, an explicit visibility matrix and a
sink column; then every implementation (the Triton kernel, in Triton's
interpreter without a GPU; the native CPU kernel; the batched torch path) is
checked against the reference on mixed tree/causal batches over paged caches
whose blocks outside every window are freed (NaN-filled), as vLLM frees them.
That the rule is vLLM's own is checked against vLLM's CPU op in
``test_cpu_tree_backend.py``.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from test_tree_attention_utils import (  # noqa: E402
    Req,
    ancestor_sets,
    build_batch,
    make_parents,
    node_depths,
    root_path,
)

from vllm_ddtree.core.tree_info import TreeAttentionInfo  # noqa: E402
from vllm_ddtree.kernels import cpu_native  # noqa: E402
from vllm_ddtree.kernels import tree_attention as ta  # noqa: E402
from vllm_ddtree.kernels.reference import tree_attention_reference  # noqa: E402
from vllm_ddtree.kernels.tree_attention_cpu import (  # noqa: E402
    plan_tree_batch,
    tree_attention_batched,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

if DEVICE == "cpu" and not ta.INTERPRETED:
    pytest.skip("the kernel module was imported before TRITON_INTERPRET=1 was set",
                allow_module_level=True)

TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
BS = 16  # cache block size: the contexts below span up to 5 blocks


def _tree(n, seed, shape="random"):
    return make_parents(n, torch.Generator().manual_seed(seed), shape)


TREE_A = _tree(12, 5)
# A tree with context, a decode, a prefill chunk with context, a chain tree
# without context and a larger tree with a long context.
REQS = [Req(37, 12, TREE_A), Req(20, 1), Req(29, 9), Req(0, 8, _tree(8, 0, "chain")),
        Req(70, 17, _tree(17, 6))]
DEPTH_A = max(node_depths(TREE_A))
assert DEPTH_A >= 3

# Windows (positions a query sees, itself included):
WINDOWS = {
    "none": None,
    "one": 1,  # every query sees only itself
    "below-depth": 2,  # shorter than the trees are deep
    "to-tree-start": DEPTH_A + 1,  # the deepest node of tree A sees no context, exactly
    "to-context-start": 37 + 1,  # the root of tree A sees context position 0, exactly
    "past-sequence": 1000,  # longer than every sequence
}


def _sinks(num_q_heads, seed=0):
    gen = torch.Generator().manual_seed(seed)
    sinks = torch.randn(num_q_heads, generator=gen) * 2
    sinks[0] = 6.0  # a sink that outweighs most keys
    return sinks


def dense_attention(batch, sliding_window=None, sinks=None, anc=None) -> torch.Tensor:
    """fp64 ``[num_tokens, Hq, D]`` from each request's dense K/V: explicit
    logical positions (a tree node's is ctx + its depth), an explicit bool
    visibility matrix and the sink as one more logit column without a value.
    ``anc`` optionally replaces a tree request's ancestor sets (``{r: [int
    bitset per node]}``). Rows past the requests stay zero."""
    out = torch.zeros(batch.query.shape, dtype=torch.float64)
    for r, req in enumerate(batch.reqs):
        q0, ctx, n, seq = int(batch.query_start_loc[r]), req.ctx, req.q_len, req.seq_len
        if req.parents is None:
            q_pos = [ctx + i for i in range(n)]
            k_pos = list(range(seq))
            sees = [[k <= q_pos[i] for k in range(seq)] for i in range(n)]
        else:
            bits = (anc or {}).get(r) or ancestor_sets(req.parents)
            q_pos = [ctx + d for d in node_depths(req.parents)]
            k_pos = list(range(ctx)) + q_pos
            sees = [[k < ctx or bool((bits[i] >> (k - ctx)) & 1) for k in range(seq)]
                    for i in range(n)]
        visible = torch.tensor(sees)
        if sliding_window is not None:
            visible &= torch.tensor(q_pos)[:, None] - torch.tensor(k_pos)[None, :] \
                < sliding_window
        q = batch.query[q0:q0 + n].double().cpu()  # [n, Hq, D]
        group = q.shape[1] // batch.keys[r].shape[1]
        k = batch.keys[r].double().repeat_interleave(group, 1)  # [seq, Hq, D]
        v = batch.values[r].double().repeat_interleave(group, 1)
        logits = torch.einsum("nhd,lhd->hnl", q, k) * batch.scale
        logits = logits.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            column = sinks.double().cpu()[:, None, None].expand(-1, n, 1)
            logits = torch.cat([logits, column], dim=-1)
        weights = logits.softmax(-1)[..., :seq]
        weights = torch.where(visible.any(1)[None, :, None], weights, 0.0)
        out[q0:q0 + n] = torch.einsum("hnl,lhd->nhd", weights, v)
    return out


def free_blocks_outside_windows(batch, sliding_window) -> int:
    """Point every block table entry whose block lies wholly before the
    request's earliest window start (ctx - window + 1) at a never-written
    (NaN) block, as vLLM's sliding-window manager frees it; returns how many
    entries were redirected."""
    if sliding_window is None:
        return 0
    table = batch.block_table
    used = {int(b) for r, req in enumerate(batch.reqs)
            for b in table[r, : -(-req.seq_len // BS)].tolist()}
    spare = next(b for b in range(batch.key_cache.shape[0]) if b not in used)
    assert torch.isnan(batch.key_cache[spare]).all()
    freed = 0
    for r, req in enumerate(batch.reqs):
        lo = max(0, req.ctx - sliding_window + 1)
        table[r, : lo // BS] = spare
        freed += lo // BS
    return freed


def _batch(dtype, layout, heads, seed=1, **kw):
    return build_batch(REQS, heads[0], heads[1], 32, BS, dtype, layout, DEVICE, seed=seed,
                       **kw)


def _tree_rows(batch) -> torch.Tensor:
    rows = torch.zeros(batch.query.shape[0], dtype=torch.bool)
    qsl = batch.query_start_loc.tolist()
    for r, req in enumerate(batch.reqs):
        if req.parents is not None:
            rows[qsl[r]:qsl[r + 1]] = True
    return rows


# ---------------------------------------------------------------- reference


@pytest.mark.parametrize("heads", [(8, 2), (4, 4), (5, 1)], ids=lambda h: f"h{h[0]}x{h[1]}")
@pytest.mark.parametrize("with_sinks", [False, True], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize("window", list(WINDOWS), ids=list(WINDOWS))
def test_reference_matches_dense_softmax(window, with_sinks, heads):
    batch = _batch(torch.float32, "nhd", heads, pad_tokens=2)
    w = WINDOWS[window]
    sinks = _sinks(heads[0]).to(DEVICE) if with_sinks else None
    freed = free_blocks_outside_windows(batch, w)
    out = tree_attention_reference(*batch.args(), sliding_window=w, sinks=sinks,
                                   depth=batch.depth)
    want = dense_attention(batch, w, sinks)
    n = int(batch.query_start_loc[-1])
    torch.testing.assert_close(out[:n].double().cpu(), want[:n], atol=1e-5, rtol=1e-5)
    if w is not None and w < 37:
        assert freed > 0  # NaN blocks were in the tables and did not leak


def test_window_edges_are_where_the_rule_puts_them():
    """Spot checks of the dense oracle itself, on tree A (request 0)."""
    batch = _batch(torch.float32, "nhd", (4, 4))
    depth = node_depths(TREE_A)
    deepest = depth.index(DEPTH_A)
    # window depth + 1: the deepest node attends to its root path only
    path = [37 + j for j in root_path(TREE_A, deepest)]
    assert len(path) == DEPTH_A + 1
    logits = torch.einsum("hd,lhd->hl", batch.query[deepest].double(),
                          batch.keys[0][path].double()) * batch.scale
    want = torch.einsum("hl,lhd->hd", logits.softmax(-1), batch.values[0][path].double())
    torch.testing.assert_close(dense_attention(batch, DEPTH_A + 1)[deepest], want)
    # window 1: every query attends to itself only (one KV head per query head)
    own = dense_attention(batch, 1)
    for r, req in enumerate(batch.reqs):
        q0 = int(batch.query_start_loc[r])
        slots = [req.ctx + i for i in range(req.q_len)]
        torch.testing.assert_close(own[q0:q0 + req.q_len], batch.values[r][slots].double())
    # the root of tree A sees context position 0 at window ctx + 1, not at ctx
    assert not torch.allclose(dense_attention(batch, 38)[0], dense_attention(batch, 37)[0])
    torch.testing.assert_close(dense_attention(batch, 38)[0], dense_attention(batch)[0])
    # no window and a window past every sequence agree
    torch.testing.assert_close(dense_attention(batch, 1000), dense_attention(batch))


def test_sink_only_scales_the_softmax():
    """A sink keeps the direction of each row's output and scales it by
    sum(e^s) / (sum(e^s) + e^sink), the sink unscaled by the softmax scale."""
    batch = _batch(torch.float32, "nhd", (4, 4))
    sinks = _sinks(4).to(DEVICE)
    plain = tree_attention_reference(*batch.args())
    sunk = tree_attention_reference(*batch.args(), sinks=sinks)
    row, head = 3, 0  # tree A, node 3
    seen = list(range(37)) + [37 + j for j in root_path(TREE_A, row)]
    logits = batch.keys[0].double()[seen, head] @ batch.query[row, head].double().cpu()
    mass = (logits * batch.scale).exp().sum()
    factor = mass / (mass + torch.exp(sinks[head].double().cpu()))
    torch.testing.assert_close(sunk[row, head].double().cpu(),
                               plain[row, head].double().cpu() * factor, atol=1e-6, rtol=1e-5)
    assert factor < 0.99  # the sink mattered


def test_row_without_keys_stays_zero_with_sinks_and_window():
    batch = build_batch([Req(0, 4, _tree(4, 0)), Req(9, 3, _tree(3, 1))], 4, 4, 32, BS,
                        torch.float32, "nhd", DEVICE)
    batch.tree_mask[1] = 0  # node 1 of the context-free tree sees nothing
    anc = {0: [x & 0xFFFFFFFF for x in batch.tree_mask[:4, 0].tolist()]}
    kw = dict(sliding_window=2, sinks=_sinks(4).to(DEVICE), depth=batch.depth)
    want = dense_attention(batch, 2, kw["sinks"], anc)
    out_r = tree_attention_reference(*batch.args(), **kw)
    out_k = ta.tree_attention(*batch.args(), **kw)
    for out in (out_r, out_k):
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        torch.testing.assert_close(out.double().cpu(), want, atol=2e-5, rtol=2e-5)


# ---------------------------------------------------------------- kernels

# (dtype, layout, (q_heads, kv_heads), sinks)
TRITON_VARIANTS = [
    (torch.float32, "cpu_vec", (8, 2), True),
    (torch.float16, "nhd", (8, 2), True),
    (torch.float32, "nhd", (5, 1), False),
]


@pytest.mark.parametrize("variant", TRITON_VARIANTS,
                         ids=[f"{str(v[0])[6:]}-{v[1]}-h{v[2][0]}x{v[2][1]}"
                              f"{'-sinks' if v[3] else ''}" for v in TRITON_VARIANTS])
@pytest.mark.parametrize("window", list(WINDOWS), ids=list(WINDOWS))
def test_triton_matches_reference(window, variant):
    dtype, layout, heads, with_sinks = variant
    batch = _batch(dtype, layout, heads, seed=2, pad_tokens=3)
    w = WINDOWS[window]
    free_blocks_outside_windows(batch, w)
    kw = dict(sliding_window=w, sinks=_sinks(heads[0]).to(DEVICE) if with_sinks else None,
              depth=batch.depth)
    ta.check_tree_attention_args(*batch.args(), max_query_len=batch.max_query_len, **kw)
    sentinel = torch.full_like(batch.query, 7.0)
    out = ta.tree_attention(*batch.args(), output=sentinel.clone(),
                            max_query_len=batch.max_query_len, **kw)
    ref = tree_attention_reference(*batch.args(), **kw)
    n = int(batch.query_start_loc[-1])
    assert torch.isfinite(out[:n]).all()
    torch.testing.assert_close(out[:n].float(), ref[:n].float(), atol=TOL[dtype],
                               rtol=TOL[dtype])
    assert torch.equal(out[n:], sentinel[n:])


def test_triton_tree_only_with_window_and_sinks():
    batch = _batch(torch.float32, "nhd", (8, 2), seed=3)
    free_blocks_outside_windows(batch, 2)
    kw = dict(sliding_window=2, sinks=_sinks(8), depth=batch.depth)
    sentinel = torch.full_like(batch.query, -3.0)
    out = ta.tree_attention(*batch.args(), output=sentinel.clone(), tree_only=True, **kw)
    ref = tree_attention_reference(*batch.args(), **kw)
    rows = _tree_rows(batch)
    torch.testing.assert_close(out[rows], ref[rows], atol=2e-5, rtol=2e-5)
    assert torch.equal(out[~rows], sentinel[~rows])


@pytest.fixture(scope="module")
def native():
    lib = cpu_native.load()
    if lib is None:
        pytest.fail("the native CPU tree-attention kernel did not build on this machine")
    return lib


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize("window", list(WINDOWS), ids=list(WINDOWS))
def test_native_matches_reference(window, with_sinks, dtype, native):
    batch = build_batch(REQS, 8, 2, 32, BS, dtype, "cpu_vec", "cpu", seed=4, pad_tokens=2)
    w = WINDOWS[window]
    free_blocks_outside_windows(batch, w)
    sinks = _sinks(8, seed=1).to(dtype) if with_sinks else None
    rows = _tree_rows(batch)
    tree_reqs = torch.tensor([r for r, req in enumerate(REQS) if req.parents is not None])
    sentinel = torch.full(batch.query.shape, 7.0)
    out = cpu_native.tree_attention_native(
        native, batch.query.float(), batch.kv_cache, batch.block_table,
        batch.query_start_loc, batch.seq_lens, tree_reqs, batch.tree_mask, batch.scale,
        sentinel.clone(), sliding_window=w, sinks=sinks, depth=batch.depth)
    ref = tree_attention_reference(*batch.args(), sliding_window=w, sinks=sinks,
                                   depth=batch.depth)
    torch.testing.assert_close(out[rows], ref[rows].float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(out[~rows], sentinel[~rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize("window", list(WINDOWS), ids=list(WINDOWS))
def test_batched_matches_reference(window, with_sinks, dtype):
    batch = build_batch(REQS, 8, 2, 32, BS, dtype, "cpu_vec", "cpu", seed=5, pad_tokens=2)
    w = WINDOWS[window]
    free_blocks_outside_windows(batch, w)
    sinks = _sinks(8, seed=2) if with_sinks else None
    rows = _tree_rows(batch)
    tree_reqs = [r for r, req in enumerate(REQS) if req.parents is not None]
    plan = plan_tree_batch(batch.query_start_loc, batch.seq_lens, batch.block_table, BS,
                           batch.tree_mask, tree_reqs, sliding_window=w, depth=batch.depth)
    sentinel = torch.full_like(batch.query, 7.0)
    out = tree_attention_batched(batch.query, batch.kv_cache, plan, batch.scale,
                                 sentinel.clone(), sinks=sinks)
    ref = tree_attention_reference(*batch.args(), sliding_window=w, sinks=sinks,
                                   depth=batch.depth)
    torch.testing.assert_close(out[rows].float(), ref[rows].float(), atol=TOL[dtype],
                               rtol=TOL[dtype])
    assert torch.equal(out[~rows], sentinel[~rows])


def test_no_window_and_no_sinks_change_nothing(native):
    """``None``/-1 windows and no sinks take exactly today's code paths."""
    batch = build_batch(REQS, 8, 2, 32, BS, torch.float32, "cpu_vec", "cpu", seed=6)
    tree_reqs = [r for r, req in enumerate(REQS) if req.parents is not None]
    base_k = ta.tree_attention(*batch.args())
    base_r = tree_attention_reference(*batch.args())
    base_n = cpu_native.tree_attention_native(
        native, batch.query, batch.kv_cache, batch.block_table, batch.query_start_loc,
        batch.seq_lens, torch.tensor(tree_reqs), batch.tree_mask, batch.scale,
        torch.zeros_like(batch.query))
    plan = plan_tree_batch(batch.query_start_loc, batch.seq_lens, batch.block_table, BS,
                           batch.tree_mask, tree_reqs)
    base_b = tree_attention_batched(batch.query, batch.kv_cache, plan, batch.scale,
                                    torch.zeros_like(batch.query))
    for w in (None, -1):
        kw = dict(sliding_window=w, sinks=None, depth=batch.depth)
        assert torch.equal(ta.tree_attention(*batch.args(), **kw), base_k)
        assert torch.equal(tree_attention_reference(*batch.args(), **kw), base_r)
        assert torch.equal(cpu_native.tree_attention_native(
            native, batch.query, batch.kv_cache, batch.block_table, batch.query_start_loc,
            batch.seq_lens, torch.tensor(tree_reqs), batch.tree_mask, batch.scale,
            torch.zeros_like(batch.query), **kw), base_n)
        plan_w = plan_tree_batch(batch.query_start_loc, batch.seq_lens, batch.block_table,
                                 BS, batch.tree_mask, tree_reqs, sliding_window=w,
                                 depth=batch.depth)
        assert torch.equal(tree_attention_batched(batch.query, batch.kv_cache, plan_w,
                                                  batch.scale, torch.zeros_like(batch.query)),
                           base_b)


# ---------------------------------------------------------------- arguments


def test_bad_window_sinks_and_depth_are_refused(native):
    batch = build_batch(REQS[:2], 4, 2, 32, BS, torch.float32, "cpu_vec", "cpu")
    args = batch.args()
    for bad in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="sliding_window"):
            tree_attention_reference(*args, sliding_window=bad, depth=batch.depth)
        with pytest.raises(ValueError, match="sliding_window"):
            ta.check_tree_attention_args(*args, sliding_window=bad, depth=batch.depth)
    for name, fn in (("reference", tree_attention_reference),
                     ("check", ta.check_tree_attention_args)):
        with pytest.raises(ValueError, match="depth"):
            fn(*args, sliding_window=4)
        with pytest.raises(ValueError, match="sinks"):
            fn(*args, sinks=torch.zeros(3))
        with pytest.raises(ValueError, match="sinks"):
            fn(*args, sinks=torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="depth"):
        ta.check_tree_attention_args(*args, sliding_window=4, depth=batch.depth.long())
    with pytest.raises(ValueError, match="depth"):
        ta.tree_attention(*args, sliding_window=4)
    with pytest.raises(ValueError, match="depth"):
        cpu_native.tree_attention_native(
            native, batch.query, batch.kv_cache, batch.block_table, batch.query_start_loc,
            batch.seq_lens, torch.tensor([0]), batch.tree_mask, batch.scale,
            batch.query.clone(), sliding_window=4)
    with pytest.raises(ValueError, match="depth"):
        plan_tree_batch(batch.query_start_loc, batch.seq_lens, batch.block_table, BS,
                        batch.tree_mask, [0], sliding_window=4)
    # a window without tree requests needs no depth
    ta.check_tree_attention_args(*args[:7], sliding_window=4)
    tree_attention_reference(*args[:-1], torch.zeros_like(batch.is_tree), sliding_window=4)


def test_tree_info_carries_validated_depth():
    mask = torch.zeros(5, 1, dtype=torch.int32)
    is_tree = torch.tensor([True, False])
    depth = torch.tensor([0, 1, 1, 2, 0], dtype=torch.int32)
    info = TreeAttentionInfo.create(mask, is_tree, depth=depth)
    assert info.depth is depth
    assert TreeAttentionInfo.create(mask, is_tree).depth is None
    with pytest.raises(TypeError, match="depth must be an int32"):
        TreeAttentionInfo.create(mask, is_tree, depth=depth.long())
    with pytest.raises(ValueError, match="depth must be 1-D"):
        TreeAttentionInfo.create(mask, is_tree, depth=depth[:4])


def test_kernels_follow_the_rule_for_any_depths(native):
    """The rule holds for any per-row depths, not only a tree's (whose node j
    always has depth <= j): the kernels' skipping of keys outside every
    window must not rely on that."""
    reqs = [Req(45, 40, _tree(40, 7)), Req(12, 1), Req(3, 33, _tree(33, 8))]
    batch = build_batch(reqs, 8, 2, 32, BS, torch.float32, "cpu_vec", "cpu", seed=7)
    gen = torch.Generator().manual_seed(0)
    batch.depth[:] = torch.randint(20, 80, batch.depth.shape, generator=gen, dtype=torch.int32)
    kw = dict(sliding_window=6, sinks=_sinks(8), depth=batch.depth)
    ref = tree_attention_reference(*batch.args(), **kw)
    rows = _tree_rows(batch)
    out_k = ta.tree_attention(*batch.args(), max_query_len=40, **kw)
    torch.testing.assert_close(out_k, ref, atol=2e-5, rtol=2e-5)
    out_n = cpu_native.tree_attention_native(
        native, batch.query, batch.kv_cache, batch.block_table, batch.query_start_loc,
        batch.seq_lens, torch.tensor([0, 2]), batch.tree_mask, batch.scale,
        torch.zeros_like(batch.query), **kw)
    torch.testing.assert_close(out_n[rows], ref[rows], atol=2e-5, rtol=2e-5)
    plan = plan_tree_batch(batch.query_start_loc, batch.seq_lens, batch.block_table, BS,
                           batch.tree_mask, [0, 2], sliding_window=6, depth=batch.depth)
    out_b = tree_attention_batched(batch.query, batch.kv_cache, plan, batch.scale,
                                   torch.zeros_like(batch.query), sinks=kw["sinks"])
    torch.testing.assert_close(out_b[rows], ref[rows], atol=2e-5, rtol=2e-5)
