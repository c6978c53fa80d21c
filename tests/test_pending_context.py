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


def test_with_prefix_caching_every_pending_row_is_stored():
    """Cached blocks outlive their request: their drafter context is stored."""
    runner, stored = _runner(prefix_caching=True)
    runner._ddtree_release_pending_context({"a"})
    assert len(stored) == 1 and stored[0][2].tolist() == [12, 13, 20, 36, 37, 14, 29, 21, 8]
    assert runner.ddtree_pending_context == [] and runner.ddtree_pending_rows == 0


def test_a_request_not_in_the_batch_stores_everything():
    """Blocks it cannot see (a request not in the batch) are not guessed."""
    runner, stored = _runner(prefix_caching=False)
    runner._ddtree_release_pending_context({"a", "gone"})
    assert len(stored) == 1 and stored[0][2].numel() == 9
