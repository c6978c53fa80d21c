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
    runner.ddtree_pending_context = [
        (torch.arange(5.0)[:, None].repeat(1, 6), torch.arange(5), step1),
        (10 + torch.arange(4.0)[:, None].repeat(1, 6), 10 + torch.arange(4), step2)]
    runner.ddtree_pending_rows = 9
    return runner, stored


def test_without_prefix_caching_the_rows_of_freed_blocks_are_dropped():
    """Rows of the requests that finished (a) or were preempted (c) are
    dropped, the rest stays pending, in step order, nothing is stored."""
    runner, stored = _runner(prefix_caching=False)
    runner._ddtree_release_pending_context({"a", "c"})
    assert stored == []
    assert runner.ddtree_pending_rows == 2
    slots = torch.cat([s for _, _, s in runner.ddtree_pending_context])
    assert slots.tolist() == [20, 21]  # b's rows only
    positions = torch.cat([p for _, p, _ in runner.ddtree_pending_context])
    hidden = torch.cat([h for h, _, _ in runner.ddtree_pending_context])
    assert positions.tolist() == [2, 12] and hidden[:, 0].tolist() == [2.0, 12.0]
    runner._ddtree_store_pending_context()
    assert [s.tolist() for _, _, s in stored] == [[20, 21]]
    assert runner.ddtree_pending_context == [] and runner.ddtree_pending_rows == 0


def test_with_prefix_caching_full_blocks_are_stored_and_partial_ones_dropped():
    """vLLM caches full blocks only: a finished request's full block (3: its
    last slot 15 is pending) may be hit later, so its rows are stored now, in
    step order; its partial block (7) is never cached: dropped. The other
    requests' rows stay pending."""
    runner, stored = _runner(prefix_caching=True)
    runner.ddtree_pending_context[1] = (runner.ddtree_pending_context[1][0],
                                        runner.ddtree_pending_context[1][1],
                                        torch.tensor([14, 15, 21, 29]))  # a a b a
    runner._ddtree_release_pending_context({"a"})
    (hidden, positions, slots), = stored
    assert slots.tolist() == [12, 13, 14, 15]
    assert positions.tolist() == [0, 1, 10, 11] and hidden[:, 0].tolist() == [0, 1, 10, 11]
    assert runner.ddtree_pending_rows == 4
    left = torch.cat([s for _, _, s in runner.ddtree_pending_context])
    assert left.tolist() == [20, 36, 37, 21]  # b, c, c, b; a's 29 dropped


def test_with_prefix_caching_a_request_without_full_blocks_stores_nothing():
    """Neither of a's blocks has its last slot pending (blocks 3 and 7 are
    partial, or were stored before): nothing to store, a's rows dropped."""
    runner, stored = _runner(prefix_caching=True)
    runner._ddtree_release_pending_context({"a"})
    assert stored == []
    left = torch.cat([s for _, _, s in runner.ddtree_pending_context])
    assert left.tolist() == [20, 36, 37, 21, 8]


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
    from vllm_ddtree.runner import _pending_rows

    runner, _ = _runner(prefix_caching=False)
    tensor_items = list(runner.ddtree_pending_context)
    extra = (20 + torch.arange(2.0)[:, None].repeat(1, 6), 20 + torch.arange(2),
             torch.tensor([15, 22]))
    # copied, by reference, by reference, copied: one order in, one order out
    mixed = [tensor_items[0], _as_outputs(*tensor_items[1]), _as_outputs(*extra), extra]
    hidden, positions, slots = _pending_rows(mixed)
    want = [tensor_items[0], tensor_items[1], extra, extra]
    assert torch.equal(hidden, torch.cat([h for h, _, _ in want]))
    assert positions.tolist() == torch.cat([p for _, p, _ in want]).tolist()
    assert slots.tolist() == torch.cat([s for _, _, s in want]).tolist()
    assert hidden.shape == (13, 6) and positions.dtype == slots.dtype == torch.int64


def test_freed_rows_are_dropped_from_rows_kept_by_reference():
    runner, stored = _runner(prefix_caching=False)
    runner.ddtree_pending_context = [_as_outputs(*item) for item in runner.ddtree_pending_context]
    runner._ddtree_release_pending_context({"a", "c"})
    assert runner.ddtree_pending_rows == 2
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
    runner.ddtree_pending_context = [_as_outputs(*item) for item in runner.ddtree_pending_context]
    before = list(runner.ddtree_pending_context)
    runner.input_batch.block_table[1].block_table.np[1] = [11, 0, 0]  # b now owns block 11 only
    runner._ddtree_release_pending_context({"b"})
    assert runner.ddtree_pending_context == before and runner.ddtree_pending_rows == 9
    assert stored == []
