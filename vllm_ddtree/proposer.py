"""``DDTreeProposer``: DFlash drafting that returns a tree instead of a chain.

One drafting step, top-down:

1. The stock DFlash forward drafts one block ``[root, MASK x depth]`` for
   every request (``DFlashProposer.propose`` asked for ``depth`` tokens, the
   drafter positions in use).
2. Instead of the per-position argmax we keep the drafter's logits
   ``[batch, depth, V]`` (:meth:`_sample_draft_tokens`).
3. :func:`vllm_ddtree.core.tree.build_tree` turns them into the ``budget`` most
   probable prefixes per request, in flat order (parents before children);
   fewer when the runner's adaptive budget runs a fixed arm below the
   budget (:attr:`build_budget`): a tree's first ``b`` nodes are the tree of
   budget ``b``, so building only those gives the same tree for less.
   On CPU the same trees come from one native call
   (``kernels/cpu_native.py``) when its kernels are available.
4. The flat tokens ``[batch, budget]`` go back to vLLM as the draft tokens;
   the tree itself waits in :meth:`take_tree` for the runner, which verifies
   it in the next step.

When the runner's adaptive policy has chosen plain decoding, the drafter
still stores its context K/V for the step's tokens, exactly as a drafting
step would, and skips the block forward: a later drafting step then sees the
whole context. After a plain step every scheduled token is context
(:meth:`store_context`); after a verify step (:attr:`skip_block` set for one
:meth:`propose`) vLLM's own ``set_inputs_first_pass`` leaves the rejected
nodes out.

Names: ``budget`` is the tree budget B (vLLM's ``num_speculative_tokens``),
``depth`` the number of drafter positions used (at most ``block_size - 1``).
"""

from __future__ import annotations

import torch
from vllm.config import VllmConfig, get_layers_from_vllm_config
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.spec_decode.dflash import DFlashProposer

from vllm_ddtree.core.config import ddtree_runtime
from vllm_ddtree.kernels import cpu_native
from vllm_ddtree.core.tree import DraftTree, build_tree


class DDTreeProposer(DFlashProposer):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner=None):
        runtime = ddtree_runtime(vllm_config)
        if runtime is None:
            raise ValueError("DDTreeProposer needs speculative_config.ddtree")
        spec = vllm_config.speculative_config
        # DFlash sizes its query buffers by num_speculative_tokens; our drafter
        # forward has 1 + depth queries per request, which can exceed 1 + budget.
        spec.num_speculative_tokens = max(runtime.budget, runtime.depth)
        try:
            super().__init__(vllm_config, device, runner)
        finally:
            spec.num_speculative_tokens = runtime.budget
        # A drafting step writes 1 + depth query ids per request into input_ids,
        # which DFlash sizes by max_num_batched_tokens; the engine arguments are
        # fitted to that (patches/spec_config.py, fit_drafter_rows), a config
        # built around them is refused here rather than overrun.
        rows = self.max_batch_size * (1 + runtime.depth)
        if rows > self.input_ids.numel():
            raise ValueError(
                f"DDTree: max_num_batched_tokens={self.max_num_tokens} cannot hold a drafting "
                f"step of max_num_seqs={self.max_batch_size} requests with {1 + runtime.depth} "
                f"drafter query rows each ({rows}). Use max_num_batched_tokens >= {rows} or "
                f"max_num_seqs <= {self.max_num_tokens // (1 + runtime.depth)}.")
        self.ddtree = runtime
        self.target_attn_layers: frozenset[str] = frozenset()
        self._draft_logits: torch.Tensor | None = None
        self._draft_banned: torch.Tensor | None = None  # [R, V] tokens no request may get
        self._tree: DraftTree | None = None
        # Set by the runner for one propose(): store context K/V only.
        self.skip_block = False
        # Set by the runner for one propose(): build trees of at most this
        # many nodes (the adaptive budget's fixed arm verifies no more).
        self.build_budget: int | None = None

    def load_model(self, target_model) -> None:
        # Called right after the target is loaded: the attention layers that
        # exist now are the target's, those added by super() the drafter's.
        # A hybrid target's Gated DeltaNet (mamba) layers are verified by
        # vllm_ddtree/gdn.py, not by the tree attention backend.
        from vllm.model_executor.layers.mamba.abstract import MambaBase

        self.target_attn_layers = frozenset(
            name for name, layer in get_layers_from_vllm_config(
                self.vllm_config, AttentionLayerBase).items()
            if not isinstance(layer, MambaBase))
        super().load_model(target_model)

    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        # [batch * depth, V], request-major. Keep the logits; the tree replaces
        # the per-position argmax, so the base class gets placeholder ids.
        logits = self.model.compute_logits(hidden_states)
        self._draft_logits = logits
        # Requests restricted to allowed_token_ids: tokens outside the set can
        # never be accepted, so they get no tree nodes (see propose).
        self._draft_banned = getattr(sampling_metadata, "allowed_token_ids_mask", None)
        return torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device), None

    def propose(self, num_speculative_tokens, *args, **kwargs) -> torch.Tensor:
        depth = self.ddtree.depth
        narrow, self.build_budget = self.build_budget, None
        if self.skip_block:
            self.skip_block = False
            return self._store_context(depth, *args, **kwargs)
        super().propose(depth, *args, **kwargs)
        logits, self._draft_logits = self._draft_logits, None
        if logits is None:
            raise RuntimeError("DDTree: the DFlash drafter produced no logits; "
                               "DFlashProposer._sample_draft_tokens was not called")
        batch = logits.shape[0] // depth
        # The scheduler's num_spec_tokens_to_schedule; 0 means "not set".
        budget = int(num_speculative_tokens) or self.ddtree.budget
        if narrow is not None:
            budget = max(1, min(budget, narrow))
        logits = logits.view(batch, depth, -1)
        banned, self._draft_banned = self._draft_banned, None
        if banned is not None and banned.shape[-1] == logits.shape[-1]:
            # The walk is lossless whatever the tree; this only keeps the
            # budget for nodes the target can accept.
            logits = logits.masked_fill(banned[:batch, None, :], float("-inf"))
        native = cpu_native.load() if logits.device.type == "cpu" else None
        if native is not None:
            lp = torch.log_softmax(logits.float(), dim=-1)
            self._tree = DraftTree(*cpu_native.build_tree_native(native, lp, budget))
        else:
            self._tree = build_tree(logits, budget)
        return self._tree.tokens

    def store_context(self, target_hidden_states: torch.Tensor, positions: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
        """The drafter's context K/V of tokens that are all context (a plain
        step): their target hidden states (auxiliary layers, concatenated),
        positions and slots in the drafter's KV-cache group."""
        self.model.precompute_and_store_context_kv(
            self.model.combine_hidden_states(target_hidden_states), positions, slot_mapping)
        self._tree = None

    def _store_context(self, depth: int, target_token_ids, target_positions,
                       target_hidden_states, next_token_ids, token_indices_to_sample,
                       common_attn_metadata, sampling_metadata, mm_embed_inputs=None,
                       num_rejected_tokens_gpu=None, slot_mappings=None) -> torch.Tensor:
        """The context half of a drafting step: the drafter's K/V of this
        step's tokens, written where ``propose`` would write them. Returns
        placeholder drafts (the runner schedules none)."""
        self.num_speculative_tokens = depth
        hidden = self.model.combine_hidden_states(target_hidden_states)
        self.set_inputs_first_pass(
            target_token_ids=target_token_ids, next_token_ids=next_token_ids,
            target_positions=target_positions, target_hidden_states=hidden,
            token_indices_to_sample=token_indices_to_sample, cad=common_attn_metadata,
            num_rejected_tokens_gpu=num_rejected_tokens_gpu)
        n = self._dflash_num_context
        self.model.precompute_and_store_context_kv(
            self._dflash_hidden_states, self._context_positions_buffer[:n],
            self._context_slot_mapping_buffer[:n])
        self._tree = None
        return torch.zeros(common_attn_metadata.batch_size(), self.ddtree.budget,
                           dtype=torch.long, device=next_token_ids.device)

    def take_tree(self) -> DraftTree | None:
        """The trees of the last :meth:`propose` (once), row ``i`` for the
        runner's request ``i`` of that step."""
        tree, self._tree = self._tree, None
        return tree
