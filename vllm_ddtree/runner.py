"""The model-runner seams of DDTree (vLLM's V1 runner, CPU and CUDA).

:class:`DDTreeRunnerMixin` behaves exactly like the stock runner unless
``speculative_config.ddtree`` is set. With DDTree on, each runner hook below
is a short delegation to the step's :class:`~vllm_ddtree.round.TreeRound`,
whose docstring gives the order of a round:

=============================  ==============================================
vLLM hook                      DDTree
=============================  ==============================================
``load_model``                 start-up guard: every target attention layer
                               is tree-capable
``initialize_kv_cache``        start-up guard: one KV-cache group for the
                               target
``_prepare_inputs``            ``TreeRound.plan``
``_build_attention_metadata``  ``TreeRound.attach``
``_model_forward``             ``TreeRound.capturing`` (first-step guard)
``_sample``                    ``TreeRound.verify`` + ``TreeRound.compact``
``propose_draft_token_ids``    ``TreeRound.condition``, then the drafter's
                               new trees are kept for the next step
=============================  ==============================================

The vLLM names this relies on are listed in ``patches/README.md``.
"""

from __future__ import annotations

import os

import torch
from vllm.config import get_layers_from_vllm_config
from vllm.logger import init_logger
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.outputs import SamplerOutput

from vllm_ddtree.attention import TreeAttentionImplMixin
from vllm_ddtree.config import ddtree_runtime
from vllm_ddtree.proposer import DDTreeProposer
from vllm_ddtree.round import DDTreeSeamError, ProposedTrees, TreeRound
from vllm_ddtree.stats import CounterWriter, stats_file

logger = init_logger("vllm.ddtree")

ENV_DEBUG = "VLLM_DDTREE_DEBUG"


class DDTreeRunnerMixin:
    """Mixed in front of vLLM's ``GPUModelRunner`` / ``CPUModelRunner``."""

    def __init__(self, vllm_config, device, *args, **kwargs):
        super().__init__(vllm_config, device, *args, **kwargs)
        self.ddtree = ddtree_runtime(vllm_config)
        if self.ddtree is None:
            return
        if self.uses_mrope:
            raise DDTreeSeamError(
                "DDTree does not support M-RoPE target models yet; use method 'dflash'.")
        # Replace the stock DFlash proposer with the tree proposer.
        self.drafter = DDTreeProposer(vllm_config, self.device, self)
        self.ddtree_round: TreeRound | None = None
        # The drafter's trees of the last step, verified in the next one.
        self.ddtree_trees: ProposedTrees | None = None
        # The last walked step, added to the metrics after the drafter launched.
        self.ddtree_unrecorded: torch.Tensor | None = None  # StepCounts.totals()
        self.ddtree_stats = self._ddtree_open_stats()
        # Per-step consistency checks that read device tensors back (debugging).
        self.ddtree_debug = os.environ.get(ENV_DEBUG, "0").strip().lower() in ("1", "true",
                                                                                "yes", "on")
        logger.info("DDTree: tree budget %d, drafter depth %d (block size %d)",
                    self.ddtree.budget, self.ddtree.depth, self.ddtree.block_size)

    # ------------------------------------------------------------------ start-up guards
    def load_model(self, *args, **kwargs):
        super().load_model(*args, **kwargs)
        if self.ddtree is not None:
            check_tree_capable_layers(self.vllm_config, self.drafter.target_attn_layers)

    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs):
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
        if self.ddtree is not None:
            self.ddtree_kv_group = target_kv_cache_group(
                kv_cache_config, self.drafter.target_attn_layers)

    # ------------------------------------------------------------------ the round
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        out = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        if self.ddtree is None:
            return out
        self._ddtree_flush_stats()
        trees, self.ddtree_trees = self.ddtree_trees, None
        total = scheduler_output.total_num_scheduled_tokens
        num_reqs = self.input_batch.num_reqs
        self.ddtree_round = TreeRound.plan(
            req_ids=self.input_batch.req_ids[:num_reqs],
            scheduled=scheduler_output.scheduled_spec_decode_tokens,
            trees=trees, budget=self.ddtree.budget, depth=self.ddtree.depth,
            positions=self.positions[:total], req_indices=self.req_indices.gpu[:total],
            query_pos=self.query_pos.gpu[:total],
            query_start=self.query_start_loc.gpu[:num_reqs],
            with_expected=self.ddtree_stats is not None, check_drafts=self.ddtree_debug)
        return out

    def _build_attention_metadata(self, *args, **kwargs):
        attn_metadata, spec_cad = super()._build_attention_metadata(*args, **kwargs)
        if self.ddtree is not None and self.ddtree_round is not None:
            self.ddtree_round.attach(attn_metadata, self.drafter.target_attn_layers)
        return attn_metadata, spec_cad

    def _model_forward(self, *args, **kwargs):
        rnd = self.ddtree_round if self.ddtree is not None else None
        if rnd is None:
            return super()._model_forward(*args, **kwargs)
        with rnd.capturing(self.drafter.target_attn_layers):
            return super()._model_forward(*args, **kwargs)

    def _sample(self, logits, spec_decode_metadata):
        rnd = self.ddtree_round if self.ddtree is not None else None
        if rnd is None or spec_decode_metadata is None:
            return super()._sample(logits, spec_decode_metadata)
        md = spec_decode_metadata
        tokens = rnd.verify(logits, md.draft_token_ids, md.num_draft_tokens,
                               self.input_batch.sampling_metadata)
        rnd.compact(self.input_batch.block_table[self.ddtree_kv_group].slot_mapping.gpu)
        if self.ddtree_stats is not None:
            counts = rnd.counts()
            self.ddtree_unrecorded = None if counts is None else counts.totals()
        out = tokens[:, : md.max_spec_len + 1].to(torch.int32)
        return SamplerOutput(sampled_token_ids=out, logprobs_tensors=None)

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata,
                                hidden_states, sample_hidden_states, aux_hidden_states,
                                spec_decode_metadata, common_attn_metadata, slot_mappings):
        rnd = self.ddtree_round if self.ddtree is not None else None
        if rnd is not None:
            rnd.condition(aux_hidden_states, self.positions)
        drafts = super().propose_draft_token_ids(
            scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
            sample_hidden_states, aux_hidden_states, spec_decode_metadata,
            common_attn_metadata, slot_mappings)
        if self.ddtree is not None:
            self.ddtree_round = None  # the round ends here
            tree = self.drafter.take_tree()
            if tree is not None:
                num_reqs = self.input_batch.num_reqs
                self.ddtree_trees = ProposedTrees(list(self.input_batch.req_ids[:num_reqs]),
                                                  tree)
            self._ddtree_flush_stats()
        return drafts

    # ------------------------------------------------------------------ metrics
    def _ddtree_open_stats(self) -> CounterWriter | None:
        """The counter file /metrics reads (one writer per engine; see stats.py)."""
        stats_dir = self.ddtree.stats_dir
        if not stats_dir:
            return None
        if not os.path.isdir(stats_dir):
            logger.warning("DDTree: stats directory %s is not on this machine; the ddtree "
                           "metrics stay empty", stats_dir)
            return None
        return CounterWriter(stats_file(stats_dir,
                                        self.vllm_config.parallel_config.data_parallel_rank))

    def _ddtree_flush_stats(self) -> None:
        """Add the last walked step to the counters (its host copy is taken
        after the drafter has been launched)."""
        c, self.ddtree_unrecorded = self.ddtree_unrecorded, None
        if c is None:
            return
        self.ddtree_stats.add_totals(c.tolist())


def check_tree_capable_layers(vllm_config, target_layers: frozenset[str]) -> None:
    """Refuse to start unless every target attention layer runs a DDTree impl
    that can serve it (a stock impl would ignore the tree mask silently)."""
    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, sorted(target_layers))
    problems = []
    for name, layer in layers.items():
        if not isinstance(layer, Attention):
            problems.append(f"{name} is a {type(layer).__name__} layer, which has no tree "
                            f"verification")
            continue
        impl = layer.impl
        backend = layer.attn_backend.get_name()
        if not isinstance(impl, TreeAttentionImplMixin):
            problems.append(f"{name} uses the {backend} backend ({type(impl).__name__}), "
                            f"which cannot apply a tree mask")
            continue
        reason = impl.tree_unsupported_reason()
        if reason is not None:
            problems.append(f"{name} ({backend}) uses {reason}, which the tree kernel "
                            f"does not implement")
    if problems:
        shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more"
                                           if len(problems) > 3 else "")
        raise DDTreeSeamError(
            f"DDTree cannot verify trees on this target: {shown}. Use method 'dflash' for "
            f"this model, or remove an --attention-backend override that replaced the "
            f"DDTree backend.")
    if not layers:
        raise DDTreeSeamError("DDTree found no attention layer in the target model; it needs "
                              "a decoder with attention. Use method 'dflash'.")


def target_kv_cache_group(kv_cache_config, target_layers: frozenset[str]) -> int:
    """The index of the single KV-cache group holding the target's attention
    layers; refuse to start when there are several (hybrid or sliding-window
    targets, whose compaction would need one move per group)."""
    groups = [g for g, grp in enumerate(kv_cache_config.kv_cache_groups)
              if target_layers & set(grp.layer_names)]
    if len(groups) != 1:
        raise DDTreeSeamError(
            f"DDTree supports targets whose attention layers share one KV-cache group; this "
            f"target has {len(groups)} (hybrid, sliding-window or mixed layers). Use method "
            f"'dflash' for this model.")
    return groups[0]


def make_runner_class(base: type) -> type:
    """``DDTree<Base>``: the mixin in front of a vLLM runner class."""
    return type(f"DDTree{base.__name__}", (DDTreeRunnerMixin, base),
                {"__module__": __name__, "__qualname__": f"DDTree{base.__name__}"})
