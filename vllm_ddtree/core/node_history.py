"""Each tree node's history, and the grammar walk over a tree.

Plain decoding transforms a request's logits with its history: penalties
count the tokens generated so far, ``min_tokens`` looks at how many there
are, bad words at how they end, a grammar at the state they leave it in. A
tree node stands for the sequence "output so far + the tokens on the path
from the root to the node", so each node gets exactly that history here, and
the distribution it is verified with is the one plain decoding would have
used had that path been generated.

Rows are the target's logits rows of one verification step, request by
request, root first: request ``r`` owns rows ``start[r] .. start[r] + n[r]``
and row ``start[r] + j`` is its node ``j`` (``0`` = the root). Parents are
flat indices, ``0`` the root, as in :class:`vllm_ddtree.core.tree.DraftTree`, and
every parent comes before its children.

The grammar walk takes a duck-typed grammar with vLLM's
``StructuredOutputGrammar`` methods (``validate_tokens``, ``accept_tokens``,
``rollback``, ``is_terminated``), so it runs with any structured-output
backend and imports nothing from vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import Tensor

from vllm_ddtree.core.tree import DraftTree

__all__ = ["Grammar", "chain_parents", "keep_nodes", "node_depths", "node_paths", "path_token_counts",
           "prune_tree", "renumber", "row_index", "walk_grammar"]


# --------------------------------------------------------------------------
# Rows and host-side histories
# --------------------------------------------------------------------------


def row_index(counts: Sequence[int], device=None) -> tuple[Tensor, Tensor]:
    """``(request, node)`` of every logits row, int64 ``[N]`` each, for
    requests with ``counts[r]`` scheduled nodes (``N = sum(counts) + R``)."""
    req, node = [], []
    for r, n in enumerate(counts):
        req.extend([r] * (n + 1))
        node.extend(range(n + 1))
    host = torch.tensor([req, node], dtype=torch.int64).reshape(2, -1)
    return tuple(host.to(device, non_blocking=True).unbind(0)) if device is not None \
        else tuple(host.unbind(0))


def chain_parents(n: int) -> list[int]:
    """The parents of an ``n``-node chain."""
    return list(range(n))


def node_depths(parents: Sequence[int]) -> list[int]:
    """Depth of the root and of every node (``[0, d_1, ..., d_n]``)."""
    depth = [0]
    for p in parents:
        depth.append(depth[p] + 1)
    return depth


def node_paths(parents: Sequence[int], tokens: Sequence[int]) -> list[list[int]]:
    """The tokens on the path from the root (excluded) to the root and to
    every node (``[[], path_1, ..., path_n]``)."""
    paths: list[list[int]] = [[]]
    for p, t in zip(parents, tokens):
        paths.append([*paths[p], t])
    return paths


# --------------------------------------------------------------------------
# Device-side path counts (penalties)
# --------------------------------------------------------------------------


def path_token_counts(tokens: Tensor, parents: Tensor, req_of_row: Tensor,
                      node_of_row: Tensor, vocab_size: int, max_depth: int) -> Tensor:
    """int64 ``[N, vocab_size]``: how often each token occurs on the path from
    the root (excluded) to each row's node.

    ``tokens`` and ``parents`` are ``[R, B]`` (node ``j`` at column ``j-1``);
    ``max_depth`` bounds the depth of every node. Everything stays on the
    device: one scatter per depth level.
    """
    rows = req_of_row.shape[0]
    counts = torch.zeros(rows, vocab_size + 1, dtype=torch.int64, device=tokens.device)
    if tokens.shape[1] == 0:
        return counts[:, :vocab_size]
    tok = tokens.long().clamp(min=0)
    par = parents.long()
    cur = node_of_row.long()
    ones = torch.ones(rows, 1, dtype=torch.int64, device=tokens.device)
    for _ in range(max_depth):
        col = (cur - 1).clamp(min=0)
        on_path = cur > 0
        t = torch.where(on_path, tok[req_of_row, col], vocab_size)
        counts.scatter_add_(1, t[:, None], ones)
        cur = torch.where(on_path, par[req_of_row, col], 0)
    return counts[:, :vocab_size]


# --------------------------------------------------------------------------
# Grammar over a tree (host)
# --------------------------------------------------------------------------


class Grammar(Protocol):
    def validate_tokens(self, tokens: list[int]) -> list[int]: ...
    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool: ...
    def rollback(self, num_tokens: int) -> None: ...
    def is_terminated(self) -> bool: ...


def _children(parents: Sequence[int]) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for j, p in enumerate(parents, start=1):
        kids[p].append(j)
    return kids


def walk_grammar(grammar: Grammar, request_id: str, parents: Sequence[int],
                 tokens: Sequence[int],
                 visit: Callable[[int], None] | None = None) -> list[bool]:
    """Depth-first over the tree from the grammar's current state, which it
    leaves unchanged. ``visit(j)`` is called with the grammar in the state
    after node ``j``'s path (the root first). Returns, for nodes ``1..n``,
    whether the grammar accepts the node's whole path: a node is rejected
    when its parent is, when the grammar has terminated at its parent (vLLM
    keeps no draft after the one that terminates the grammar), or when the
    grammar refuses its token."""
    kids = _children(parents)
    ok = [False] * (len(parents) + 1)
    ok[0] = True

    def descend(j: int) -> None:
        if visit is not None:
            visit(j)
        if grammar.is_terminated():
            return
        for c in kids[j]:
            tok = tokens[c - 1]
            if not grammar.validate_tokens([tok]):
                continue
            if not grammar.accept_tokens(request_id, [tok]):
                continue
            ok[c] = True
            descend(c)
            grammar.rollback(1)

    descend(0)
    return ok[1:]


def prune_tree(grammar: Grammar, request_id: str, parents: Sequence[int],
               tokens: Sequence[int]) -> list[int] | None:
    """The nodes (flat indices ``1..n``, in order) whose paths the grammar
    accepts, or None when it accepts all of them."""
    ok = walk_grammar(grammar, request_id, parents, tokens)
    if all(ok):
        return None
    return [j for j, good in enumerate(ok, start=1) if good]


def renumber(parents: Sequence[int], kept: Sequence[int]) -> list[int]:
    """The parents of the tree made of ``kept`` nodes (flat indices, parents
    kept before children), in the new numbering."""
    new = {0: 0}
    for i, j in enumerate(kept, start=1):
        new[j] = i
    try:
        return [new[parents[j - 1]] for j in kept]
    except KeyError as e:
        raise ValueError(f"node {e.args[0]} is a parent of a kept node but not kept") from None


def keep_nodes(tree: DraftTree, rows: dict[int, tuple[Sequence[int], Sequence[int]]]
               ) -> DraftTree:
    """``tree`` with row ``i`` cut down to the nodes ``rows[i][0]`` (flat
    indices, in order) whose parents are ``rows[i][1]`` in the new numbering;
    the columns past them become invalid leaves of the root."""
    if not rows:
        return tree
    b, budget = tree.tokens.shape
    index = torch.arange(budget).repeat(b, 1)
    parents = torch.zeros(b, budget, dtype=torch.int64)
    keep_row = torch.zeros(b, dtype=torch.bool)
    width = torch.zeros(b, dtype=torch.int64)
    for i, (kept, par) in rows.items():
        n = len(kept)
        index[i, :n] = torch.as_tensor(list(kept), dtype=torch.int64) - 1
        index[i, n:] = 0
        parents[i, :n] = torch.as_tensor(list(par), dtype=torch.int64)
        keep_row[i] = True
        width[i] = n
    dev = tree.tokens.device
    index, parents, keep_row, width = (t.to(dev) for t in (index, parents, keep_row, width))
    kept_col = torch.arange(budget, device=dev)[None, :] < width[:, None]
    pad = keep_row[:, None] & ~kept_col

    def take(t, fill):
        picked = t.gather(1, index)
        picked = torch.where(pad, torch.as_tensor(fill, dtype=t.dtype, device=dev), picked)
        return torch.where(keep_row[:, None], picked, t)

    return DraftTree(
        tokens=take(tree.tokens, -1),
        parents=torch.where(keep_row[:, None], parents, tree.parents.long()).to(
            tree.parents.dtype),
        depth=take(tree.depth, 1),
        logq=take(tree.logq, float("-inf")),
        valid=take(tree.valid, False),
    )
