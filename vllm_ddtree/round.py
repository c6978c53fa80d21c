"""One DDTree verification round, in the order it happens.

A round verifies the trees the drafter proposed in the previous step and
prepares the drafter's next input. The runner (``vllm_ddtree/runner.py``)
calls one method per vLLM hook, in this order:

1. :meth:`TreeRound.plan` (``_prepare_inputs``, after vLLM's own inputs):
   match the scheduled drafts to the proposed trees, rewrite the RoPE
   positions of tree nodes to ``p0 + depth`` (node ``j`` keeps its KV slot
   ``slot(p0 + j)``) and pack every token's ancestor mask.
2. :meth:`TreeRound.attach` (``_build_attention_metadata``): hang the masks
   on the target layers' attention metadata as ``metadata.ddtree``.
3. :meth:`TreeRound.capturing` (``_model_forward``): the target forward,
   during which every target attention layer applies its mask and hands its
   fresh K/V to the capture; afterwards a layer that did not is an error.
4. :meth:`TreeRound.verify` (``_sample``): the target's token at every node
   (argmax, or one draw from the request's processed distribution) and the
   tree walk.
5. :meth:`TreeRound.compact`: move the accepted nodes' K/V into contiguous
   slots (``vllm_ddtree/compaction.py``).
6. :meth:`TreeRound.condition` (``propose_draft_token_ids``): put the
   accepted rows first in the drafter's inputs and restore sequential
   positions, so vLLM's DFlash "rejected suffix" logic applies unchanged.

Requests whose drafts are not a tree of ours (new requests padded with
placeholders, drafts cut by the scheduler near ``max_model_len``) and trees
that came out chain-shaped are verified as a chain: no mask, no move.

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
from torch import Tensor

from vllm_ddtree import tree as tree_ops
from vllm_ddtree.compaction import compaction_moves, kv_capture
from vllm_ddtree.tree_info import TreeAttentionInfo

__all__ = ["DDTreeSeamError", "ProposedTrees", "TreeRound"]


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


@dataclass
class TreeRound:
    req_ids: list[str]
    budget: int
    depth: int
    num_nodes: Tensor  # [R] scheduled draft nodes per request
    parents: Tensor  # [R, B] flat parent index (a chain for non-tree requests)
    from_drafter: Tensor  # [R] bool: the drafts are a tree of ours
    is_tree: Tensor  # [R] bool: ... and not chain-shaped (needs a mask)
    any_tree: bool  # some request needs a mask (always True off CPU: no sync)
    expected: Tensor  # [R] float64 Σ q(u) over the scheduled nodes (0: unknown)
    # Set when any_tree:
    query_start: Tensor | None = None  # [R] first token row of each request
    seq_positions: Tensor | None = None  # stock sequential positions
    info: TreeAttentionInfo | None = None
    capture_rows: Tensor | None = None  # [R * (1+B)] token rows kept for compaction
    # Set by verify:
    path: Tensor | None = None  # [R, 1+B]
    num_accepted: Tensor | None = None  # [R]

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
    ) -> TreeRound | None:
        """The round for this step, or None when nothing is verified.

        ``scheduled`` maps request ids to their scheduled draft tokens;
        ``positions``, ``req_indices`` and ``query_pos`` are the runner's
        per-token buffers over the step's tokens (``positions`` is rewritten
        in place); ``query_start`` is ``[R]``.
        """
        if not scheduled:
            return None
        req_ids = list(req_ids)
        num_reqs = len(req_ids)
        dev = positions.device
        counts = [len(scheduled.get(r, ())) for r in req_ids]
        if max(counts) > budget:
            raise DDTreeSeamError(f"DDTree: {max(counts)} draft nodes scheduled for one "
                                  f"request, but the tree budget is {budget}")
        num_nodes = torch.tensor(counts, dtype=torch.int64, device=dev)
        ar = torch.arange(budget, device=dev)
        parents = ar.expand(num_reqs, budget).clone()  # chain: node j+1's parent is j
        node_depth = (ar + 1).expand(num_reqs, budget).clone()
        from_drafter = torch.zeros(num_reqs, dtype=torch.bool, device=dev)
        expected = torch.zeros(num_reqs, dtype=torch.float64, device=dev)
        rows, src = [], []
        if trees is not None:
            where = {rid: i for i, rid in enumerate(trees.req_ids)}
            for r, rid in enumerate(req_ids):
                if counts[r] > 0 and rid in where:
                    rows.append(r)
                    src.append(where[rid])
        rnd = cls(req_ids, budget, depth, num_nodes, parents, from_drafter,
                  from_drafter.clone(), False, expected)
        if not rows:
            return rnd
        tree = trees.tree
        rows_t = torch.tensor(rows, device=dev)
        src_t = torch.tensor(src, device=dev)
        parents[rows_t] = tree.parents[src_t]
        node_depth[rows_t] = tree.depth[src_t]
        if dev.type == "cpu":  # free on CPU; off CPU it would sync every step
            _check_scheduled_tokens(scheduled, req_ids, rows, tree.tokens[src_t])
        in_sched = ar[None, :] < num_nodes[:, None]
        from_drafter[rows_t] = True
        if with_expected:
            expected[rows_t] = (tree.logq[src_t].double().exp() * in_sched[rows_t]).sum(-1)
        # A chain-shaped (prefix of the) tree is plain causal attention.
        rnd.is_tree = ((parents != ar) & in_sched).any(-1)
        rnd.any_tree = bool(rnd.is_tree.any()) if dev.type == "cpu" else True
        if not rnd.any_tree:
            return rnd

        ridx, qpos = req_indices.long(), query_pos.long()
        node = qpos.clamp(max=budget)
        tok_tree = rnd.is_tree[ridx] & (qpos <= num_nodes[ridx])
        depth_full = torch.cat([torch.zeros_like(node_depth[:, :1]), node_depth], dim=1)
        rnd.seq_positions = positions.clone()
        positions += torch.where(tok_tree, depth_full[ridx, node] - node, 0)
        anc = tree_ops.ancestor_mask(parents, node_depth)  # [R, 1+B, W]
        rnd.info = TreeAttentionInfo.create(anc[ridx, node].contiguous(), rnd.is_tree)
        rnd.query_start = query_start.long()
        ar1 = torch.arange(budget + 1, device=dev)
        rnd.capture_rows = (rnd.query_start[:, None]
                            + torch.minimum(ar1[None, :], num_nodes[:, None])).flatten()
        return rnd

    # ------------------------------------------------------------ 2. attach
    def attach(self, attn_metadata: dict[str, Any] | list[dict[str, Any]],
               target_layers: frozenset[str]) -> None:
        """Set ``.ddtree`` on the metadata of every target attention layer
        (None when no request needs a mask)."""
        per_ubatch = attn_metadata if isinstance(attn_metadata, list) else [attn_metadata]
        for by_layer in per_ubatch:
            for name, md in by_layer.items():
                if name in target_layers:
                    md.ddtree = self.info

    # ------------------------------------------------------------ 3. forward
    @contextmanager
    def capturing(self, target_layers: Iterable[str]):
        """Around the target forward: capture K/V for compaction, then check
        that every target layer applied the mask and captured its write."""
        if not self.any_tree:
            yield
            return
        kv_capture.start(self.capture_rows, target_layers)
        try:
            yield
        finally:
            kv_capture.stop()
        missing = kv_capture.missing_layers()
        if missing:
            kv_capture.clear()
            detail = "; ".join(f"{what}: {', '.join(names[:4])}"
                               + (f" (+{len(names) - 4} more)" if len(names) > 4 else "")
                               for what, names in missing.items())
            raise DDTreeSeamError(
                "DDTree: target attention layers did not run the tree path in a tree "
                f"verification step ({detail}). Their attention backend ignores the tree "
                "mask, so the output would be wrong. Serve with the DDTree attention backend "
                "(the plugin selects it unless --attention-backend overrides it), or use "
                "method 'dflash'.")

    # ------------------------------------------------------------ 4. verify
    def verify(self, logits: Tensor, draft_token_ids: Tensor, num_draft_tokens: Sequence[int],
               sampling: Any) -> Tensor:
        """The walk over the scheduled nodes. ``logits`` has ``n + 1`` rows per
        request (its ``n`` scheduled nodes and the root, root first);
        ``draft_token_ids`` the scheduled drafts back to back; ``sampling``
        vLLM's per-request sampling metadata (``all_greedy``, ``temperature``,
        ``top_k``, ``top_p``, ``generators``). Returns ``[R, 1+B]``: the
        accepted path then the bonus token, -1 padded."""
        num_reqs = len(num_draft_tokens)
        dev = logits.device
        counts = torch.tensor([n + 1 for n in num_draft_tokens], device=dev)
        if sampling.all_greedy:
            # What sample_posterior returns for greedy rows, without drawing noise.
            post_flat = logits.float().argmax(-1)
        else:
            post_flat = _sample_nodes(logits, num_draft_tokens, sampling, counts)
        starts = torch.cumsum(counts, 0) - counts
        ar = torch.arange(self.budget + 1, device=dev)
        post = post_flat[starts[:, None] + torch.minimum(ar[None, :], self.num_nodes[:, None])]
        if draft_token_ids.numel():
            draft_starts = starts - torch.arange(num_reqs, device=dev)  # no root rows
            dr = (draft_starts[:, None] + ar[None, : self.budget]).clamp(
                max=draft_token_ids.numel() - 1)
            tokens = draft_token_ids.long()[dr]
        else:
            tokens = torch.full((num_reqs, self.budget), -1, device=dev, dtype=torch.long)
        res = tree_ops.walk(tokens, self.parents, post, num_nodes=self.num_nodes)
        self.path, self.num_accepted = res.path, res.num_accepted
        return res.output_tokens

    # ------------------------------------------------------------ 5. compact
    def compact(self, slot_mapping: Tensor) -> None:
        """Move accepted nodes' K/V from ``slot(p0 + path[k])`` to
        ``slot(p0 + k)``; ``slot_mapping`` is the target group's, per token row."""
        if not self.any_tree:
            return
        try:
            moves = compaction_moves(self.path, self.num_accepted, self.is_tree, self.depth)
            if slot_mapping.device.type == "cpu" and not bool(moves.move.any()):
                return
            kv_capture.compact(moves, self.query_start, self.budget + 1, slot_mapping)
        finally:
            kv_capture.clear()

    # ------------------------------------------------------------ 6. condition
    def condition(self, aux_hidden_states: Sequence[Tensor] | None, positions: Tensor) -> None:
        """Rows ``p0..p0+a`` of each tree request become its accepted path, in
        order, in the drafter's inputs; ``positions`` (the runner's buffer)
        gets its sequential values back."""
        if not self.any_tree or self.path is None:
            return
        k = torch.arange(self.path.shape[1], device=self.path.device)[None, :]
        # Only rows inside the request move; the others map onto the root row
        # with its own value (duplicates then carry identical data).
        inside = torch.where(k <= self.num_nodes[:, None], k, 0)
        take = (k <= self.num_accepted[:, None]) & self.is_tree[:, None]
        qs = self.query_start[:, None]
        src = (qs + torch.where(take, self.path, inside)).flatten()
        dst = (qs + inside).flatten()
        for h in aux_hidden_states or ():
            h[dst] = h[src]
        positions[: self.seq_positions.shape[0]] = self.seq_positions

    # ------------------------------------------------------------ metrics
    def counts(self) -> StepCounts | None:
        if self.num_accepted is None:
            return None
        return StepCounts(self.num_nodes, self.num_accepted, self.expected, self.from_drafter)


def _check_scheduled_tokens(scheduled, req_ids, rows, tree_tokens) -> None:
    for k, r in enumerate(rows):
        sched = list(scheduled[req_ids[r]])
        have = tree_tokens[k, : len(sched)].tolist()
        if have != sched:
            raise DDTreeSeamError(
                f"DDTree: the scheduled drafts of request {req_ids[r]} are not a prefix of "
                f"its tree (scheduled {sched[:8]}..., tree {have[:8]}...)")


def _sample_nodes(logits: Tensor, num_draft_tokens: Sequence[int], sampling: Any,
                  counts: Tensor) -> Tensor:
    """One draw per node row from its request's processed distribution."""
    num_reqs, rows = len(num_draft_tokens), logits.shape[0]

    def per_row(t):
        return None if t is None else torch.repeat_interleave(t[:num_reqs], counts,
                                                              output_size=rows)
    temp = sampling.temperature
    if temp is None:
        temp = torch.zeros(num_reqs, device=logits.device)
    gens = {}
    offs = 0
    for r, n in enumerate(num_draft_tokens):
        if r in sampling.generators:
            gens.update({offs + j: sampling.generators[r] for j in range(n + 1)})
        offs += n + 1
    return tree_ops.sample_posterior(logits[:, None, :], per_row(temp), per_row(sampling.top_k),
                                     per_row(sampling.top_p), None, gens or None)[:, 0]
