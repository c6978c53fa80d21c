"""The tree description a verification step hands to the attention backends.

The runner attaches one :class:`TreeAttentionInfo` to the target model's
per-layer attention metadata as ``metadata.ddtree`` (see
``vllm_ddtree/core/round.py``); the DDTree attention impls read it
(``vllm_ddtree/attention.py``). No vLLM imports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["TreeAttentionInfo", "get_tree_info"]


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

    @classmethod
    def create(cls, mask: torch.Tensor, is_tree: torch.Tensor,
               tree_reqs: tuple[int, ...] | None = None,
               max_tree_query_len: int | None = None,
               depth: torch.Tensor | None = None) -> TreeAttentionInfo:
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
                   max_tree_query_len=max_tree_query_len, depth=depth)

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
