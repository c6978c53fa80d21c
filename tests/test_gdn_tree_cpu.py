"""Tree verification on vLLM CPU's Gated DeltaNet path, against the stock chain.

The stock function is vLLM CPU's own speculative GDN forward
(``gdn_attention._spec_forward``); ours is ``vllm_ddtree.gdn.cpu_tree_spec_forward``,
which the ``cpu-gdn-tree`` patch routes DDTree steps to. Both run on the same
fake layer and caches (bf16 activations, as vLLM CPU's GDN requires; the
recurrent state in fp32 for the exact checks, bf16 where stated). The stock
path is pinned to its torch conv (``_is_amx_tile_supported`` -> False), so the
comparison does not depend on the machine's ISA.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from benchmarks.bench_gdn_tree_cpu import gdn_layer
from vllm_ddtree.gdn import GDNTreeStep, cpu_tree_spec_forward
from vllm_ddtree.core.gdn_tree import build_plan, commit_columns

gdn_attention = pytest.importorskip("vllm.model_executor.layers.mamba.ops.cpu.gdn_attention")

H, HV, K, V, W, S = 1, 3, 128, 128, 4, 8
DIM = 2 * H * K + HV * V
STATE_LEN = W - 1 + S


@pytest.fixture(autouse=True)
def _torch_conv(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)


def make_layer(seed=0):
    return gdn_layer(torch.Generator().manual_seed(seed))


def make_caches(num_slots, ssm_dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    conv = torch.randn(num_slots, STATE_LEN, DIM, generator=g).bfloat16()  # SD storage
    ssm = (torch.randn(num_slots, HV, K, V, generator=g) * 0.1).to(ssm_dtype)
    return conv, ssm


def conv_view(conv):
    return conv.transpose(1, 2)  # [slots, dim, state_len], as vLLM CPU's _conv_buffer_view


def metadata(rows, qsl, num_acc):
    n = len(rows) // (S + 1)
    return SimpleNamespace(
        num_spec_decodes=n, num_prefills=0, num_decodes=0, spec_token_indx=None,
        spec_sequence_masks=None,
        spec_state_indices_tensor=torch.tensor(rows, dtype=torch.int32).view(n, S + 1),
        spec_query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        num_accepted_tokens=torch.tensor(num_acc, dtype=torch.int32))


def inputs(total, seed=2):
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(total, DIM, generator=g)).bfloat16(),
            torch.randn(total, HV, generator=g).bfloat16(),
            torch.randn(total, HV, generator=g).bfloat16())


def stock(layer, md, x, b, a, conv, ssm):
    return gdn_attention._spec_forward(layer, md, x, b, a, conv_view(conv), ssm, W, STATE_LEN)


def ours(layer, md, x, b, a, conv, ssm, parent, native=False):
    step = GDNTreeStep(torch.tensor(parent))
    return cpu_tree_spec_forward(step, layer, md, x, b, a, conv_view(conv), ssm, W,
                                 layer.conv1d.weight.view(DIM, W), native=native), step


def random_trees(rng, n, max_q=S + 1):
    parents, qsl = [], [0]
    for _ in range(n):
        q = rng.randint(1, max_q)
        parents += [-1] + [rng.randrange(j) for j in range(1, q)]
        qsl.append(qsl[-1] + q)
    return parents, qsl


def path_of(parent, base, j):
    out = []
    while j >= 0:
        out.append(j)
        j = parent[base + j]
    return out[::-1]


def test_plan_segments_and_waves():
    # one request: 0 -> 1 -> 2, 0 -> 3 -> 4, 1 -> 5
    parent = [-1, 0, 1, 0, 3, 1]
    plan = build_plan(parent, [0, 6], W, S)
    assert len(plan.waves) == 2
    w0, w1 = plan.waves
    assert w0.tokens.tolist() == [0, 1, 2] and w0.from_root.tolist() == [True]
    assert w1.tokens.tolist() == [3, 4, 5] and w1.cu_seqlens.tolist() == [0, 2, 3]
    assert w1.cols[0].tolist()[:3] == [3, 4, 0] and w1.cols[1].tolist()[:2] == [5, 1]
    # node 4's window: prior col 2 (latest prior), root 0, node 3, node 4
    prior = 1 * (W - 1)
    assert plan.conv_src[4].tolist() == [2, prior + 0, prior + 3, prior + 4]
    assert build_plan([-1, 0, 1, 2], [0, 4], W, S).is_chain
    with pytest.raises(ValueError, match="parents before children"):
        build_plan([-1, 2, 0], [0, 3], W, S)


@pytest.mark.parametrize("ssm_dtype", [torch.float32, torch.bfloat16])
def test_chain_shaped_tree_equals_stock_chain(ssm_dtype):
    """Every request a full chain (q = S + 1): outputs, every state column and
    the whole conv buffer are bit-identical to vLLM's own chain verification."""
    rng = random.Random(0)
    n = 3
    layer = make_layer()
    rows = list(range(n * (S + 1)))
    rng.shuffle(rows)
    qsl = [i * (S + 1) for i in range(n + 1)]
    num_acc = [rng.randint(1, S + 1) for _ in range(n)]
    x, b, a = inputs(qsl[-1])
    parent = [j - 1 for _ in range(n) for j in range(S + 1)]
    conv1, ssm1 = make_caches(len(rows) + 2, ssm_dtype)
    conv2, ssm2 = conv1.clone(), ssm1.clone()
    md = metadata(rows, qsl, num_acc)
    ref = stock(layer, md, x, b, a, conv1, ssm1)
    out, _ = ours(layer, md, x, b, a, conv2, ssm2, parent)
    assert torch.equal(out, ref)
    assert torch.equal(ssm2, ssm1)
    assert torch.equal(conv2, conv1)


@pytest.mark.parametrize("ssm_dtype", [torch.float32, torch.bfloat16])
def test_random_trees_equal_stock_chain_along_each_path(ssm_dtype):
    """Each node's output and stored state equal vLLM's chain run over the
    node's root-to-node path from the same prior window and state."""
    rng = random.Random(1)
    n = 4
    layer = make_layer(3)
    parent, qsl = random_trees(rng, n)
    rows = list(range(n * (S + 1)))
    rng.shuffle(rows)
    # DDTree's commit leaves every request at num_accepted = 1 (the stock chain
    # cannot run a path shorter than num_accepted from other offsets; the
    # chain-shaped test covers them)
    num_acc = [1] * n
    x, b, a = inputs(qsl[-1], seed=4)
    conv0, ssm0 = make_caches(len(rows) + 1, ssm_dtype, seed=5)
    conv, ssm = conv0.clone(), ssm0.clone()
    out, step = ours(layer, metadata(rows, qsl, num_acc), x, b, a, conv, ssm, parent)
    assert len(step.plan.waves) > 1  # real branching
    checked = 0
    for i in range(n):
        base, q = qsl[i], qsl[i + 1] - qsl[i]
        row = rows[i * (S + 1):(i + 1) * (S + 1)]
        for j in range(q):
            p = path_of(parent, base, j)
            toks = torch.tensor([base + k for k in p])
            c, s = conv0.clone(), ssm0.clone()
            ref = stock(layer, metadata(row, [0, len(p)], [num_acc[i]]), x[toks], b[toks],
                        a[toks], c, s)
            assert torch.equal(out[base + j], ref[-1]), (i, j, p)
            assert torch.equal(ssm[row[j]], s[row[len(p) - 1]]), (i, j, p)
            checked += 1
    assert checked == qsl[-1]
    # the rolling write-back: prior window minus its oldest input, then the inputs
    for i in range(n):
        slot, off = rows[i * (S + 1)], num_acc[i] - 1
        q = qsl[i + 1] - qsl[i]
        assert torch.equal(conv[slot, : W - 2], conv0[slot, off + 1: off + W - 1])
        assert torch.equal(conv[slot, W - 2: W - 2 + q], x[qsl[i]: qsl[i + 1]])


def test_commit_then_stock_step_equals_fresh_chain():
    """After the walk's commit, a stock chain step from the committed caches
    (num_accepted = 1) equals one fresh chain over the accepted path and the
    step's tokens; without the commit it does not."""
    rng = random.Random(2)
    n = 3
    layer = make_layer(6)
    # request 0 accepts 0 -> 3 -> 4, a path that leaves the first branch
    rest, rest_qsl = random_trees(rng, n - 1)
    parent = [-1, 0, 1, 0, 3] + rest
    qsl = [0] + [5 + q for q in rest_qsl]
    rows = list(range(n * (S + 1)))
    rng.shuffle(rows)
    x, b, a = inputs(qsl[-1], seed=7)
    conv0, ssm0 = make_caches(len(rows), torch.float32, seed=8)
    conv, ssm = conv0.clone(), ssm0.clone()
    md = metadata(rows, qsl, [1] * n)
    ours(layer, md, x, b, a, conv, ssm, parent)
    paths = []
    for i in range(n):
        base, q = qsl[i], qsl[i + 1] - qsl[i]
        paths.append(path_of(parent, base, rng.randrange(q) if i else 4))
    assert paths[0] == [0, 3, 4]
    width = 1 + S
    path_t = torch.tensor([p + [-1] * (width - len(p)) for p in paths])
    acc = torch.tensor([len(p) - 1 for p in paths])
    state_col, conv_cols = commit_columns(path_t, acc, W)
    skipped_conv, skipped_ssm = conv.clone(), ssm.clone()
    from vllm_ddtree.core.gdn_tree import commit_layer

    commit_layer(conv_view(conv), ssm, md.spec_state_indices_tensor, state_col, conv_cols)
    m = 3
    nx, nb, na = inputs(n * m, seed=9)
    step_md = metadata(rows, [i * m for i in range(n + 1)], [1] * n)
    after = stock(layer, step_md, nx, nb, na, conv, ssm)
    after_skipped = stock(layer, step_md, nx, nb, na, skipped_conv, skipped_ssm)
    differs = False
    for i in range(n):
        row = rows[i * (S + 1):(i + 1) * (S + 1)]
        toks = [qsl[i] + k for k in paths[i]]
        fx = torch.cat([x[toks], nx[i * m:(i + 1) * m]])
        fb = torch.cat([b[toks], nb[i * m:(i + 1) * m]])
        fa = torch.cat([a[toks], na[i * m:(i + 1) * m]])
        c, s = conv0.clone(), ssm0.clone()
        fresh = stock(layer, metadata(row, [0, len(toks) + m], [1]), fx, fb, fa, c, s)
        assert torch.equal(after[i * m:(i + 1) * m], fresh[-m:]), (i, paths[i])
        differs |= not torch.equal(after_skipped[i * m:(i + 1) * m], fresh[-m:])
    assert differs, "skipping the commit should change the next step"



# ---------------------------------------------------------------------------
# The native path (kernels/tree_attention_cpu.c): one call per layer
# ---------------------------------------------------------------------------

def _native_or_skip():
    from vllm_ddtree.kernels import cpu_native

    if cpu_native.load() is None:
        pytest.skip("the native CPU kernels are unavailable (no C compiler)")
    return cpu_native


# kernel against the torch path: the same values up to fp32 summation order
# and, where bf16 rounding boundaries fall between the two, a few bf16 steps
OUT_TOL = dict(atol=5e-4, rtol=1e-2)
STATE_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5),
             torch.bfloat16: dict(atol=1e-3, rtol=2e-2)}  # a few bf16 steps


def _random_case(seed, ssm_dtype, n=4, strided=False):
    rng = random.Random(seed)
    parent, qsl = random_trees(rng, n)
    rows = list(range(n * (S + 1)))
    rng.shuffle(rows)
    num_acc = [rng.randint(1, S + 1) for _ in range(n)]
    x, b, a = inputs(qsl[-1], seed=seed + 10)
    conv, ssm = make_caches(len(rows) + 1, ssm_dtype, seed=seed + 20)
    if strided:  # the engine's state is a view whose slots lie further apart
        ssm = torch.stack([ssm, torch.full_like(ssm, float("nan"))], 1)[:, 0]
        assert not ssm.is_contiguous()
    return parent, qsl, rows, num_acc, (x, b, a), conv, ssm


@pytest.mark.parametrize("ssm_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_native_tree_equals_torch_path(ssm_dtype, seed):
    """Outputs and every node's stored state match the torch path (itself bit
    for bit vLLM's chain along each path); the conv buffer is written
    identically. A tree with one parent changed does not match: the
    tolerances can tell trees apart."""
    _native_or_skip()
    layer = make_layer(seed)
    parent, qsl, rows, num_acc, (x, b, a), conv0, ssm0 = _random_case(seed, ssm_dtype,
                                                                       strided=seed == 2)
    md = metadata(rows, qsl, num_acc)
    conv_t, ssm_t = conv0.clone(), ssm0.clone()
    if seed == 2:  # clone() compacts; keep the native run's state strided
        ssm_n_base = torch.stack([ssm0.clone(), torch.full_like(ssm0, float("nan"))], 1)
    out_t, step_t = ours(layer, md, x, b, a, conv_t, ssm_t, parent, native=False)
    assert len(step_t.plan.waves) > 1  # real branching
    conv_n, ssm_n = conv0.clone(), ssm0.clone()
    if seed == 2:
        ssm_n = ssm_n_base[:, 0]
        assert not ssm_n.is_contiguous()
    out_n, step_n = ours(layer, md, x, b, a, conv_n, ssm_n, parent, native=True)
    if seed == 2:  # nothing written between the slots
        assert torch.isnan(ssm_n_base[:, 1]).all()
    assert out_n.dtype == out_t.dtype and out_n.shape == out_t.shape
    torch.testing.assert_close(out_n, out_t, **OUT_TOL)
    torch.testing.assert_close(ssm_n, ssm_t, **STATE_TOL[ssm_dtype])
    assert torch.equal(conv_n, conv_t)
    # what the commit needs was recorded
    assert step_n.width == W and set(step_n.layers) == {layer.prefix}
    assert step_n.spec_rows.tolist() == list(range(len(qsl) - 1))

    # a branch moved to another parent changes what its subtree computes
    moved = list(parent)
    j = next(t for t in range(len(parent)) if parent[t] > 0)
    moved[j] = parent[j] - 1
    conv_m, ssm_m = conv0.clone(), ssm0.clone()
    out_m, _ = ours(layer, md, x, b, a, conv_m, ssm_m, moved, native=True)
    assert not torch.allclose(out_m[j].float(), out_t[j].float(), **OUT_TOL)


def test_native_chain_matches_stock_chain():
    """A chain-shaped tree through the native kernel: vLLM's own chain
    verification, up to rounding."""
    _native_or_skip()
    rng = random.Random(5)
    n = 3
    layer = make_layer(4)
    rows = list(range(n * (S + 1)))
    rng.shuffle(rows)
    qsl = [i * (S + 1) for i in range(n + 1)]
    num_acc = [rng.randint(1, S + 1) for _ in range(n)]
    x, b, a = inputs(qsl[-1], seed=6)
    parent = [j - 1 for _ in range(n) for j in range(S + 1)]
    conv1, ssm1 = make_caches(len(rows) + 2, torch.float32)
    conv2, ssm2 = conv1.clone(), ssm1.clone()
    md = metadata(rows, qsl, num_acc)
    ref = stock(layer, md, x, b, a, conv1, ssm1)
    out, _ = ours(layer, md, x, b, a, conv2, ssm2, parent, native=True)
    torch.testing.assert_close(out, ref, **OUT_TOL)
    torch.testing.assert_close(ssm2, ssm1, **STATE_TOL[torch.float32])
    # the stock path rolls the whole buffer; the columns a later step reads agree
    for i in range(n):
        slot = rows[i * (S + 1)]
        assert torch.equal(conv2[slot, : W - 2 + S + 1], conv1[slot, : W - 2 + S + 1])


@pytest.mark.parametrize("bad, match", [
    ("parent", "parent does not come before its child"),
    ("num_acc", "num_accepted is outside"),
    ("slot", "state index is outside"),
    ("cu", "do not match the state-index rows and tokens"),
    ("cu0", "not ascending from 0"),
])
def test_native_rejects_bad_input(bad, match):
    _native_or_skip()
    layer = make_layer(0)
    parent, qsl, rows, num_acc, (x, b, a), conv, ssm = _random_case(3, torch.float32, n=2)
    if bad == "parent":
        parent = list(parent)
        parent[1] = 1
    elif bad == "num_acc":
        num_acc = [0] + num_acc[1:]
    elif bad == "slot":
        rows = list(rows)
        rows[0] = ssm.shape[0]
    elif bad == "cu":  # one token more than the step has
        qsl = qsl[:-1] + [qsl[-1] + 1]
        parent = parent + [0]
    else:  # the first sequence starts after token 0
        qsl = [1] + qsl[1:]
    with pytest.raises(ValueError, match=match):
        ours(layer, metadata(rows, qsl, num_acc), x, b, a, conv, ssm, parent, native=True)


def test_without_the_native_kernels_the_torch_path_runs(monkeypatch):
    """``native=None`` falls back to the torch path when the kernels do not
    load (bit for bit the stock chain), and ``native=True`` then refuses."""
    from vllm_ddtree.kernels import cpu_native

    monkeypatch.setitem(cpu_native._LOADED, "lib", None)
    layer = make_layer(2)
    n = 2
    rows = list(range(n * (S + 1)))
    qsl = [i * (S + 1) for i in range(n + 1)]
    x, b, a = inputs(qsl[-1], seed=3)
    parent = [j - 1 for _ in range(n) for j in range(S + 1)]
    conv1, ssm1 = make_caches(len(rows), torch.float32)
    conv2, ssm2 = conv1.clone(), ssm1.clone()
    md = metadata(rows, qsl, [1] * n)
    ref = stock(layer, md, x, b, a, conv1, ssm1)
    out, _ = ours(layer, md, x, b, a, conv2, ssm2, parent, native=None)
    assert torch.equal(out, ref) and torch.equal(ssm2, ssm1)
    with pytest.raises(RuntimeError, match="native CPU kernels are unavailable"):
        ours(layer, md, x, b, a, conv2, ssm2, parent, native=True)


def test_native_without_bias_or_activation():
    """The conv without a bias and without SiLU (vLLM CPU's GDN kernels take
    bf16 activations only), through the native kernel and the torch path."""
    _native_or_skip()
    layer = make_layer(7)
    layer.conv1d = SimpleNamespace(weight=layer.conv1d.weight, bias=None)
    layer.activation = None
    parent, qsl, rows, num_acc, (x, b, a), conv0, ssm0 = _random_case(4, torch.float32)
    md = metadata(rows, qsl, num_acc)
    conv_t, ssm_t = conv0.clone(), ssm0.clone()
    out_t, _ = ours(layer, md, x, b, a, conv_t, ssm_t, parent, native=False)
    conv_n, ssm_n = conv0.clone(), ssm0.clone()
    out_n, _ = ours(layer, md, x, b, a, conv_n, ssm_n, parent, native=True)
    torch.testing.assert_close(out_n, out_t, **OUT_TOL)
    torch.testing.assert_close(ssm_n, ssm_t, **STATE_TOL[torch.float32])
    assert torch.equal(conv_n, conv_t)
