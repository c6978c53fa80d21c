"""Tree Gated DeltaNet spec-decode kernels: torch reference, Triton kernels,
and the engine's commit after the walk (``vllm_ddtree.core.gdn_tree``).

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1 is
set here before the kernel module is imported). With a GPU they run natively.
Shapes are small: every tree has at most S + 1 = 9 nodes.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import dataclass, replace  # noqa: E402

import pytest  # noqa: E402

from vllm_ddtree.core.gdn_tree import commit_columns, commit_layer  # noqa: E402
from vllm_ddtree.kernels import gdn_tree as gt  # noqa: E402
from vllm_ddtree.kernels import gdn_tree_reference as ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"

if not ON_GPU and not gt.INTERPRETED:
    pytest.skip(
        "the kernel module was imported before TRITON_INTERPRET=1 was set",
        allow_module_level=True,
    )

pytestmark = pytest.mark.usefixtures("one_thread")

S = 8  # speculative tokens: trees of up to S + 1 nodes, S + 1 state columns

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# (atol, rtol) of kernel vs reference, by the coarsest dtype involved.
TOL = {F32: (1e-5, 1e-5), F16: (4e-3, 4e-3), BF16: (3e-2, 3e-2)}


# --------------------------------------------------------------------------
# Batch construction
# --------------------------------------------------------------------------


def random_parents(n, gen, branch=True):
    """Flat-order tree of n nodes; with ``branch`` node 2 is a sibling of 1."""
    par = [-1]
    for j in range(1, n):
        if branch and j == 2:
            par.append(0)
        else:
            par.append(int(torch.randint(0, j, (1,), generator=gen)))
    return par


@dataclass
class Batch:
    cu: torch.Tensor
    parent: torch.Tensor
    par: list  # per request: local parent list
    n_acc: torch.Tensor
    conv_slot: torch.Tensor
    rows: torch.Tensor
    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    activation: str | None
    conv_state: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    ssm_state: torch.Tensor

    @property
    def width(self):
        return self.weight.shape[1]

    def conv_args(self, conv_state=None, parent="tree"):
        return (self.x, self.conv_state if conv_state is None else conv_state,
                self.weight, self.bias, self.activation, self.conv_slot, self.n_acc,
                self.parent if parent == "tree" else parent, self.cu)

    def rec_args(self, ssm_state=None, parent="tree"):
        return (self.q, self.k, self.v, self.a, self.b, self.A_log, self.dt_bias,
                self.ssm_state if ssm_state is None else ssm_state, self.rows,
                self.n_acc, self.parent if parent == "tree" else parent, self.cu)

    def spans(self):
        cu = self.cu.tolist()
        return [(cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


def make_batch(seed, trees, n_acc, *, width=4, dim=20, heads=(2, 4), K=8, V=8,
               dtype=F32, conv_dtype=None, ssm_dtype=None, transposed=False,
               bias=True, activation="silu", shared_slots=False):
    """``trees``: per request a parent list (local indices). ``shared_slots``:
    vLLM's layout, where conv buffers and SSM states share one slot space and
    a request's conv slot is column 0 of its state-index row."""
    gen = torch.Generator().manual_seed(seed)
    H, HV = heads
    conv_dtype = conv_dtype or dtype
    ssm_dtype = ssm_dtype or dtype
    n_req = len(trees)
    lens = [len(p) for p in trees]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    T = int(cu[-1])

    def rnd(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=gen) * scale).to(dt)

    state_len = width - 1 + S
    ssm_slots = n_req * (S + 1) + 4
    conv_slots = ssm_slots if shared_slots else n_req + 3
    if transposed:  # vLLM's "SD" layout: [slots, state_len, dim] storage
        conv_state = rnd(conv_slots, state_len, dim, dt=conv_dtype).transpose(1, 2)
    else:
        conv_state = rnd(conv_slots, dim, state_len, dt=conv_dtype)
    if not shared_slots:
        conv_slot = (torch.randperm(conv_slots - 1, generator=gen)[:n_req] + 1).int()
    ssm_state = rnd(ssm_slots, HV, V, K, scale=0.5, dt=ssm_dtype)
    rows = (torch.randperm(ssm_slots - 1, generator=gen)[: n_req * (S + 1)] + 1)
    rows = rows.view(n_req, S + 1).int()
    if shared_slots:
        conv_slot = rows[:, 0].clone()
    a = rnd(T, HV)
    if T:
        a[0, 0] = 25.0  # softplus above its threshold
    bt = Batch(
        cu=cu,
        parent=torch.tensor([p for t in trees for p in t], dtype=torch.int32),
        par=[list(t) for t in trees],
        n_acc=torch.tensor(n_acc, dtype=torch.int32),
        conv_slot=conv_slot,
        rows=rows,
        x=rnd(T, dim),
        weight=rnd(dim, width, scale=0.5),
        bias=rnd(dim, scale=0.5) if bias else None,
        activation=activation,
        conv_state=conv_state,
        q=rnd(T, H, K),
        k=rnd(T, H, K),
        v=rnd(T, HV, V),
        a=a,
        b=rnd(T, HV),
        A_log=torch.empty(HV).uniform_(-1.0, 0.5, generator=gen),
        dt_bias=rnd(HV, scale=0.5),
        ssm_state=ssm_state,
    )
    return to_device(bt, DEVICE)


def to_device(bt, device):
    return replace(bt, **{
        f: getattr(bt, f).to(device)
        for f in bt.__dataclass_fields__
        if isinstance(getattr(bt, f), torch.Tensor)
    })


def random_batch(seed, n_req=4, **kw):
    gen = torch.Generator().manual_seed(1000 + seed)
    sizes = [int(s) for s in torch.randint(1, S + 2, (n_req,), generator=gen)]
    sizes[0] = max(sizes[0], 4)  # at least one real branch
    trees = [random_parents(n, gen) for n in sizes]
    n_acc = [int(s) for s in torch.randint(1, S + 2, (n_req,), generator=gen)]
    return make_batch(seed, trees, n_acc, **kw)


def path_chains(bt, nodes, conv_state0, ssm_state0):
    """One chain request per (request, node): its root-to-node path, starting
    from the same prior buffer and initial state (copied to fresh slots)."""
    spans = bt.spans()
    tokens, lens, chain_nacc = [], [], []
    for i, j in nodes:
        path = ref.path_of(bt.par[i], j)
        tokens += [spans[i][0] + p for p in path]
        lens.append(len(path))
        chain_nacc.append(int(bt.n_acc[i]))
    tok = torch.tensor(tokens, device=bt.x.device)
    n = len(nodes)
    conv_slot = torch.arange(1, n + 1, dtype=torch.int32)
    rows = (torch.arange(n * (S + 1)) + 1).view(n, S + 1).int()
    conv_state = torch.zeros(n + 1, *conv_state0.shape[1:], dtype=conv_state0.dtype)
    ssm_state = torch.zeros(n * (S + 1) + 1, *ssm_state0.shape[1:],
                            dtype=ssm_state0.dtype)
    for c, (i, _) in enumerate(nodes):
        conv_state[c + 1] = conv_state0[int(bt.conv_slot[i])].cpu()
        init_col = chain_nacc[c] - 1
        ssm_state[int(rows[c, init_col])] = ssm_state0[int(bt.rows[i, init_col])].cpu()
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    chain = replace(
        bt, cu=cu, parent=ref.chain_parent(cu), par=[list(range(-1, m - 1)) for m in lens],
        n_acc=torch.tensor(chain_nacc, dtype=torch.int32), conv_slot=conv_slot,
        rows=rows, conv_state=conv_state, ssm_state=ssm_state,
        x=bt.x[tok], q=bt.q[tok], k=bt.k[tok], v=bt.v[tok], a=bt.a[tok], b=bt.b[tok],
    )
    return to_device(chain, bt.x.device), lens


def all_nodes(bt):
    return [(i, j) for i, (s, e) in enumerate(bt.spans()) for j in range(e - s)]


def assert_nodes_equal_path_chains(bt, out, o, hs, conv_fn, rec_fn):
    """Every node's conv output, GDN output and stored state (``out``, ``o``,
    ``hs`` of a tree step) equal ``conv_fn``/``rec_fn`` run as a chain along
    the node's root path, bit for bit."""
    nodes = all_nodes(bt)
    chain, lens = path_chains(bt, nodes, bt.conv_state, bt.ssm_state)
    c_out = conv_fn(*chain.conv_args())
    c_o = rec_fn(*chain.rec_args())
    ends = (torch.tensor(lens).cumsum(0) - 1).tolist()
    spans = bt.spans()
    for c, (i, j) in enumerate(nodes):
        t = spans[i][0] + j
        assert torch.equal(out[t], c_out[ends[c]]), (i, j)
        assert torch.equal(o[t], c_o[ends[c]]), (i, j)
        assert torch.equal(hs[int(bt.rows[i, j])],
                           chain.ssm_state[int(chain.rows[c, lens[c] - 1])]), (i, j)


def assert_close(got, want, dtype):
    atol, rtol = TOL[dtype]
    assert torch.isfinite(got.float()).all()
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


# --------------------------------------------------------------------------
# Independent per-token chain updates (vLLM's stock spec-decode semantics)
# --------------------------------------------------------------------------


def stock_chain_conv(bt, conv_state):
    W = bt.width
    out = torch.empty_like(bt.x)
    for i, (s, e) in enumerate(bt.spans()):
        buf = conv_state[int(bt.conv_slot[i])]
        off = int(bt.n_acc[i]) - 1
        xs = bt.x[s:e].to(conv_state.dtype)
        seq = torch.cat([buf[:, off:off + W - 1], xs.T], dim=1).float()
        windows = seq.unfold(1, W, 1)                         # [dim, q, W]
        y = (windows * bt.weight.float()[:, None, :]).sum(-1).T
        if bt.bias is not None:
            y = y + bt.bias.float()
        if bt.activation == "silu":
            y = torch.nn.functional.silu(y)
        out[s:e] = y.to(out.dtype)
        buf[:, :W - 2 + (e - s)] = seq[:, 1:].to(buf.dtype)
    return out


def stock_chain_recurrent(bt, ssm_state):
    H, HV = bt.q.shape[1], bt.v.shape[1]
    out = torch.empty(bt.v.shape, dtype=bt.q.dtype)
    scale = bt.q.shape[-1] ** -0.5
    for i, (s, e) in enumerate(bt.spans()):
        row = bt.rows[i].tolist()
        h = ssm_state[row[int(bt.n_acc[i]) - 1]].float().transpose(1, 2)  # [HV,K,V]
        for j, t in enumerate(range(s, e)):
            qn = torch.nn.functional.normalize(bt.q[t].float(), dim=-1, eps=0)
            kn = torch.nn.functional.normalize(bt.k[t].float(), dim=-1, eps=0)
            qn = qn.repeat_interleave(HV // H, 0) * scale
            kn = kn.repeat_interleave(HV // H, 0)
            g = -bt.A_log.float().exp() * torch.nn.functional.softplus(
                bt.a[t].float() + bt.dt_bias.float())
            beta = bt.b[t].float().sigmoid()
            h = h * g.exp()[:, None, None]
            err = bt.v[t].float() - torch.einsum("hk,hkv->hv", kn, h)
            h = h + torch.einsum("hk,hv->hkv", kn, err * beta[:, None])
            out[t] = torch.einsum("hk,hkv->hv", qn, h).to(out.dtype)
            ssm_state[row[j]] = h.transpose(1, 2).to(ssm_state.dtype)
    return out


# --------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------


@pytest.mark.parametrize("width", [2, 3, 4])
def test_reference_chain_is_stock_per_token_update(width):
    sizes = [9, 1, 4, 6, 9]
    bt = to_device(make_batch(width, [list(range(-1, n - 1)) for n in sizes],
                              [1, 9, 5, 3, 9], width=width), "cpu")
    for parent in (bt.parent, None):
        cs_ref, cs_stock = bt.conv_state.clone(), bt.conv_state.clone()
        out_ref = ref.tree_conv_update_ref(*bt.conv_args(cs_ref, parent=parent))
        out_stock = stock_chain_conv(bt, cs_stock)
        torch.testing.assert_close(out_ref, out_stock, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(cs_ref, cs_stock, atol=0, rtol=0)

        h_ref, h_stock = bt.ssm_state.clone(), bt.ssm_state.clone()
        o_ref = ref.tree_recurrent_update_ref(*bt.rec_args(h_ref, parent=parent))
        o_stock = stock_chain_recurrent(bt, h_stock)
        torch.testing.assert_close(o_ref, o_stock, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(h_ref, h_stock, atol=1e-5, rtol=1e-5)
        assert not torch.equal(h_ref, bt.ssm_state)


@pytest.mark.parametrize("width,seed", [(4, 0), (3, 1), (2, 2)])
def test_reference_tree_nodes_equal_path_chains(width, seed):
    bt = to_device(random_batch(seed, n_req=5, width=width), "cpu")
    cs, hs = bt.conv_state.clone(), bt.ssm_state.clone()
    out = ref.tree_conv_update_ref(*bt.conv_args(cs))
    o = ref.tree_recurrent_update_ref(*bt.rec_args(hs))

    assert_nodes_equal_path_chains(bt, out, o, hs, ref.tree_conv_update_ref,
                                   ref.tree_recurrent_update_ref)


def test_reference_validates_trees():
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    ref.validate_tree(torch.tensor([-1, 0, 0, -1, 0], dtype=torch.int32), cu)
    for bad in ([-1, 0, 2, -1, 0], [0, 0, 0, -1, 0], [-1, 0, 1, -1, -1]):
        with pytest.raises(ValueError, match="parent"):
            ref.validate_tree(torch.tensor(bad, dtype=torch.int32), cu)
    assert ref.path_of([-1, 0, 0, 2, 1], 3) == [0, 2, 3]
    assert ref.chain_parent(cu).tolist() == [-1, 0, 1, -1, 0]


# --------------------------------------------------------------------------
# Kernels vs reference
# --------------------------------------------------------------------------

# (name, seed, make_batch keywords, conv block_n, tolerance dtype)
KERNEL_CASES = [
    ("f32-w4-T", 3, dict(width=4, dim=40, transposed=True), 16, F32),
    ("f32-w3-k24-v40-nobias", 4,
     dict(width=3, dim=33, heads=(1, 2), K=24, V=40, bias=False, activation=None),
     32, F32),
    ("f32-w2-k64", 5, dict(width=2, dim=17, heads=(1, 1), K=64, V=64), None, F32),
    ("f16-w2", 6, dict(width=2, dtype=F16, ssm_dtype=F32), 8, F16),
    ("f16-w4-f16state", 7, dict(width=4, dtype=F16, transposed=True), None, F16),
    ("bf16-w4-bf16state", 8, dict(width=4, dtype=BF16, heads=(2, 2)), 16, BF16),
]


@pytest.mark.parametrize("case", KERNEL_CASES, ids=[c[0] for c in KERNEL_CASES])
def test_kernel_matches_reference(case):
    _, seed, kw, block_n, tol = case
    bt = random_batch(seed, **kw)
    cs_k, cs_r = bt.conv_state.clone(), bt.conv_state.clone()
    out_k = gt.tree_conv_update(*bt.conv_args(cs_k), block_n=block_n)
    out_r = ref.tree_conv_update_ref(*bt.conv_args(cs_r))
    assert out_k.dtype == bt.x.dtype
    assert_close(out_k, out_r, tol)
    # The buffer holds copies of inputs and old columns: exact, untouched
    # slots and columns included.
    assert torch.equal(cs_k, cs_r)
    assert not torch.equal(cs_k, bt.conv_state)

    hs_k, hs_r = bt.ssm_state.clone(), bt.ssm_state.clone()
    o_k = gt.tree_recurrent_update(*bt.rec_args(hs_k))
    o_r = ref.tree_recurrent_update_ref(*bt.rec_args(hs_r))
    assert o_k.dtype == bt.q.dtype and o_k.shape == bt.v.shape
    assert_close(o_k, o_r, tol)
    assert_close(hs_k, hs_r, tol)  # every slot, every column
    unused = torch.ones(hs_k.shape[0], dtype=torch.bool)
    for i, (s, e) in enumerate(bt.spans()):
        unused[bt.rows[i, : e - s].long().cpu()] = False
    assert torch.equal(hs_k[unused.to(hs_k.device)], bt.ssm_state[unused.to(hs_k.device)])


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_kernel_chain_tree_is_the_chain_kernel(dtype):
    """parent = j - 1 takes no branch: bit for bit the parent-free (stock)
    chain, also with a bf16 state, where a reload would round."""
    bt = make_batch(11, [list(range(-1, n - 1)) for n in (9, 3, 1, 6)], [9, 1, 4, 2],
                    width=4, dtype=dtype)
    results = []
    for parent in (bt.parent, None):
        cs, hs = bt.conv_state.clone(), bt.ssm_state.clone()
        out = gt.tree_conv_update(*bt.conv_args(cs, parent=parent), block_n=8)
        o = gt.tree_recurrent_update(*bt.rec_args(hs, parent=parent))
        results.append((out, cs, o, hs))
    for got, want in zip(results[0], results[1], strict=True):
        assert torch.equal(got, want)


def test_kernel_tree_nodes_equal_kernel_path_chains():
    """fp32 state: each node's output and stored state are bit for bit those of
    the kernel run as a chain along the node's root path."""
    bt = random_batch(12, n_req=3, width=4, dim=12, heads=(1, 2))
    cs, hs = bt.conv_state.clone(), bt.ssm_state.clone()
    out = gt.tree_conv_update(*bt.conv_args(cs))
    o = gt.tree_recurrent_update(*bt.rec_args(hs))
    assert_nodes_equal_path_chains(bt, out, o, hs, gt.tree_conv_update,
                                   gt.tree_recurrent_update)


def test_null_slots_are_skipped():
    bt = make_batch(13, [[-1, 0, 0], [-1, 0], [-1]], [3, 1, 1], width=3)
    bt.conv_slot[1] = 0           # conv: request 1 is padding
    bt.rows[2] = 0                # recurrence: request 2 is padding
    bt.rows[0, 1] = 0             # request 0's leaf 1: its state is not stored
    bt.conv_state[0] = 7.0
    bt.ssm_state[0] = 7.0
    cpu = to_device(bt, "cpu")
    conv_written = {int(cpu.conv_slot[0]), int(cpu.conv_slot[2])}
    ssm_written = {int(cpu.rows[0, 0]), int(cpu.rows[0, 2]), int(cpu.rows[1, 0]),
                   int(cpu.rows[1, 1])}
    for impl in ("kernel", "ref"):
        if impl == "kernel":
            cs, hs = bt.conv_state.clone(), bt.ssm_state.clone()
            gt.tree_conv_update(*bt.conv_args(cs))
            gt.tree_recurrent_update(*bt.rec_args(hs))
            cs, hs = cs.cpu(), hs.cpu()
        else:
            cs, hs = cpu.conv_state.clone(), cpu.ssm_state.clone()
            ref.tree_conv_update_ref(*cpu.conv_args(cs))
            ref.tree_recurrent_update_ref(*cpu.rec_args(hs))
        for slot in range(cs.shape[0]):
            same = torch.equal(cs[slot], cpu.conv_state[slot])
            assert same == (slot not in conv_written), (impl, "conv", slot)
        for slot in range(hs.shape[0]):
            same = torch.equal(hs[slot], cpu.ssm_state[slot])
            assert same == (slot not in ssm_written), (impl, "ssm", slot)


# --------------------------------------------------------------------------
# Commit
# --------------------------------------------------------------------------


def _path_tensor(paths, device):
    """The engine's accepted-path layout: ``path`` ``[N, 1 + S]`` (local node
    indices, -1 padded) and ``num_accepted`` ``[N]`` (nodes past the root)."""
    path = torch.full((len(paths), S + 1), -1, dtype=torch.long)
    for i, p in enumerate(paths):
        path[i, : len(p)] = torch.tensor(p)
    acc = torch.tensor([len(p) - 1 for p in paths], dtype=torch.long)
    return path.to(device), acc.to(device)


def _window_cols(path, width):
    """Oracle: the conv-buffer columns (after the tree step) holding the last
    ``W - 1`` inputs along ``path``: ``[0, W - 2)`` is the prior window minus
    its oldest input, node ``j``'s input is column ``W - 2 + j``."""
    seq = list(range(width - 2)) + [width - 2 + j for j in path]
    return seq[-(width - 1):]


def _commit(bt, conv_state, ssm_state, paths):
    """The engine's commit, in place (vLLM layout: conv slot = rows[:, 0])."""
    assert torch.equal(bt.conv_slot.long(), bt.rows[:, 0].long())
    path, acc = _path_tensor(paths, conv_state.device)
    state_col, conv_cols = commit_columns(path, acc, bt.width)
    commit_layer(conv_state, ssm_state, bt.rows, state_col, conv_cols)


def _pick_paths(bt, gen):
    """An accepted path per request: request 0's deepest path that leaves the
    chain, request 1's longest chain-shaped path (``[0, 1, .., a]``, a >= 1),
    request 2 only the root, any others a random node's path."""
    paths = []
    for i, par in enumerate(bt.par):
        all_paths = [ref.path_of(par, j) for j in range(len(par))]
        if i == 0:
            path = max((p for p in all_paths if p != list(range(len(p)))), key=len)
        elif i == 1:
            path = max((p for p in all_paths if p == list(range(len(p)))), key=len)
            assert len(path) >= 2
        elif i == 2:
            path = [0]
        else:
            path = all_paths[int(torch.randint(0, len(par), (1,), generator=gen))]
        paths.append(path)
    return paths


@pytest.mark.parametrize("width", [4, 2])
@pytest.mark.parametrize("engine", ["ref", "kernel"])
def test_commit_then_chain_step_equals_chain_over_accepted_path(engine, width):
    """Tree step + the engine's commit + a chain step with num_accepted = 1 ==
    one chain over (accepted path + that step's tokens) from the original
    buffers and num_accepted (all steps by ``engine``); skipping the commit
    breaks every request that accepted more than the root."""
    if engine == "kernel":
        conv_update, rec_update, device = gt.tree_conv_update, gt.tree_recurrent_update, DEVICE
    else:
        conv_update, rec_update = ref.tree_conv_update_ref, ref.tree_recurrent_update_ref
        device = "cpu"
    W = width
    gen = torch.Generator().manual_seed(21)
    trees = [[-1, 0, 0, 2, 1, 3, 5],       # accepts 0-2-3-5-6: off the chain, deep
             [-1, 0, 1, 0, 2, 3],          # accepts 0-1-2: chain-shaped
             [-1, 0, 0],                   # accepts the root only
             random_parents(6, gen)]       # a random node
    kw = dict(width=W, dim=12, heads=(1, 2), transposed=True, shared_slots=True)
    bt = to_device(make_batch(21, trees, [3, 9, 1, 5], **kw), device)
    paths = _pick_paths(bt, gen)
    assert paths[:3] == [[0, 2, 3, 5, 6], [0, 1, 2], [0]]
    n_req = len(paths)

    # Tree step (original num_accepted), then the commit.
    cs, hs = bt.conv_state.clone(), bt.ssm_state.clone()
    assert cs.stride(1) == 1  # vLLM's transposed view of [slots, state_len, dim]
    conv_update(*bt.conv_args(cs))
    rec_update(*bt.rec_args(hs))
    uncommitted = (cs.clone(), hs.clone())
    _commit(bt, cs, hs, paths)
    # Only column 0 of each row (conv slot and state slot) is written.
    written = torch.zeros(cs.shape[0], dtype=torch.bool, device=device)
    written[bt.rows[:, 0].long()] = True
    assert torch.equal(cs[~written], uncommitted[0][~written])
    assert torch.equal(hs[~written], uncommitted[1][~written])

    # Next step: a chain of fresh tokens per request, num_accepted = 1.
    q_next = [min(3, S + 1 - len(p)) for p in paths]
    nxt = to_device(make_batch(22, [list(range(-1, m - 1)) for m in q_next],
                               [1] * n_req, **kw), device)
    nxt = replace(nxt, weight=bt.weight, bias=bt.bias, A_log=bt.A_log,
                  dt_bias=bt.dt_bias, conv_slot=bt.conv_slot, rows=bt.rows)

    def step(batch, conv_state, ssm_state):
        conv_state, ssm_state = conv_state.clone(), ssm_state.clone()
        out = conv_update(*batch.conv_args(conv_state, parent=None))
        o = rec_update(*batch.rec_args(ssm_state, parent=None))
        return out, o, conv_state, ssm_state

    # Baseline: one chain per request over the accepted path's inputs and the
    # next step's, from the original buffers with the original num_accepted.
    spans, nspans = bt.spans(), nxt.spans()
    lens = [len(p) + m for p, m in zip(paths, q_next, strict=True)]

    def gather(name):
        src, fresh = getattr(bt, name), getattr(nxt, name)
        return torch.cat([torch.cat([src[spans[i][0] + torch.tensor(p, device=device)],
                                     fresh[nspans[i][0]:nspans[i][1]]])
                          for i, p in enumerate(paths)])

    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    base = replace(bt, cu=cu.to(device), parent=ref.chain_parent(cu).to(device),
                   par=[list(range(-1, m - 1)) for m in lens],
                   **{f: gather(f) for f in ("x", "q", "k", "v", "a", "b")})
    want = step(base, bt.conv_state, bt.ssm_state)
    got = step(nxt, cs, hs)
    skipped = step(nxt, *uncommitted)

    W1 = W - 1
    bspans = base.spans()
    for i, p in enumerate(paths):
        b0, b1 = bspans[i][0] + len(p), bspans[i][1]   # next step's tokens in the baseline
        n0, n1 = nspans[i]
        m, L = q_next[i], lens[i]
        slot, row = int(bt.conv_slot[i]), bt.rows[i].tolist()
        # Outputs of the next step, the state it leaves and the conv window a
        # following step would resume from (columns [m - 1, m + W - 2) after
        # it, [L - 1, L + W - 2) after the baseline).
        checks = [
            ("conv out", got[0][n0:n1], want[0][b0:b1], skipped[0][n0:n1]),
            ("rec out", got[1][n0:n1], want[1][b0:b1], skipped[1][n0:n1]),
            ("window", got[2][slot, :, m - 1:m - 1 + W1],
             want[2][slot, :, L - 1:L - 1 + W1], skipped[2][slot, :, m - 1:m - 1 + W1]),
            ("state", got[3][row[m - 1]], want[3][row[L - 1]], skipped[3][row[m - 1]]),
        ]
        for name, g, w, sk in checks:
            assert torch.equal(g, w), (i, p, name)
            if len(p) == 1:   # root only: the commit is the identity
                assert torch.equal(sk, w), (i, p, name)
            elif name != "window" or m < W1:
                # Negative control (the window no longer holds accepted
                # inputs once the next step has written W - 1 of its own).
                assert not torch.allclose(sk.float(), w.float(), atol=1e-3), (i, p, name)


@pytest.mark.parametrize("width", [2, 3, 4])
def test_commit_ignores_padding_and_chains(width):
    """``commit_columns`` + ``commit_layer`` against a per-request oracle:
    column 0 <- the accepted node's state, conv columns [0, W - 1) <- the last
    W - 1 inputs along the accepted path; entries past ``num_accepted`` are
    ignored, a root-only request and a chain-shaped path need nothing else,
    and nothing but column 0 of each row is written."""
    W = width
    trees = [[-1, 0, 0, 2, 1, 3, 5], [-1, 0, 1, 2, 3, 4], [-1, 0, 0], [-1]]
    bt = make_batch(31, trees, [1, 1, 1, 1], width=W, transposed=True,
                    shared_slots=True)
    paths = [[0, 2, 3, 5, 6], [0, 1, 2, 3], [0], [0]]
    cs, hs = bt.conv_state.clone(), bt.ssm_state.clone()
    assert cs.stride(1) == 1
    path, acc = _path_tensor(paths, DEVICE)
    junk = path.clone()
    junk[junk < 0] = 5          # padding past num_accepted: junk, not -1
    state_col, conv_cols = commit_columns(junk, acc, W)
    assert state_col.tolist() == [p[-1] for p in paths]
    assert conv_cols.tolist() == [_window_cols(p, W) for p in paths]
    assert [c.tolist() for c in commit_columns(path, acc, W)] == [state_col.tolist(),
                                                                  conv_cols.tolist()]
    commit_layer(cs, hs, bt.rows, state_col, conv_cols)

    want_cs, want_hs = bt.conv_state.clone(), bt.ssm_state.clone()
    for i, p in enumerate(paths):
        slot, row = int(bt.conv_slot[i]), bt.rows[i].tolist()
        want_cs[slot, :, : W - 1] = bt.conv_state[slot, :, _window_cols(p, W)]
        want_hs[row[0]] = bt.ssm_state[row[p[-1]]]
    assert torch.equal(cs, want_cs) and torch.equal(hs, want_hs)
    # The chain-shaped path takes buffer columns [a, a + W - 1) and column a;
    # the root-only requests are untouched.
    s1, a1 = int(bt.conv_slot[1]), len(paths[1]) - 1
    assert torch.equal(cs[s1, :, : W - 1], bt.conv_state[s1, :, a1:a1 + W - 1])
    assert torch.equal(hs[int(bt.rows[1, 0])], bt.ssm_state[int(bt.rows[1, a1])])
    for i in (2, 3):
        assert torch.equal(cs[int(bt.conv_slot[i])], bt.conv_state[int(bt.conv_slot[i])])
        assert torch.equal(hs[int(bt.rows[i, 0])], bt.ssm_state[int(bt.rows[i, 0])])
    # Request 0's commit really moves something (the test has power).
    assert not torch.equal(cs[int(bt.conv_slot[0])], bt.conv_state[int(bt.conv_slot[0])])
    assert not torch.equal(hs[int(bt.rows[0, 0])], bt.ssm_state[int(bt.rows[0, 0])])


# --------------------------------------------------------------------------
# Compilation for NVIDIA targets (checked without a GPU)
# --------------------------------------------------------------------------

COMPILE_SCRIPT = r"""
import json, sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vllm_ddtree.kernels import gdn_tree as gt

assert not gt.INTERPRETED
PTR = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32"}
FLOAT_PTRS = {"x_ptr", "w_ptr", "bias_ptr", "o_ptr", "q_ptr", "k_ptr", "v_ptr",
              "a_ptr", "b_ptr", "dt_bias_ptr"}


def signature(fn, consts, in_dt, state_dt):
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in FLOAT_PTRS:
            sig[name] = PTR[in_dt]
        elif name in ("state_ptr", "h_ptr"):
            sig[name] = PTR[state_dt]
        elif name == "A_log_ptr":
            sig[name] = "*fp32"
        elif name.endswith("_ptr"):
            sig[name] = "*i32"
        elif name == "scale":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


out = []
for kind, in_dt, state_dt, arg, has_parent, cap in json.loads(sys.argv[1]):
    if kind == "conv":
        fn = gt._tree_conv_update_kernel
        consts = gt.conv_constexprs(getattr(torch, state_dt), getattr(torch, in_dt),
                                    10240, arg, True, True, has_parent, True)
    else:
        fn = gt._tree_recurrent_kernel
        consts = gt.recurrent_constexprs(arg, arg, 3, True, has_parent, True)
    kernel = triton.compile(
        ASTSource(fn=fn, signature=signature(fn, consts, in_dt, state_dt),
                  constexprs=consts),
        target=GPUTarget("cuda", cap, 32),
    )
    out.append(len(kernel.asm.get("cubin", b"")))
print(json.dumps(out))
"""

# (kernel, input dtype, state dtype, conv width | head dim, has parent, sm)
COMPILE_VARIANTS = [
    ("conv", "bfloat16", "bfloat16", 4, True, 90),
    ("conv", "float32", "float32", 2, False, 80),
    ("recurrent", "bfloat16", "float32", 128, True, 90),
    ("recurrent", "float16", "float16", 64, False, 80),
]


def test_kernels_compile_for_nvidia_targets():
    """The interpreter cannot catch what only the compiler rejects; Triton
    ships ptxas, so compile down to a cubin (subprocess, no interpreter)."""
    import json
    import subprocess
    import sys

    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, "-c", COMPILE_SCRIPT, json.dumps(COMPILE_VARIANTS)],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    sizes = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(sizes) == len(COMPILE_VARIANTS) and all(n > 0 for n in sizes)
