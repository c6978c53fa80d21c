"""``DDTreeProposer``: DFlash drafting that returns a tree instead of a chain.

One round, top-down:

1. The stock DFlash forward drafts one block ``[root, MASK x K]`` for every
   request (``DFlashProposer.propose`` with K masks, K = the drafter depth).
2. Instead of the per-position argmax we keep the drafter's logits
   ``[batch, K, V]`` (:meth:`_sample_draft_tokens`).
3. :func:`vllm_ddtree.tree.build_tree` turns them into the B most probable
   prefixes per request, in flat order (parents before children).
4. The flat tokens ``[batch, B]`` go back to vLLM as the "draft tokens"; the
   tree structure stays on the proposer (:attr:`last_tree`, with the request
   ids it belongs to) until the runner verifies it in the next step.
"""

from __future__ import annotations

import torch
from vllm.config import VllmConfig
from vllm.v1.spec_decode.dflash import DFlashProposer

from vllm_ddtree.config import ddtree_runtime
from vllm_ddtree.tree import DraftTree, build_tree


class DDTreeProposer(DFlashProposer):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner=None):
        runtime = ddtree_runtime(vllm_config)
        assert runtime is not None, "DDTreeProposer needs speculative_config.ddtree"
        spec = vllm_config.speculative_config
        budget = spec.num_speculative_tokens
        # DFlash sizes its query buffers by num_speculative_tokens; our drafter
        # forward has 1 + K queries per request, which can exceed 1 + B.
        spec.num_speculative_tokens = max(budget, runtime.depth)
        try:
            super().__init__(vllm_config, device, runner)
        finally:
            spec.num_speculative_tokens = budget
        self.ddtree = runtime
        self._draft_logits: torch.Tensor | None = None
        # The trees proposed in the last round, row-aligned with last_req_ids.
        self.last_tree: DraftTree | None = None

    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        # [batch * K, V], request-major. Keep the logits; the argmax is only
        # returned to satisfy the base class (the tree replaces it).
        logits = self.model.compute_logits(hidden_states)
        self._draft_logits = logits
        return logits.argmax(dim=-1), None

    def propose(self, num_speculative_tokens, *args, **kwargs) -> torch.Tensor:
        depth = self.ddtree.depth
        super().propose(depth, *args, **kwargs)
        logits = self._draft_logits
        self._draft_logits = None
        assert logits is not None
        batch = logits.shape[0] // depth
        budget = int(num_speculative_tokens) or self.ddtree.budget
        tree = build_tree(logits.view(batch, depth, -1), budget)
        self.last_tree = tree
        return tree.tokens
