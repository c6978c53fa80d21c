"""Deliberately broken DDTree paths, to show that the sampling tests have power.

Each function is a ``benchmarks.run_llm`` ``setup`` hook: it runs in the
engine's process before the engine starts, so the job must set
``VLLM_ENABLE_V1_MULTIPROCESSING=0``. The replacement goes into
``vllm_ddtree.core.tree``, through which the runner calls the tree algorithms; any
other ``vllm_ddtree`` module that imported the function by name gets it too.
"""

from __future__ import annotations

import sys

import torch


def _replace(name: str, fn) -> None:
    import vllm_ddtree.runner  # noqa: F401  (imports the modules that use the tree functions)
    import vllm_ddtree.core.tree as tree

    real = getattr(tree, name)
    for mod_name, mod in list(sys.modules.items()):
        if mod_name.startswith("vllm_ddtree") and getattr(mod, name, None) is real:
            setattr(mod, name, fn)
    assert getattr(tree, name) is fn


def root_only_mask() -> None:
    """Every tree node attends to the context, the root and itself only.

    The intermediate ancestors are dropped, so nodes at depth >= 2 are scored
    without their parents. Depth-1 nodes and the root keep their true rows, so
    the root sample stays right: only tokens decided by deeper nodes (and the
    K/V those nodes leave in the cache) go wrong.
    """
    import vllm_ddtree.core.tree as tree

    real = tree.ancestor_mask

    def root_only(parents, depth, valid=None, max_depth=None):
        # As if every node were a child of the root: row i = root | bit(i).
        return real(torch.zeros_like(parents), torch.ones_like(depth), valid, max_depth)

    _replace("ancestor_mask", root_only)


def accept_first_draft() -> None:
    """The walk takes the drafter's first node as the target's root sample.

    The first node (the drafter's most probable first token) is then always
    accepted, which breaks the distribution of the token after the root.
    """
    import vllm_ddtree.core.tree as tree

    real = tree.walk

    def first_draft_walk(tree_tokens, parents, post, num_nodes=None):
        post = post.clone()
        has = (num_nodes > 0) if num_nodes is not None else torch.ones_like(post[:, 0], dtype=torch.bool)
        post[:, 0] = torch.where(has, tree_tokens[:, 0].to(post.dtype), post[:, 0])
        return real(tree_tokens, parents, post, num_nodes)

    _replace("walk", first_draft_walk)
