"""Structured output on trees: the scheduler's side.

vLLM keeps each request's grammar in the scheduler's
``StructuredOutputManager``; it checks drafts as a chain (the longest valid
prefix) and fills one bitmask row per draft by advancing the grammar along
the chain. With DDTree the drafts of a request are a tree, so:

- :func:`update_drafts` (``Scheduler.update_draft_token_ids``) walks the
  tree with the grammar and drops every node whose path the grammar rejects,
  so the tree budget is spent on nodes that can be accepted. The surviving
  nodes keep their order and get renumbered parents; the request remembers
  them (``request.ddtree_parents``) and, when nodes were dropped, the runner
  is told which (:func:`pruned_for`, attached to the next
  ``SchedulerOutput`` as ``ddtree_pruned``).
- :func:`fill_bitmask` (``StructuredOutputManager.grammar_bitmask``) fills
  row ``j`` of a request with the grammar's mask after node ``j``'s path, in
  the flat node order the runner's logits rows use and in the row layout of
  the installed vLLM (:func:`bitmask_layout`: packed in 0.32, a fixed stride
  per request from 0.33), so vLLM's ``apply_grammar_bitmask`` masks every node
  with its own state.
- The accepted path is a chain again: vLLM's ``update_from_output`` advances
  the grammar with the generated tokens as in plain decoding.

A request whose grammar is not active yet (a reasoning parser still inside
the reasoning part) gets no drafts until it is: where the grammar starts
along a tree path is not something vLLM's bounds logic can answer per node.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

from vllm.logger import init_logger
from vllm.v1.outputs import DraftTokenIds

from vllm_ddtree.core.node_history import chain_parents, prune_tree, renumber, walk_grammar

logger = init_logger("vllm.ddtree")

__all__ = ["DDTreeDraftTokenIds", "GrammarTimer", "PACKED", "STRIDED", "bitmask_layout",
           "fill_bitmask", "pruned_for", "update_drafts"]


@dataclass
class DDTreeDraftTokenIds(DraftTokenIds):
    """vLLM's drafts plus each request's tree (parents of its drafts)."""

    parents: list[list[int]] = field(default_factory=list)


class GrammarTimer:
    """Host time spent on per-node grammar work (for the benchmark's report)."""

    prune_s = 0.0
    fill_s = 0.0
    nodes_pruned = 0
    nodes_seen = 0

    @classmethod
    def reset(cls) -> None:
        cls.prune_s = cls.fill_s = 0.0
        cls.nodes_pruned = cls.nodes_seen = 0


def _grammar_active(manager, request) -> bool:
    from vllm.v1.structured_output import _CONSTRAINED_FROM_START

    return manager._get_constraint_bounds(request, ()) == _CONSTRAINED_FROM_START


def update_drafts(scheduler, draft_token_ids: DraftTokenIds) -> None:
    """``Scheduler.update_draft_token_ids`` for trees."""
    parents_all = getattr(draft_token_ids, "parents", None) or []
    manager = scheduler.structured_output_manager
    t0 = time.perf_counter()
    for i, (req_id, drafts) in enumerate(zip(draft_token_ids.req_ids,
                                              draft_token_ids.draft_token_ids)):
        request = scheduler.requests.get(req_id)
        if request is None or request.is_finished():
            continue
        request.ddtree_pruned = None
        if request.is_prefill_chunk:
            request.spec_token_ids = []
            continue
        parents = list(parents_all[i][: len(drafts)]) if i < len(parents_all) \
            else chain_parents(len(drafts))
        if not request.use_structured_output or not drafts:
            request.spec_token_ids = drafts
            request.ddtree_parents = parents
            continue
        if not _grammar_active(manager, request):
            request.spec_token_ids = []
            request.ddtree_parents = []
            continue
        grammar = request.structured_output_request.grammar
        kept = prune_tree(grammar, req_id, parents, drafts)
        GrammarTimer.nodes_seen += len(drafts)
        if kept is None:
            request.spec_token_ids = drafts
            request.ddtree_parents = parents
            continue
        GrammarTimer.nodes_pruned += len(drafts) - len(kept)
        new_parents = renumber(parents, kept)
        request.spec_token_ids = [drafts[j - 1] for j in kept]
        request.ddtree_parents = new_parents
        request.ddtree_pruned = (kept, new_parents)
    GrammarTimer.prune_s += time.perf_counter() - t0


def pruned_for(scheduler, scheduler_output) -> dict[str, tuple[list[int], list[int]]]:
    """The pruned trees among the scheduled drafts: ``{req_id: (kept nodes
    as flat indices of the drafter's tree, their parents)}``, cut to what was
    scheduled."""
    out = {}
    for req_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
        request = scheduler.requests.get(req_id)
        pruned = getattr(request, "ddtree_pruned", None)
        if pruned is not None:
            kept, parents = pruned
            out[req_id] = (kept[: len(drafts)], parents[: len(drafts)])
    return out


# How ``StructuredOutputManager.grammar_bitmask`` lays out its rows, which the
# runner's ``apply_grammar_bitmask`` reads back:
# - "packed" (vLLM 0.32): request after request, ``1 + len(drafts)`` rows each;
#   ``_fill_bitmasks`` takes ``(grammar, row, apply)``;
# - "strided" (vLLM 0.33 on): request ``i`` owns rows ``i * S .. i * S + S - 1``
#   with ``S = num_speculative_tokens + 1`` and uses the first ``1 + len(drafts)``;
#   ``_fill_bitmasks`` takes ``(grammar, row, apply, masked_ids)``, the last
#   being the reasoning-end tokens an unconstrained row must still mask.
PACKED, STRIDED = "packed", "strided"


def bitmask_layout(vllm_version=None) -> str:
    """The bitmask layout of the installed vLLM (or of ``vllm_version``)."""
    from packaging.version import Version

    if vllm_version is None:
        return _installed_layout()
    return STRIDED if Version(str(vllm_version)).release[:2] >= (0, 33) else PACKED


@functools.cache
def _installed_layout() -> str:
    from vllm_ddtree.version import installed_vllm

    return bitmask_layout(installed_vllm()[1])


def fill_bitmask(manager, requests, structured_output_request_ids,
                 scheduled_spec_decode_tokens, layout: str | None = None):
    """``StructuredOutputManager.grammar_bitmask`` for trees: row ``j`` of a
    request is the mask after node ``j``'s path (``j = 0``: the root), in the
    installed vLLM's layout (:func:`bitmask_layout`)."""
    if not structured_output_request_ids:
        return None
    layout = layout or bitmask_layout()
    if layout not in (PACKED, STRIDED):
        raise ValueError(f"unknown bitmask layout {layout!r}")
    t0 = time.perf_counter()
    num_spec = manager.vllm_config.num_speculative_tokens
    if manager._grammar_bitmask is None:
        max_batch = manager.vllm_config.scheduler_config.max_num_seqs
        manager._grammar_bitmask = manager.backend.allocate_token_bitmask(
            max_batch * (1 + num_spec))
    bitmask = manager._grammar_bitmask

    def fill(grammar, row: int, apply: bool, request) -> None:
        if layout == PACKED:
            manager._fill_bitmasks(((grammar, row, apply),))
        else:
            masked = () if apply else manager._masked_reasoning_ends(request)
            manager._fill_bitmasks(((grammar, row, apply, masked),))

    index = 0
    for i, req_id in enumerate(structured_output_request_ids):
        request = requests[req_id]
        grammar = request.structured_output_request.grammar
        drafts = scheduled_spec_decode_tokens.get(req_id, [])
        base = index if layout == PACKED else i * (1 + num_spec)
        if len(drafts) > num_spec:
            raise RuntimeError(f"DDTree: request {req_id} has {len(drafts)} scheduled drafts, "
                               f"more than the budget {num_spec}")
        if not drafts:
            apply = manager._get_constraint_bounds(request, ()).constraint_start == 0
            fill(grammar, base, apply, request)
            index = base + 1
            continue
        parents = (getattr(request, "ddtree_parents", None) or [])[: len(drafts)]
        if len(parents) != len(drafts):
            raise RuntimeError(f"DDTree: request {req_id} has {len(drafts)} scheduled drafts "
                               f"but a tree of {len(parents)} nodes")

        def visit(j: int, base=base, grammar=grammar, request=request) -> None:
            fill(grammar, base + j, True, request)

        ok = walk_grammar(grammar, req_id, parents, drafts, visit)
        if not all(ok):
            # Every scheduled node passed the grammar when it was drafted.
            logger.error("DDTree: the grammar of request %s rejects %d scheduled tree nodes; "
                         "their rows get their nearest valid ancestor's mask", req_id,
                         ok.count(False))
            for j, p in enumerate(parents, start=1):
                if not ok[j - 1]:
                    anc = p
                    while anc and not ok[anc - 1]:
                        anc = parents[anc - 1]
                    bitmask[base + j].copy_(bitmask[base + anc])
        index = base + 1 + len(drafts)
    GrammarTimer.fill_s += time.perf_counter() - t0
    if layout == STRIDED:
        index = len(structured_output_request_ids) * (1 + num_spec)
    return bitmask[:index].numpy()
