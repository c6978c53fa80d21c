"""Triton tree-attention kernel vs the torch reference and vs path attention.

Without a GPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1 is
set here before the kernel module is imported). With a GPU it runs natively.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from test_tree_attention_utils import (  # noqa: E402
    Req,
    build_batch,
    make_parents,
    path_attention,
    quantize_batch,
)

from vllm_ddtree.kernels import tree_attention as ta  # noqa: E402
from vllm_ddtree.kernels.reference import tree_attention_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"

if not ON_GPU and not ta.INTERPRETED:
    pytest.skip(
        "the kernel module was imported before TRITON_INTERPRET=1 was set",
        allow_module_level=True,
    )

# (atol, rtol) of kernel vs reference; the reference computes in fp32.
TOL = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}


def _tree(n, seed, shape="random"):
    return make_parents(n, torch.Generator().manual_seed(seed), shape)


def _run_both(batch, **kw):
    ta.check_tree_attention_args(*batch.args(), max_query_len=batch.max_query_len, **kw)
    out_k = ta.tree_attention(*batch.args(), max_query_len=batch.max_query_len, **kw)
    out_r = tree_attention_reference(*batch.args(), **kw)
    return out_k, out_r


def _assert_close(out_k, out_r, dtype, rows=None):
    atol, rtol = TOL[dtype]
    if rows is not None:
        out_k, out_r = out_k[rows], out_r[rows]
    assert torch.isfinite(out_k).all()
    torch.testing.assert_close(out_k.float(), out_r.float(), atol=atol, rtol=rtol)


# Each case mixes a prefill chunk, decodes and trees of 1 + B nodes; context
# lengths cover 0, 1, bs-1, bs+1 and several blocks across the cases.
# (dtype, layout, (q_heads, kv_heads), block_size, head_size, B, requests)
def _cases():
    f32, f16 = torch.float32, torch.float16
    return [
        (f32, "nhd", (4, 4), 16, 32, 1,
         [("tree", 0), ("decode", 1), ("prefill", 0, 20)]),
        (f16, "cpu_vec", (8, 2), 32, 32, 7,
         [("tree", 31), ("decode", 33), ("prefill", 1, 5), ("tree", 1)]),
        (f32, "cpu_vec", (5, 1), 16, 32, 31,
         [("decode", 15), ("tree", 17), ("prefill", 50, 30)]),
        (f16, "nhd", (4, 4), 32, 32, 32,
         [("tree", 101), ("decode", 0), ("chain", 31)]),
        (f32, "nhd", (8, 2), 32, 32, 33,
         [("tree", 0), ("prefill", 33, 40), ("tree", 31), ("decode", 64)]),
        (f16, "cpu_vec", (5, 1), 16, 32, 64,
         [("prefill", 16, 40), ("tree", 70), ("decode", 5)]),
        (f32, "cpu_vec", (4, 4), 32, 32, 64,
         [("chain", 130), ("tree", 95), ("decode", 200)]),
        (f16, "nhd", (8, 2), 16, 80, 7,
         [("tree", 16), ("decode", 17), ("tree", 3), ("decode", 48),
          ("tree", 47), ("prefill", 0, 3)]),
    ]  # fmt: skip


def _make_reqs(spec, budget, seed):
    reqs = []
    for k, item in enumerate(spec):
        kind, ctx = item[0], item[1]
        if kind == "decode":
            reqs.append(Req(ctx, 1))
        elif kind == "prefill":
            reqs.append(Req(ctx, item[2]))
        else:
            shape = "chain" if kind == "chain" else "random"
            reqs.append(Req(ctx, budget + 1, _tree(budget + 1, seed + k, shape)))
    return reqs


CASES = _cases()


@pytest.mark.parametrize(
    "case",
    CASES,
    ids=[
        f"{str(c[0])[6:]}-{c[1]}-h{c[2][0]}x{c[2][1]}-bs{c[3]}-d{c[4]}-B{c[5]}"
        for c in CASES
    ],
)
def test_kernel_matches_reference_mixed_batch(case):
    dtype, layout, (hq, hkv), bs, hd, budget, spec = case
    reqs = _make_reqs(spec, budget, seed=budget)
    batch = build_batch(
        reqs, hq, hkv, hd, bs, dtype, layout, DEVICE, seed=budget, pad_tokens=3
    )
    sentinel = torch.full_like(batch.query, 7.0)
    out_k = ta.tree_attention(
        *batch.args(), output=sentinel.clone(), max_query_len=batch.max_query_len
    )
    out_r = tree_attention_reference(*batch.args())
    n = int(batch.query_start_loc[-1])
    _assert_close(out_k[:n], out_r[:n], dtype)
    # padding rows beyond the last request are not written
    assert torch.equal(out_k[n:], sentinel[n:])


@pytest.mark.parametrize("kind", ["e4m3", "e5m2"])
@pytest.mark.parametrize("layout", ["nhd", "cpu_vec"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fp8_cache_matches_reference(kind, layout, dtype):
    # uint8 fp8 codes with per-tensor scales (tests/test_tree_attention_fp8.py
    # has the CPU paths and vLLM's own cache); the decoded values are exact in
    # every query dtype, so the tolerances are the unquantized ones.
    reqs = _make_reqs([("tree", 31), ("decode", 33), ("prefill", 1, 5), ("chain", 17)], 9,
                      seed=3)
    batch = build_batch(reqs, 8, 2, 32, 16, torch.float32, layout, DEVICE, seed=3,
                        pad_tokens=2)
    batch = quantize_batch(batch, layout, kind, 0.37, 1.9)
    batch.query = batch.query.to(dtype)
    quant = dict(kv_quant=kind, k_scale=0.37, v_scale=1.9)
    out_k, out_r = _run_both(batch, **quant)
    n = int(batch.query_start_loc[-1])
    _assert_close(out_k[:n], out_r[:n], dtype)
    if dtype == torch.float32:
        for node in range(reqs[0].q_len):  # the reference itself: dequantized K/V
            torch.testing.assert_close(out_k[node].double().cpu(),
                                       path_attention(batch, 0, node), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["nhd", "cpu_vec", "hnd"])
def test_chain_tree_is_causal(layout):
    dtype = torch.float32
    ctxs = [0, 5, 37]
    reqs = [Req(c, 20, _tree(20, c, "chain")) for c in ctxs]
    batch = build_batch(reqs, 8, 2, 32, 16, dtype, layout, DEVICE, seed=3)
    causal = torch.zeros_like(batch.is_tree)
    out_tree = ta.tree_attention(*batch.args())
    out_causal = ta.tree_attention(*batch.args()[:-1], causal)
    if ON_GPU:
        torch.testing.assert_close(out_tree, out_causal, atol=1e-6, rtol=0)
    else:
        assert torch.equal(out_tree, out_causal)
    ref_tree = tree_attention_reference(*batch.args())
    ref_causal = tree_attention_reference(*batch.args()[:-1], causal)
    assert torch.equal(ref_tree, ref_causal)
    _assert_close(out_tree, ref_tree, dtype)


@pytest.mark.parametrize(
    "layout,dtype,heads,n,shape",
    [
        ("nhd", torch.float32, (8, 2), 40, "random"),
        ("cpu_vec", torch.float32, (5, 1), 33, "random"),
        ("cpu_vec", torch.float16, (4, 4), 17, "star"),
    ],
)
def test_each_node_attends_to_its_root_path(layout, dtype, heads, n, shape):
    reqs = [Req(23, n, _tree(n, 11, shape)), Req(9, 1), Req(0, n, _tree(n, 12))]
    batch = build_batch(reqs, heads[0], heads[1], 32, 16, dtype, layout, DEVICE, seed=5)
    out_k, out_r = _run_both(batch)
    atol = 1e-5 if dtype == torch.float32 else 4e-3
    for ri in (0, 2):
        q0 = int(batch.query_start_loc[ri])
        for node in range(n):
            expected = path_attention(batch, ri, node)
            got_k = out_k[q0 + node].double().cpu()
            got_r = out_r[q0 + node].double().cpu()
            torch.testing.assert_close(got_k, expected, atol=atol, rtol=atol)
            torch.testing.assert_close(got_r, expected, atol=atol, rtol=atol)


def test_bf16_matches_reference():
    # bf16 tl.dot is wrong in the interpreter; the kernel must avoid it there.
    if not ON_GPU:
        assert ta._dot_in_fp32(torch.bfloat16)
    reqs = [Req(40, 9, _tree(9, 1)), Req(7, 1), Req(3, 12)]
    batch = build_batch(reqs, 4, 2, 64, 16, torch.bfloat16, "cpu_vec", DEVICE, seed=9)
    out_k, out_r = _run_both(batch)
    _assert_close(out_k, out_r, torch.bfloat16)


def test_tree_only_leaves_other_rows():
    reqs = [Req(10, 1), Req(20, 8, _tree(8, 2)), Req(5, 6)]
    batch = build_batch(reqs, 4, 4, 32, 16, torch.float32, "nhd", DEVICE, seed=1)
    sentinel = torch.full_like(batch.query, -3.0)
    out_k = ta.tree_attention(*batch.args(), output=sentinel.clone(), tree_only=True)
    out_r = tree_attention_reference(*batch.args(), output=sentinel.clone(), tree_only=True)
    assert torch.equal(out_k[:1], sentinel[:1])
    assert torch.equal(out_k[9:], sentinel[9:])
    assert torch.equal(out_r[9:], sentinel[9:])
    assert not torch.equal(out_k[1:9], sentinel[1:9])
    _assert_close(out_k, out_r, torch.float32, rows=slice(1, 9))


def test_row_without_visible_keys_is_zero():
    parents = _tree(4, 0)
    batch = build_batch([Req(0, 4, parents)], 4, 4, 32, 16, torch.float32, "nhd", DEVICE)
    batch.tree_mask[2] = 0  # node 2 sees nothing (no context either)
    out_k, out_r = _run_both(batch)
    assert torch.equal(out_k[2], torch.zeros_like(out_k[2]))
    assert torch.equal(out_r[2], torch.zeros_like(out_r[2]))
    _assert_close(out_k, out_r, torch.float32)


def test_mask_rows_of_causal_requests_are_ignored():
    reqs = [Req(12, 5), Req(3, 6, _tree(6, 4))]
    batch = build_batch(reqs, 8, 2, 32, 16, torch.float32, "cpu_vec", DEVICE, seed=2)
    out1 = ta.tree_attention(*batch.args())
    batch.tree_mask[:5] = -1
    out2 = ta.tree_attention(*batch.args())
    assert torch.equal(out1, out2)


def test_validator_rejects_bad_arguments():
    batch = build_batch([Req(4, 3, _tree(3, 0))], 4, 2, 32, 16, torch.float32, "nhd", DEVICE)
    args = list(batch.args())
    with pytest.raises(ValueError, match="key_cache"):
        ta.check_tree_attention_args(args[0], args[1].half(), *args[2:])
    with pytest.raises(ValueError, match="tree_mask"):
        ta.check_tree_attention_args(*args[:7], args[7].long(), args[8])
    with pytest.raises(ValueError, match="is_tree"):
        ta.check_tree_attention_args(*args[:8], args[8].int())
    with pytest.raises(ValueError, match="num_q_heads"):
        ta.check_tree_attention_args(args[0][:, :3].contiguous(), *args[1:])
    with pytest.raises(ValueError, match="query_start_loc"):
        ta.check_tree_attention_args(*args[:4], args[4][:-1], *args[5:])
    with pytest.raises(ValueError, match="tree_mask"):
        ta.check_tree_attention_args(*args, max_query_len=33)
    with pytest.raises(ValueError, match="query"):
        ta.check_tree_attention_args(args[0].double(), *args[1:])
    ta.check_tree_attention_args(*args, max_query_len=batch.max_query_len)  # well-formed


def test_reference_rejects_short_masks():
    batch = build_batch([Req(2, 40, _tree(40, 0))], 4, 4, 32, 16, torch.float32, "nhd", DEVICE)
    args = list(batch.args())
    with pytest.raises(ValueError, match="tree_mask"):
        tree_attention_reference(*args[:7], args[7][:, :1], args[8])
