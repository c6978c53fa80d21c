"""Construction, masks and the walk compile as one graph (no host sync, static shapes)."""

import torch

from vllm_ddtree.core.compaction import compaction_rows
from vllm_ddtree.core.tree import ancestor_mask, build_tree, walk

K, V, B = 4, 24, 40


def one_round(logits, budgets, post):
    tree = build_tree(logits, B, budgets)
    mask = ancestor_mask(tree.parents, tree.depth, tree.valid)
    mask_levels = ancestor_mask(tree.parents, tree.depth, tree.valid, max_depth=K)
    res = walk(tree.tokens, tree.parents, post, tree.valid.sum(-1))
    return (*tree, mask, mask_levels, *res,
            *compaction_rows(res.path, res.num_accepted, torch.tensor([0, 41, 82]), K))


def test_fullgraph_compile_matches_eager():
    torch._dynamo.reset()
    compiled = torch.compile(one_round, fullgraph=True, dynamic=False)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):  # the second call reuses the graph
        logits = torch.randn(3, K, V, generator=g) * 2
        budgets = torch.tensor([B, 17, 1])
        tree = build_tree(logits, B, budgets)
        # post agrees with the first-ranked child often enough to accept something
        post = torch.randint(0, V, (3, B + 1), generator=g)
        post[:, 0] = tree.tokens[:, 0]
        eager = one_round(logits, budgets, post)
        got = compiled(logits, budgets, post)
        assert len(got) == len(eager)
        for a, b in zip(got, eager):
            assert a.dtype == b.dtype and torch.equal(a, b)
        assert (eager[-4] >= 1).all()  # num_accepted
