"""A verification round never reads a device tensor back on the host.

On a GPU every ``.item()``, ``.tolist()``, ``bool(tensor)`` or ``.cpu()``
stalls the stream until the queued kernels finish, and it would keep a CUDA
graph from capturing the step. The round takes every host-side value it
needs from the scheduler's lists, so one whole round (plan, attach, verify,
compact, condition) runs here with every such call turned into an error.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from vllm_ddtree.core import tree as tree_ops
from vllm_ddtree.core.compaction import kv_capture
from vllm_ddtree.core.round import ProposedTrees, TreeRound

B, K, V = 8, 4, 11
SYNCS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu",
         "nonzero")


class HostSync(AssertionError):
    pass


@contextlib.contextmanager
def no_host_sync():
    """Every host read of a tensor raises :class:`HostSync` (and is counted)."""
    calls = []
    saved = {name: getattr(torch.Tensor, name) for name in SYNCS}

    def forbid(name):
        def f(self, *a, **k):
            calls.append(name)
            raise HostSync(f"host sync: Tensor.{name}")
        return f

    for name in SYNCS:
        setattr(torch.Tensor, name, forbid(name))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def _step(greedy: bool, seed: int = 0):
    """Three requests: a full tree, a tree cut to 5 nodes by the scheduler,
    and a prefill of 4 tokens; the step's runner buffers and logits."""
    g = torch.Generator().manual_seed(seed)
    ids = ["a", "b", "c"]
    trees = ProposedTrees(ids[:2], tree_ops.build_tree(torch.randn(2, K, V, generator=g) * 2, B))
    tokens = trees.tree.tokens.tolist()
    scheduled = {"a": tokens[0], "b": tokens[1][:5]}
    q_lens = [1 + B, 1 + 5, 4]
    starts = [0, q_lens[0], q_lens[0] + q_lens[1]]
    total = sum(q_lens)
    req_indices = torch.repeat_interleave(torch.arange(3), torch.tensor(q_lens)).int()
    query_pos = torch.cat([torch.arange(n) for n in q_lens]).int()
    positions = torch.cat([torch.arange(20, 20 + q_lens[0]), torch.arange(7, 7 + q_lens[1]),
                           torch.arange(0, 4)])
    logits = torch.randn(q_lens[0] + q_lens[1] + 1, V, generator=g)
    sampling = SimpleNamespace(
        all_greedy=greedy, temperature=None if greedy else torch.tensor([0.8, 1.0, 0.0]),
        top_k=None if greedy else torch.tensor([5, 0, 0]),
        top_p=None if greedy else torch.tensor([0.9, 1.0, 1.0]),
        generators={} if greedy else {1: torch.Generator().manual_seed(3)})
    draft_ids = torch.tensor(scheduled["a"] + scheduled["b"])
    return SimpleNamespace(ids=ids, trees=trees, scheduled=scheduled, starts=starts, total=total,
                           req_indices=req_indices, query_pos=query_pos, positions=positions,
                           logits=logits, sampling=sampling, draft_ids=draft_ids,
                           num_draft=[B, 5, 0])


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_one_round_without_host_sync(greedy):
    st = _step(greedy)
    positions = st.positions.clone()
    aux = [torch.randn(st.total, 6) for _ in range(2)]
    aux_before = [h.clone() for h in aux]
    slot_mapping = torch.arange(100, 100 + st.total)
    md = SimpleNamespace()
    with no_host_sync() as calls:
        rnd = TreeRound.plan(
            req_ids=st.ids, scheduled=st.scheduled, trees=st.trees, budget=B, depth=K,
            positions=positions, req_indices=st.req_indices, query_pos=st.query_pos,
            query_start=torch.tensor(st.starts), with_expected=True)
        rewritten = positions.clone()
        rnd.attach({"layer.0": md, "drafter.0": SimpleNamespace()}, frozenset({"layer.0"}))
        with rnd.capturing([]):
            pass
        out = rnd.verify(st.logits, st.draft_ids, st.num_draft, st.sampling)
        rnd.compact(slot_mapping)
        rnd.condition(aux, positions)
        counts = rnd.counts()
        past = rnd.accepted_past([1, 2, 4])
    assert calls == []
    assert past.tolist() == [sum(int(j) > b for j in rnd.path[:, 1:].flatten()) for b in (1, 2, 4)]
    # The round did its work: masks attached, positions rewritten and restored,
    # the walk's output and the drafter's rows consistent with the path.
    assert md.ddtree is rnd.info and rnd.info.tree_reqs() == (0, 1)
    # node j of a tree sat at p0 + depth(j) during the forward; then restored
    depth = st.trees.tree.depth
    assert rewritten[: 1 + B].tolist() == [20] + (20 + depth[0]).tolist()
    assert rewritten[1 + B: 1 + B + 6].tolist() == [7] + (7 + depth[1, :5]).tolist()
    assert torch.equal(rewritten[-4:], st.positions[-4:])
    assert torch.equal(positions, st.positions)
    # each tree row's depth is its node's offset from the root's position
    assert rnd.info.depth.dtype == torch.int32 and rnd.info.depth.shape == (st.total,)
    assert rnd.info.depth[: 1 + B].tolist() == (rewritten[: 1 + B] - 20).tolist()
    assert rnd.info.depth[1 + B: 1 + B + 6].tolist() == (rewritten[1 + B: 1 + B + 6] - 7).tolist()
    assert out.shape == (3, 1 + B) and torch.equal(counts.num_accepted, rnd.num_accepted)
    for r in range(2):
        a = int(rnd.num_accepted[r])
        path = rnd.path[r, : a + 1].tolist()
        for h, h0 in zip(aux, aux_before):
            assert torch.equal(h[st.starts[r]: st.starts[r] + a + 1],
                               h0[[st.starts[r] + j for j in path]])
    assert kv_capture.records() == []  # no layer was recorded: compact moved nothing


def test_detector_catches_a_sync():
    """The detector itself: the CPU-only draft check reads the trees back."""
    st = _step(True)
    with no_host_sync(), pytest.raises(HostSync):
        TreeRound.plan(
            req_ids=st.ids, scheduled=st.scheduled, trees=st.trees, budget=B, depth=K,
            positions=st.positions.clone(), req_indices=st.req_indices,
            query_pos=st.query_pos, query_start=torch.tensor(st.starts), with_expected=False,
            check_drafts=True)
