"""DDTree draft trees: construction, ancestor masks, the lossless walk, sampling.

Pure torch (no vLLM import). Every function is batched over requests, keeps
static shapes, and never synchronises with the host, so it can run inside a
CUDA graph or under ``torch.compile(fullgraph=True)``.

Conventions
-----------
*Flat indexing.* A request's verify block has ``1 + B`` nodes. Flat index 0 is
the root (the last committed token, not yet processed by the target); flat
indices ``1..B`` are the draft nodes. Per-node tensors of width ``B``
(``tokens``, ``parents``, ``depth``, ``logq``, ``valid``) describe nodes
``1..B``: column ``j`` is flat index ``j + 1``. Tensors of width ``1 + B``
(``post``, mask rows) include the root at column 0.

*Topological order.* A parent always has a smaller flat index than its
children: ``parents[:, j] <= j``. The first ``n`` draft nodes of any tree
therefore form a valid subtree for every ``n``, so a request may be truncated
to a prefix of the flat order (scheduler truncation, per-request budgets).

*Tree of a request.* The drafter gives K per-position marginals ``q_1..q_K``.
Under the factorized draft ``Q(y) = prod_i q_i(y_i)`` a prefix ``u`` of length
``d`` has ``q(u) = prod_{i<=d} q_i(u_i)``; its expected contribution to the
acceptance length is ``q(u)``, so the best tree with B nodes is the set of the
B most probable prefixes. :func:`build_tree` returns exactly that set, sorted
by ``(log q desc, depth asc)``.

*Ancestor masks.* ``int32`` words, little-endian bit order: bit ``j`` of a row
lives in word ``j // 32`` at bit ``j % 32`` (word 0 bit 0 is the root). Bit 31
is the sign bit of its ``int32`` word.

*Walk.* ``post[i]`` is the target's token at flat node ``i`` (argmax, or one
sample from the processed target distribution). A node is accepted iff its
token equals ``post`` of its parent and its parent is accepted. Siblings carry
distinct tokens, so the accepted nodes form a single root-to-node path. Each
emitted token is a draw from the target given its true prefix, so the output
distribution equals plain decoding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "DraftTree",
    "WalkResult",
    "build_tree",
    "ancestor_mask",
    "walk",
    "widen",
    "accepted_past",
    "process_logits",
    "sample_posterior",
    "SAMPLING_EPS",
]

# Temperatures below this are greedy (argmax), as in vLLM's sampler.
SAMPLING_EPS = 1e-5


class DraftTree(NamedTuple):
    """A batch of draft trees in flat order (see the module docstring)."""

    tokens: Tensor  # [b, B] int64 draft token of each node
    parents: Tensor  # [b, B] int64 flat index of the parent (0 = root)
    depth: Tensor  # [b, B] int64 in 1..K
    logq: Tensor  # [b, B] float32 log q(u) of the node's prefix
    valid: Tensor  # [b, B] bool; False on the tail beyond the request's budget


class WalkResult(NamedTuple):
    """Outcome of :func:`walk` for a batch of requests."""

    output_tokens: Tensor  # [b, B+1] int64 accepted tokens, then the bonus, then -1
    num_accepted: Tensor  # [b] int64 number a of accepted draft nodes
    path: Tensor  # [b, B+1] int64 flat indices: root, a accepted nodes, then -1


# --------------------------------------------------------------------------
# Construction
# --------------------------------------------------------------------------


def _staircase_size(n_prev: int, k: int, budget: int) -> int:
    """Number of pairs (i, j), i < n_prev, j < k, with (i+1)(j+1) <= budget."""
    total, i = 0, 1
    while i <= n_prev:  # blocks of equal budget // i
        q = budget // i
        last = min(n_prev, budget // q)
        total += (last - i + 1) * min(k, q)
        i = last + 1
    return total


class _Level(NamedTuple):
    n: int  # prefixes kept at this depth
    slot: Tensor  # [c] parent slot (0..n_prev-1) of each candidate pair
    flat_rank: Tensor  # [c] index into the [K * k] top-k table: depth * k + token rank
    base: int  # position of this level's candidates in the concatenated tables


class _Plan(NamedTuple):
    levels: list[_Level]  # depths 2..K
    parent: Tensor  # [sum c] parent of every candidate, as 1 + union index
    flat_rank: Tensor  # [sum c] the levels' flat_rank, concatenated
    depth: Tensor  # [N] depth of every union entry


def _staircase(n_prev: int, k: int, budget: int, device) -> tuple[Tensor, Tensor]:
    """Pairs (i, j), i < n_prev, j < k, with (i+1)(j+1) <= budget, row by row."""
    c = _staircase_size(n_prev, k, budget)
    i = torch.arange(n_prev, device=device)
    per_row = torch.clamp(budget // (i + 1), max=k)  # >= 1 since i < n_prev <= budget
    start = torch.cumsum(per_row, 0) - per_row
    # row of every pair: count the row starts at or before its position
    bumps = torch.zeros(c, dtype=torch.long, device=device).index_fill_(0, start[1:], 1)
    row = torch.cumsum(bumps, 0)
    col = torch.arange(c, device=device) - start[row]
    return row, col


def _build_plan(num_levels: int, k: int, budget: int, device) -> _Plan:
    """Static candidate sets of depths 2..K (they depend only on K, k and B).

    Depth d keeps ``min(B, n_{d-1} * k)`` prefixes. Its candidates are the
    pairs (parent slot i, token rank j) with ``(i+1)(j+1) <= B``: parents and
    tokens are both sorted by score, so a pair outside that staircase is
    dominated by at least B others and is never needed.
    """
    levels, parents, ranks = [], [], []
    sizes = [k]
    n_prev, offset, base = k, 0, 0  # offset: union index of depth d-1's first slot
    for d in range(1, num_levels):
        n = min(budget, n_prev * k)
        slot, rank = _staircase(n_prev, k, budget, device)
        assert slot.shape[0] >= n
        levels.append(_Level(n, slot, d * k + rank, base))
        parents.append(offset + slot + 1)
        ranks.append(d * k + rank)
        sizes.append(n)
        base += slot.shape[0]
        offset += n_prev
        n_prev = n
    empty = torch.zeros(0, dtype=torch.long, device=device)
    depth = torch.cat([torch.full((n,), d + 1, dtype=torch.long, device=device) for d, n in enumerate(sizes)])
    return _Plan(levels, torch.cat([empty, *parents]), torch.cat([empty, *ranks]), depth)


_PLANS: dict[tuple, _Plan] = {}


def _plan(num_levels: int, k: int, budget: int, device) -> _Plan:
    """:func:`_build_plan`, cached in eager mode (traced inline under torch.compile)."""
    if torch.compiler.is_compiling():
        return _build_plan(num_levels, k, budget, device)
    key = (num_levels, k, budget, str(device))
    if key not in _PLANS:
        _PLANS[key] = _build_plan(num_levels, k, budget, device)
    return _PLANS[key]


def _descending_key(scores: Tensor) -> Tensor:
    """int64 keys, unique per row, ascending in (score desc, column asc)."""
    bits = torch.where(scores == 0, 0.0, scores).view(torch.int32)  # -0.0 ties +0.0
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # int32 order == float order
    column = torch.arange(scores.shape[-1], device=scores.device)
    return (~ordered).long() * 2**32 + column


def build_tree(logits: Tensor, budget: int, budgets: Tensor | None = None) -> DraftTree:
    """Build the B most probable prefixes of the factorized draft, per request.

    ``logits`` is ``[b, K, V]`` (any float dtype; log-softmax in fp32). Level
    by level it keeps the top ``B`` prefixes of each depth (exact: the parent
    of a global top-B prefix is in the top B of its own depth), then takes the
    first ``B`` of the depth-major union ordered by ``(log q desc, union
    position asc)``: ties keep shallower nodes first, so every parent precedes
    its children even when a child's log-prob is exactly 0.

    ``budgets`` (optional ``[b]`` int64, each ``<= budget``) marks nodes past a
    request's own budget invalid. Nodes are also invalid when fewer than
    ``budget`` prefixes exist (``sum_d V**d < B``). Invalid nodes sit at the
    tail and hold token 0, parent 0, depth 1, logq -inf. Prefixes with
    probability zero (``-inf`` logits) are real, distinct prefixes and stay
    valid.
    """
    b, num_levels, vocab = logits.shape
    budget = int(budget)
    device = logits.device
    lp = torch.log_softmax(logits.float(), dim=-1)
    k = min(budget, vocab)
    top_lp, top_tok = lp.topk(k, dim=-1)  # [b, K, k], sorted descending
    plan = _plan(num_levels, k, budget, device)
    # Every level's token log-probs, gathered at once: [b, sum c].
    lp_cand = top_lp.flatten(1).index_select(1, plan.flat_rank)

    scores = top_lp[:, 0]
    all_scores, picks = [scores], []
    for d, level in enumerate(plan.levels, start=1):
        c = level.slot.shape[0]
        cand = scores.index_select(1, level.slot) + lp_cand[:, level.base: level.base + c]
        # the next depth's staircase relies on sorted parents; the last needs no order
        scores, pick = cand.topk(level.n, dim=-1, sorted=d < len(plan.levels))
        all_scores.append(scores)
        picks.append(pick + level.base)

    # The union of all depths, depth-major; parents as 1 + union index (0 = root).
    u_scores = torch.cat(all_scores, 1)
    chosen = torch.cat([top_tok.new_zeros(b, 0), *picks], 1)  # candidates kept at depths >= 2
    u_tokens = torch.cat([top_tok[:, 0], top_tok.flatten(1).gather(1, plan.flat_rank.take(chosen))], 1)
    u_parents = torch.cat([top_tok.new_zeros(b, k), plan.parent.take(chosen)], 1)
    total = u_scores.shape[1]
    m = min(budget, total)

    order = _descending_key(u_scores).topk(m, dim=1, largest=False).indices
    logq = u_scores.gather(1, order)
    # Flat index of every union entry (0 where not selected; unselected entries
    # are never parents of selected ones because the selection is prefix-closed).
    flat = torch.arange(1, m + 1, device=device).expand(b, m)
    pos = torch.zeros(b, total, dtype=torch.long, device=device).scatter(1, order, flat)
    pos = torch.cat([pos.new_zeros(b, 1), pos], 1)  # indexed by 1 + union index
    tokens = u_tokens.gather(1, order)
    parents = pos.gather(1, u_parents.gather(1, order))
    depth = plan.depth[order]

    if m < budget:
        pad = budget - m
        tokens = torch.cat([tokens, tokens.new_zeros(b, pad)], 1)
        parents = torch.cat([parents, parents.new_zeros(b, pad)], 1)
        depth = torch.cat([depth, depth.new_ones(b, pad)], 1)
        logq = torch.cat([logq, logq.new_full((b, pad), float("-inf"))], 1)
    col = torch.arange(budget, device=device)
    valid = (col < m).expand(b, budget)
    if budgets is not None:
        valid = valid & (col[None, :] < budgets.to(device)[:, None])
    tokens = torch.where(valid, tokens, 0)
    parents = torch.where(valid, parents, 0)
    depth = torch.where(valid, depth, 1)
    logq = torch.where(valid, logq, float("-inf"))
    return DraftTree(tokens, parents, depth, logq, valid)


# --------------------------------------------------------------------------
# Ancestor masks
# --------------------------------------------------------------------------


def _num_doublings(budget: int) -> int:
    """Pointer-doubling steps that cover any root path of a B-node tree."""
    return max(0, (budget - 1).bit_length())


_SELF_BITS: dict[tuple, Tensor] = {}


def _self_bits(n: int, device) -> Tensor:
    """:func:`_build_self_bits`, cached in eager mode (traced under torch.compile)."""
    if torch.compiler.is_compiling():
        return _build_self_bits(n, device)
    key = (n, str(device))
    if key not in _SELF_BITS:
        _SELF_BITS[key] = _build_self_bits(n, device)
    return _SELF_BITS[key]


def _build_self_bits(n: int, device) -> Tensor:
    """``[n, W]`` int32: row i holds bit i (little-endian words) and the root bit."""
    words = (n + 31) // 32
    idx = torch.arange(n, device=device)
    value = torch.bitwise_left_shift(torch.ones_like(idx), idx % 32)  # int64, < 2**32
    value = torch.where(value >= 2**31, value - 2**32, value)  # two's complement int32
    bits = torch.nn.functional.one_hot(idx // 32, words) * value[:, None]
    bits[:, 0] |= 1  # the root is visible to every row
    return bits.to(torch.int32)


def ancestor_mask(
    parents: Tensor,
    depth: Tensor,
    valid: Tensor | None = None,
    max_depth: int | None = None,
) -> Tensor:
    """Packed ancestor-or-self mask, ``int32 [b, 1+B, ceil((1+B)/32)]``.

    Row ``i`` (flat index, row 0 = root) has bit ``j`` set iff flat node ``j``
    is ``i``, an ancestor of ``i``, or the root. Evaluates
    ``anc[i] = anc[parent[i]] | bit(i)``: level by level over
    ``depth == 1..max_depth`` when ``max_depth`` (the drafter's K) is given,
    otherwise by pointer doubling in ``ceil(log2 B)`` steps, which needs no
    depth bound. Nodes with ``valid == False`` are treated as children of the
    root (their row is root | self) and are never ancestors of valid nodes.
    """
    b, budget = parents.shape
    n = budget + 1
    device = parents.device
    par = parents.long()
    if valid is not None:
        par = torch.where(valid, par, 0)
    par = torch.nn.functional.pad(par, (1, 0))  # the root is its own parent
    own = _self_bits(n, device)
    words = own.shape[1]
    anc = own.expand(b, n, words)
    if max_depth is not None:
        dep = torch.cat([depth.new_zeros(b, 1), depth.long()], 1)
        if valid is not None:
            dep[:, 1:] = torch.where(valid, dep[:, 1:], 1)
        index = par[:, :, None].expand(b, n, words)
        for d in range(1, max_depth + 1):
            new = anc.gather(1, index) | own
            anc = torch.where((dep == d)[:, :, None], new, anc)
        return anc.contiguous()
    jump = par
    for _ in range(_num_doublings(budget)):
        anc = anc | anc.gather(1, jump[:, :, None].expand(b, n, words))
        jump = jump.gather(1, jump)
    return anc.contiguous()  # a fresh tensor even when no step ran (B = 1)


# --------------------------------------------------------------------------
# Walk
# --------------------------------------------------------------------------


def walk(
    tree_tokens: Tensor,
    parents: Tensor,
    post: Tensor,
    num_nodes: Tensor | None = None,
) -> WalkResult:
    """Accept the longest draft path that agrees with the target's tokens.

    ``post`` ``[b, 1+B]`` is the target's token at every flat node.
    ``ok[i] = tokens[i] == post[parent[i]] and ok[parent[i]]``. Only flat nodes
    ``1..num_nodes[r]`` exist for request ``r`` (default: all ``B``); pass
    ``tree.valid.sum(-1)`` (or the budgets) so that invalid tail nodes never
    match. Requires ``parents[:, j] <= j`` and distinct sibling tokens, as
    :func:`build_tree` guarantees. The bonus token is ``post[path[a]]``.
    """
    b, budget = tree_tokens.shape
    n = budget + 1
    device = tree_tokens.device
    par = parents.long()
    post = post.long()
    tokens = tree_tokens.long()
    match = tokens == post.gather(1, par)
    flat = torch.arange(1, n, device=device)
    if num_nodes is not None:
        match = match & (flat <= num_nodes.to(device)[:, None])
    pad = torch.nn.functional.pad
    ok = pad(match, (1, 0), value=True)  # [b, n], root accepted
    jump = pad(par, (1, 0))
    for _ in range(_num_doublings(budget)):
        ok = ok & ok.gather(1, jump)
        jump = jump.gather(1, jump)
    ok = ok[:, 1:]
    num_accepted = ok.sum(1)

    # Accepted nodes form a chain and parents precede children, so their
    # depth order is their flat order: node of rank k (1-based) sits at path
    # column k and emits output column k - 1; the rest go to a dump column.
    rank = torch.where(ok, torch.cumsum(ok, 1), n)
    path = pad(torch.full_like(tokens, -1), (1, 1), value=0)  # [b, n + 1]; column 0 = root
    path = path.scatter(1, rank, flat.expand(b, budget))[:, :n]
    last = path.gather(1, num_accepted[:, None])
    out = torch.full((b, n + 1), -1, dtype=torch.long, device=device)
    out = out.scatter(1, rank - ok.long(), tokens)  # accepted: rank - 1; others: n (dump)
    out = out.scatter(1, num_accepted[:, None], post.gather(1, last))[:, :n]
    return WalkResult(out, num_accepted, path)


def widen(tree: DraftTree, budget: int) -> DraftTree:
    """``tree`` padded to ``budget`` columns with invalid leaves of the root
    (log q ``-inf``), which no walk accepts."""
    pad = budget - tree.tokens.shape[1]
    if pad <= 0:
        return tree
    F = torch.nn.functional
    return DraftTree(F.pad(tree.tokens, (0, pad)), F.pad(tree.parents, (0, pad)),
                     F.pad(tree.depth, (0, pad), value=1),
                     F.pad(tree.logq, (0, pad), value=float("-inf")),
                     F.pad(tree.valid, (0, pad), value=False))


def accepted_past(path: Tensor, budgets: Tensor | Sequence[int]) -> Tensor:
    """``[len(budgets)]``: the accepted draft nodes of a walk (``path``, as
    :func:`walk` returns it), over all requests, whose flat index is past
    each budget ``b``. A tree's first ``b`` nodes are the tree of budget
    ``b`` and an accepted path's flat indices rise, so the walk of that
    smaller tree, on the same target tokens, accepts this many nodes fewer."""
    cut = torch.as_tensor(budgets, dtype=path.dtype, device=path.device)
    return (path[None, :, 1:] > cut[:, None, None]).sum((1, 2))


# --------------------------------------------------------------------------
# Sampling the target's token at every node
# --------------------------------------------------------------------------


def process_logits(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor | None = None,
    top_p: Tensor | None = None,
    min_p: Tensor | None = None,
) -> Tensor:
    """fp32 logits of the distribution vLLM's sampler draws from, ``-inf`` = removed.

    ``logits`` is ``[b, N, V]``; the parameters are per request, ``[b]``. In
    the order of vLLM 0.32's sampler (``Sampler.sample``):

    1. temperature: divide by ``T``; rows with ``T < 1e-5`` (greedy) use 1;
    2. min-p: drop tokens whose probability (after temperature) is below
       ``min_p * max_prob``; ``min_p <= 0`` is off;
    3. top-k: keep tokens whose logit is ``>=`` the k-th largest (ties at the
       threshold are kept); ``k <= 0`` or ``k >= V`` is off;
    4. top-p: over the survivors sorted ascending, drop tokens whose ascending
       cumulative probability is ``<= 1 - p``, always keeping the largest;
       ``p >= 1`` is off.

    ``None`` means the filter is off for every row. The masks match vLLM's
    torch path (``apply_top_k_top_p_pytorch`` and the min-p logits processor)
    exactly; vLLM's Triton and FlashInfer paths are statistically equivalent
    but may break exact ties at a top-k/top-p boundary differently.

    Min-p is applied as in plain (non-speculative) decoding. vLLM 0.32 itself
    does not load the min-p processor when a speculative config is present, so
    a caller that wants to reproduce vLLM's speculative behaviour passes
    ``min_p=None``.
    """
    x = logits.float()
    b, _, vocab = x.shape
    t = temperature.to(device=x.device, dtype=torch.float32)
    t = torch.where(t < SAMPLING_EPS, 1.0, t)
    x = x / t[:, None, None]
    if min_p is not None:
        probs = x.softmax(-1)
        thresh = probs.amax(-1, keepdim=True) * min_p.to(x.device, torch.float32)[:, None, None]
        x = x.masked_fill(probs < thresh, float("-inf"))
    if top_k is None and top_p is None:
        return x
    xs, idx = torch.sort(x, dim=-1, descending=False, stable=True)
    if top_k is not None:
        k = top_k.to(x.device).long()
        k = torch.where((k <= 0) | (k >= vocab), vocab, k)
        kth = xs.gather(-1, (vocab - k)[:, None, None].expand(b, xs.shape[1], 1))
        xs = xs.masked_fill(xs < kth, float("-inf"))
    if top_p is not None:
        cum = xs.softmax(-1).cumsum(-1)
        drop = cum <= 1 - top_p.to(x.device, torch.float32)[:, None, None]
        drop[..., -1] = False
        xs = xs.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(-1, idx, xs)


def sample_posterior(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor | None = None,
    top_p: Tensor | None = None,
    min_p: Tensor | None = None,
    generators: dict[int, torch.Generator] | None = None,
) -> Tensor:
    """The target's token at every flat node: ``post`` ``[b, 1+B]`` int64.

    Greedy rows (``temperature < 1e-5``) take the argmax of the raw fp32
    logits (first index on ties). Other rows draw one independent sample per
    node from ``softmax(process_logits(...))`` by the exponential race
    ``argmax(p / E)``, ``E ~ Exp(1)`` i.i.d., as vLLM does. Rows listed in
    ``generators`` (``{row: torch.Generator}``) draw their noise from that
    generator only, so a seeded request is reproducible whatever the batch.
    """
    x = logits.float()
    greedy = x.argmax(-1)
    probs = process_logits(x, temperature, top_k, top_p, min_p).softmax(-1)
    noise = torch.empty_like(probs)
    generators = generators or {}
    if len(generators) != probs.shape[0]:
        noise.exponential_()
    for row, gen in generators.items():
        noise[row].exponential_(generator=gen)
    # Guard against an exact zero draw: 0/0 would be NaN and win the argmax.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    sampled = (probs / noise).argmax(-1)
    is_greedy = temperature.to(x.device) < SAMPLING_EPS
    return torch.where(is_greedy[:, None], greedy, sampled)
