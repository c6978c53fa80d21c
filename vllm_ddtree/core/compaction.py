"""KV compaction after a tree walk.

During verification node ``j`` of a request writes its K/V to
``slot(p0 + j)`` (its flat index). After the walk accepts the path
``path[0..a]`` (``path[0]`` = root), vLLM's bookkeeping assumes the accepted
tokens sit at ``slot(p0 + 1..a)``, so node ``path[k]`` must move to
``slot(p0 + k)``. :func:`compaction_rows` turns the walk into source and
destination token rows (the round maps them to slots, and reuses the same rows
to condition the drafter); :class:`KVCapture` applies them:

1. **Note** (:meth:`KVCapture.record`): while the target runs the
   verification forward, every DDTree attention impl reports its cache write
   (``do_kv_cache_update``); the capture keeps, per target layer, the impl,
   the layer and its cache tensor (no copy of any activation).
2. **Move** (:meth:`KVCapture.compact`): per layer, the accepted nodes' K/V
   are read back from the cache through the impl's own strided views
   (``tree_kv_views``) and written to their destination slots through the
   impl's own ``do_kv_cache_update``, so the cache layout is the backend's
   business; an impl class with a ``move_kv_slots(caches, src, dst)`` that
   returns True does it for all layers at once instead (the CPU backend's
   native copy). A quantized cache (the impl's ``tree_kv_quant`` is set) is
   copied slot to slot through the same views instead: its codes move as
   they are, because writing their dequantized values through the cache
   write would quantize them a second time (the per-tensor scales stay as
   they are). All sources are read before any destination is written, so
   overlapping moves are safe.

The capture also proves the tree path ran: :meth:`KVCapture.missing_layers`
names every target attention layer that did not report a cache write or did
not apply the tree mask, which the round turns into an error.

No vLLM imports: impls and layers are duck-typed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["KVCapture", "KVRecord", "compaction_rows", "kv_capture"]


def compaction_rows(path: Tensor, num_accepted: Tensor, query_start: Tensor,
                    max_depth: int) -> tuple[Tensor, Tensor]:
    """Token rows ``(src, dst)``, flat ``[R * (1 + D)]``: the accepted node
    ``path[k]`` of request ``r`` moves from row ``query_start[r] + path[k]``
    to row ``query_start[r] + k`` for ``k = 0..a``; the other pairs are the
    root onto itself, so the shapes stay static.

    ``path`` ``[R, 1+B]`` and ``num_accepted`` ``[R]`` come from
    :func:`vllm_ddtree.core.tree.walk`. An accepted path is never longer than the
    drafter depth, so only ``D = min(max_depth, B)`` columns are formed.
    ``path[k] >= k``, so applying the moves in ascending ``k`` in place would
    be safe as well; :meth:`KVCapture.compact` reads every source first.
    """
    cols = min(max_depth, path.shape[1] - 1) + 1
    k = torch.arange(cols, device=path.device)
    take = k <= num_accepted[:, None]
    qs = query_start[:, None]
    src = qs + torch.where(take, path[:, :cols], 0)
    dst = qs + torch.where(take, k, 0)
    return src.flatten(), dst.flatten()


@dataclass
class KVRecord:
    """One target layer's cache, and how to read it by slot."""

    impl: Any
    layer: Any
    kv_cache: Tensor
    key_view: Tensor  # [num_blocks, block_size, Hk, D] strided view of the cache
    value_view: Tensor


class KVCapture:
    """The verification step's target attention layers and their caches.

    ``start(layers)`` begins a step for the layers named in ``layers`` (the
    target's attention layers; the drafter's share the impl classes and are
    ignored); :meth:`stop` ends it. Records persist across steps (a layer's
    cache tensor does not change) and are refreshed if it does.
    """

    def __init__(self) -> None:
        self._active = False
        self._moving = False
        self._layers: frozenset[str] = frozenset()
        self._records: dict[str, KVRecord] = {}
        self._written: set[str] = set()
        self._tree_layers: set[str] = set()

    @property
    def active(self) -> bool:
        return self._active

    def start(self, layers: Iterable[str]) -> None:
        self._written.clear()
        self._tree_layers.clear()
        self._layers = frozenset(layers)
        self._active = True

    def stop(self) -> None:
        self._active = False

    def clear(self) -> None:
        """Forget every record (their cache tensors too)."""
        self._records.clear()

    def record(self, impl: Any, layer: Any, kv_cache: Tensor) -> None:
        """Called by every DDTree impl's ``do_kv_cache_update``."""
        name = layer.layer_name
        if not self._active or self._moving or name not in self._layers:
            return
        self._written.add(name)
        rec = self._records.get(name)
        if rec is None or rec.kv_cache is not kv_cache or rec.impl is not impl:
            key_view, value_view = impl.tree_kv_views(kv_cache)
            self._records[name] = KVRecord(impl, layer, kv_cache, key_view, value_view)

    def saw_tree(self, layer_name: str) -> None:
        """Called by a DDTree impl whose forward applied the tree mask."""
        if self._active:
            self._tree_layers.add(layer_name)

    def replayed(self, layers: Iterable[str]) -> None:
        """The step's forward was a replayed CUDA graph, so no impl reported
        anything: every target layer is taken as written, from its record of
        the capture (a target layer without a record is an error)."""
        layers = frozenset(layers)
        absent = sorted(layers - self._records.keys())
        if absent:
            raise RuntimeError(f"DDTree: no cache record for target layers {absent[:4]} "
                               f"after a replayed CUDA graph (the graph was not captured "
                               f"with the tree path)")
        self._layers = layers
        self._written = set(layers)
        self._tree_layers = set(layers)

    def missing_layers(self) -> dict[str, list[str]]:
        """Target layers that did not report their cache write or did not
        apply the tree mask in the current step, by what is missing."""
        missing = {"kv_capture": sorted(self._layers - self._written),
                   "tree_mask": sorted(self._layers - self._tree_layers)}
        return {k: v for k, v in missing.items() if v}

    def records(self, layers: Iterable[str] | None = None) -> list[KVRecord]:
        names = self._written if layers is None else self._written.intersection(layers)
        return [self._records[n] for n in sorted(names) if n in self._records]

    def compact(self, src_slots: Tensor, dst_slots: Tensor,
                layers: Iterable[str] | None = None) -> int:
        """Copy the K/V at cache slots ``src_slots`` to ``dst_slots`` in every
        layer written this step, or in those of ``layers`` (one KV-cache group:
        the slots are that group's, in the runner's slot-mapping dtype).
        Returns the number of layers moved."""
        records = self.records(layers)
        if not records or src_slots.numel() == 0:
            return 0
        mover = getattr(type(records[0].impl), "move_kv_slots", None)
        if mover is not None and all(type(r.impl) is type(records[0].impl) for r in records):
            # one call for every layer (the CPU impl's native copy)
            if mover([r.kv_cache for r in records], src_slots, dst_slots):
                return len(records)
        block_size = records[0].key_view.shape[1]
        src_block = torch.div(src_slots, block_size, rounding_mode="floor")
        src_offset = src_slots - src_block * block_size
        dst_block = torch.div(dst_slots, block_size, rounding_mode="floor")
        dst_offset = dst_slots - dst_block * block_size
        self._moving = True
        try:
            for rec in records:
                if rec.key_view.shape[1] != block_size:
                    raise ValueError("DDTree: target layers with different cache block "
                                     "sizes cannot share one slot mapping")
                key = rec.key_view[src_block, src_offset]
                value = rec.value_view[src_block, src_offset]
                if rec.impl.tree_kv_quant is not None:
                    rec.key_view[dst_block, dst_offset] = key
                    rec.value_view[dst_block, dst_offset] = value
                else:
                    rec.impl.do_kv_cache_update(rec.layer, key, value, rec.kv_cache,
                                                dst_slots)
            return len(records)
        finally:
            self._moving = False


kv_capture = KVCapture()
