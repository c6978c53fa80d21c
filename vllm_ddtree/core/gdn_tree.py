"""Tree verification for Gated DeltaNet (GDN) layers: the index plan and the commit.

A hybrid target (Qwen3.5 / Qwen3.6, Qwen3-Next) mixes full-attention layers with
GDN layers, whose per-request state is a recurrent matrix plus a short
convolution window instead of a K/V cache. vLLM verifies speculative tokens on
them as a chain; a tree needs each node's state to follow its own ancestors.

Per request, with the step's tokens in flat order (root first, parents before
children) and ``parent[j]`` the local index of node ``j``'s parent (-1 for the
root):

* **Convolution.** Node ``j``'s input window is the last ``W`` inputs on its
  root-to-``j`` path; where the path is shorter, the window continues into the
  request's prior window (the ``W - 1`` inputs before the root, buffer columns
  ``[offset, offset + W - 1)``, ``offset = num_accepted - 1``).
* **Recurrence.** ``state(j) = update(state(parent(j)), inputs(j))``; the root
  starts from state column ``num_accepted - 1``, and node ``j``'s state is
  stored in column ``j`` of the request's state-index row (vLLM reserves
  ``1 + num_speculative_tokens`` columns: one per tree node).
* **Buffer after the step.** Conv columns ``[0, W - 2)`` hold the prior window
  minus its oldest input and columns ``W - 2 + j`` hold ``x_j`` (for a full
  chain this is exactly vLLM's rolling write-back).

The recurrence runs with vLLM's own chain kernel, segment by segment: a
*segment* is a maximal run of nodes ``s, s+1, ..., e`` in which each node's
parent is the node before it. A segment starting at the root uses the stock
state row and ``num_accepted``; any other segment starting at ``s`` gets the
row ``[col s, ..., col e, col parent(s), ...]`` with ``num_accepted = e - s + 2``,
so the kernel reads its initial state from the parent's column and stores
every node's state in the node's own column. Segments run in *waves*: a
segment's wave is one more than its parent segment's, so a parent's state is
always stored before a child reads it. A chain-shaped tree is one segment,
one wave: the stock call itself.

**Commit** (after the tree walk accepted the path ``p[0..a]``, ``p[0] = 0``):
the accepted node's state is copied into column 0 and the last ``W - 1``
inputs along the accepted path into conv columns ``[0, W - 1)``. Every GDN
request then starts the next step from column 0 with ``offset = 0``
(``num_accepted = 1``), which is also where vLLM's non-speculative decode and
prefill paths read it, so plain steps, chunked prefills and tree steps can
follow each other in any order.

This module imports nothing from vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["TreePlan", "Wave", "build_plan", "commit_columns", "commit_layer"]


@dataclass(frozen=True)
class Wave:
    """Segments whose parent segments ran in earlier waves: one kernel call."""

    tokens: Tensor | None  # [n] token indices in segment order (None: all, in order)
    cu_seqlens: Tensor  # [num_segments + 1] int32
    seq: Tensor  # [num_segments] the spec sequence of each segment
    cols: Tensor  # [num_segments, S + 1] columns of the sequence's state-index row
    from_root: Tensor  # [num_segments] bool: starts at the root
    length: Tensor  # [num_segments]


@dataclass(frozen=True)
class TreePlan:
    """The index plan of one step's speculative tokens; it depends only on
    the trees' shapes, so every GDN layer of the step shares it."""

    num_seqs: int
    width: int
    conv_src: Tensor  # [T, W] rows of cat(prior windows [N * (W-1)], inputs [T]); oldest first
    tok_seq: Tensor  # [T] spec sequence of each token
    tok_col: Tensor  # [T] the conv-buffer column each input is written to (W - 2 + j)
    waves: tuple[Wave, ...]

    @property
    def is_chain(self) -> bool:
        return len(self.waves) == 1 and self.waves[0].tokens is None


def build_plan(parent: list[int], query_start: list[int], width: int, num_spec: int,
               device: torch.device | str = "cpu") -> TreePlan:
    """``parent``: the local parent of every speculative token (-1 for each
    sequence's root), packed by ``query_start`` (``N + 1`` offsets); ``width``
    the conv kernel width; ``num_spec`` the speculative tokens vLLM reserved
    state columns for (each state row has ``num_spec + 1`` columns)."""
    n = len(query_start) - 1
    total = query_start[-1]
    if len(parent) != total:
        raise ValueError(f"{len(parent)} parents for {total} tokens")
    prior = n * (width - 1)
    conv_src = [[0] * width for _ in range(total)]
    tok_seq, tok_col, depth = [0] * total, [0] * total, [0] * total
    # segments: [seq, start (local), length, parent (local, -1 = root), wave]
    segs: list[list[int]] = []
    seg_of = [0] * total
    for i in range(n):
        base, q = query_start[i], query_start[i + 1] - query_start[i]
        if q > num_spec + 1:
            raise ValueError(f"sequence {i} has {q} tokens; the state rows hold {num_spec + 1}")
        for j in range(q):
            t = base + j
            p = parent[t]
            if (j == 0) != (p < 0) or p >= j:
                raise ValueError(f"sequence {i}: node {j} has parent {p}; the root must come "
                                 "first and parents before children")
            tok_seq[t], tok_col[t] = i, width - 2 + j
            depth[t] = 0 if p < 0 else depth[base + p] + 1
            # conv window, oldest first: ancestors at distance d = W-1 .. 0
            node = j
            for d in range(width):
                if node >= 0:
                    conv_src[t][width - 1 - d] = prior + base + node
                    node = parent[base + node]
                else:
                    conv_src[t][width - 1 - d] = i * (width - 1) + (width - 1) - (d - depth[t])
            if j > 0 and p == j - 1:
                segs[seg_of[t - 1]][2] += 1
                seg_of[t] = seg_of[t - 1]
            else:
                wave = 0 if p < 0 else segs[seg_of[base + p]][4] + 1
                segs.append([i, j, 1, p, wave])
                seg_of[t] = len(segs) - 1
    waves = []
    num_waves = 1 + max((s[4] for s in segs), default=0)
    for w in range(num_waves):
        mine = [s for s in segs if s[4] == w]
        toks, cu, cols = [], [0], []
        for i, s0, length, p, _ in mine:
            toks.extend(range(query_start[i] + s0, query_start[i] + s0 + length))
            cu.append(cu[-1] + length)
            if p < 0:
                cols.append(list(range(num_spec + 1)))
            else:
                cols.append(list(range(s0, s0 + length)) + [p] * (num_spec + 1 - length))
        all_in_order = num_waves == 1 and toks == list(range(total))
        waves.append(Wave(
            tokens=None if all_in_order else torch.tensor(toks, dtype=torch.long, device=device),
            cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
            seq=torch.tensor([s[0] for s in mine], dtype=torch.long, device=device),
            cols=torch.tensor(cols, dtype=torch.long, device=device).view(len(mine),
                                                                             num_spec + 1),
            from_root=torch.tensor([s[3] < 0 for s in mine], dtype=torch.bool, device=device),
            length=torch.tensor([s[2] for s in mine], dtype=torch.long, device=device)))
    as_t = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
    return TreePlan(n, width, as_t(conv_src).view(total, width), as_t(tok_seq), as_t(tok_col),
                    tuple(waves))


def commit_columns(path: Tensor, num_accepted: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """For accepted paths ``path`` ``[N, 1+B]`` (local node indices, -1
    padded) with ``num_accepted`` ``[N]`` accepted nodes past the root: the
    state column to copy into column 0 (``[N]``) and, per sequence, the conv
    columns that become columns ``0 .. W-2`` (``[N, W-1]``)."""
    a = num_accepted.long()
    state_col = path.long().gather(1, a[:, None])[:, 0]
    e = a[:, None] + torch.arange(width - 1, device=path.device)  # positions in [tail, path]
    k = e - (width - 2)
    on_path = path.long().gather(1, k.clamp(min=0, max=path.shape[1] - 1))
    conv_cols = torch.where(k < 0, e, width - 2 + on_path)
    return state_col, conv_cols


def commit_layer(conv_state: Tensor, ssm_state: Tensor, state_indices: Tensor,
                 state_col: Tensor, conv_cols: Tensor) -> None:
    """Apply a commit to one GDN layer's caches. ``conv_state`` is viewed as
    ``[slots, dim, state_len]`` (any strides), ``ssm_state`` has slots first;
    ``state_indices`` is ``[N, S+1]`` (column 0 holds the conv slot)."""
    rows = state_indices.long()
    dst = rows[:, 0]
    src = rows.gather(1, state_col[:, None])[:, 0]
    ssm_state.index_copy_(0, dst, ssm_state.index_select(0, src))
    window = conv_state[dst[:, None], :, conv_cols]  # [N, W-1, dim] (a copy)
    cols = torch.arange(conv_cols.shape[1], device=conv_cols.device)
    conv_state[dst[:, None], :, cols[None, :]] = window
