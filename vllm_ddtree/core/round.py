"""One DDTree verification round, in the order it happens.

A round verifies the trees the drafter proposed in the previous step and
prepares the drafter's next input. The runner (``vllm_ddtree/runner.py``)
calls one method per vLLM hook, in this order:

1. :meth:`TreeRound.plan` (``_prepare_inputs``, after vLLM's own inputs):
   match the scheduled drafts to the proposed trees, rewrite the RoPE
   positions of tree nodes to ``p0 + depth`` (node ``j`` keeps its KV slot
   ``slot(p0 + j)``), pack every token's ancestor mask and note every
   token's node depth (sliding-window layers measure their window in
   logical positions).
2. :meth:`TreeRound.attach` (``_build_attention_metadata``): hang the masks
   on the target layers' attention metadata as ``metadata.ddtree``.
3. :meth:`TreeRound.capturing` (``_model_forward``): the target forward,
   during which every target attention layer applies its mask and reports
   its cache write; afterwards a layer that did not is an error.
4. :meth:`TreeRound.verify` (``_sample``): the target's token at every node
   (argmax, or one draw from the request's processed distribution), the
   tree walk, and the rows the accepted nodes move to.
5. :meth:`TreeRound.compact`: move the accepted nodes' K/V into contiguous
   slots (``vllm_ddtree/core/compaction.py``).
6. :meth:`TreeRound.condition` (``propose_draft_token_ids``): put the
   accepted rows first in the drafter's inputs and restore sequential
   positions, so vLLM's DFlash "rejected suffix" logic applies unchanged.

Requests whose scheduled drafts are not a tree of ours (drafts kept from an
older step, placeholders) are verified as a chain through the same walk, with
the stock attention. A tree of ours always takes the tree path, even when it
came out chain-shaped (its mask is then causal), so that no step has to ask
the device which trees are chains.

No step reads a device tensor back on the host: every host-side value comes
from the scheduler's lists (``tests/test_round_sync_free.py``).

This module imports nothing from vLLM; the runner passes it tensors and
duck-typed metadata. The tree algorithms are called through the module
(``tree_ops.walk``), so a test can replace one of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from vllm_ddtree.core import tree as tree_ops
from vllm_ddtree.core.compaction import compaction_rows, kv_capture
from vllm_ddtree.core.stats import HIST_BINS
from vllm_ddtree.core.tree_info import TreeAttentionInfo, TreeStepBuffers

__all__ = ["DDTreeSeamError", "ProposedTrees", "StepCounts", "TreeRound", "attach_info"]


class DDTreeSeamError(RuntimeError):
    """A vLLM seam DDTree relies on did not take effect; serving on would
    produce wrong tokens silently."""


@dataclass(frozen=True)
class ProposedTrees:
    """The drafter's trees of one step, row ``i`` for request ``req_ids[i]``."""

    req_ids: list[str]
    tree: tree_ops.DraftTree


@dataclass
class StepCounts:
    """One walked step, for the ddtree metrics (host copy taken later)."""

    num_nodes: Tensor  # [R]
    num_accepted: Tensor  # [R]
    expected: Tensor  # [R] float64 drafter's expected accepted nodes
    from_drafter: Tensor  # [R] bool

    def totals(self) -> Tensor:
        """float64 ``[len(stats.FIELDS) + stats.HIST_BINS]``: the step's
        counters in the order of ``vllm_ddtree/core/stats.py`` (requests that
        verified at least one node only), summed on the device."""
        walked = self.num_nodes > 0
        w = walked.double()
        acc = self.num_accepted * walked
        sums = torch.stack([w.amax(), w.sum(), (self.from_drafter & walked).double().sum(),
                            (self.num_nodes * walked).double().sum(), acc.double().sum(),
                            (self.expected * w).sum()])
        hist = torch.bincount(acc.clamp(max=HIST_BINS - 1), weights=w, minlength=HIST_BINS)
        return torch.cat([sums, hist[:HIST_BINS].double()])


# Callables run with every verified round (after the walk), in the engine's
# process: the trace (``vllm-ddtree trace``) records rounds through this.
ROUND_OBSERVERS: list = []


@dataclass
class TreeRound:
    req_ids: list[str]
    budget: int
    depth: int
    num_nodes: Tensor  # [R] scheduled draft nodes per request
    parents: Tensor  # [R, B] flat parent index (a chain for requests without a tree)
    from_drafter: Tensor  # [R] bool: the drafts are a tree of ours
    tree_rows: tuple[int, ...]  # the same, on the host: the requests with a mask
    logit_rows: Tensor  # [R, 1+B] the logits row of every node (root first)
    logit_starts: list[int]  # each request's first logits row, on the host
    node_counts: list[int]  # the same as num_nodes, on the host
    expected: Tensor  # [R] float64 Σ q(u) over the scheduled nodes (0: unknown)
    # [R] nodes the walk may accept: the scheduled ones, or fewer when a cut
    # tree was padded back to its full size (the padding is never accepted)
    num_valid: Tensor | None = None
    tokens: Tensor | None = None  # [R, B] draft tokens (None: read the scheduled drafts)
    logq: Tensor | None = None  # [R, B] log q of the tree nodes (with_logq)
    # Set when tree_rows:
    query_start: Tensor | None = None  # [R] first token row of each request
    seq_positions: Tensor | None = None  # stock sequential positions
    info: TreeAttentionInfo | None = None
    # Set by verify:
    path: Tensor | None = None  # [R, 1+B]
    num_accepted: Tensor | None = None  # [R]
    src_rows: Tensor | None = None  # token rows of the accepted nodes, in path order ...
    dst_rows: Tensor | None = None  # ... and the rows they move to (root onto itself else)

    def __post_init__(self) -> None:
        if self.num_valid is None:
            self.num_valid = self.num_nodes

    @property
    def any_tree(self) -> bool:
        return bool(self.tree_rows)

    # ------------------------------------------------------------ 1. plan
    @classmethod
    def plan(
        cls,
        *,
        req_ids: Sequence[str],
        scheduled: dict[str, list[int]],
        trees: ProposedTrees | None,
        budget: int,
        depth: int,
        positions: Tensor,
        req_indices: Tensor,
        query_pos: Tensor,
        query_start: Tensor,
        with_expected: bool,
        with_logq: bool = False,
        check_drafts: bool = False,
        buffers: TreeStepBuffers | None = None,
        valid: dict[str, int] | None = None,
    ) -> TreeRound | None:
        """The round for this step, or None when nothing is verified.

        ``scheduled`` maps request ids to their scheduled draft tokens;
        ``positions``, ``req_indices`` and ``query_pos`` are the runner's
        per-token buffers over the step's tokens (``positions`` is rewritten
        in place); ``query_start`` is ``[R]``. Everything that needs a host
        value comes from the scheduler's lists, never from a device tensor;
        ``check_drafts`` (a debug option) compares the scheduled drafts with
        the trees, which reads the trees back. ``with_logq`` keeps the nodes'
        log q for :meth:`node_outcomes` (the adaptive budget's calibration).

        ``buffers``: the runner's persistent tensors; the masks and tree flags
        are written into them in place (every step, so that a replayed CUDA
        graph never sees an older step's tree) and the info views them.
        ``valid`` maps request ids to how many of their scheduled nodes the
        walk may accept (a tree cut by the adaptive budget and padded back to
        its full size for a uniform batch); the rest are verified but never
        accepted, so the step's tokens are those of the cut tree.
        """
        if not scheduled:
            return None
        if buffers is not None:
            buffers.is_tree.zero_()
        with_logq = with_logq or bool(ROUND_OBSERVERS)
        req_ids = list(req_ids)
        counts = [len(scheduled.get(r, ())) for r in req_ids]
        if max(counts) > budget:
            raise DDTreeSeamError(f"DDTree: {max(counts)} draft nodes scheduled for one "
                                  f"request, but the tree budget is {budget}")
        width = budget if trees is None else trees.tree.tokens.shape[1]
        if width < budget:
            # A tree built narrower than the budget (the adaptive budget's fixed
            # arm): the round is as wide as the tree, unless some request kept
            # wider drafts from an older step; then the tree is padded back.
            if max(counts) > width:
                trees = ProposedTrees(trees.req_ids, tree_ops.widen(trees.tree, budget))
            else:
                budget = width
        where = {} if trees is None else {rid: i for i, rid in enumerate(trees.req_ids)}
        src = [where.get(rid, -1) if n else -1 for rid, n in zip(req_ids, counts)]
        tree_rows = tuple(r for r, i in enumerate(src) if i >= 0)
        # Scheduled drafts that are not a tree of ours are verified as a chain.
        chain_rows = any(n and i < 0 for n, i in zip(counts, src))
        starts, total = [], 0
        for n in counts:
            starts.append(total)
            total += n + 1
        dev = positions.device
        usable = counts if not valid else [min(n, valid.get(r, n)) for r, n in zip(req_ids, counts)]
        host = torch.tensor([counts, [max(i, 0) for i in src], [i >= 0 for i in src], starts,
                             usable], dtype=torch.int64)
        num_nodes, src_t, fd, logit_start, num_valid = host.to(dev, non_blocking=True).unbind(0)
        if usable is counts:
            num_valid = num_nodes
        from_drafter = fd.bool()
        ar1 = torch.arange(budget + 1, device=dev)
        rnd = cls(req_ids, budget, depth, num_nodes, _chain(len(req_ids), budget, dev),
                  from_drafter, tree_rows,
                  logit_start[:, None] + torch.minimum(ar1, num_nodes[:, None]), starts,
                  counts, torch.zeros(len(req_ids), dtype=torch.float64, device=dev),
                  num_valid)
        if not tree_rows:
            return rnd
        tree = trees.tree
        parents = tree.parents.index_select(0, src_t)
        node_depth = tree.depth.index_select(0, src_t)
        if chain_rows:
            chain_depth = rnd.parents + 1
            parents = torch.where(from_drafter[:, None], parents, rnd.parents)
            node_depth = torch.where(from_drafter[:, None], node_depth, chain_depth)
        else:
            rnd.tokens = tree.tokens.index_select(0, src_t)
        rnd.parents = parents
        if check_drafts:
            _check_scheduled_tokens(scheduled, req_ids, tree_rows,
                                    tree.tokens.index_select(0, src_t))
        if with_expected or with_logq:
            rnd.logq = tree.logq.index_select(0, src_t)
        if with_expected:
            scheduled_node = ar1[None, 1:] <= num_valid[:, None]
            rnd.expected = (rnd.logq.double().exp()
                            * (scheduled_node & from_drafter[:, None])).sum(-1)

        # Node j of a tree request is at position p0 + depth(j); every other
        # token keeps its position (delta 0).
        anc = tree_ops.ancestor_mask(parents, node_depth)  # [R, 1+B, W]
        depth_with_root = F.pad(node_depth, (1, 0))  # [R, 1+B], root 0
        delta = (depth_with_root - ar1) * fd[:, None]
        ridx, node = req_indices.long(), query_pos.long().clamp(max=budget)
        rnd.seq_positions = positions.clone()
        positions += delta[ridx, node]
        max_len = 1 + max(counts[r] for r in tree_rows)
        depth = depth_with_root[ridx, node].to(torch.int32)
        if buffers is None:
            rnd.info = TreeAttentionInfo.create(anc[ridx, node], from_drafter, tree_rows,
                                                max_tree_query_len=max_len, depth=depth)
        else:
            num_tokens = positions.shape[0]
            words = anc.shape[-1]  # fewer than the buffer's for a narrow tree
            buffers.mask[:num_tokens, :words].copy_(anc[ridx, node])
            if words < buffers.mask.shape[1]:
                buffers.mask[:num_tokens, words:].zero_()
            buffers.depth[:num_tokens].copy_(depth)
            buffers.is_tree[: len(req_ids)].copy_(from_drafter)
            rnd.info = buffers.info(num_tokens, len(req_ids), tree_rows, max_len)
        rnd.query_start = query_start.long()
        return rnd

    # ------------------------------------------------------------ 2. attach
    def attach(self, attn_metadata: dict[str, Any] | list[dict[str, Any]],
               target_layers: frozenset[str]) -> None:
        """Set ``.ddtree`` on the metadata of every target attention layer
        (None when no request needs a mask)."""
        attach_info(attn_metadata, target_layers, self.info)

    # ------------------------------------------------------------ 3. forward
    @contextmanager
    def capturing(self, target_layers: Iterable[str]):
        """Around the target forward: note every target layer's cache (for
        compaction), then check that every target layer applied the mask and
        wrote its K/V through a DDTree impl."""
        if not self.any_tree:
            yield
            return
        kv_capture.start(target_layers)
        try:
            yield
        finally:
            kv_capture.stop()
        missing = kv_capture.missing_layers()
        if missing:
            detail = "; ".join(f"{what}: {', '.join(names[:4])}"
                               + (f" (+{len(names) - 4} more)" if len(names) > 4 else "")
                               for what, names in missing.items())
            raise DDTreeSeamError(
                "DDTree: target attention layers did not run the tree path in a tree "
                f"verification step ({detail}). Their attention backend ignores the tree "
                "mask, so the output would be wrong. Serve with the DDTree attention backend "
                "(the plugin selects it unless --attention-backend overrides it), or use "
                "method 'dflash'.")

    def replayed(self, target_layers: Iterable[str]) -> None:
        """The forward was a replayed CUDA graph, captured with the tree path
        (no Python ran in it): compaction moves every target layer's cache as
        recorded at capture, and the device-side guard checks the step."""
        kv_capture.replayed(target_layers)

    # ------------------------------------------------------------ 4. verify
    def node_tokens(self, draft_token_ids: Tensor) -> Tensor:
        """``[R, B]`` the scheduled nodes' tokens (kept for :meth:`verify`)."""
        if self.tokens is None:
            self.tokens = self._scheduled_drafts(draft_token_ids)
        return self.tokens

    def verify(self, logits: Tensor, draft_token_ids: Tensor, num_draft_tokens: Sequence[int],
               sampling: Any, min_p: Tensor | None = None) -> Tensor:
        """The walk over the scheduled nodes. ``logits`` has ``n + 1`` rows per
        request (its ``n`` scheduled nodes and the root, root first), each
        already transformed with its node's history where the request asks
        for it (``vllm_ddtree/node_sampling.py``); ``draft_token_ids`` the
        scheduled drafts back to back; ``sampling`` vLLM's per-request
        sampling metadata (``all_greedy``, ``temperature``, ``top_k``,
        ``top_p``, ``generators``); ``min_p`` ``[R]`` or None. Returns
        ``[R, 1+B]``: the accepted path then the bonus token, -1 padded."""
        if sampling.all_greedy:
            # What sample_posterior returns for greedy rows, without drawing noise.
            post_flat = logits.float().argmax(-1)
        else:
            post_flat = _sample_nodes(logits, self.num_nodes, self.logit_starts,
                                      sampling, min_p)
        post = post_flat[self.logit_rows]
        tokens = self.node_tokens(draft_token_ids)
        res = tree_ops.walk(tokens, self.parents, post, num_nodes=self.num_valid)
        self.path, self.num_accepted = res.path, res.num_accepted
        if self.any_tree:
            self.src_rows, self.dst_rows = compaction_rows(
                self.path, self.num_accepted, self.query_start, self.depth)
        for observe in ROUND_OBSERVERS:
            observe(self, res.output_tokens)
        return res.output_tokens

    def output_rows(self) -> Tensor:
        """``[R, 1+B]`` after :meth:`verify`: the logits row each output token
        was sampled at (the accepted nodes' rows, then the bonus row; rows
        past the output repeat the root's)."""
        return self.logit_rows.gather(1, self.path.clamp(min=0))

    def _scheduled_drafts(self, draft_token_ids: Tensor) -> Tensor:
        """``[R, B]`` drafts from vLLM's flat list (rows past a request's own
        drafts are never matched by the walk)."""
        num_reqs, dev = self.num_nodes.shape[0], self.num_nodes.device
        if not draft_token_ids.numel():
            return torch.full((num_reqs, self.budget), -1, device=dev, dtype=torch.long)
        starts = self.logit_rows[:, 0] - torch.arange(num_reqs, device=dev)  # no root rows
        cols = torch.arange(self.budget, device=dev)
        idx = (starts[:, None] + cols).clamp(max=draft_token_ids.numel() - 1)
        return draft_token_ids.long()[idx]

    # ------------------------------------------------------------ 5. compact
    def compact(self, slot_mapping: Tensor, layers: Iterable[str] | None = None) -> None:
        """Move accepted nodes' K/V from ``slot(p0 + path[k])`` to
        ``slot(p0 + k)`` in the target layers ``layers`` (default: all), whose
        KV-cache group's slot mapping, per token row, is ``slot_mapping``."""
        if not self.any_tree:
            return
        kv_capture.compact(slot_mapping[self.src_rows], slot_mapping[self.dst_rows], layers)

    # ------------------------------------------------------------ 6. condition
    def condition(self, aux_hidden_states: Sequence[Tensor] | None, positions: Tensor) -> None:
        """Rows ``p0..p0+a`` of each tree request become its accepted path, in
        order, in the drafter's inputs; ``positions`` (the runner's buffer)
        gets its sequential values back."""
        if not self.any_tree or self.path is None:
            return
        for h in aux_hidden_states or ():
            h.index_copy_(0, self.dst_rows, h.index_select(0, self.src_rows))
        positions[: self.seq_positions.shape[0]] = self.seq_positions

    # ------------------------------------------------------------ metrics
    def node_outcomes(self) -> tuple[Tensor, Tensor, Tensor] | None:
        """``[R, B]`` log q, verified and accepted flags of the drafter's tree
        nodes after :meth:`verify` (rows without a tree of ours are not
        verified), or None when there is nothing to report."""
        if self.logq is None or self.path is None or not self.any_tree:
            return None
        cols = torch.arange(1, self.budget + 1, device=self.path.device)
        verified = (cols[None, :] <= self.num_valid[:, None]) & self.from_drafter[:, None]
        hit = torch.zeros(self.path.shape, dtype=torch.bool, device=self.path.device)
        hit.scatter_(1, self.path.clamp(min=0), True)  # -1 pads land on the root column
        return self.logq, verified, hit[:, 1:] & verified

    def accepted_past(self, budgets: Tensor | Sequence[int]) -> Tensor | None:
        """``[len(budgets)]`` after :meth:`verify`: how many accepted draft
        nodes, over all requests, lie past each budget ``b`` in flat order
        (index ``> b``). A tree's first ``b`` nodes are the tree a budget of
        ``b`` verifies, and flat indices rise along a path, so the step would
        have committed this many tokens fewer had every request verified
        only its first ``b`` nodes: the same draws, the same walk, cut short."""
        return None if self.path is None else tree_ops.accepted_past(self.path, budgets)

    def counts(self) -> StepCounts | None:
        if self.num_accepted is None:
            return None
        return StepCounts(self.num_valid, self.num_accepted, self.expected, self.from_drafter)


def attach_info(attn_metadata: dict[str, Any] | list[dict[str, Any]],
                target_layers: frozenset[str], info: TreeAttentionInfo | None) -> None:
    """Set ``.ddtree = info`` on the metadata of every target attention layer
    (a dict by layer name, or one per micro-batch)."""
    per_ubatch = attn_metadata if isinstance(attn_metadata, list) else [attn_metadata]
    for by_layer in per_ubatch:
        for name, md in by_layer.items():
            if name in target_layers:
                md.ddtree = info


_CHAINS: dict[tuple, Tensor] = {}


def _chain(num_reqs: int, budget: int, device) -> Tensor:
    """``[R, B]`` chain parents (node j+1's parent is j); a cached constant
    expanded over the requests (read-only)."""
    key = (budget, str(device))
    if key not in _CHAINS:
        _CHAINS[key] = torch.arange(budget, device=device)
    return _CHAINS[key].expand(num_reqs, budget)


def _check_scheduled_tokens(scheduled, req_ids, rows, tree_tokens) -> None:
    have_all = tree_tokens.tolist()
    for r in rows:
        sched = list(scheduled[req_ids[r]])
        have = have_all[r][: len(sched)]
        if have != sched:
            raise DDTreeSeamError(
                f"DDTree: the scheduled drafts of request {req_ids[r]} are not a prefix of "
                f"its tree (scheduled {sched[:8]}..., tree {have[:8]}...)")


def _sample_nodes(logits: Tensor, num_nodes: Tensor, logit_starts: list[int],
                  sampling: Any, min_p: Tensor | None = None) -> Tensor:
    """One draw per node row from its request's processed distribution."""
    num_reqs, rows = num_nodes.shape[0], logits.shape[0]
    counts = num_nodes + 1

    def per_row(t):
        return None if t is None else torch.repeat_interleave(t[:num_reqs], counts,
                                                              output_size=rows)
    temp = sampling.temperature
    if temp is None:
        temp = torch.zeros(num_reqs, device=logits.device)
    gens = {}
    ends = logit_starts[1:] + [rows]
    for r, gen in sampling.generators.items():  # seeded requests only
        gens.update(dict.fromkeys(range(logit_starts[r], ends[r]), gen))
    return tree_ops.sample_posterior(logits[:, None, :], per_row(temp), per_row(sampling.top_k),
                                     per_row(sampling.top_p), per_row(min_p),
                                     gens or None)[:, 0]
