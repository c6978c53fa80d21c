"""Plain mode's pending drafter context: which rows stay live when blocks
change hands (``DDTreeRunnerMixin._ddtree_settle_pending_context``,
``core/pending_context.py``), and how they are joined and stored."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

BLOCK = 4
GID = 1  # the drafter's KV-cache group; group 0 stands for another (a GDN group)


def _runner(prefix_caching: bool, kv_transfer=None):
    pytest.importorskip("vllm")
    from vllm_ddtree.runner import DDTreeRunnerMixin

    stored = []
    runner = object.__new__(type("R", (DDTreeRunnerMixin,), {}))
    table = SimpleNamespace(block_size=BLOCK, dcp_world_size=1,
                            block_table=SimpleNamespace(np=np.array([[3, 7, 0], [5, 0, 0],
                                                                     [9, 2, 0]], np.int32)),
                            num_blocks_per_row=np.array([2, 1, 2], np.int32))
    # tokens per request, the last sampled one included (its K/V not computed yet)
    runner.input_batch = SimpleNamespace(block_table={GID: table},
                                         req_id_to_index={"a": 0, "b": 1, "c": 2},
                                         num_tokens_no_spec=np.array([7, 3, 6]))
    runner.drafter = SimpleNamespace(
        kv_cache_gid=GID, store_context=lambda h, p, s: stored.append((h, p, s)))
    runner.cache_config = SimpleNamespace(enable_prefix_caching=prefix_caching)
    runner.vllm_config = SimpleNamespace(kv_transfer_config=kv_transfer)
    # two plain steps' rows: slots of requests a (blocks 3, 7), b (5) and c (9, 2)
    step1 = torch.tensor([12, 13, 20, 36, 37])  # a a b c c
    step2 = torch.tensor([14, 29, 21, 8])  # a a b c
    runner.ddtree_pending_context = _pending([
        (torch.arange(5.0)[:, None].repeat(1, 6), torch.arange(5), step1),
        (10 + torch.arange(4.0)[:, None].repeat(1, 6), 10 + torch.arange(4), step2)])
    return runner, stored


def _pending(steps):
    from vllm_ddtree.core.pending_context import PendingContext

    pending = PendingContext(BLOCK)
    for step in steps:
        pending.tick()
        pending.add(*step)
    return pending


def _step(runner, new=(), cached=(), finished=(), preempted=()):
    """One engine step's start: the clock ticks, then the runner settles the
    blocks that change hands. ``new``: (block ids per group, computed
    tokens) per new request; ``cached``: (req id, block ids per group,
    computed tokens, resumed) per scheduled running request."""
    so = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(block_ids=b, num_computed_tokens=n) for b, n in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[c[0] for c in cached], new_block_ids=[c[1] for c in cached],
            num_computed_tokens=[c[2] for c in cached],
            resumed_req_ids={c[0] for c in cached if c[3]}),
        finished_req_ids=set(finished), preempted_req_ids=set(preempted))
    runner.ddtree_pending_context.tick()
    runner._ddtree_settle_pending_context(so)


def _stored_slots(runner, stored) -> list[int]:
    runner._ddtree_store_pending_context()
    assert not runner.ddtree_pending_context and runner.ddtree_pending_context.held_rows == 0
    return [x for _, _, s in stored for x in s.tolist()]


def test_without_prefix_caching_the_rows_of_freed_blocks_die():
    """Rows of the requests that finished (a) or were preempted (c) die; the
    rest is stored, in step order, when drafting resumes. Settling copies
    nothing: the steps stay as they were."""
    runner, stored = _runner(prefix_caching=False)
    before = list(runner.ddtree_pending_context.steps)
    _step(runner, finished={"a"}, preempted={"c"})
    assert stored == [] and runner.ddtree_pending_context.steps == before
    assert runner.ddtree_pending_context.held_rows == 9
    runner._ddtree_store_pending_context()
    (hidden, positions, slots), = stored
    assert slots.tolist() == [20, 21] and positions.tolist() == [2, 12]
    assert hidden[:, 0].tolist() == [2, 12]


def test_with_prefix_caching_full_blocks_keep_their_rows_and_partial_ones_die():
    """vLLM caches full blocks only: a finished request's full block (3: a
    had 6 tokens with K/V, block size 4) may be hit later, so its rows stay
    pending; its partial block (7) is never cached: its rows die."""
    runner, stored = _runner(prefix_caching=True)
    _step(runner, finished={"a"})
    assert _stored_slots(runner, stored) == [12, 13, 20, 36, 37, 14, 21, 8]


def test_a_block_handed_out_again_drops_its_rows_in_every_group():
    """A freed full block the cache hands to a new request fresh, in the
    drafter's group (past the request's computed tokens) or in another
    group sharing the memory (a GDN state block), must not get the old
    rows: on a hybrid they would overwrite that state."""
    for group, blocks in ((GID, ([], [4, 3])), (0, ([3], []))):
        runner, stored = _runner(prefix_caching=True)
        _step(runner, finished={"a"})  # block 3 cached, its rows 12, 13, 14 pending
        _step(runner, new=[(blocks, 4)])  # hands out 3 fresh (in the drafter's group: 4 is the hit)
        assert _stored_slots(runner, stored) == [20, 36, 37, 21, 8], group


def test_a_prefix_hit_keeps_the_rows_of_the_block_it_hits():
    """A new request that hits the cached block 3 (its first 4 tokens
    computed) reads its drafter context: the rows stay and are stored."""
    runner, stored = _runner(prefix_caching=True)
    _step(runner, finished={"a"})
    _step(runner, new=[(([11], [3, 6]), 4)])
    assert _stored_slots(runner, stored) == [12, 13, 20, 36, 37, 14, 21, 8]


def test_blocks_appended_to_running_requests_and_resumed_ones():
    """A running request's new blocks are fresh; a resumed request's first
    blocks up to its computed tokens are hits."""
    runner, stored = _runner(prefix_caching=True)
    _step(runner, preempted={"c"}, cached=[("b", ([], [7]), 3, False)])  # 7: a's, fresh for b
    # c's blocks 9, 2 (5 tokens with K/V): 9 full and cached, 2 partial
    assert _stored_slots(runner, stored) == [12, 13, 20, 36, 37, 14, 21]
    runner, stored = _runner(prefix_caching=True)
    _step(runner, preempted={"c"})
    _step(runner, cached=[("c", ([], [9, 12]), 4, True)])  # resumed: hits 9, 12 fresh
    assert _stored_slots(runner, stored) == [12, 13, 20, 36, 37, 14, 29, 21]
    runner, stored = _runner(prefix_caching=True)
    _step(runner, preempted={"c"})
    _step(runner, cached=[("c", ([], [9, 12]), 0, True)])  # resumed without a hit
    assert _stored_slots(runner, stored) == [12, 13, 20, 14, 29, 21]


def test_with_a_kv_connector_no_block_is_taken_as_a_hit():
    """Tokens loaded by a KV connector count as computed, but their blocks
    are fresh: their old rows die."""
    runner, stored = _runner(prefix_caching=True, kv_transfer=object())
    _step(runner, finished={"a"})
    _step(runner, new=[(([], [3]), 4)])
    assert _stored_slots(runner, stored) == [20, 36, 37, 21, 8]


def test_a_request_not_in_the_batch_and_an_idle_step_change_nothing():
    runner, stored = _runner(prefix_caching=False)
    _step(runner, finished={"gone"})
    _step(runner)
    assert _stored_slots(runner, stored) == [12, 13, 20, 36, 37, 14, 29, 21, 8]


def test_nothing_live_stores_nothing():
    runner, stored = _runner(prefix_caching=False)
    _step(runner, finished={"a", "b", "c"})
    runner._ddtree_store_pending_context()
    assert stored == [] and not runner.ddtree_pending_context


def _as_outputs(hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor):
    """One plain step's rows as a CPU plain step keeps them by reference: the
    forward's k = 3 auxiliary outputs (two columns each), numpy copies of the
    positions and slots."""
    return (tuple(hidden[:, 2 * i: 2 * i + 2].clone() for i in range(3)),
            positions.numpy().copy(), slots.numpy().copy())


def test_rows_kept_as_the_forwards_outputs_join_in_step_order():
    from vllm_ddtree.core.pending_context import PendingStep, joined_rows

    runner, _ = _runner(prefix_caching=False)
    tensor_items = [tuple(step[:3]) for step in runner.ddtree_pending_context.steps]
    extra = (20 + torch.arange(2.0)[:, None].repeat(1, 6), 20 + torch.arange(2),
             torch.tensor([15, 22]))
    # copied, by reference, by reference, copied: one order in, one order out
    mixed = [tensor_items[0], _as_outputs(*tensor_items[1]), _as_outputs(*extra), extra]
    hidden, positions, slots = joined_rows([PendingStep(*item) for item in mixed])
    want = [tensor_items[0], tensor_items[1], extra, extra]
    assert torch.equal(hidden, torch.cat([h for h, _, _ in want]))
    assert positions.tolist() == torch.cat([p for _, p, _ in want]).tolist()
    assert slots.tolist() == torch.cat([s for _, _, s in want]).tolist()
    assert hidden.shape == (13, 6) and positions.dtype == slots.dtype == torch.int64


def test_rows_kept_by_reference_die_and_join_like_copied_ones():
    runner, stored = _runner(prefix_caching=False)
    runner.ddtree_pending_context = _pending(
        [_as_outputs(*step[:3]) for step in runner.ddtree_pending_context.steps])
    _step(runner, finished={"a"}, preempted={"c"})
    runner._ddtree_store_pending_context()
    (hidden, positions, slots), = stored
    assert slots.tolist() == [20, 21] and positions.tolist() == [2, 12]
    assert hidden[:, 0].tolist() == [2.0, 12.0] and hidden.shape == (2, 6)


def test_compacting_lets_the_dead_rows_go_and_later_renewals_still_apply():
    """The live rows become one step made now (they are live now); a block
    renewed afterwards kills its compacted rows as it would have the
    originals; rows added after keep step order."""
    runner, stored = _runner(prefix_caching=False)
    pending = runner.ddtree_pending_context
    _step(runner, finished={"a"})
    pending.compact()
    assert len(pending.steps) == 1 and pending.held_rows == 5
    assert pending.steps[0].slots.tolist() == [20, 36, 37, 21, 8]
    _step(runner, new=[(([9], []), 0)])  # c's block 9 handed out (c preempted, say)
    pending.add(tuple(torch.full((1, 2), -1.0) for _ in range(3)), np.array([99]),
                np.array([44]))
    hidden, _, slots = pending.take()
    assert slots.tolist() == [20, 21, 8, 44] and hidden[:, 0].tolist() == [2, 12, 13, -1]
    assert pending.take() is None


def _one_row_steps(pending, first: int, count: int) -> None:
    for t in range(first, first + count):  # one row a step, slot t
        pending.tick()
        pending.add(tuple(torch.full((1, 2), float(t)) for _ in range(3)),
                    np.array([t]), np.array([t]))


def test_many_steps_are_compacted_into_a_few():
    """Every MAX_STEPS steps the live rows are joined into a few steps whose
    sizes at least halve from one to the next (joining costs per step; at one
    request a plain step adds one row)."""
    from vllm_ddtree.core.pending_context import MAX_STEPS, PendingContext

    pending = PendingContext(BLOCK)
    _one_row_steps(pending, 0, MAX_STEPS)
    pending.tick()
    pending.renew([0])  # slots 0..3
    extra = list(range(1000, 1005))  # the first compacts: MAX_STEPS - 4 rows, then 5 steps
    for t in extra:
        pending.add(tuple(torch.full((1, 2), -float(t)) for _ in range(3)), np.array([t]),
                    np.array([t]))
    joined = [len(s.slots) for s in pending.steps[:-len(extra)]]
    assert sum(joined) == MAX_STEPS - 4 and len(joined) <= 8, joined
    assert all(a > 2 * b for a, b in zip(joined, joined[1:])), joined
    assert pending.held_rows == MAX_STEPS + 1
    hidden, positions, slots = pending.take()
    assert slots.tolist() == list(range(4, MAX_STEPS)) + extra
    assert hidden[:, 0].tolist() == list(range(4, MAX_STEPS)) + [-t for t in extra]
    assert hidden.shape[1] == 6 and positions.tolist() == slots.tolist()


def test_rows_that_stay_pending_are_copied_a_few_times(monkeypatch):
    """At one request with the cache keeping every block, rows stay pending
    for thousands of steps: each compaction copies the new rows and merges
    only groups of like size, about 4 copies a row over 64 compactions (a
    join of everything held each time would be about 32; one that stops at
    JOIN_ROWS, 8.5)."""
    from vllm_ddtree.core import pending_context as pc

    copied = [0]
    join = pc.joined_rows

    def counted(*args, **kwargs):
        out = join(*args, **kwargs)
        copied[0] += len(out[2])
        return out
    monkeypatch.setattr(pc, "joined_rows", counted)
    monkeypatch.setattr(pc, "MAX_STEPS", 256)  # the same shape, in fewer steps
    pending = pc.PendingContext(BLOCK)
    rows = 64 * pc.MAX_STEPS
    _one_row_steps(pending, 0, rows)
    assert copied[0] <= 5 * rows, copied[0] / rows
    assert len(pending.steps) <= pc.MAX_STEPS
    slots = pending.take()[2]
    assert torch.equal(slots, torch.arange(rows))


def test_live_rows_are_found_among_steps_of_every_size():
    """Steps with every row live, some dead and none live, next to each
    other (the live mask is split per step by counts), and an empty step,
    which adds nothing."""
    from vllm_ddtree.core.pending_context import PendingContext

    pending = PendingContext(BLOCK)
    sizes = [3, 1, 4, 1, 5, 2]
    first = 0
    for n in sizes:
        pending.tick()
        ids = np.arange(first, first + n)
        pending.add(torch.from_numpy(ids).float()[:, None], ids, ids)
        first += n
    pending.add(torch.zeros(0, 1), np.zeros(0, np.int64), np.zeros(0, np.int64))
    assert len(pending.steps) == len(sizes)
    pending.tick()
    pending.renew([0, 3])  # slots 0-3 and 12-15: the first two steps, the last, part of one
    masks = pending._live_masks()
    assert [None if m is None else m.tolist() for m in masks] == [
        [False] * 3, [False], None, None, [True] * 3 + [False] * 2, [False] * 2]
    hidden, _, slots = pending.take()
    assert slots.tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert hidden[:, 0].tolist() == slots.tolist()


def test_rows_without_a_block_size_are_refused():
    from vllm_ddtree.core.pending_context import PendingContext

    pending = PendingContext()
    pending.add(torch.zeros(1, 2), np.array([0]), np.array([0]))
    with pytest.raises(RuntimeError, match="block_size"):
        pending.take()


def test_outputs_are_kept_by_reference_only_when_the_forward_returns_new_tensors():
    pytest.importorskip("vllm")
    from vllm_ddtree.runner import DDTreeRunnerMixin

    def runner(device):
        r = object.__new__(type("R", (DDTreeRunnerMixin,), {}))
        r.device = torch.device(device)
        r.ddtree_aux_refs, r.ddtree_aux_probe = None, None
        return r

    fresh = runner("cpu")
    assert fresh._ddtree_keeps_outputs([torch.zeros(2, 4)]) is False  # the first step copies
    assert fresh._ddtree_keeps_outputs([torch.zeros(2, 4)]) is True
    assert fresh.ddtree_aux_probe is None
    reused, out = runner("cpu"), torch.zeros(8, 4)
    assert reused._ddtree_keeps_outputs([out[:2]]) is False
    assert reused._ddtree_keeps_outputs([out[:3]]) is False  # the same buffer again
    assert reused._ddtree_keeps_outputs([torch.zeros(2, 4)]) is False  # decided for good
    assert runner("meta")._ddtree_keeps_outputs([torch.zeros(2, 4)]) is False


@pytest.mark.parametrize("widths, dtype, rows", [
    ((192, 192, 192), torch.float32, (192 << 20) // (3 * 192 * 4)),  # the tiny pair
    ((4096, 4096, 4096), torch.bfloat16, 8192),  # an 8B-class target
    ((8192, 8192, 8192), torch.bfloat16, 8192),  # wider: the row floor
])
def test_pending_rows_are_capped_by_their_memory(widths, dtype, rows):
    pytest.importorskip("vllm")
    from vllm_ddtree.runner import DDTreeRunnerMixin

    runner = object.__new__(type("R", (DDTreeRunnerMixin,), {}))
    runner.ddtree_pending_cap = None
    assert runner._ddtree_pending_cap([torch.zeros(1, w, dtype=dtype) for w in widths]) == rows


def test_compacting_keeps_large_mostly_live_steps_by_reference():
    """A step of at least JOIN_ROWS rows, half of them live or more, is not
    copied again; one mostly dead is, joined with the small step before it
    (the one after it, a group of its own, stays as it is)."""
    from vllm_ddtree.core.pending_context import JOIN_ROWS, PendingContext

    n = JOIN_ROWS
    pending = PendingContext(BLOCK)
    big = [torch.arange(float(n))[:, None].repeat(1, 2) for _ in range(3)]
    for first in (0, n, 2 * n):  # three large steps between small ones
        pending.tick()
        pending.add(tuple(big), np.arange(first, first + n), np.arange(first, first + n))
        pending.tick()
        pending.add(tuple(torch.zeros(1, 2) for _ in range(3)), np.array([9 * n]),
                    np.array([9 * n]))
    pending.tick()
    pending.renew(np.arange(n // BLOCK // 2))  # half of the first large step dies
    pending.renew(np.arange(n // BLOCK, 2 * n // BLOCK - 1))  # all but one block of the second
    pending.compact()
    sizes = [len(s.slots) for s in pending.steps]
    assert sizes == [n, 1 + BLOCK, 1, n, 1]
    assert pending.steps[0].hidden[0] is big[0] and pending.steps[3].hidden[0] is big[0]
    assert pending.held_rows == sum(sizes)
    slots = pending.take()[2].tolist()
    assert slots == (list(range(n // 2, n)) + [9 * n] + list(range(2 * n - BLOCK, 2 * n))
                     + [9 * n] + list(range(2 * n, 3 * n)) + [9 * n])


def test_live_rows_are_taken_in_chunks_of_whole_steps_in_step_order():
    runner, _ = _runner(prefix_caching=False)
    pending = runner.ddtree_pending_context
    pending.add(torch.full((3, 6), 7.0), torch.arange(3), torch.tensor([40, 41, 42]))
    _step(runner, finished={"a"})  # 12, 13, 14, 29 die
    chunks = pending.take_chunks(max_rows=3)
    assert [c[2].tolist() for c in chunks] == [[20, 36, 37], [21, 8], [40, 41, 42]]
    assert [c[0][:, 0].tolist() for c in chunks] == [[2, 3, 4], [12, 13], [7, 7, 7]]
    assert not pending and pending.take_chunks(3) == []
    runner, _ = _runner(prefix_caching=False)  # a step longer than a chunk is one chunk
    assert [len(c[2]) for c in runner.ddtree_pending_context.take_chunks(2)] == [5, 4]
