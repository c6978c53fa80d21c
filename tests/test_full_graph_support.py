"""What full CUDA graphs of tree steps rely on, checked on a CPU.

* The step's tree lives in persistent buffers (``TreeStepBuffers``): steps
  with different trees and batch sizes write into the same tensors, and the
  attention info views them, so a graph captured with them reads every
  later step's tree. A step without trees clears the tree flags a replayed
  graph would otherwise reuse.
* A tree the adaptive budget cut, padded back to the full budget for a
  uniform batch, gives exactly the cut tree's tokens: the padding is
  verified but never accepted, and no usable node sees it.
* The guard that holds under replay: each layer that ran the tree path
  marks the step in its device-side slot; a layer left stock keeps an old
  mark, and the runner refuses the step's result (the CPU impl's own mark is
  checked in ``test_cpu_tree_backend.py``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_ddtree.core import tree as tree_ops
from vllm_ddtree.core.round import DDTreeSeamError, ProposedTrees, TreeRound
from vllm_ddtree.core.tree_info import TreeStepBuffers, mask_words

B, K, V = 12, 4, 17
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]


def _plan(buffers, trees, scheduled, p0s, valid=None, with_logq=False):
    ids = list(scheduled)
    q_lens = [1 + len(scheduled[r]) for r in ids]
    starts = [sum(q_lens[:i]) for i in range(len(ids))]
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(p0s, q_lens)])
    req_indices = torch.repeat_interleave(torch.arange(len(ids)), torch.tensor(q_lens))
    query_pos = torch.cat([torch.arange(n) for n in q_lens])
    return TreeRound.plan(req_ids=ids, scheduled=scheduled, trees=trees, budget=B, depth=K,
                          positions=positions, req_indices=req_indices, query_pos=query_pos,
                          query_start=torch.tensor(starts), with_expected=True,
                          with_logq=with_logq, buffers=buffers, valid=valid)


def _trees(n, seed):
    g = torch.Generator().manual_seed(seed)
    ids = [f"r{seed}.{i}" for i in range(n)]
    return ids, ProposedTrees(ids, tree_ops.build_tree(torch.randn(n, K, V, generator=g) * 2,
                                                       B))


def test_buffers_keep_identity_and_shape_across_steps():
    buffers = TreeStepBuffers(64, 8, B, LAYERS, "cpu")
    ptrs = (buffers.mask.data_ptr(), buffers.is_tree.data_ptr())
    shapes = (buffers.mask.shape, buffers.is_tree.shape)
    assert buffers.mask.shape == (64, mask_words(B)) and buffers.is_tree.shape == (8,)
    seen_masks = []
    for seed, n in ((0, 3), (1, 2), (2, 4)):
        ids, trees = _trees(n, seed)
        tokens = trees.tree.tokens.tolist()
        # the second request's tree cut by the scheduler, the last one not a tree
        scheduled = {rid: tokens[i][: (5 if i == 1 else B)] for i, rid in enumerate(ids)}
        scheduled[ids[-1]] = [1, 2, 3]
        p0s = [10 * (i + 1) for i in range(n)]
        # (the last request's row of the drafter's trees is not offered)
        offered = ProposedTrees(ids[:-1], trees.tree)
        rnd = _plan(buffers, offered, scheduled, p0s)
        unbuffered = _plan(None, offered, scheduled, p0s)
        info = rnd.info
        assert (info.mask.data_ptr(), info.is_tree.data_ptr()) == ptrs
        assert info.depth.data_ptr() == buffers.depth.data_ptr()
        assert (buffers.mask.shape, buffers.is_tree.shape) == shapes
        assert info.buffers is buffers
        total = sum(1 + len(v) for v in scheduled.values())
        # the same masks and flags the round builds without buffers
        assert torch.equal(info.mask, unbuffered.info.mask[:total])
        assert torch.equal(info.depth, unbuffered.info.depth)
        assert info.is_tree.tolist() == [True] * (n - 1) + [False]
        assert not buffers.is_tree[n:].any()
        seen_masks.append(buffers.mask[:total].clone())
    assert not torch.equal(seen_masks[0][:10], seen_masks[1][:10])
    # a step whose drafts are no tree of ours clears the flags a graph would read
    rnd = _plan(buffers, None, {"x": [1, 2], "y": [3]}, [5, 9])
    assert rnd.info is None and not buffers.is_tree.any()


def _verify(rnd, scheduled, logits_by_req):
    ids = list(scheduled)
    logits = torch.cat([logits_by_req[r][: 1 + len(scheduled[r])] for r in ids])
    drafts = torch.tensor([t for r in ids for t in scheduled[r]])
    sampling = SimpleNamespace(all_greedy=True, temperature=None, top_k=None, top_p=None,
                               generators={})
    return rnd.verify(logits, drafts, [len(scheduled[r]) for r in ids], sampling)


@pytest.mark.parametrize("seed", range(6))
def test_padded_tree_gives_the_cut_trees_tokens(seed):
    """Greedy targets that accept deep into the tree: the padded step's
    output equals the cut step's for every request, although the target would
    accept padding nodes, and its path never leaves the usable nodes."""
    g = torch.Generator().manual_seed(100 + seed)
    ids, trees = _trees(3, seed)
    tokens = trees.tree.tokens.tolist()
    parents = trees.tree.parents.tolist()
    cut = {ids[0]: 3, ids[1]: 0, ids[2]: 7}
    # the target's argmax at every node is the token of its first child, so
    # the walk would go down to a leaf of the full tree: padding nodes are
    # accepted unless the walk is told they are not usable
    logits_by_req = {}
    for i, rid in enumerate(ids):
        lg = torch.randn(1 + B, V, generator=g)
        for j in range(B - 1, -1, -1):
            par = parents[i][j]  # flat index of node j + 1's parent (0: the root)
            lg[par] = -10.0
            lg[par, tokens[i][j]] = 10.0
        logits_by_req[rid] = lg
    full = {rid: tokens[i] for i, rid in enumerate(ids)}
    cut_drafts = {rid: tokens[i][: cut[rid]] for i, rid in enumerate(ids)}
    p0s = [20, 30, 40]
    padded = _plan(TreeStepBuffers(64, 8, B, LAYERS, "cpu"), trees, full, p0s, valid=cut,
                   with_logq=True)
    unpadded = _plan(None, trees, cut_drafts, p0s, with_logq=True)
    out_pad = _verify(padded, full, logits_by_req)
    out_cut = _verify(unpadded, cut_drafts, logits_by_req)
    assert torch.equal(out_pad, out_cut)
    assert torch.equal(padded.num_accepted, unpadded.num_accepted)
    assert padded.num_accepted.tolist() == [min(c, d) for c, d in zip(
        cut.values(), unpadded.num_accepted.tolist())]
    # without the cut, the same logits accept past it: the check has power
    free = _plan(None, trees, full, p0s)
    _verify(free, full, logits_by_req)
    assert (free.num_accepted > padded.num_accepted).any()
    # the policy's bookkeeping counts the usable nodes only
    assert padded.counts().num_nodes.tolist() == list(cut.values())
    _, verified, _ = padded.node_outcomes()
    assert verified.sum(-1).tolist() == list(cut.values())


def test_guard_slots_name_a_layer_left_stock():
    """Two layers mark the step; the third (a stock layer) does not and is
    named; a later step where every layer ran passes."""
    buffers = TreeStepBuffers(16, 4, B, LAYERS, "cpu")
    info = buffers.info(4, 1, (0,), 4)
    buffers.begin_step()
    for name in LAYERS[:2]:
        info.mark_seen(name)
    assert buffers.unseen_layers(set(LAYERS)) == [LAYERS[2]]
    assert buffers.unseen_layers(set(LAYERS[:2])) == []  # only what the step expected
    buffers.begin_step()
    for name in LAYERS:
        info.mark_seen(name)
    buffers.fetch_seen()
    assert buffers.unseen_layers(set(LAYERS)) == []
    buffers.begin_step()  # a step where nothing ran: every layer is stale
    assert buffers.unseen_layers(set(LAYERS)) == LAYERS


def test_runner_refuses_a_step_with_an_unseen_layer():
    """``sample_tokens`` raises before the step's output leaves the runner."""
    pytest.importorskip("vllm")
    from vllm_ddtree.runner import DDTreeRunnerMixin

    class Base:
        def sample_tokens(self, *args, **kwargs):
            return "output"

    runner = object.__new__(type("R", (DDTreeRunnerMixin, Base), {}))
    buffers = TreeStepBuffers(16, 4, B, LAYERS, "cpu")
    runner.ddtree, runner.ddtree_buffers, runner.ddtree_step = object(), buffers, None
    runner.ddtree_tp, runner.ddtree_plain_run = None, False
    runner.execute_model_state = None  # vLLM's step state (a stand-in's output: no drafts)
    runner.ddtree_expected = frozenset(LAYERS)
    buffers.begin_step()
    for name in LAYERS:
        buffers.mark_seen(name)
    runner.ddtree_guarded = True
    assert runner.sample_tokens() == "output"
    buffers.begin_step()
    for name in LAYERS[1:]:
        buffers.mark_seen(name)
    runner.ddtree_guarded = True
    with pytest.raises(DDTreeSeamError, match=r"1 target layers did not run the tree path.*"
                                              + LAYERS[0].replace(".", r"\.")):
        runner.sample_tokens()
