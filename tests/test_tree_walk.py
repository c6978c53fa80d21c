"""ancestor_mask packing, the walk and the KV compaction pairs against naive versions."""

import numpy as np
import pytest
import torch

from vllm_ddtree.core.compaction import compaction_rows
from vllm_ddtree.core.tree import accepted_past, ancestor_mask, build_tree, walk


pytestmark = pytest.mark.usefixtures("one_thread")


def random_tree(rng, B, V, chainy=0.5):
    """Random topologically ordered tree with distinct sibling tokens."""
    parents = np.zeros(B, dtype=np.int64)
    tokens = np.zeros(B, dtype=np.int64)
    children = {0: []}
    depth = np.zeros(B + 1, dtype=np.int64)
    for j in range(B):
        flat = j + 1
        while True:
            p = flat - 1 if rng.random() < chainy else int(rng.integers(0, flat))
            used = {tokens[c - 1] for c in children[p]}
            if len(used) < V:
                break
        tok = int(rng.choice([t for t in range(V) if t not in used]))
        parents[j], tokens[j] = p, tok
        children[p].append(flat)
        children[flat] = []
        depth[flat] = depth[p] + 1
    return tokens, parents, depth[1:]


def random_batch(rng, b, B, V):
    trees = [random_tree(rng, B, V, chainy=rng.random()) for _ in range(b)]
    tokens = torch.tensor(np.stack([t[0] for t in trees]))
    parents = torch.tensor(np.stack([t[1] for t in trees]))
    depth = torch.tensor(np.stack([t[2] for t in trees]))
    return tokens, parents, depth


def naive_mask(parents_r, valid_r=None):
    B = len(parents_r)
    m = np.zeros((B + 1, B + 1), dtype=bool)
    for i in range(B + 1):
        m[i, 0] = True
        j = i
        while j != 0:
            m[i, j] = True
            if valid_r is not None and not valid_r[j - 1]:
                break  # invalid nodes hang off the root
            j = int(parents_r[j - 1])
    return m


def pack_little(m):
    """numpy.packbits(bitorder="little") regrouped into little-endian int32 words."""
    n = m.shape[1]
    W = (n + 31) // 32
    padded = np.zeros((m.shape[0], W * 32), dtype=bool)
    padded[:, :n] = m
    return np.packbits(padded, axis=1, bitorder="little").view("<i4")


@pytest.mark.parametrize("B", [1, 5, 31, 32, 33, 64, 100])
@pytest.mark.parametrize("levels", [False, True])
def test_ancestor_mask_matches_naive(B, levels):
    rng = np.random.default_rng(B)
    tokens, parents, depth = random_batch(rng, 6, B, V=6)
    max_depth = int(depth.max()) if levels else None
    mask = ancestor_mask(parents, depth, max_depth=max_depth)
    W = (B + 1 + 31) // 32
    assert mask.dtype == torch.int32 and mask.shape == (6, B + 1, W)
    for r in range(6):
        ref = naive_mask(parents[r].numpy())
        np.testing.assert_array_equal(mask[r].numpy(), pack_little(ref))
        # unpack independently: bit j of word j // 32
        bits = (mask[r].numpy().view(np.uint32)[:, np.arange(B + 1) // 32] >> (np.arange(B + 1) % 32)) & 1
        np.testing.assert_array_equal(bits.astype(bool), ref)
    if B >= 32 and not levels:
        assert (mask < 0).any(), "bit 31 (sign bit) must be exercised"


def test_ancestor_mask_bit31_chain():
    B = 40
    parents = torch.arange(B)[None, :]  # a chain: node j+1 has parent j
    depth = torch.arange(1, B + 1)[None, :]
    mask = ancestor_mask(parents, depth)
    ref = pack_little(naive_mask(parents[0].numpy()))
    np.testing.assert_array_equal(mask[0].numpy(), ref)
    assert mask[0, 31, 0].item() == -1  # bits 0..31 all set
    assert mask[0, 40, 1].item() == 0x1FF


@pytest.mark.parametrize("levels", [False, True])
def test_ancestor_mask_of_built_trees_with_invalid_tail(levels):
    torch.manual_seed(0)
    K, B = 5, 70
    logits = torch.randn(4, K, 8) * 2
    tree = build_tree(logits, B, torch.tensor([70, 33, 1, 0]))
    # Garbage in the invalid tail must not leak into the mask.
    parents = torch.where(tree.valid, tree.parents, 7)
    mask = ancestor_mask(parents, tree.depth, tree.valid, max_depth=K if levels else None)
    for r in range(4):
        ref = naive_mask(parents[r].numpy(), tree.valid[r].numpy())
        np.testing.assert_array_equal(mask[r].numpy(), pack_little(ref))


def naive_walk(tokens, parents, post, num_nodes):
    B = len(tokens)
    path = [0]
    while True:
        cur = path[-1]
        nxt = [j + 1 for j in range(num_nodes) if parents[j] == cur and tokens[j] == post[cur]]
        assert len(nxt) <= 1
        if not nxt:
            break
        path.append(nxt[0])
    a = len(path) - 1
    out = [int(tokens[p - 1]) for p in path[1:]] + [int(post[path[-1]])]
    out += [-1] * (B + 1 - len(out))
    return out, a, path + [-1] * (B + 1 - len(path))


def matching_post(rng, tokens, parents, accept_rate, V):
    """Target tokens that often agree with some child, so paths get long."""
    B = len(tokens)
    post = rng.integers(0, V + 2, size=B + 1)  # some tokens absent from the tree
    for i in range(B + 1):
        kids = [j for j in range(B) if parents[j] == i]
        if kids and rng.random() < accept_rate:
            post[i] = tokens[kids[int(rng.integers(0, len(kids)))]]
    return post


@pytest.mark.parametrize("B", [1, 7, 32, 90])
def test_walk_matches_naive(B):
    rng = np.random.default_rng(100 + B)
    b, V = 24, 5
    tokens, parents, _ = random_batch(rng, b, B, V)
    post = torch.tensor(
        np.stack([matching_post(rng, tokens[r].numpy(), parents[r].numpy(), rng.random(), V) for r in range(b)])
    )
    num_nodes = torch.tensor(rng.integers(0, B + 1, size=b))
    num_nodes[:4] = B
    num_nodes[4] = 0
    for nn in (num_nodes, None):
        res = walk(tokens, parents, post, nn)
        assert res.output_tokens.shape == (b, B + 1) and res.path.shape == (b, B + 1)
        for r in range(b):
            n_r = B if nn is None else int(nn[r])
            out, a, path = naive_walk(tokens[r].numpy(), parents[r].numpy(), post[r].numpy(), n_r)
            assert res.output_tokens[r].tolist() == out
            assert res.num_accepted[r].item() == a
            assert res.path[r].tolist() == path
    assert res.num_accepted.max().item() >= min(B, 3), "long paths must be exercised"


def test_accepted_past_is_the_walk_of_each_smaller_budget():
    """What the tuner's shadow comparisons rest on: a built tree of budget B
    cut to budget b (``build_tree(..., budgets=b)``, as a fixed arm verifies)
    walks, on the same target tokens, to as many accepted nodes fewer as
    ``accepted_past`` counts past b, for every b at once."""
    torch.manual_seed(5)
    b, K, V, B = 48, 6, 4, 40
    logits = torch.randn(b, K, V) * 3
    full = build_tree(logits, B)
    rng = np.random.default_rng(7)
    # target tokens that follow the tree often, so that long paths occur
    post = torch.tensor(np.stack([matching_post(rng, full.tokens[r].numpy(),
                                                full.parents[r].numpy(), 0.9, V)
                                  for r in range(b)]))
    res = walk(full.tokens, full.parents, post, full.valid.sum(-1))
    budgets = [1, 2, 4, 8, 16, 39]
    past = accepted_past(res.path, budgets).tolist()
    for cut, over in zip(budgets, past):
        small = build_tree(logits, B, torch.full((b,), cut))
        got = walk(small.tokens, small.parents, post, small.valid.sum(-1)).num_accepted
        assert int(res.num_accepted.sum()) - over == int(got.sum()), cut
    assert past[0] > past[-1] > 0, "paths past every budget must be exercised"
    assert accepted_past(res.path, [B]).tolist() == [0]


def test_walk_ignores_invalid_tail_of_built_trees():
    torch.manual_seed(1)
    B = 12
    tree = build_tree(torch.randn(16, 4, 3), B, torch.randint(0, B + 1, (16,)))
    post = torch.zeros(16, B + 1, dtype=torch.long)  # token 0 everywhere: tail nodes would match
    res = walk(tree.tokens, tree.parents, post, tree.valid.sum(-1))
    for r in range(16):
        out, a, path = naive_walk(tree.tokens[r].numpy(), tree.parents[r].numpy(), post[r].numpy(), int(tree.valid[r].sum()))
        assert res.output_tokens[r].tolist() == out and res.path[r].tolist() == path
        assert all(p <= int(tree.valid[r].sum()) for p in path)


@pytest.mark.parametrize("B,depth", [(1, 1), (9, 4), (40, 40), (40, 6)])
def test_compaction_rows(B, depth):
    rng = np.random.default_rng(7 + B)
    b = 20
    tokens, parents, _ = random_batch(rng, b, B, V=4)
    post = torch.tensor(np.stack([matching_post(rng, tokens[r].numpy(), parents[r].numpy(), 0.8, 4) for r in range(b)]))
    res = walk(tokens, parents, post)
    query_start = torch.tensor(np.cumsum([0] + [B + 1] * (b - 1)) + 3)  # rows after a prefill of 3
    src, dst = compaction_rows(res.path, res.num_accepted, query_start, depth)
    D = min(depth, B)
    assert src.shape == dst.shape == (b * (D + 1),)
    src, dst = src.view(b, D + 1), dst.view(b, D + 1)
    saw_copy = saw_in_place = False
    for r in range(b):
        a = min(res.num_accepted[r].item(), D)
        path = res.path[r].tolist()
        qs = query_start[r].item()
        for k in range(D + 1):
            if k <= a:
                assert (src[r, k].item(), dst[r, k].item()) == (qs + path[k], qs + k)
                assert path[k] >= k
                saw_copy |= path[k] != k
                saw_in_place |= k > 0 and path[k] == k
            else:  # padding pairs: the root onto itself
                assert src[r, k].item() == dst[r, k].item() == qs
        # Reading every source, then writing every destination, lays the path
        # out in depth rows (a KV cache indexed by token row).
        kv = list(range(qs + B + 1))
        moved = [kv[i] for i in src[r].tolist()]
        for i, v in zip(dst[r].tolist(), moved):
            kv[i] = v
        assert kv[qs: qs + a + 1] == [qs + p for p in path[: a + 1]]
    assert saw_in_place and (saw_copy or B == 1)


@pytest.mark.parametrize("max_depth", [None, 0, 1])
def test_ancestor_mask_is_a_fresh_tensor(max_depth):
    parents = torch.zeros(2, 1, dtype=torch.long)
    depth = torch.ones(2, 1, dtype=torch.long)
    a = ancestor_mask(parents, depth, max_depth=max_depth)
    a[0, 0, 0] = 0  # writing one row must not alias the other rows or later calls
    assert a[1, 0, 0].item() == 1
    assert ancestor_mask(parents, depth, max_depth=max_depth)[0, 0, 0].item() == 1
