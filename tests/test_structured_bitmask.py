"""The tree bitmask in both of vLLM's row layouts.

``fill_bitmask`` writes one bitmask row per tree node; the runner's
``apply_grammar_bitmask`` reads them back for the logits rows. The two sides
must agree on where a request's rows start:

- packed (vLLM 0.32): read with vLLM 0.32's own ``apply_grammar_bitmask``
  (the installed one), rows ``1 + len(drafts)`` per request back to back;
- strided (vLLM 0.33 and 0.34): request ``i`` at row ``i * (B + 1)``. That
  reader is not installed here, so :func:`read_strided` restates the audited
  0.33 rule (``docs/seam_audit.md``): stride ``bitmask.shape[0] // requests``,
  the first ``1 + len(drafts)`` rows of the block.

Every node's row allows exactly one token, an id of the grammar state after
the node's path, so a row read for the wrong node is seen. Batches mix draft
counts, a request without drafts and a request without structured output.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_ddtree.core.node_history import node_paths
from vllm_ddtree.structured import PACKED, STRIDED, bitmask_layout, fill_bitmask

VOCAB = 64
WORDS = VOCAB // 32


def state_token(state: list[int]) -> int:
    """The one token a row for grammar state ``state`` allows."""
    return (hash(tuple(state)) % (VOCAB - 1)) + 1


class StateGrammar:
    """Accepts every token; its bitmask allows one token naming its state."""

    def __init__(self):
        self.state: list[int] = []

    def validate_tokens(self, tokens):
        return list(tokens)

    def accept_tokens(self, request_id, tokens):
        self.state.extend(tokens)
        return True

    def rollback(self, n):
        del self.state[len(self.state) - n:]

    def is_terminated(self):
        return False

    def fill_bitmask(self, bitmask, index):
        row = np.zeros(WORDS, dtype=np.uint32)
        t = state_token(self.state)
        row[t >> 5] |= np.uint32(1 << (t & 31))
        bitmask[index] = torch.from_numpy(row.view(np.int32))


class FakeManager:
    """The parts of ``StructuredOutputManager`` that ``fill_bitmask`` uses,
    with each layout's ``_fill_bitmasks`` tuple arity (a 3-tuple given to the
    0.33 method fails to unpack, as in vLLM)."""

    def __init__(self, layout: str, budget: int, max_seqs: int):
        self.layout = layout
        self.vllm_config = SimpleNamespace(num_speculative_tokens=budget,
                                           scheduler_config=SimpleNamespace(max_num_seqs=max_seqs))
        self._grammar_bitmask = None
        self.backend = SimpleNamespace(
            allocate_token_bitmask=lambda n: torch.full((n, WORDS), -1, dtype=torch.int32))
        self.reasoning_end_calls = 0

    def _fill_bitmasks(self, batch):
        for entry in batch:
            if self.layout == PACKED:
                grammar, index, apply = entry
                masked = ()
            else:
                grammar, index, apply, masked = entry
            if apply:
                grammar.fill_bitmask(self._grammar_bitmask, index)
            else:
                self._grammar_bitmask[index].fill_(-1)
                row = self._grammar_bitmask[index].numpy().view(np.uint32)
                for t in masked:
                    row[t >> 5] &= ~np.uint32(1 << (t & 31))

    def _masked_reasoning_ends(self, request):
        self.reasoning_end_calls += 1
        return (0,)

    def _get_constraint_bounds(self, request, spec_tokens):
        return SimpleNamespace(constraint_start=0 if request.active else 1)


def random_tree(rng, n):
    parents = [rng.randrange(j) for j in range(1, n + 1)]
    tokens = [rng.randrange(VOCAB) for _ in range(n)]
    return parents, tokens


def make_batch(rng, budget, counts, active=None):
    """Requests r0.. with the given draft counts (0: none) and trees."""
    requests, scheduled, trees = {}, {}, {}
    for i, n in enumerate(counts):
        rid = f"r{i}"
        parents, tokens = random_tree(rng, n) if n else ([], [])
        grammar = StateGrammar()
        grammar.state = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 3))]
        requests[rid] = SimpleNamespace(
            structured_output_request=SimpleNamespace(grammar=grammar),
            ddtree_parents=parents, active=True if active is None else active[i])
        if n:
            scheduled[rid] = tokens
        trees[rid] = (parents, tokens, list(grammar.state))
    return requests, scheduled, trees


def read_packed_with_vllm(bitmask, structured_ids, batch_ids, scheduled):
    """vLLM 0.32's own reader: which token each logits row still allows."""
    from vllm.v1.structured_output.utils import apply_grammar_bitmask

    rows = sum(1 + len(scheduled.get(r, ())) for r in batch_ids)
    logits = torch.zeros(rows, VOCAB)
    apply_grammar_bitmask(SimpleNamespace(scheduled_spec_decode_tokens=scheduled),
                          SimpleNamespace(grammar_bitmask=bitmask,
                                          structured_output_request_ids=structured_ids),
                          SimpleNamespace(req_ids=batch_ids), logits)
    return logits


def read_strided(bitmask, structured_ids, batch_ids, scheduled):
    """vLLM 0.33's rule (audited): request ``i``'s rows start at
    ``i * (bitmask.shape[0] // len(structured_ids))``."""
    stride = bitmask.shape[0] // len(structured_ids)
    rows = sum(1 + len(scheduled.get(r, ())) for r in batch_ids)
    logits = torch.zeros(rows, VOCAB)
    start, logit_row = {}, 0
    for rid in batch_ids:
        start[rid] = logit_row
        logit_row += 1 + len(scheduled.get(rid, ()))
    for i, rid in enumerate(structured_ids):
        for j in range(1 + len(scheduled.get(rid, ()))):
            words = bitmask[i * stride + j].view(np.uint32)
            allowed = [(int(words[t >> 5]) >> (t & 31)) & 1 for t in range(VOCAB)]
            logits[start[rid] + j][torch.tensor(allowed) == 0] = float("-inf")
    return logits


READERS = {PACKED: read_packed_with_vllm, STRIDED: read_strided}


def check_rows(logits, structured_ids, batch_ids, scheduled, trees, active):
    start, row = {}, 0
    for rid in batch_ids:
        start[rid] = row
        row += 1 + len(scheduled.get(rid, ()))
    for rid in structured_ids:
        parents, tokens, state0 = trees[rid]
        paths = node_paths(parents, tokens) if tokens else [[]]
        for j, path in enumerate(paths):
            allowed = torch.isfinite(logits[start[rid] + j]).nonzero().flatten().tolist()
            if active[rid]:
                assert allowed == [state_token(state0 + path)], (rid, j)
            else:  # grammar not active yet: everything but the reasoning end (0.33) / all
                assert len(allowed) >= VOCAB - 1, (rid, j)
    for rid in set(batch_ids) - set(structured_ids):
        assert torch.isfinite(logits[start[rid]]).all()


@pytest.mark.parametrize("layout", [PACKED, STRIDED])
@pytest.mark.parametrize("seed", range(4))
def test_rows_reach_their_nodes(layout, seed):
    rng = random.Random(seed)
    budget = 8
    counts = [rng.randint(1, budget), 0, budget, rng.randint(1, 3), 0]
    requests, scheduled, trees = make_batch(rng, budget, counts)
    structured = ["r3", "r0", "r1", "r2"]  # not batch order; r4 is unconstrained
    batch_ids = [f"r{i}" for i in range(len(counts))]
    manager = FakeManager(layout, budget, max_seqs=len(counts))
    bitmask = fill_bitmask(manager, requests, structured, scheduled, layout=layout)
    if layout == STRIDED:
        assert bitmask.shape[0] == len(structured) * (budget + 1)
    else:
        assert bitmask.shape[0] == sum(1 + len(scheduled.get(r, ())) for r in structured)
    logits = READERS[layout](bitmask, structured, batch_ids, scheduled)
    check_rows(logits, structured, batch_ids, scheduled, trees,
               {r: True for r in batch_ids})


@pytest.mark.parametrize("layout", [PACKED, STRIDED])
def test_request_whose_grammar_is_not_active(layout):
    rng = random.Random(7)
    requests, scheduled, trees = make_batch(rng, 4, [0, 3], active=[False, True])
    manager = FakeManager(layout, 4, max_seqs=2)
    bitmask = fill_bitmask(manager, requests, ["r0", "r1"], scheduled, layout=layout)
    logits = READERS[layout](bitmask, ["r0", "r1"], ["r0", "r1"], scheduled)
    check_rows(logits, ["r0", "r1"], ["r0", "r1"], scheduled, trees,
               {"r0": False, "r1": True})
    if layout == STRIDED:  # 0.33's rows before the grammar starts mask the reasoning ends
        assert manager.reasoning_end_calls == 1
        assert not torch.isfinite(logits[0, 0])
    else:
        assert manager.reasoning_end_calls == 0


@pytest.mark.parametrize("fill_as,read_as", [(PACKED, STRIDED), (STRIDED, PACKED)])
def test_a_layout_mismatch_is_seen(fill_as, read_as):
    # The check above has power: rows written in one layout and read in the
    # other land on the wrong nodes (or the 0.33 method refuses 3-tuples).
    rng = random.Random(3)
    requests, scheduled, trees = make_batch(rng, 6, [2, 5, 1])
    ids = ["r0", "r1", "r2"]
    manager = FakeManager(fill_as, 6, max_seqs=3)
    bitmask = fill_bitmask(manager, requests, ids, scheduled, layout=fill_as)
    logits = READERS[read_as](bitmask, ids, ids, scheduled)
    with pytest.raises(AssertionError):
        check_rows(logits, ids, ids, scheduled, trees, {r: True for r in ids})


def test_old_tuples_do_not_fit_the_new_method():
    rng = random.Random(1)
    requests, scheduled, _ = make_batch(rng, 4, [2])
    manager = FakeManager(STRIDED, 4, max_seqs=1)
    with pytest.raises(ValueError, match="not enough values"):
        fill_bitmask(manager, requests, ["r0"], scheduled, layout=PACKED)


def test_layout_follows_the_vllm_version():
    assert bitmask_layout("0.32.0") == PACKED
    assert bitmask_layout("0.32.1+cpu") == PACKED
    assert bitmask_layout("0.33.0") == STRIDED
    assert bitmask_layout("0.34.0") == STRIDED
    assert bitmask_layout() == PACKED  # the installed vLLM CPU 0.32


def test_more_drafts_than_the_budget_are_refused():
    rng = random.Random(2)
    requests, scheduled, _ = make_batch(rng, 8, [6])
    manager = FakeManager(STRIDED, 4, max_seqs=1)
    with pytest.raises(RuntimeError, match="more than the budget"):
        fill_bitmask(manager, requests, ["r0"], scheduled, layout=STRIDED)
