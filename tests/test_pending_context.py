"""Plain mode's pending drafter context when requests give their blocks back
(``DDTreeRunnerMixin._ddtree_release_pending_context``)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

BLOCK = 4


def _runner(prefix_caching: bool):
    pytest.importorskip("vllm")
    from vllm_ddtree.runner import DDTreeRunnerMixin

    stored = []
    runner = object.__new__(type("R", (DDTreeRunnerMixin,), {}))
    table = SimpleNamespace(block_size=BLOCK, dcp_world_size=1,
                            block_table=SimpleNamespace(np=np.array([[3, 7, 0], [5, 0, 0],
                                                                     [9, 2, 0]], np.int32)),
                            num_blocks_per_row=np.array([2, 1, 2], np.int32))
    runner.input_batch = SimpleNamespace(block_table={1: table},
                                         req_id_to_index={"a": 0, "b": 1, "c": 2})
    runner.drafter = SimpleNamespace(
        kv_cache_gid=1, store_context=lambda h, p, s: stored.append((h, p, s)))
    runner.cache_config = SimpleNamespace(enable_prefix_caching=prefix_caching)
    # two plain steps' rows: slots of requests a (blocks 3, 7), b (5) and c (9, 2)
    step1 = torch.tensor([12, 13, 20, 36, 37])  # a a b c c
    step2 = torch.tensor([14, 29, 21, 8])  # a a b c
    runner.ddtree_pending_context = _pending([
        (torch.arange(5.0)[:, None].repeat(1, 6), torch.arange(5), step1),
        (10 + torch.arange(4.0)[:, None].repeat(1, 6), 10 + torch.arange(4), step2)])
    return runner, stored


def _pending(steps):
    from vllm_ddtree.core.pending_context import PendingContext

    pending = PendingContext()
    for step in steps:
        pending.add(*step)
    return pending


def _left(runner, col: int) -> list:
    """The rows still pending, column ``col`` (0 hidden, 1 positions, 2 slots)."""
    from vllm_ddtree.core.pending_context import joined_rows

    return joined_rows(runner.ddtree_pending_context.steps)[col]


def test_without_prefix_caching_the_rows_of_freed_blocks_are_dropped():
    """Rows of the requests that finished (a) or were preempted (c) are
    dropped, the rest stays pending, in step order, nothing is stored."""
    runner, stored = _runner(prefix_caching=False)
    runner._ddtree_release_pending_context({"a", "c"})
    assert stored == []
    pending = runner.ddtree_pending_context
    # both steps keep one live row each: their memory stays held
    assert pending.live_rows == 2 and pending.held_rows == 9
    assert _left(runner, 2).tolist() == [20, 21]  # b's rows only
    assert _left(runner, 1).tolist() == [2, 12] and _left(runner, 0)[:, 0].tolist() == [2, 12]
    runner._ddtree_store_pending_context()
    assert [s.tolist() for _, _, s in stored] == [[20, 21]]
    assert not pending and pending.held_rows == pending.live_rows == 0


def test_with_prefix_caching_full_blocks_are_stored_and_partial_ones_dropped():
    """vLLM caches full blocks only: a finished request's full block (3: its
    last slot 15 is pending) may be hit later, so its rows are stored now, in
    step order; its partial block (7) is never cached: dropped. The other
    requests' rows stay pending."""
    runner, stored = _runner(prefix_caching=True)
    steps = runner.ddtree_pending_context.steps
    steps[1] = steps[1]._replace(slots=torch.tensor([14, 15, 21, 29]))  # a a b a
    runner._ddtree_release_pending_context({"a"})
    (hidden, positions, slots), = stored
    assert slots.tolist() == [12, 13, 14, 15]
    assert positions.tolist() == [0, 1, 10, 11] and hidden[:, 0].tolist() == [0, 1, 10, 11]
    assert runner.ddtree_pending_context.live_rows == 4
    assert _left(runner, 2).tolist() == [20, 36, 37, 21]  # b, c, c, b; a's 29 dropped


def test_with_prefix_caching_a_request_without_full_blocks_stores_nothing():
    """Neither of a's blocks has its last slot pending (blocks 3 and 7 are
    partial, or were stored before): nothing to store, a's rows dropped."""
    runner, stored = _runner(prefix_caching=True)
    runner._ddtree_release_pending_context({"a"})
    assert stored == []
    assert _left(runner, 2).tolist() == [20, 36, 37, 21, 8]


def test_a_request_not_in_the_batch_stores_everything():
    """Blocks it cannot see (a request not in the batch) are not guessed."""
    runner, stored = _runner(prefix_caching=False)
    runner._ddtree_release_pending_context({"a", "gone"})
    assert len(stored) == 1 and stored[0][2].numel() == 9


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


def test_freed_rows_are_dropped_from_rows_kept_by_reference():
    runner, stored = _runner(prefix_caching=False)
    runner.ddtree_pending_context = _pending(
        [_as_outputs(*step[:3]) for step in runner.ddtree_pending_context.steps])
    runner._ddtree_release_pending_context({"a", "c"})
    assert runner.ddtree_pending_context.live_rows == 2
    runner._ddtree_store_pending_context()
    (hidden, positions, slots), = stored
    assert slots.tolist() == [20, 21] and positions.tolist() == [2, 12]
    assert hidden[:, 0].tolist() == [2.0, 12.0] and hidden.shape == (2, 6)


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


def test_rows_of_other_requests_stay_as_they_were():
    """Requests without pending rows gave their blocks back: nothing is joined or copied."""
    runner, stored = _runner(prefix_caching=False)
    runner.ddtree_pending_context = _pending(
        [_as_outputs(*step[:3]) for step in runner.ddtree_pending_context.steps])
    before = list(runner.ddtree_pending_context.steps)
    runner.input_batch.block_table[1].block_table.np[1] = [11, 0, 0]  # b now owns block 11 only
    runner._ddtree_release_pending_context({"b"})
    assert runner.ddtree_pending_context.steps == before
    assert runner.ddtree_pending_context.live_rows == 9
    assert stored == []


def test_rows_left_pending_are_not_copied_and_settle_again():
    """A release marks the freed rows dead in place: the survivors' tensors
    are the same memory (a copy of every pending row per finished request
    cost more than the rows stored). A second release on the marked steps
    settles only live rows, and what is stored at the end is in step order."""
    runner, stored = _runner(prefix_caching=True)
    runner.ddtree_pending_context = _pending(
        [_as_outputs(*step[:3]) for step in runner.ddtree_pending_context.steps])
    outputs = [step.hidden for step in runner.ddtree_pending_context.steps]
    runner._ddtree_release_pending_context({"a"})  # no full block of a's pending: none stored
    steps = runner.ddtree_pending_context.steps
    assert stored == [] and [s.hidden for s in steps] == outputs
    assert all(a.data_ptr() == b.data_ptr() for s, o in zip(steps, outputs)
               for a, b in zip(s.hidden, o))
    assert steps[0].live.tolist() == [False, False, True, True, True]
    # c's block 9 (slots 36..39) is not full; block 2 (8..11) neither: dropped
    runner._ddtree_release_pending_context({"c"})
    assert stored == [] and runner.ddtree_pending_context.live_rows == 2
    assert runner.ddtree_pending_context.held_rows == 9
    runner._ddtree_store_pending_context()
    (hidden, positions, slots), = stored
    assert slots.tolist() == [20, 21] and positions.tolist() == [2, 12]
    assert hidden.tolist() == [[2.0] * 6, [12.0] * 6]


def test_a_step_without_live_rows_is_let_go():
    """Held memory counts a step's dead rows until none of its rows is live."""
    runner, _ = _runner(prefix_caching=False)
    runner._ddtree_release_pending_context({"a", "b"})
    pending = runner.ddtree_pending_context
    assert pending.live_rows == 3 and pending.held_rows == 9  # c's 36, 37 and 8
    runner._ddtree_release_pending_context({"c"})
    assert not pending and pending.held_rows == pending.live_rows == 0


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


def test_many_steps_are_joined_into_one_without_their_dead_rows():
    """Every MAX_STEPS steps the live rows become one step (a release costs
    per step; at one request a plain step adds one row); the rows, their
    order and what a later release settles stay the same."""
    from vllm_ddtree.core.pending_context import MAX_STEPS, PendingContext

    pending = PendingContext()
    for t in range(MAX_STEPS):  # one row a step, slots t; block size 4
        pending.add(tuple(torch.full((1, 2), float(t)) for _ in range(3)),
                    np.array([t]), np.array([t]))
    assert pending.release(torch.tensor([0]), BLOCK, keep_full=False) is None  # slots 0..3
    assert pending.held_rows == MAX_STEPS - 4 and len(pending.steps) == MAX_STEPS - 4
    extra = list(range(1000, 1005))  # 4 fill MAX_STEPS again, the 5th joins
    for t in extra:
        assert len(pending.steps) == MAX_STEPS - 4 + (t - 1000)
        pending.add(tuple(torch.full((1, 2), -float(t)) for _ in range(3)), np.array([t]),
                    np.array([t]))
    assert len(pending.steps) == 2 and pending.held_rows == pending.live_rows == MAX_STEPS + 1
    stored = pending.release(torch.tensor([1]), BLOCK, keep_full=True)  # slots 4..7: full
    assert stored[2].tolist() == [4, 5, 6, 7] and stored[0][:, 0].tolist() == [4, 5, 6, 7]
    hidden, positions, slots = pending.take()
    assert slots.tolist() == list(range(8, MAX_STEPS)) + extra
    assert hidden[:, 0].tolist() == list(range(8, MAX_STEPS)) + [-t for t in extra]
    assert hidden.shape[1] == 6 and positions.tolist() == slots.tolist()
