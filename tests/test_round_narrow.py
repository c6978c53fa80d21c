"""A round over trees built narrower than the budget.

The adaptive budget's fixed arm builds only the nodes it verifies (a tree of
``b`` nodes under an engine budget ``B``). Its round must be the round of the
full tree cut to ``b`` nodes: the same masks (the persistent mask buffer,
sized for ``B``, keeps no stale words), positions, walk and shadow counts;
and a request that kept wider drafts from an older step (a chain) widens the
round back to ``B``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_ddtree.core import tree as tree_ops
from vllm_ddtree.core.round import ProposedTrees, TreeRound
from vllm_ddtree.core.tree_info import TreeStepBuffers

B, K, V, NARROW = 40, 4, 13, 5  # B needs two mask words, NARROW one


def _plan_and_walk(trees, scheduled, logits_of, chain_row=None, seed=0):
    """Plan (into fresh buffers full of stale bits), verify greedily; the
    round, its positions, the buffers' mask rows and the walk's output."""
    ids = list(scheduled)
    counts = [len(scheduled[r]) for r in ids]
    q_lens = [1 + n for n in counts]
    total = sum(q_lens)
    starts = [sum(q_lens[:i]) for i in range(len(ids))]
    req_indices = torch.repeat_interleave(torch.arange(len(ids)), torch.tensor(q_lens)).int()
    query_pos = torch.cat([torch.arange(n) for n in q_lens]).int()
    positions = torch.cat([torch.arange(10 * (i + 1), 10 * (i + 1) + n)
                           for i, n in enumerate(q_lens)])
    buffers = TreeStepBuffers(total, len(ids), B, [], "cpu")
    buffers.mask.fill_(-1)  # a previous step's bits
    rnd = TreeRound.plan(
        req_ids=ids, scheduled=scheduled, trees=trees, budget=B, depth=K,
        positions=positions, req_indices=req_indices, query_pos=query_pos,
        query_start=torch.tensor(starts), with_expected=True, with_logq=True,
        buffers=buffers)
    rewritten = positions.clone()
    logits = torch.cat([logits_of(r, n) for r, n in zip(ids, counts)])
    sampling = SimpleNamespace(all_greedy=True, temperature=None, top_k=None, top_p=None,
                               generators={})
    drafts = torch.tensor([t for r in ids for t in scheduled[r]])
    out = rnd.verify(logits, drafts, counts, sampling)
    return rnd, rewritten, buffers.mask.clone(), out


@pytest.mark.parametrize("seed", range(4))
def test_narrow_tree_round_is_the_cut_full_tree_round(seed):
    g = torch.Generator().manual_seed(seed)
    draft_logits = torch.randn(2, K, V, generator=g) * 1.5
    full = tree_ops.build_tree(draft_logits, B)
    narrow = tree_ops.build_tree(draft_logits, NARROW)
    for w, h in zip(full, narrow):
        assert torch.equal(w[:, :NARROW], h)
    target = {r: torch.randn(1 + B, V, generator=g) for r in ("a", "b")}
    # the target agrees with the tree's first branch often enough to accept
    for i, r in enumerate(("a", "b")):
        target[r][1:, :] *= 0.1
        target[r][0, int(full.tokens[i, 0])] += 8.0

    def logits_of(r, n):
        return target[r][: n + 1] if r in target else torch.zeros(n + 1, V)

    ids = ["a", "b"]
    cut = {r: full.tokens[i, :NARROW].tolist() for i, r in enumerate(ids)}
    wide = _plan_and_walk(ProposedTrees(ids, full), cut, logits_of)
    thin = _plan_and_walk(ProposedTrees(ids, narrow), cut, logits_of)
    (rw, pos_w, mask_w, out_w), (rn, pos_n, mask_n, out_n) = wide, thin
    assert rw.budget == B and rn.budget == NARROW
    assert torch.equal(pos_w, pos_n)
    assert torch.equal(mask_w, mask_n)  # stale words of the buffer cleared
    assert torch.equal(rw.num_accepted, rn.num_accepted)
    assert torch.equal(rw.path[:, : NARROW + 1], rn.path)
    assert torch.equal(out_w[:, : NARROW + 1], out_n)
    assert torch.equal(rw.accepted_past([1, 2, 4]), rn.accepted_past([1, 2, 4]))
    assert int(rn.num_accepted.sum()) > 0, "nothing accepted: the walk was not exercised"

    # A request with wider drafts from an older step (a chain, no tree of
    # this step): the round widens back to the budget, and the tree requests
    # walk as in the full-width round.
    older = {**cut, "c": list(range(1, 13))}
    wide_c = _plan_and_walk(ProposedTrees(ids, full), older, logits_of)
    thin_c = _plan_and_walk(ProposedTrees(ids, narrow), older, logits_of)
    assert thin_c[0].budget == B
    assert torch.equal(wide_c[1], thin_c[1]) and torch.equal(wide_c[2], thin_c[2])
    assert torch.equal(wide_c[0].path, thin_c[0].path)
    assert torch.equal(wide_c[3], thin_c[3])
