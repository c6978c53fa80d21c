"""The CPU runtime tree attention (batched torch, vLLM's "vec" cache layout)
against the torch reference."""

import pytest
import torch
from test_tree_attention_utils import Req, build_batch, make_parents

from vllm_ddtree.kernels.reference import tree_attention_reference
from vllm_ddtree.kernels import cpu_native
from vllm_ddtree.kernels.tree_attention_cpu import plan_tree_batch, tree_attention_batched

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def _tree(n, seed, shape="random"):
    return make_parents(n, torch.Generator().manual_seed(seed), shape)


# (dtype, layout, (q_heads, kv_heads), block_size, head_size, requests); a
# request is (ctx, q_len, tree shape or None for causal rows).
CASES = [
    (torch.float32, "cpu_vec", (4, 2), 32, 32,
     [(0, 17, "random"), (40, 1, None), (31, 17, "random"), (5, 9, "chain")]),
    (torch.float32, "cpu_vec", (8, 2), 16, 48,
     [(15, 65, "random"), (17, 1, "random"), (100, 33, "random")]),
    (torch.bfloat16, "cpu_vec", (5, 1), 16, 32,
     [(70, 5, None), (3, 33, "random"), (129, 64, "random")]),
    (torch.float32, "cpu_vec", (4, 4), 128, 64, [(1, 2, "random"), (300, 16, "random")]),
]


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_batched_matches_reference_on_tree_rows(case):
    dtype, layout, (hq, hkv), bs, hd, spec = case
    reqs = [Req(c, q, _tree(q, 11 * i, shape) if shape else None)
            for i, (c, q, shape) in enumerate(spec)]
    batch = build_batch(reqs, hq, hkv, hd, bs, dtype, layout, "cpu", seed=len(spec),
                        pad_tokens=2)
    tree_reqs = [i for i, r in enumerate(reqs) if r.parents is not None]
    plan = plan_tree_batch(batch.query_start_loc, batch.seq_lens, batch.block_table, bs,
                           batch.tree_mask, tree_reqs)
    # the runner's host-side sizes give the same plan without reading tensors
    num_q = max(spec[i][1] for i in tree_reqs)
    plan_host = plan_tree_batch(batch.query_start_loc, batch.seq_lens, batch.block_table, bs,
                                batch.tree_mask, tree_reqs, num_q=num_q,
                                max_seq_len=max(c + q for c, q, _ in spec) + bs)
    sentinel = torch.full_like(batch.query, 7.0)
    out = tree_attention_batched(batch.query, batch.kv_cache, plan,
                                 batch.scale, sentinel.clone())
    out_host = tree_attention_batched(batch.query, batch.kv_cache, plan_host,
                                      batch.scale, sentinel.clone())
    torch.testing.assert_close(out_host, out, atol=TOL[dtype], rtol=TOL[dtype])
    ref = tree_attention_reference(*batch.args())
    rows = torch.zeros(batch.query.shape[0], dtype=torch.bool)
    qsl = batch.query_start_loc.tolist()
    for r in tree_reqs:
        rows[qsl[r]:qsl[r + 1]] = True
    torch.testing.assert_close(out[rows].float(), ref[rows].float(), atol=TOL[dtype],
                               rtol=TOL[dtype])
    # Rows of other requests and padding rows are not written.
    assert torch.equal(out[~rows], sentinel[~rows])


def test_row_that_sees_nothing_is_zero():
    reqs = [Req(0, 4, _tree(4, 0)), Req(9, 3, _tree(3, 1))]
    batch = build_batch(reqs, 2, 2, 16, 16, torch.float32, "cpu_vec", "cpu", seed=0)
    batch.tree_mask[1] = 0  # node 1 of the context-free tree: no ancestor, not even itself
    plan = plan_tree_batch(batch.query_start_loc, batch.seq_lens, batch.block_table, 16,
                           batch.tree_mask, [0, 1])
    out = tree_attention_batched(batch.query, batch.kv_cache, plan,
                                 batch.scale, torch.full_like(batch.query, 7.0))
    ref = tree_attention_reference(*batch.args())
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out[:7], ref[:7], atol=2e-5, rtol=2e-5)


def test_plan_checks_its_inputs():
    reqs = [Req(3, 40, _tree(40, 0))]
    batch = build_batch(reqs, 2, 2, 16, 16, torch.float32, "cpu_vec", "cpu", seed=0)
    with pytest.raises(ValueError, match="words cannot hold"):
        plan_tree_batch(batch.query_start_loc, batch.seq_lens, batch.block_table, 16,
                        batch.tree_mask[:, :1], [0])
    with pytest.raises(ValueError, match="seq_lens"):
        plan_tree_batch(batch.query_start_loc, batch.seq_lens - 10, batch.block_table, 16,
                        batch.tree_mask, [0])
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        plan = plan_tree_batch(batch.query_start_loc, batch.seq_lens, batch.block_table, 16,
                               batch.tree_mask, [0])
        tree_attention_batched(batch.query[:, :1].expand(-1, 3, -1), batch.kv_cache,
                               plan, batch.scale, batch.query.clone())


@pytest.fixture(scope="module")
def native():
    lib = cpu_native.load()
    if lib is None:
        pytest.fail("the native CPU tree-attention kernel did not build on this machine; "
                    "the CPU engine would fall back to the slow torch path")
    return lib


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_native_matches_reference_on_tree_rows(case, native):
    dtype, layout, (hq, hkv), bs, hd, spec = case
    reqs = [Req(c, q, _tree(q, 11 * i, shape) if shape else None)
            for i, (c, q, shape) in enumerate(spec)]
    batch = build_batch(reqs, hq, hkv, hd, bs, dtype, layout, "cpu", seed=len(spec),
                        pad_tokens=2)
    tree_reqs = torch.tensor([i for i, r in enumerate(reqs) if r.parents is not None])
    sentinel = torch.full(batch.query.shape, 7.0)
    out = cpu_native.tree_attention_native(
        native, batch.query.float(), batch.kv_cache, batch.block_table,
        batch.query_start_loc, batch.seq_lens, tree_reqs, batch.tree_mask, batch.scale,
        sentinel.clone())
    ref = tree_attention_reference(*batch.args())
    rows = torch.zeros(batch.query.shape[0], dtype=torch.bool)
    qsl = batch.query_start_loc.tolist()
    for r in tree_reqs.tolist():
        rows[qsl[r]:qsl[r + 1]] = True
    torch.testing.assert_close(out[rows], ref[rows].float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(out[~rows], sentinel[~rows])  # nothing else is written


def test_native_row_that_sees_nothing_is_zero_and_bad_input_is_refused(native):
    reqs = [Req(0, 4, _tree(4, 0)), Req(9, 3, _tree(3, 1))]
    batch = build_batch(reqs, 2, 2, 16, 16, torch.float32, "cpu_vec", "cpu", seed=0)
    batch.tree_mask[1] = 0
    out = cpu_native.tree_attention_native(
        native, batch.query, batch.kv_cache, batch.block_table, batch.query_start_loc,
        batch.seq_lens, torch.tensor([0, 1]), batch.tree_mask, batch.scale,
        torch.full_like(batch.query, 7.0))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    ref = tree_attention_reference(*batch.args())
    torch.testing.assert_close(out[:7], ref[:7], atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="longer than its sequence"):
        cpu_native.tree_attention_native(
            native, batch.query, batch.kv_cache, batch.block_table, batch.query_start_loc,
            batch.seq_lens - 5, torch.tensor([0]), batch.tree_mask, batch.scale,
            batch.query.clone())
    with pytest.raises(TypeError, match="seq_lens must be a CPU torch.int32"):
        cpu_native.tree_attention_native(
            native, batch.query, batch.kv_cache, batch.block_table, batch.query_start_loc,
            batch.seq_lens.long(), torch.tensor([0]), batch.tree_mask, batch.scale,
            batch.query.clone())
