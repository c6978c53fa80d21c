"""The tree description a verification step hands to the attention backends.

The runner attaches one :class:`TreeAttentionInfo` to the target model's
per-layer attention metadata as ``metadata.ddtree`` (see
``vllm_ddtree/core/round.py``); the DDTree attention impls read it
(``vllm_ddtree/attention.py``).

Its tensors are views of :class:`TreeStepBuffers`, device tensors the runner
allocates once and every step fills in place, so that a CUDA graph captured
with them reads each step's tree on replay. The buffers also carry the guard
that works under replay, where no Python runs between the captured kernels:
each tree-capable layer copies the step's counter into its own slot of
``seen`` in the captured work itself, and the runner compares ``seen`` with
the counter after the step (:meth:`TreeStepBuffers.unseen_layers`). A layer
that did not run the tree path, in a replayed graph or not, keeps an old
counter. No vLLM imports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["TreeAttentionInfo", "TreeStepBuffers", "get_tree_info", "mask_words"]


def mask_words(budget: int) -> int:
    """int32 words of one packed ancestor-mask row for trees of ``budget`` nodes."""
    return (budget + 1 + 31) // 32


@dataclass
class TreeAttentionInfo:
    """``mask``: int32 ``[num_tokens, W]``, one row per query token of the
    batch: little-endian packed bits over the request's own query span (bit
    ``j % 32`` of word ``j // 32``: "sees tree node j"); rows of non-tree
    requests are ignored. ``is_tree``: bool ``[num_reqs]`` on the mask's
    device. ``depth``: int32 ``[num_tokens]`` (optional) the tree depth of
    each row's node (root 0), which places tree node ``j`` at logical
    position ``ctx_len + depth`` for sliding-window layers; rows of non-tree
    requests are ignored. ``plans``: per-step data derived once and shared
    by every layer (e.g. the CPU batched plan), keyed by the backend.

    The runner also passes the host-side facts it already has, so that no
    backend has to read them back from the device: ``tree_reqs`` (the indices
    where ``is_tree`` is set) and ``max_tree_query_len`` (the longest query of
    a tree request).

    Build it with :meth:`create`, which validates shapes and dtypes.
    """

    mask: torch.Tensor
    is_tree: torch.Tensor
    _tree_reqs: tuple[int, ...] | None = field(default=None, repr=False)
    max_tree_query_len: int | None = None
    depth: torch.Tensor | None = None
    plans: dict = field(default_factory=dict, repr=False, compare=False)
    # The step's buffers, when the info views them (the replay-safe guard).
    buffers: TreeStepBuffers | None = field(default=None, repr=False, compare=False)

    @classmethod
    def create(cls, mask: torch.Tensor, is_tree: torch.Tensor,
               tree_reqs: tuple[int, ...] | None = None,
               max_tree_query_len: int | None = None,
               depth: torch.Tensor | None = None,
               buffers: TreeStepBuffers | None = None) -> TreeAttentionInfo:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.int32:
            raise TypeError(f"TreeAttentionInfo.mask must be an int32 tensor, got "
                            f"{getattr(mask, 'dtype', type(mask))}")
        if mask.dim() != 2 or mask.shape[1] < 1:
            raise ValueError(f"TreeAttentionInfo.mask must be 2-D [num_tokens, W>=1], got "
                             f"shape {tuple(mask.shape)}")
        if not isinstance(is_tree, torch.Tensor) or is_tree.dtype != torch.bool:
            raise TypeError(f"TreeAttentionInfo.is_tree must be a bool tensor, got "
                            f"{getattr(is_tree, 'dtype', type(is_tree))}")
        if is_tree.dim() != 1:
            raise ValueError(f"TreeAttentionInfo.is_tree must be 1-D [num_reqs], got shape "
                             f"{tuple(is_tree.shape)}")
        if is_tree.device != mask.device:
            raise ValueError(f"TreeAttentionInfo.is_tree is on {is_tree.device} but mask is "
                             f"on {mask.device}")
        if tree_reqs is not None and len(tree_reqs) and max(tree_reqs) >= is_tree.shape[0]:
            raise ValueError(f"TreeAttentionInfo.tree_reqs {tree_reqs} out of range for "
                             f"{is_tree.shape[0]} requests")
        if depth is not None:
            if not isinstance(depth, torch.Tensor) or depth.dtype != torch.int32:
                raise TypeError(f"TreeAttentionInfo.depth must be an int32 tensor, got "
                                f"{getattr(depth, 'dtype', type(depth))}")
            if depth.shape != mask.shape[:1]:
                raise ValueError(f"TreeAttentionInfo.depth must be 1-D [num_tokens="
                                 f"{mask.shape[0]}] like the mask's rows, got shape "
                                 f"{tuple(depth.shape)}")
            if depth.device != mask.device:
                raise ValueError(f"TreeAttentionInfo.depth is on {depth.device} but mask is "
                                 f"on {mask.device}")
        return cls(mask=mask, is_tree=is_tree, _tree_reqs=tree_reqs,
                   max_tree_query_len=max_tree_query_len, depth=depth, buffers=buffers)

    def mark_seen(self, layer_name: str) -> None:
        """Called by a tree-capable layer that applied this info: record the
        step in the layer's guard slot (a device copy, part of a captured graph)."""
        if self.buffers is not None:
            self.buffers.mark_seen(layer_name)

    def tree_reqs(self) -> tuple[int, ...]:
        """Indices of the tree requests on the host: as given to
        :meth:`create` (the runner always gives them), else read from
        ``is_tree`` once (a device sync off CPU)."""
        if self._tree_reqs is None:
            self._tree_reqs = tuple(i for i, f in enumerate(self.is_tree.tolist()) if f)
        return self._tree_reqs


def get_tree_info(attn_metadata: Any) -> TreeAttentionInfo | None:
    """The step's tree description, or None. Metadata objects the runner did
    not tag (the drafter's, or any built outside a verification step) have no
    ``ddtree`` attribute: that means "no tree"."""
    return getattr(attn_metadata, "ddtree", None)


class TreeStepBuffers:
    """The device tensors a verification step's tree lives in, allocated once.

    ``mask`` int32 ``[max_tokens, W]``, ``depth`` int32 ``[max_tokens]`` (each
    node's depth, for sliding windows) and ``is_tree`` bool ``[max_reqs]`` are
    what the attention kernels read (filled by ``TreeRound.plan``; rows and
    requests past the step's own are causal padding); ``parent`` int64
    ``[max_tokens]`` is every token row's local tree parent (-1: a root), for
    Gated DeltaNet layers. ``step`` int32 ``[1]`` counts tree steps on the
    device and ``seen`` int32 ``[num_layers]`` holds, per guarded layer, the
    last step whose tree path that layer ran; :meth:`unseen_layers` compares
    them after the step (reading ``seen`` back once the step's results are on
    the host anyway). Identity and shapes never change, which is what a
    captured CUDA graph needs.
    """

    def __init__(self, max_tokens: int, max_reqs: int, budget: int, layers, device) -> None:
        if max_tokens < 1 or max_reqs < 1 or budget < 1:
            raise ValueError(f"TreeStepBuffers: max_tokens, max_reqs and budget must be "
                             f">= 1, got {max_tokens}, {max_reqs}, {budget}")
        self.budget = budget
        self.mask = torch.zeros(max_tokens, mask_words(budget), dtype=torch.int32,
                                device=device)
        self.depth = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        self.is_tree = torch.zeros(max_reqs, dtype=torch.bool, device=device)
        self.parent = torch.full((max_tokens,), -1, dtype=torch.long, device=device)
        self.layer_names = tuple(sorted(layers))
        self.slot = {name: i for i, name in enumerate(self.layer_names)}
        self.step = torch.zeros(1, dtype=torch.int32, device=device)
        self.seen = torch.zeros(max(1, len(self.layer_names)), dtype=torch.int32,
                                device=device)
        self.step_host = 0
        pin = torch.device(device).type == "cuda"
        self._seen_host = torch.zeros(self.seen.shape, dtype=torch.int32, pin_memory=pin)
        self._fetched = False

    def begin_step(self) -> None:
        """A new tree step: advance the counter (host and device)."""
        self.step_host += 1
        self.step.add_(1)
        self._fetched = False

    def mark_seen(self, layer_name: str) -> None:
        i = self.slot.get(layer_name)
        if i is not None:
            self.seen[i: i + 1].copy_(self.step)

    def fetch_seen(self) -> None:
        """Start copying ``seen`` to the host (after the forward; asynchronous
        on a GPU, where the step's own result copy later waits for it)."""
        self._seen_host.copy_(self.seen, non_blocking=True)
        self._fetched = True

    def unseen_layers(self, expected) -> list[str]:
        """The layers of ``expected`` whose tree path did not run in the
        current step (call once the step's results reached the host)."""
        if not self._fetched:
            self.fetch_seen()
        stale = (self._seen_host != self.step_host).tolist()
        return [name for name, bad in zip(self.layer_names, stale) if bad and name in expected]

    def info(self, num_tokens: int, num_reqs: int, tree_reqs: tuple[int, ...],
             max_tree_query_len: int | None) -> TreeAttentionInfo:
        """The step's :class:`TreeAttentionInfo` over views of the buffers."""
        return TreeAttentionInfo.create(self.mask[:num_tokens], self.is_tree[:num_reqs],
                                        tree_reqs, max_tree_query_len,
                                        depth=self.depth[:num_tokens], buffers=self)
