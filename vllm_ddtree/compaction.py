"""KV compaction after a tree walk: capture, index math, rewrite.

During verification node ``j`` of a request writes its K/V to
``slot(p0 + j)`` (its flat index). After the walk accepts the path
``path[0..a]`` (``path[0]`` = root), vLLM's bookkeeping assumes the accepted
tokens sit at ``slot(p0 + 1..a)``, so node ``path[k]`` must move to
``slot(p0 + k)``. Three steps, all in this module:

1. **Capture** (:class:`KVCapture`): while the target runs the verification
   forward, every DDTree attention impl hands the K/V it writes to the cache
   (``do_kv_cache_update``) to :data:`kv_capture`, which keeps a *copy* of
   each request's root and node rows. A copy, because the arguments are
   activation buffers that a compiled graph reuses after the cache write.
2. **Index math** (:func:`compaction_moves`): which ``(request, k)`` move,
   from which captured row, to which token row.
3. **Rewrite** (:meth:`KVCapture.rewrite`): the captured rows are written to
   the destination slots through each layer's own ``do_kv_cache_update``, so
   every cache layout (CPU ISA-packed, CUDA token-major, quantized) works.

The capture also proves the tree path ran: :meth:`KVCapture.missing_layers`
names every target attention layer that did not record a tree write, which
the round turns into an error on the first tree step.

No vLLM imports: impls and layers are duck-typed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = ["KVCapture", "KVRecord", "Moves", "compaction_moves", "kv_capture"]


class Moves(NamedTuple):
    """KV moves of a batch: destination depth ``k`` of column ``k - 1``."""

    src_node: Tensor  # [R, D] flat index moved to depth k (k itself where unused)
    move: Tensor  # [R, D] bool: k <= a, the request is a tree and path[k] != k


def compaction_moves(path: Tensor, num_accepted: Tensor, is_tree: Tensor,
                     max_depth: int) -> Moves:
    """The moves ``path[k] -> k`` for ``k = 1..min(a, max_depth)``.

    ``path`` ``[R, 1+B]`` and ``num_accepted`` ``[R]`` come from
    :func:`vllm_ddtree.tree.walk`. An accepted path is never longer than the
    drafter depth, so only ``D = min(max_depth, B)`` columns are formed.
    Requests verified as a chain (``is_tree`` False) and nodes already in
    place (``path[k] == k``) do not move. Ascending ``k`` in place is safe
    because ``path[k] >= k``; with captured copies the order does not matter.
    """
    depth = min(max_depth, path.shape[1] - 1)
    k = torch.arange(1, depth + 1, device=path.device)
    src = path[:, 1: depth + 1]
    move = (k[None, :] <= num_accepted[:, None]) & (src != k[None, :]) & is_tree[:, None]
    return Moves(torch.where(move, src, k[None, :]), move)


@dataclass
class KVRecord:
    """One layer's captured cache write (rows restricted to the capture rows)."""

    impl: Any
    layer: Any
    key: Tensor
    value: Tensor
    kv_cache: Tensor


class KVCapture:
    """The verification step's fresh K/V per attention layer.

    ``start(rows, layers)`` drops earlier records and begins recording the
    token ``rows`` of the layers named in ``layers`` (the target's attention
    layers; the drafter's share the impl classes and are ignored). Recording
    stops with :meth:`stop`; :meth:`clear` releases the copies after the
    rewrite.
    """

    def __init__(self) -> None:
        self._active = False
        self._rewriting = False
        self._rows: Tensor | None = None
        self._layers: frozenset[str] = frozenset()
        self._records: dict[str, KVRecord] = {}
        self._tree_layers: set[str] = set()

    @property
    def active(self) -> bool:
        return self._active

    def start(self, rows: Tensor, layers: Iterable[str]) -> None:
        self._records.clear()
        self._tree_layers.clear()
        self._rows = rows
        self._layers = frozenset(layers)
        self._active = True

    def stop(self) -> None:
        self._active = False

    def clear(self) -> None:
        self._records.clear()

    def record(self, impl: Any, layer: Any, key: Tensor, value: Tensor,
               kv_cache: Tensor) -> None:
        """Called by every DDTree impl's ``do_kv_cache_update``."""
        if not self._active or self._rewriting or layer.layer_name not in self._layers:
            return
        rows = self._rows
        self._records[layer.layer_name] = KVRecord(
            impl, layer, key.index_select(0, rows), value.index_select(0, rows), kv_cache)

    def saw_tree(self, layer_name: str) -> None:
        """Called by a DDTree impl whose forward applied the tree mask."""
        if self._active:
            self._tree_layers.add(layer_name)

    def missing_layers(self) -> dict[str, list[str]]:
        """Target layers that did not capture their write or did not apply the
        tree mask in the current step, by what is missing."""
        missing = {"kv_capture": sorted(self._layers - self._records.keys()),
                   "tree_mask": sorted(self._layers - self._tree_layers)}
        return {k: v for k, v in missing.items() if v}

    def records(self) -> list[KVRecord]:
        return list(self._records.values())

    def rewrite(self, src_rows: Tensor, dst_slots: Tensor) -> int:
        """Write captured rows ``src_rows`` (indices into the ``rows`` given to
        :meth:`start`) of every layer to cache slots ``dst_slots`` (the
        runner's slot-mapping dtype). Returns the number of layers written."""
        if src_rows.numel() == 0:
            return 0
        self._rewriting = True
        try:
            for rec in self._records.values():
                rec.impl.do_kv_cache_update(rec.layer, rec.key[src_rows], rec.value[src_rows],
                                            rec.kv_cache, dst_slots)
            return len(self._records)
        finally:
            self._rewriting = False

    def compact(self, moves: Moves, query_start: Tensor, rows_per_req: int,
                slot_mapping: Tensor) -> int:
        """Apply ``moves``: the captured row of request ``r``'s node
        ``src_node`` (capture row ``r * rows_per_req + src_node``) goes to the
        slot of token row ``query_start[r] + k``. Pairs that do not move
        rewrite the request's root onto its own slot (a no-op), so the shapes
        stay static."""
        num_reqs, depth = moves.move.shape
        k = torch.arange(1, depth + 1, device=query_start.device)
        dst_rows = query_start[:, None] + torch.where(moves.move, k[None, :], 0)
        base = torch.arange(num_reqs, device=query_start.device)[:, None] * rows_per_req
        src = base + torch.where(moves.move, moves.src_node, 0)
        return self.rewrite(src.flatten(), slot_mapping[dst_rows.flatten()])


kv_capture = KVCapture()
