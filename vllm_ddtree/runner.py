"""The model-runner seams of DDTree (vLLM's V1 runner, CPU and CUDA).

:class:`DDTreeRunnerMixin` behaves exactly like the stock runner unless
``speculative_config.ddtree`` is set. With DDTree on, each runner hook below
is a short delegation to the step's :class:`~vllm_ddtree.core.round.TreeRound`,
whose docstring gives the order of a round:

=============================  ==============================================
vLLM hook                      DDTree
=============================  ==============================================
``load_model``                 start-up guard: every target attention layer
                               is tree-capable
``initialize_kv_cache``        the target's KV-cache groups (compaction
                               moves each by its own slots); GDN state memory
``_prepare_inputs``            ``TreeRound.plan`` (+ M-RoPE rows, GDN parents)
``_build_attention_metadata``  ``TreeRound.attach``
``_model_forward``             ``TreeRound.capturing`` (first-step guard);
                               GDN layers verify trees (``gdn.tree_step``)
``_sample``                    ``TreeRound.verify`` + ``TreeRound.compact``
                               + the GDN commit
``_update_states_after_model_  every GDN request resumes from state column 0
execute``                      (where the commit put it)
``propose_draft_token_ids``    ``TreeRound.condition``, then the drafter's
                               new trees are kept for the next step; the
                               adaptive policy chooses their budgets (or
                               skips the drafter's block in plain mode)
``take_draft_token_ids``       each request's drafts cut to its budget
``execute_model``              step clock for the cost model
``initialize_kv_cache`` (CPU)  the cost model's start-up profile
``capture_model`` (CUDA)
=============================  ==============================================

The vLLM names this relies on are listed in ``patches/README.md``.
"""

from __future__ import annotations

import inspect
import os
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F
from vllm.config import get_layers_from_vllm_config
from vllm.logger import init_logger
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput, SamplerOutput
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_ddtree.attention import TreeAttentionImplMixin
from vllm_ddtree.core.budget import (AdaptivePolicy, CostModel, PiecewiseLinear, ladder,
                                parse_pinned_cost)
from vllm_ddtree.core.config import ddtree_runtime
from vllm_ddtree.gdn import GDNTreeStep, tree_step
from vllm_ddtree.core.node_history import (chain_parents, keep_nodes, node_depths,
                                      row_index)
from vllm_ddtree.parallel import TPAgreement
from vllm_ddtree.patches import cpu_gemm_handler_del as _gemm_del
from vllm_ddtree.node_sampling import (NodeRows, logprobs_of_outputs, min_p_per_request,
                                       needs_processing, process_nodes)
from vllm_ddtree.proposer import DDTreeProposer
from vllm_ddtree.core.compaction import kv_capture
from vllm_ddtree.core.pending_context import PendingContext
from vllm_ddtree.core.round import DDTreeSeamError, ProposedTrees, TreeRound, attach_info
from vllm_ddtree.core.stats import CounterWriter, stats_file
from vllm_ddtree.core.step_clock import BusyGap
from vllm_ddtree.structured import DDTreeDraftTokenIds
from vllm_ddtree.core.tree import process_logits
from vllm_ddtree.core.tree_info import TreeStepBuffers
from vllm_ddtree.core.tuner import RateTuner, bucket_of, bucket_range

logger = init_logger("vllm.ddtree")

ENV_DEBUG = "VLLM_DDTREE_DEBUG"
# "A,B,D" in ms: pin the adaptive budget's cost model instead of profiling it.
ENV_COST = "VLLM_DDTREE_COST_MODEL"
# "1"/"0": pad trees the adaptive budget cut back to the full budget (never
# accepted past the cut) so that tree batches stay uniform. Default: exactly
# when tree steps run under full CUDA graphs.
ENV_PAD = "VLLM_DDTREE_PAD_TREES"
# seconds of engine time per trial of the adaptive budget's rate tuner
# (default 0.3): shorter trials end the cold start within a short run.
ENV_TRIAL = "VLLM_DDTREE_TRIAL_SECONDS"


class DDTreeRunnerMixin:
    """Mixed in front of vLLM's ``GPUModelRunner`` / ``CPUModelRunner``."""

    def __init__(self, vllm_config, device, *args, **kwargs):
        super().__init__(vllm_config, device, *args, **kwargs)
        self.ddtree = ddtree_runtime(vllm_config)
        if self.ddtree is None:
            return
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
        # The adaptive budget (vllm_ddtree/core/budget.py): created with its cost
        # profile after warm-up, or at the first step.
        self.ddtree_policy: AdaptivePolicy | None = None
        # ... and the arm the adaptive budget runs, chosen by the tokens per
        # second each arm delivers (core/tuner.py; None with a pinned cost
        # model, under which the model decides alone)
        self.ddtree_tuner: RateTuner | None = None
        self.ddtree_shadow_budgets: list[int] = []
        self.ddtree_shadow_cut: torch.Tensor | None = None  # the same, on the device
        self.ddtree_best: dict[int, str] = {}  # bucket -> best arm last logged
        self.ddtree_best_seen: tuple[int, int] | None = None  # (trials closed, bucket) then
        # Plain steps' tokens whose drafter context K/V is not stored yet,
        # stored together when the drafter next runs (plain steps then cost
        # what plain decoding does; core/pending_context.py). The hidden
        # states are one [n, k * H] tensor per step, or (CPU) the forward's
        # own k auxiliary outputs; positions and slots tensors or numpy
        # copies (_ddtree_plain_step). Stored anyway once they hold
        # ddtree_pending_cap rows (_ddtree_pending_cap).
        self.ddtree_pending_context = PendingContext()
        self.ddtree_pending_cap: int | None = None
        # Whether a plain step keeps the forward's auxiliary outputs by
        # reference (None: not known yet; see _ddtree_keeps_outputs)
        self.ddtree_aux_refs: bool | None = None
        self.ddtree_aux_probe: torch.Tensor | None = None
        self.ddtree_host_views: dict[int, tuple[torch.Tensor, np.ndarray]] = {}
        self.ddtree_budgets: torch.Tensor | None = None  # [R] of the last drafts
        # The model arm's calibration of q learns from every walk of the
        # model's trees and from every CALIBRATE_EVERY-th walk of a fixed
        # arm's (the same q; sparser, so that a fixed arm's step costs what a
        # fixed engine's does): whether the trees drafted last (verified
        # next) are the model's, and the fixed walks since the last lesson.
        self.ddtree_model_tree = False
        self.ddtree_uncalibrated = 0
        self.ddtree_step: dict | None = None  # the step being timed
        self.ddtree_gap = BusyGap()  # engine time between two runner steps, idle left out
        # Hybrid targets: the target's Gated DeltaNet layers and this step's
        # tree bookkeeping for them (vllm_ddtree/gdn.py).
        self.ddtree_gdn_layers: frozenset[str] = frozenset()
        self.ddtree_gdn_step: GDNTreeStep | None = None
        # M-RoPE targets: the depth-position shift applied to every M-RoPE row.
        self.ddtree_mrope_delta: torch.Tensor | None = None
        # The persistent tensors every step's tree lives in (created at model
        # load, once the target's layers are known), the info attached while a
        # full CUDA graph of a tree batch is captured, the GDN layers' records
        # per captured graph size, whether cut trees are padded back to the
        # budget (uniform batches), and the padded requests' usable nodes.
        self.ddtree_buffers: TreeStepBuffers | None = None
        self.ddtree_capture = None
        self.ddtree_graph_gdn: dict[int, tuple] = {}
        self.ddtree_pad: bool | None = None
        self.ddtree_valid: dict[str, int] | None = None
        self.ddtree_guarded = False  # this step's tree path is checked after sampling
        self.ddtree_expected: frozenset[str] = frozenset()  # ... in these layers
        # Tensor parallelism: rank 0's policy decisions, and the check that
        # every rank walked the same paths (vllm_ddtree/parallel.py).
        self.ddtree_tp = TPAgreement.for_runner(self.device)
        # Each request's tree of the last drafts on the host (parents of its
        # drafts), and this step's scheduled drafts: the node histories.
        self.ddtree_host_parents: dict[str, list[int]] = {}
        self.ddtree_no_drafts = False  # the last step was plain and drafted nothing
        # The drafts taken for the last step's output (patches/step_drafts.py),
        # returned again if the engine asks for them in a call of its own.
        self.ddtree_sent_drafts: tuple | None = None
        # This step's drafting decision when made before the forward (a step
        # without drafts), and whether the step runs as a plain engine's.
        self.ddtree_decision: tuple | None = None
        self.ddtree_plain_run = False
        self.ddtree_rates_seen = -1  # the tuner's closed trials when its rates were last exported
        self.ddtree_scheduled: dict[str, list[int]] = {}
        logger.info("DDTree: tree budget %d%s, drafter depth %d (block size %d)",
                    self.ddtree.budget, " (adaptive: at most)" if self.ddtree.adaptive
                    else " (fixed)", self.ddtree.depth, self.ddtree.block_size)

    # ------------------------------------------------------------------ start-up guards
    def load_model(self, *args, **kwargs):
        super().load_model(*args, **kwargs)
        _release_gemm_handles()
        if self.ddtree is not None:
            check_tree_capable_layers(self.vllm_config, self.drafter.target_attn_layers)
            self.ddtree_gdn_layers = check_tree_capable_gdn_layers(self.vllm_config)
            self.ddtree_buffers = TreeStepBuffers(
                self.max_num_tokens, self.scheduler_config.max_num_seqs, self.ddtree.budget,
                self.drafter.target_attn_layers | self.ddtree_gdn_layers, self.device)

    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs):
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
        _release_gemm_handles()
        if self.ddtree is not None:
            self.ddtree_kv_groups = target_kv_cache_groups(
                kv_cache_config, self.drafter.target_attn_layers)
            if self.ddtree_gdn_layers:
                log_gdn_state_memory(kv_cache_config, self.ddtree_gdn_layers,
                                     self.ddtree.budget, self.scheduler_config.max_num_seqs)
            if self.device.type == "cpu":  # compiled already; no graphs to capture
                self._ddtree_start_policy()

    def capture_model(self, *args, **kwargs):  # CUDA: after the graphs exist
        out = super().capture_model(*args, **kwargs)
        self._ddtree_start_policy()
        return out

    # ------------------------------------------------------------------ the round
    def execute_model(self, scheduler_output, *args, **kwargs):
        _release_gemm_handles()
        if self.ddtree is not None:
            self.ddtree_decision = None
            self.ddtree_sent_drafts = None
            pending = self.ddtree_pending_context
            pending.tick()
            if pending:
                # Blocks that change hands at this step, before anything of
                # it writes one: pending rows in them are dead from now on.
                self._ddtree_settle_pending_context(scheduler_output)
        if self.ddtree is not None and self.ddtree.adaptive:
            self._ddtree_step_clock(scheduler_output)
        if (self.ddtree is not None and self.ddtree_policy is not None
                and self.use_aux_hidden_state_outputs
                and scheduler_output.total_num_scheduled_tokens
                and not scheduler_output.scheduled_spec_decode_tokens):
            # A step without drafts: the drafting decision now (nothing the
            # step does moves it), and in plain mode the step runs as a plain
            # engine's (no speculative metadata, no drafting hooks), its
            # tokens kept for the drafter's context after sampling.
            self.ddtree_decision = self._ddtree_decide(
                len(scheduler_output.num_scheduled_tokens))
            if not self.ddtree_decision[1]:
                self.ddtree_plain_run = True
                return self._ddtree_as_plain(super().execute_model, scheduler_output,
                                             *args, **kwargs)
        return super().execute_model(scheduler_output, *args, **kwargs)

    def _ddtree_as_plain(self, fn, *args, **kwargs):
        """``fn`` (a step's phase) with vLLM's speculative configuration set
        aside: the path a plain engine takes."""
        spec, self.speculative_config = self.speculative_config, None
        try:
            return fn(*args, **kwargs)
        finally:
            self.speculative_config = spec

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        if self.ddtree is not None and not scheduler_output.scheduled_spec_decode_tokens:
            # No request verifies drafts (a plain step): prepared as a plain
            # engine prepares it, without vLLM's zero-draft spec metadata, so
            # that plain steps cost what plain decoding costs.
            out = self._ddtree_as_plain(super()._prepare_inputs, scheduler_output,
                                        num_scheduled_tokens)
            # GDN layers: no row is speculative, so vLLM's metadata builder
            # (which reads these with spec decoding configured) sends every row
            # down its plain path. That path reads the state DDTree's commit
            # leaves: the recurrent state in state column 0 and the conv
            # window in the first W - 1 conv columns (_update_states_after_model_execute).
            self.num_decode_draft_tokens.np.fill(-1)
            self._ddtree_flush_stats()
            self.ddtree_trees = self.ddtree_round = self.ddtree_gdn_step = None
            self.ddtree_valid = None
            self.ddtree_scheduled = {}
            self.ddtree_expected = frozenset()
            return out
        else:
            out = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        if self.ddtree is None:
            return out
        self._ddtree_flush_stats()
        trees, self.ddtree_trees = self.ddtree_trees, None
        pruned = getattr(scheduler_output, "ddtree_pruned", None)
        if pruned and trees is not None:
            # The grammar check dropped nodes of these trees (patches/structured_output.py).
            where = {rid: i for i, rid in enumerate(trees.req_ids)}
            rows = {where[rid]: kp for rid, kp in pruned.items() if rid in where}
            trees = ProposedTrees(trees.req_ids, keep_nodes(trees.tree, rows))
            for rid, (_, par) in pruned.items():
                self.ddtree_host_parents[rid] = list(par)
        self.ddtree_scheduled = scheduler_output.scheduled_spec_decode_tokens
        total = scheduler_output.total_num_scheduled_tokens
        num_reqs = self.input_batch.num_reqs
        self.ddtree_round = TreeRound.plan(
            req_ids=self.input_batch.req_ids[:num_reqs],
            scheduled=scheduler_output.scheduled_spec_decode_tokens,
            trees=trees, budget=self.ddtree.budget, depth=self.ddtree.depth,
            positions=self.positions[:total], req_indices=self.req_indices.gpu[:total],
            query_pos=self.query_pos.gpu[:total],
            query_start=self.query_start_loc.gpu[:num_reqs],
            with_expected=self.ddtree_stats is not None,
            with_logq=self.ddtree_policy is not None, check_drafts=self.ddtree_debug,
            buffers=self.ddtree_buffers, valid=self.ddtree_valid)
        self.ddtree_valid = None
        rnd = self.ddtree_round
        if self.ddtree_gdn_layers and (self.num_decode_draft_tokens.np[:num_reqs] >= 0).any():
            # vLLM verifies every decode row of a speculative engine on the GDN
            # layers' speculative path, with or without drafts; all of them take
            # the tree path, whose buffer layout the next step expects (vLLM
            # CPU's chain path leaves rows with fewer than S drafts misaligned).
            # Each token row's parent within its request (-1: the root); drafts
            # that are not a tree of ours are chains.
            # (in the persistent buffer a captured CUDA graph reads)
            parent = self.ddtree_buffers.parent[:total]
            if rnd is None:
                parent.fill_(-1)
            else:
                parents = F.pad(rnd.parents, (1, 0), value=-1)
                node = self.query_pos.gpu[:total].long().clamp(max=rnd.budget)
                parent.copy_(parents[self.req_indices.gpu[:total].long(), node])
            self.ddtree_gdn_step = GDNTreeStep(parent, self.ddtree_buffers)
        # the layers whose tree path the step's guard expects
        expected = set()
        if rnd is not None and rnd.any_tree:
            expected |= self.drafter.target_attn_layers
        if self.ddtree_gdn_step is not None:
            expected |= self.ddtree_gdn_layers
        if expected:
            self.ddtree_buffers.begin_step()
        self.ddtree_expected = frozenset(expected)
        if rnd is not None and rnd.any_tree and self.uses_mrope:
            # Text tokens carry the same position in every M-RoPE row, and a
            # tree node's position is p0 + depth in each of them.
            delta = self.positions[:total] - rnd.seq_positions
            self.mrope_positions.gpu[:, :total] += delta
            self.ddtree_mrope_delta = delta
        return out

    def _preprocess(self, scheduler_output, *args, **kwargs):
        if self.ddtree is not None and not scheduler_output.scheduled_spec_decode_tokens:
            # A plain step has no draft placeholders among its input ids:
            # without vLLM's clamp for them, as a plain engine runs it.
            return self._ddtree_as_plain(super()._preprocess, scheduler_output,
                                         *args, **kwargs)
        return super()._preprocess(scheduler_output, *args, **kwargs)

    def _build_attention_metadata(self, *args, **kwargs):
        attn_metadata, spec_cad = super()._build_attention_metadata(*args, **kwargs)
        if self.ddtree is None:
            return attn_metadata, spec_cad
        if self.ddtree_capture is not None:  # a full CUDA graph of a tree batch
            attach_info(attn_metadata, self.drafter.target_attn_layers, self.ddtree_capture)
        elif self.ddtree_round is not None:
            self.ddtree_round.attach(attn_metadata, self.drafter.target_attn_layers)
        return attn_metadata, spec_cad

    def _model_forward(self, *args, **kwargs):
        rnd = self.ddtree_round if self.ddtree is not None else None
        step = self.ddtree_gdn_step if self.ddtree is not None else None
        if rnd is None and step is None:
            return super()._model_forward(*args, **kwargs)
        replay = full_graph_replay()
        if replay is not None:
            # No Python runs inside the graph: the layers' cache records and
            # GDN records are those of the capture, and the device-side guard
            # is checked after sampling (sample_tokens).
            out = super()._model_forward(*args, **kwargs)
            if rnd is not None and rnd.any_tree:
                rnd.replayed(self.drafter.target_attn_layers)
            if step is not None:
                step.replayed(*self._ddtree_graph_gdn_records(replay))
            self._ddtree_guard_step(rnd, step)
            return out
        with (rnd.capturing(self.drafter.target_attn_layers) if rnd is not None
              else nullcontext()), tree_step(step):
            out = super()._model_forward(*args, **kwargs)
        if step is not None:
            missing = sorted(self.ddtree_gdn_layers - step.layers.keys())
            if missing:
                raise DDTreeSeamError(
                    f"DDTree: Gated DeltaNet layers did not run the tree path in a tree "
                    f"verification step ({', '.join(missing[:4])}"
                    f"{f' and {len(missing) - 4} more' if len(missing) > 4 else ''}); their "
                    f"states would follow a chain instead of each node's parent. Use method "
                    f"'dflash' for this model.")
        self._ddtree_guard_step(rnd, step)
        return out

    def _ddtree_guard_step(self, rnd, step) -> None:
        """After a tree step's forward: start reading back the layers' guard
        slots (checked in ``sample_tokens``, when the step's results are on
        the host)."""
        if self.ddtree_expected:
            self.ddtree_buffers.fetch_seen()
            self.ddtree_guarded = True

    def sample_tokens(self, *args, **kwargs):
        ran = self.execute_model_state is not None  # a forward to sample from
        state = None
        if self.ddtree is not None and self.ddtree_plain_run:
            self.ddtree_plain_run = False
            state = self.execute_model_state
        if state is None:
            out = super().sample_tokens(*args, **kwargs)
        else:  # a plain step in plain mode (execute_model)
            out = self._ddtree_as_plain(super().sample_tokens, *args, **kwargs)
            self._ddtree_plain_step(state.scheduler_output, state.aux_hidden_states)
        if self.ddtree is not None and self.ddtree_step is not None:
            sampled = getattr(out, "sampled_token_ids", None)
            if sampled is not None:  # the tokens this step committed
                emitted = sum(len(t) for t in sampled)
                self.ddtree_step["emitted"] = emitted
                past = self.ddtree_step.pop("past", None)
                if past is not None:
                    self.ddtree_step["shadow"] = {
                        b: emitted - n for b, n in zip(self.ddtree_shadow_budgets, past.tolist())}
        if self.ddtree is not None and self.ddtree_tp is not None:
            self.ddtree_tp.verify()
        if self.ddtree is not None and self.ddtree_guarded:
            self.ddtree_guarded = False
            unseen = self.ddtree_buffers.unseen_layers(self.ddtree_expected)
            if unseen:
                raise DDTreeSeamError(
                    f"DDTree: {len(unseen)} target layers did not run the tree path in the "
                    f"last verification step ({', '.join(unseen[:4])}"
                    f"{' ...' if len(unseen) > 4 else ''}): a CUDA graph captured without "
                    f"it, or a stock attention or GDN path. Its tokens were not returned. "
                    f"Serve with --enforce-eager to find the layer, or use method 'dflash'.")
        if (self.ddtree is not None and ran and type(out) is ModelRunnerOutput
                and out is not EMPTY_MODEL_RUNNER_OUTPUT):
            self._ddtree_send_drafts(out)
        return out

    def _ddtree_send_drafts(self, out: ModelRunnerOutput) -> None:
        """The step's drafts ride on its output (``ddtree_drafts``; None: no
        drafts), so that the engine core takes them from there
        (``patches/step_drafts.py``) rather than asking the worker for them in
        a second call per step: a round trip between the engine core and
        worker processes in a server, which cost 0.8-1.6 ms of a 6-7 ms step
        at 16 requests on two cores. The drafts are taken here (the decision
        is counted once) and kept: a call of the engine's own until the next
        step gets the same drafts."""
        drafts = self._ddtree_take_drafts()
        out.ddtree_drafts = drafts
        self.ddtree_sent_drafts = (drafts,)

    # ------------------------------------------------------------------ full CUDA graphs
    def _dummy_run(self, num_tokens, *args, **kwargs):
        if self.ddtree is None or not self._ddtree_captures_tree(num_tokens, *args, **kwargs):
            return super()._dummy_run(num_tokens, *args, **kwargs)
        # A full CUDA graph of a uniform tree batch: capture it with the tree
        # path (the persistent buffers attached, every GDN layer on its tree
        # kernels) and prove every target layer took it.
        buffers = self.ddtree_buffers
        width = 1 + self.ddtree.budget
        self.ddtree_capture = buffers.info(num_tokens, max(1, num_tokens // width), (), width)
        gdn_step = None
        if self.ddtree_gdn_layers:
            gdn_step = GDNTreeStep(buffers.parent[:num_tokens], buffers)
        kv_capture.start(self.drafter.target_attn_layers)
        try:
            with tree_step(gdn_step):
                out = super()._dummy_run(num_tokens, *args, **kwargs)
        finally:
            kv_capture.stop()
            self.ddtree_capture = None
        missing = kv_capture.missing_layers()
        if gdn_step is not None:
            gdn_missing = sorted(self.ddtree_gdn_layers - gdn_step.layers.keys())
            if gdn_missing:
                missing["gdn_tree"] = gdn_missing
            self.ddtree_graph_gdn[num_tokens] = (dict(gdn_step.layers), gdn_step.width)
        if missing:
            raise DDTreeSeamError(
                f"DDTree: a full CUDA graph of {num_tokens} tokens was captured without the "
                f"tree path in some target layers ({missing}); replaying it would ignore the "
                f"tree. Use --enforce-eager or method 'dflash'.")
        return out

    def _ddtree_captures_tree(self, num_tokens, *args, **kwargs) -> bool:
        """Whether this ``_dummy_run`` captures (or warms up) a full CUDA graph
        of a uniform verification batch."""
        try:
            bound = _DUMMY_RUN_SIG.bind(self, num_tokens, *args, **kwargs).arguments
        except TypeError:
            return False
        mode = bound.get("cudagraph_runtime_mode")
        return bool(bound.get("uniform_decode")) and getattr(mode, "name", "") == "FULL"

    def _ddtree_graph_gdn_records(self, num_tokens: int):
        rec = self.ddtree_graph_gdn.get(num_tokens)
        if rec is None:
            raise DDTreeSeamError(
                f"DDTree: a full CUDA graph of {num_tokens} tokens was replayed, but no "
                f"Gated DeltaNet tree path was captured for that size. Use --enforce-eager "
                f"or method 'dflash'.")
        return rec

    def _sample(self, logits, spec_decode_metadata):
        rnd = self.ddtree_round if self.ddtree is not None else None
        if self.ddtree is not None and _no_drafts(spec_decode_metadata):
            # A step without drafts (vLLM builds its spec metadata with zero
            # drafts per row in a speculative engine): vLLM's plain sampler,
            # as a plain engine samples. Its GDN rows were roots: nothing to commit.
            self.ddtree_gdn_step = None
            return super()._sample(logits, None)
        if rnd is None or spec_decode_metadata is None:
            return super()._sample(logits, spec_decode_metadata)
        md = spec_decode_metadata
        sampling = self.input_batch.sampling_metadata
        num_reqs = len(rnd.req_ids)
        processed = logits
        if needs_processing(sampling):
            processed = process_nodes(logits.to(torch.float32, copy=True), sampling,
                                      self._ddtree_node_rows(rnd, md.draft_token_ids))
        min_p = min_p_per_request(sampling, num_reqs)
        tokens = rnd.verify(processed, md.draft_token_ids, md.num_draft_tokens, sampling,
                            min_p)
        if self.ddtree_tp is not None:
            self.ddtree_tp.check_walk(tokens, rnd.num_accepted)
        for group, layers in self.ddtree_kv_groups.items():
            rnd.compact(self.input_batch.block_table[group].slot_mapping.gpu, layers)
        step, self.ddtree_gdn_step = self.ddtree_gdn_step, None
        if step is not None:
            step.commit(rnd.path, rnd.num_accepted)
        if self.ddtree_step is not None and self.ddtree_shadow_budgets:
            # what smaller budgets would have committed on these draws (the tuner's
            # shadow comparisons); read back with the sampled tokens
            self.ddtree_step["past"] = rnd.accepted_past(self.ddtree_shadow_cut)
        if self.ddtree_policy is not None and self._ddtree_calibrates():
            outcomes = rnd.node_outcomes()
            if outcomes is not None:
                self.ddtree_policy.calibration.observe(*outcomes)
        if self.ddtree_stats is not None:
            counts = rnd.counts()
            self.ddtree_unrecorded = None if counts is None else counts.totals()
        out = tokens[:, : md.max_spec_len + 1]
        logprobs = None
        if sampling.max_num_logprobs is not None:
            logprobs = self._ddtree_logprobs(rnd, logits, processed, out, sampling, min_p)
        return SamplerOutput(sampled_token_ids=out.to(torch.int32), logprobs_tensors=logprobs)

    def _ddtree_calibrates(self) -> bool:
        """Whether this step's walk teaches the model arm's calibration (see
        ``ddtree_model_tree``)."""
        if self.ddtree_model_tree or self.ddtree_tuner is None:
            return True
        self.ddtree_uncalibrated += 1
        if self.ddtree_uncalibrated < CALIBRATE_EVERY:
            return False
        self.ddtree_uncalibrated = 0
        return True

    def _ddtree_node_rows(self, rnd, draft_token_ids) -> NodeRows:
        """The step's logits rows with each node's tree (host and device)."""
        parents, tokens = [], []
        from_drafter = set(rnd.tree_rows)
        for r, (rid, n) in enumerate(zip(rnd.req_ids, rnd.node_counts)):
            tokens.append(list(self.ddtree_scheduled.get(rid, ()))[:n])
            if r not in from_drafter:
                parents.append(chain_parents(n))
                continue
            par = self.ddtree_host_parents.get(rid)
            if par is None or len(par) < n:
                raise DDTreeSeamError(f"DDTree: no tree on the host for the {n} scheduled "
                                      f"drafts of request {rid}")
            parents.append(list(par[:n]))
        req_of_row, node_of_row = row_index(rnd.node_counts, self.device)
        max_depth = max(max(node_depths(p)) for p in parents)
        return NodeRows(rnd.node_counts, rnd.logit_starts, req_of_row, node_of_row, parents,
                        tokens, rnd.node_tokens(draft_token_ids), rnd.parents, max_depth)

    def _ddtree_logprobs(self, rnd, raw, processed, out, sampling, min_p):
        """Logprobs of every output token, from the row it was sampled at,
        as vLLM's ``logprobs_mode`` asks (raw: the target's logits; processed:
        after the request's transformations, temperature, min-p, top-k and
        top-p, as vLLM's sampler reports them)."""
        rows = rnd.output_rows()[:, : out.shape[1]]
        mode = self.model_config.logprobs_mode
        if mode.startswith("raw"):
            source = raw
        else:
            source = processed.index_select(0, rows.reshape(-1)).float()
            rows = torch.arange(source.shape[0], device=source.device).view_as(rows)
            if not sampling.all_greedy:
                num_reqs, width = out.shape
                per = torch.arange(num_reqs, device=source.device).repeat_interleave(width)

                def sel(t):
                    return None if t is None else t[:num_reqs][per]
                source = process_logits(source[:, None, :], sel(sampling.temperature),
                                        sel(sampling.top_k), sel(sampling.top_p),
                                        sel(min_p))[:, 0]
        return logprobs_of_outputs(source, rows, out, sampling.max_num_logprobs,
                                   as_logits=mode.endswith("logits"))

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata,
                                hidden_states, sample_hidden_states, aux_hidden_states,
                                spec_decode_metadata, common_attn_metadata, slot_mappings):
        rnd = self.ddtree_round if self.ddtree is not None else None
        if rnd is not None:
            rnd.condition(aux_hidden_states, self.positions)
            delta, self.ddtree_mrope_delta = self.ddtree_mrope_delta, None
            if delta is not None:
                self.mrope_positions.gpu[:, : delta.shape[0]] -= delta
        policy = self.ddtree_policy if self.ddtree is not None else None
        num_reqs = self.input_batch.num_reqs
        decision = None
        if self.ddtree is not None:
            decision, self.ddtree_decision = self.ddtree_decision, None
        arm, drafting = decision if decision is not None else self._ddtree_decide(num_reqs)
        if not drafting and _no_drafts(spec_decode_metadata) and aux_hidden_states:
            # A plain step in plain mode: every scheduled token is context.
            self._ddtree_plain_step(scheduler_output, aux_hidden_states)
            # No drafts as lists (vLLM's path for host-side proposers): nothing
            # to copy to the host and turn into num_reqs x budget Python ints.
            return [[] for _ in range(num_reqs)]
        if self.ddtree is not None:
            self._ddtree_store_pending_context()
        if not drafting:  # the step verified drafts: the stock path drops rejected rows
            self.drafter.skip_block = True
            policy.skipped()
        if (drafting and arm is not None and arm.kind == "fixed" and self.ddtree_tp is None
                and not self._ddtree_pads()):
            # a fixed arm verifies at most its budget's nodes: build only those
            # (the first nodes of the full tree), as an engine of that budget does
            self.drafter.build_budget = arm.budget
        clock = _Stopwatch(self.device) if policy is not None and drafting else None
        drafts = super().propose_draft_token_ids(
            scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
            sample_hidden_states, aux_hidden_states, spec_decode_metadata,
            common_attn_metadata, slot_mappings)
        if self.ddtree is not None:
            self.drafter.skip_block = False
            self.ddtree_round = None  # the round ends here
            tree = self.drafter.take_tree()
            self.ddtree_budgets = None
            if tree is not None:
                self.ddtree_trees = ProposedTrees(list(self.input_batch.req_ids[:num_reqs]),
                                                  tree)
                if policy is not None:
                    # Requests still prefilling get no nodes (their drafts are dropped).
                    prefilling = self.discard_request_mask.gpu[:num_reqs]
                    valid = tree.valid & ~prefilling.bool()[:, None]
                    self.ddtree_model_tree = arm is None or arm.kind == "model"
                    if self.ddtree_model_tree:
                        self.ddtree_budgets = policy.choose(tree.logq, valid).budgets
                    else:  # a fixed arm: each request's best `budget` nodes
                        self.ddtree_budgets = valid.sum(1).clamp(max=arm.budget)
                    if self.ddtree_tp is not None:
                        self.ddtree_budgets = self.ddtree_tp.budgets(self.ddtree_budgets)
            elif policy is not None:
                self.ddtree_budgets = torch.zeros(num_reqs, dtype=torch.long)
            if self.ddtree_step is not None:
                if clock is not None:
                    self.ddtree_step["draft"] = clock.stop()
                self.ddtree_step["end"] = time.perf_counter()
            self._ddtree_flush_stats()
        return drafts

    def _ddtree_decide(self, num_reqs: int):
        """This step's drafting decision, once per step: the rate tuner's arm
        (None without one) and whether the drafter drafts after the step."""
        policy = self.ddtree_policy if self.ddtree is not None else None
        arm = (self.ddtree_tuner.arm(num_reqs)
               if policy is not None and self.ddtree_tuner is not None else None)
        if arm is not None and self.ddtree_stats is not None:
            tuner, rates = self.ddtree_tuner, None
            if tuner.closed != self.ddtree_rates_seen:  # a trial closed: new rates
                self.ddtree_rates_seen = tuner.closed
                last = tuner.last_measured()
                measured = last[1] if last is not None else {}
                rates = [measured.get(a.name, 0.0) for a in tuner.arms]
            self.ddtree_stats.add_arm(tuner.arms.index(arm), rates)
        if arm is not None and arm.kind != "model":
            drafting = arm.drafts
        else:
            drafting = policy is None or policy.should_draft(num_reqs)
        if policy is not None and self.ddtree_tp is not None:
            drafting = self.ddtree_tp.mode(drafting)
        return arm, drafting

    def _ddtree_plain_step(self, scheduler_output, aux_hidden_states) -> None:
        """Plain mode after a plain step: keep the step's tokens for the
        drafter's context K/V (stored in one batched call when drafting
        resumes, ``_ddtree_store_pending_context``) and mark the step as one
        that drafted nothing (``take_draft_token_ids``), without the rest of
        the drafting machinery."""
        n = scheduler_output.total_num_scheduled_tokens
        slots = self.input_batch.block_table[self.drafter.kv_cache_gid].slot_mapping.gpu
        pending = self.ddtree_pending_context
        if not pending.block_size:
            pending.block_size = self.input_batch.block_table[self.drafter.kv_cache_gid].block_size
        if self._ddtree_keeps_outputs(aux_hidden_states):
            # no tensor op: a few of them cost as much as the rest of a
            # plain step's bookkeeping (the rows are joined when stored)
            pending.add(tuple(h if h.shape[0] == n else h[:n] for h in aux_hidden_states),
                        self._ddtree_host(self.positions)[:n].copy(),
                        self._ddtree_host(slots)[:n].copy())
        else:
            pending.add(torch.cat([h[:n] for h in aux_hidden_states], dim=-1),
                        self.positions[:n].clone(), slots[:n].clone())
        cap = self._ddtree_pending_cap(aux_hidden_states)
        if pending.held_rows >= cap:
            pending.compact()  # the dead rows let go; stored once the live ones fill half
            if pending.held_rows >= cap // 2:
                self._ddtree_store_pending_context()
        self.ddtree_policy.skipped()
        self.ddtree_round = None
        self.ddtree_trees = None
        self.ddtree_budgets = None
        self.ddtree_no_drafts = True
        if self.ddtree_step is not None:
            self.ddtree_step["end"] = time.perf_counter()
        self._ddtree_flush_stats()

    def _ddtree_keeps_outputs(self, aux_hidden_states) -> bool:
        """Whether a plain step may keep the forward's auxiliary outputs by
        reference. Only on CPU, and only if the forward returns new tensors
        every step: the first plain step copies its rows and holds on to the
        forward's output; the second compares its own with it (an output
        buffer the forward reused would be the same memory, which nothing
        else can hold while it is referenced). CUDA graphs replay into fixed
        outputs: copied there."""
        if self.ddtree_aux_refs is not None:
            return self.ddtree_aux_refs
        if self.device.type != "cpu":
            self.ddtree_aux_refs = False
            return False
        probe, self.ddtree_aux_probe = self.ddtree_aux_probe, aux_hidden_states[0]
        if probe is None:
            return False
        self.ddtree_aux_probe = None
        self.ddtree_aux_refs = (aux_hidden_states[0].untyped_storage().data_ptr()
                                != probe.untyped_storage().data_ptr())
        return self.ddtree_aux_refs

    def _ddtree_host(self, t: torch.Tensor) -> np.ndarray:
        """A numpy view of a persistent CPU buffer (made once)."""
        view = self.ddtree_host_views.get(id(t))
        if view is None or view[0] is not t:
            view = self.ddtree_host_views[id(t)] = (t, t.numpy())
        return view[1]

    def _ddtree_settle_pending_context(self, scheduler_output) -> None:
        """Renew (``PendingContext.renew``) the blocks that change hands at
        this step: the blocks the scheduler hands out fresh (to a new or
        resumed request, or appended to a running one; in every KV-cache
        group, since on a hybrid target the groups share one memory pool and
        a drafter row stored into a block that became a Gated DeltaNet state
        block would overwrite that state), and the blocks that finished or
        preempted requests gave back whose drafter context nobody reads
        again: all of them without prefix caching, else those past the
        request's full ones (vLLM caches full blocks only; a later request
        may hit one and read its drafter context, which its pending rows
        still hold). A block a new request hits in the drafter's group keeps
        its rows. At high load, where the adaptive budget runs plain, most
        requests finish without drafting again, and storing their context
        was most of what plain mode cost over plain decoding; this costs the
        blocks that change hands, not the rows pending."""
        gid = self.drafter.kv_cache_gid
        table = self.input_batch.block_table[gid]
        if table.dcp_world_size != 1:  # blocks split across ranks: the safe way
            self._ddtree_store_pending_context()
            return
        # Blocks a request starts with up to its computed tokens are hits
        # (with a KV connector, tokens loaded from outside count as computed
        # but their blocks are fresh: none taken as hits then).
        hits = (bool(self.cache_config.enable_prefix_caching)
                and self.vllm_config.kv_transfer_config is None)
        size = table.block_size
        renewed = []

        def handed_out(block_ids, computed: int) -> None:
            for g, ids in enumerate(block_ids):
                renewed.append(ids[computed // size:] if hits and g == gid else ids)

        for req in scheduler_output.scheduled_new_reqs:
            handed_out(req.block_ids, req.num_computed_tokens)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        for i, block_ids in enumerate(cached.new_block_ids):
            if block_ids is not None:  # appended blocks are fresh; a resumed request's may hit
                handed_out(block_ids, cached.num_computed_tokens[i]
                           if cached.req_ids[i] in resumed else 0)
        batch = self.input_batch
        for rid in set(scheduler_output.finished_req_ids) | set(
                scheduler_output.preempted_req_ids or ()):
            row = batch.req_id_to_index.get(rid)
            if row is None:  # left the batch before: settled then
                continue
            ids = table.block_table.np[row, :table.num_blocks_per_row[row]]
            # every token but the last sampled one has its K/V computed
            full = max(int(batch.num_tokens_no_spec[row]) - 1, 0) // size if hits else 0
            renewed.append(ids[full:])
        if renewed:
            self.ddtree_pending_context.renew(np.concatenate(
                [np.asarray(ids, dtype=np.int64) for ids in renewed]))

    def _ddtree_store_pending_context(self) -> None:
        """The drafter's context K/V of the tokens of plain steps since it last
        ran, in step order, in calls of at most ``PENDING_STORE_ROWS`` rows
        (whole steps), before anything reads the drafter's cache again."""
        for rows in self.ddtree_pending_context.take_chunks(PENDING_STORE_ROWS):
            self.drafter.store_context(*rows)

    def _ddtree_pending_cap(self, aux_hidden_states) -> int:
        """Pending rows held (dead ones included) before the dead ones are
        let go, and the live ones stored if they still fill half of it:
        what ``PENDING_CONTEXT_BYTES`` of hidden states hold, at least
        ``PENDING_CONTEXT_ROWS``. The larger the cap, the more rows die
        unstored (those of blocks that change hands first); the cap bounds
        memory, and the time the first drafting step after a long plain
        stretch spends storing them."""
        if self.ddtree_pending_cap is None:
            row_bytes = sum(h.shape[-1] * h.element_size() for h in aux_hidden_states)
            self.ddtree_pending_cap = max(PENDING_CONTEXT_ROWS,
                                          PENDING_CONTEXT_BYTES // max(row_bytes, 1))
        return self.ddtree_pending_cap

    def _update_states_after_model_execute(self, output_token_ids, scheduler_output):
        if self.ddtree is None or not self.ddtree_gdn_layers:
            return super()._update_states_after_model_execute(output_token_ids,
                                                              scheduler_output)
        # The GDN commit left every request's state in column 0 and its conv
        # window in the first W - 1 columns: the next step reads them there
        # (vLLM's offset num_accepted - 1 = 0), speculative or not.
        num_reqs = output_token_ids.size(0)
        self.num_accepted_tokens.gpu[:num_reqs] = 1
        self.input_batch.num_accepted_tokens_cpu_tensor[:num_reqs] = 1
        self.num_accepted_tokens_event.record()

    def take_draft_token_ids(self):
        if self.ddtree is None:
            return super().take_draft_token_ids()
        sent, self.ddtree_sent_drafts = self.ddtree_sent_drafts, None
        if sent is not None:  # taken for the step's output already
            return sent[0]
        return self._ddtree_take_drafts()

    def _ddtree_take_drafts(self):
        """The last step's drafts (vLLM's ``take_draft_token_ids``) cut to
        each request's budget, with their parents; the decision counted."""
        if self.ddtree_no_drafts:
            # A plain step in plain mode drafted for no request. The scheduler
            # cleared the drafts of every request it scheduled, so it has
            # nothing to update (nor to check against a grammar): plain
            # decoding's engine step, with the decision counted.
            self.ddtree_no_drafts = False
            self.ddtree_host_parents = {}
            self.ddtree_policy.decided(0)
            if self.ddtree_stats is not None:
                self.ddtree_stats.add_choice(0)
            return None
        out = super().take_draft_token_ids()
        budgets, self.ddtree_budgets = self.ddtree_budgets, None
        if out is None:
            return out
        out = self._ddtree_with_parents(out)
        if budgets is None:
            return out
        # The adaptive policy's choice: each request verifies its first
        # budget nodes (a valid tree: flat order puts parents first).
        cut = budgets.tolist()
        cut += [0] * (len(out.draft_token_ids) - len(cut))
        total = sum(cut)
        if total and self._ddtree_pads():
            # Full CUDA graphs replay uniform batches only: keep every tree at
            # the full budget and let the walk accept only the chosen nodes.
            self.ddtree_valid = dict(zip(out.req_ids, cut))
        else:
            for i, drafts in enumerate(out.draft_token_ids):
                del drafts[cut[i]:]
                del out.parents[i][cut[i]:]
        policy = self.ddtree_policy
        policy.decided(total)
        if self.ddtree_stats is not None:
            num_reqs, cost = len(cut), policy.cost
            plain = cost.plain_step(num_reqs)
            draft = cost.draft(num_reqs)
            tree = cost.verify(num_reqs + total) + draft
            per_node = cost.verify(num_reqs + total + 1) - cost.verify(num_reqs + total)
            self.ddtree_stats.add_choice(total, policy.calibration.table,
                                         (plain, tree, draft, per_node))
        return out

    def _ddtree_pads(self) -> bool:
        """Whether trees the adaptive budget cut are padded back to the full
        budget (``VLLM_DDTREE_PAD_TREES``; by default exactly when tree steps
        run under full CUDA graphs, which replay uniform batches only)."""
        if self.ddtree_pad is None:
            flag = os.environ.get(ENV_PAD, "").strip().lower()
            if flag in ("1", "true", "yes", "on"):
                self.ddtree_pad = True
            elif flag in ("0", "false", "no", "off"):
                self.ddtree_pad = False
            elif flag:
                raise ValueError(f"{ENV_PAD} must be 0 or 1, got {flag!r}")
            else:
                from vllm.config import CUDAGraphMode

                mode = self.compilation_config.cudagraph_mode
                self.ddtree_pad = (self.device.type == "cuda"
                                   and not self.model_config.enforce_eager
                                   and mode.decode_mode() == CUDAGraphMode.FULL)
            if self.ddtree_pad:
                logger.info("DDTree: the adaptive budget's cut trees are padded back to %d "
                            "nodes (never accepted past the cut), so that verification "
                            "batches stay uniform for full CUDA graphs", self.ddtree.budget)
        return self.ddtree_pad

    def _ddtree_with_parents(self, out) -> DDTreeDraftTokenIds:
        """The drafts with each request's tree, for the scheduler's grammar
        check and the next step's node histories (host copies of the
        drafter's parents, read after vLLM read the drafts)."""
        trees = self.ddtree_trees
        where = {} if trees is None else {rid: i for i, rid in enumerate(trees.req_ids)}
        host = trees.tree.parents.tolist() if trees is not None else []
        parents = []
        for rid, drafts in zip(out.req_ids, out.draft_token_ids):
            i = where.get(rid)
            parents.append(host[i][: len(drafts)] if i is not None
                           else chain_parents(len(drafts)))
        self.ddtree_host_parents = dict(zip(out.req_ids, parents))
        return DDTreeDraftTokenIds(out.req_ids, out.draft_token_ids, parents)

    # ------------------------------------------------------------------ adaptive budget
    def _ddtree_log_best(self, num_reqs: int) -> None:
        """Log when the incumbent arm (the one the tuner runs) changes at a
        batch size."""
        best = self.ddtree_tuner.best(num_reqs)
        if best is None:
            return
        bucket = bucket_of(num_reqs)
        if self.ddtree_best.get(bucket) == best.name:
            return
        self.ddtree_best[bucket] = best.name
        lo, hi = bucket_range(bucket)
        logger.info("DDTree adaptive budget: at %s requests %s",
                    f"{lo}-{hi}" if hi is not None and hi > lo else f"{lo}" if hi else f"{lo}+",
                    self.ddtree_tuner.describe(num_reqs))

    def _ddtree_start_policy(self) -> None:
        """Create the adaptive policy with its cost model: pinned by
        ``VLLM_DDTREE_COST_MODEL``, or profiled now from dummy forwards."""
        if self.ddtree is None or not self.ddtree.adaptive or self.ddtree_policy is not None:
            return
        max_reqs = self.scheduler_config.max_num_seqs
        max_tokens = max(2, min(self.max_num_tokens, max_reqs * (1 + self.ddtree.budget)))
        pinned = os.environ.get(ENV_COST, "").strip()
        if pinned:
            cost = parse_pinned_cost(pinned, max_tokens, max_reqs)
            logger.info("DDTree adaptive budget: cost model pinned by %s=%s", ENV_COST, pinned)
        else:
            cost = self._ddtree_profile_costs(max_tokens, max_reqs)
        self.ddtree_policy = AdaptivePolicy(self.ddtree.budget, cost, self.device)
        if not pinned:
            self.ddtree_tuner = RateTuner(self.ddtree.budget, **_tuner_overrides())
            # the budgets whose shadow counts every tree step reports
            self.ddtree_shadow_budgets = self.ddtree_tuner.shadow_budgets
            self.ddtree_shadow_cut = torch.tensor(self.ddtree_shadow_budgets, dtype=torch.long,
                                                  device=self.device)

    @torch.inference_mode()
    def _ddtree_profile_costs(self, max_tokens: int, max_reqs: int) -> CostModel:
        """Time dummy target and drafter forwards over ladders of sizes (about
        a second): the cost model's first guess, refined online. Sizes past
        the profiled ones start on the last measured slope."""
        t0 = time.perf_counter()
        width = 1 + self.ddtree.depth

        def timed(fn, n, reps=2):
            out = []
            for _ in range(reps):
                sw = _Stopwatch(self.device)
                fn(n)
                out.append(sw.stop(sync=True))
            return min(out)

        def draft(n):
            self.drafter.dummy_run(n, use_cudagraphs=False)

        def both(n):  # _dummy_run runs the drafter on the same tokens after the target
            self._dummy_run(n, skip_eplb=True)

        both(1)  # warm
        req_ladder, tok_ladder = ladder(max_reqs), ladder(max_tokens)
        reqs = [r for r in req_ladder if r * width <= PROFILE_MAX_TOKENS] or req_ladder[:1]
        toks = [t for t in tok_ladder if t <= PROFILE_MAX_TOKENS] or tok_ladder[:1]
        draft_s = [timed(draft, min(r * width, self.max_num_tokens)) for r in reqs]
        verify_s = [max(timed(both, t) - timed(draft, t), 1e-6) for t in toks]
        cost = CostModel(PiecewiseLinear(tok_ladder, _extend(toks, verify_s, tok_ladder)),
                         PiecewiseLinear(req_ladder, _extend(reqs, draft_s, req_ladder)))
        logger.info(
            "DDTree adaptive budget: profiled the step cost in %.1f s: target %.2f ms at 1 "
            "token, %.2f ms at %d; drafter %.2f ms for 1 request, %.2f ms for %d (refined "
            "online from measured steps)",
            time.perf_counter() - t0, 1e3 * cost.verify(1), 1e3 * cost.verify(toks[-1]),
            toks[-1], 1e3 * cost.draft(1), 1e3 * cost.draft(reqs[-1]), reqs[-1])
        return cost

    def _ddtree_step_clock(self, scheduler_output) -> None:
        """Close the previous step's measurement (runner time plus the
        engine's time between steps, idle gaps excluded) and open this one."""
        if self.ddtree_policy is None:
            self._ddtree_start_policy()
        now = time.perf_counter()
        last, self.ddtree_step = self.ddtree_step, None
        if last is not None and "end" in last:
            # the whole cycle from this step's start to the next one's, idle
            # time left out (core/step_clock.py): the engine's work between
            # steps differs between arms (drafts to schedule and check)
            step_s = last["end"] - last["start"] + self.ddtree_gap.busy(now - last["end"])
            draft_s = last.get("draft", 0.0)
            draft_s = draft_s() if callable(draft_s) else draft_s
            self.ddtree_policy.observe(last["reqs"], last["tokens"], step_s, draft_s)
            tuner = self.ddtree_tuner
            if tuner is not None and "emitted" in last:
                tuner.observe(last["reqs"], last["emitted"], step_s, counted=last["decoding"],
                              verified=last["tokens"], drafted="draft" in last,
                              shadow=last.get("shadow"))
                # a bucket's best arm changes only when a trial closes
                seen = (tuner.closed, bucket_of(last["reqs"]))
                if seen != self.ddtree_best_seen:
                    self.ddtree_best_seen = seen
                    self._ddtree_log_best(last["reqs"])
        if self.ddtree_tuner is not None and scheduler_output.scheduled_new_reqs:
            # new prompts: the trees' rates were measured on other text
            self.ddtree_tuner.admit(len(scheduler_output.scheduled_new_reqs))
        total = scheduler_output.total_num_scheduled_tokens
        if total:
            reqs = len(scheduler_output.num_scheduled_tokens)
            drafts = sum(len(d) for d in scheduler_output.scheduled_spec_decode_tokens.values())
            # every scheduled request decodes (no prefill chunk in the step)
            self.ddtree_step = {"start": now, "tokens": total, "reqs": reqs,
                                "decoding": total == reqs + drafts}

    # ------------------------------------------------------------------ metrics
    def _ddtree_open_stats(self) -> CounterWriter | None:
        """The counter file /metrics reads (one writer per engine; see stats.py)."""
        stats_dir = self.ddtree.stats_dir
        if not stats_dir:
            return None
        from vllm.distributed.parallel_state import get_tp_group

        if get_tp_group().rank_in_group != 0:  # counted once per engine
            return None
        if not os.path.isdir(stats_dir):
            logger.warning("DDTree: stats directory %s is not on this machine; the ddtree "
                           "metrics stay empty", stats_dir)
            return None
        # The engine's data-parallel index (vLLM resets data_parallel_rank to 0
        # in each engine of a dense model; the index keeps the engine's place).
        parallel = self.vllm_config.parallel_config
        index = getattr(parallel, "data_parallel_index", parallel.data_parallel_rank)
        return CounterWriter(stats_file(stats_dir, index))

    def _ddtree_flush_stats(self) -> None:
        """Add the last walked step to the counters (its host copy is taken
        after the drafter has been launched)."""
        c, self.ddtree_unrecorded = self.ddtree_unrecorded, None
        if c is None:
            return
        self.ddtree_stats.add_totals(c.tolist())


PROFILE_MAX_TOKENS = 1024  # largest dummy forward of the start-up profile
CALIBRATE_EVERY = 4  # a fixed arm's walks per lesson of the model arm's calibration
# Plain steps' rows kept for the drafter's context before they are stored
# anyway: as many as this many bytes of hidden states hold (8192 rows of an
# 8B-class target's three 4096-wide bf16 layers), at least the row count.
PENDING_CONTEXT_BYTES = 192 << 20
PENDING_CONTEXT_ROWS = 8192
# Pending rows stored per call (whole plain steps): joining and storing
# tens of thousands at once costs more per row.
PENDING_STORE_ROWS = 8192


def _tuner_overrides() -> dict:
    """The rate tuner's trial length from ``VLLM_DDTREE_TRIAL_SECONDS``, if set."""
    text = os.environ.get(ENV_TRIAL, "").strip()
    if not text:
        return {}
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{ENV_TRIAL} must be a number of seconds > 0 (the adaptive "
                         f"budget's trial length; default 0.3), got {text!r}")
    return {"trial_seconds": seconds}


def _no_drafts(spec_decode_metadata) -> bool:
    """Whether a step verifies no draft token (vLLM builds spec metadata with
    zero drafts per row in a speculative engine)."""
    return spec_decode_metadata is None or spec_decode_metadata.max_spec_len == 0
_DUMMY_RUN_SIG = inspect.signature(GPUModelRunner._dummy_run)


def _release_gemm_handles() -> None:
    """vLLM CPU's oneDNN handles finalized since the last call (queued by
    patches/cpu_gemm_handler_del.py, where no tensor op may run)."""
    if _gemm_del.PENDING_HANDLES:
        _gemm_del.release_pending()


def full_graph_replay() -> int | None:
    """The padded token count when the running forward is a replayed full
    CUDA graph (no Python runs inside it), else None."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    ctx = get_forward_context()
    if ctx.cudagraph_runtime_mode != CUDAGraphMode.FULL or ctx.batch_descriptor is None:
        return None
    return ctx.batch_descriptor.num_tokens


def _extend(xs: list[int], ys: list[float], knots: list[int]) -> list[float]:
    """``ys`` measured at the first knots ``xs``; the rest on the last slope."""
    out = list(ys)
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else 0.0
    for k in knots[len(xs):]:
        out.append(ys[-1] + max(slope, 0.0) * (k - xs[-1]))
    return out


class _Stopwatch:
    """Elapsed seconds of device work: CUDA events on a GPU (read once the
    work is done), the wall clock elsewhere (the CPU backend is synchronous)."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.start = time.perf_counter()

    def stop(self, sync: bool = False):
        """Seconds (a float), or on a GPU without ``sync`` a callable that
        returns them once the recorded work has finished."""
        if not self.cuda:
            return time.perf_counter() - self.start
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        if sync:
            end.synchronize()
            return self.start.elapsed_time(end) / 1e3
        return lambda: self.start.elapsed_time(end) / 1e3 if end.query() else 0.0


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


def check_tree_capable_gdn_layers(vllm_config) -> frozenset[str]:
    """The target's Gated DeltaNet layers (empty for attention-only targets).
    Refuse to start unless every non-attention layer is one whose speculative
    path DDTree replaces, and that replacement is installed."""
    from vllm.model_executor.layers.mamba.abstract import MambaBase
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        QwenGatedDeltaNetAttention,
    )
    from vllm.platforms import current_platform

    from vllm_ddtree.patches import gdn_tree, gdn_tree_cuda

    layers = get_layers_from_vllm_config(vllm_config, MambaBase)
    if not layers:
        return frozenset()
    other = [f"{name} ({type(layer).__name__})" for name, layer in layers.items()
             if not isinstance(layer, QwenGatedDeltaNetAttention)]
    if other:
        raise DDTreeSeamError(
            f"DDTree verifies trees on Qwen Gated DeltaNet layers only; this target also has "
            f"{', '.join(other[:3])}. Use method 'dflash' for this model.")
    if current_platform.is_cpu():
        patch, applied = "cpu-gdn-tree", gdn_tree.applied()
    else:
        patch, applied = "cuda-gdn-tree-*", gdn_tree_cuda.applied()
        for name, layer in layers.items():
            # vLLM's fused CUDA spec-decode kernel verifies chains and bypasses
            # the calls the tree path replaces: keep these layers on the Triton path.
            if getattr(layer, "enable_fused_gdn_spec_decode", False):
                layer.enable_fused_gdn_spec_decode = False
                logger.info_once("DDTree: Gated DeltaNet layers verify trees with the "
                                 "parent-aware Triton kernels (vLLM's fused chain kernel is "
                                 "off for them)")
    if not applied:
        raise DDTreeSeamError(
            f"DDTree's Gated DeltaNet tree path (patch {patch}) is not installed in this "
            "process, so GDN layers would verify chains. Check that the vllm_ddtree plugin "
            "loads (VLLM_PLUGINS), or use method 'dflash'.")
    return frozenset(layers)


def log_gdn_state_memory(kv_cache_config, gdn_layers: frozenset[str], budget: int,
                         max_num_seqs: int) -> None:
    """Log what one request's GDN states take at this budget (``1 + budget``
    state blocks per GDN layer, as vLLM allocates them), and warn when the
    KV cache cannot hold ``max_num_seqs`` requests at once because of them."""
    per_layer, gdn_groups = {}, 0
    groups = kv_cache_config.kv_cache_groups
    for grp in groups:
        names = gdn_layers.intersection(grp.layer_names)
        gdn_groups += bool(names)
        for name in names:
            per_layer[name] = grp.kv_cache_spec.page_size_bytes
    total = sum(per_layer.values()) * (1 + budget)
    logger.info("DDTree: %d Gated DeltaNet layers x %d state slots (budget %d + 1) take "
                "%.1f MiB per request", len(per_layer), 1 + budget, budget, total / 2**20)
    # every group draws its blocks from one pool; a request holds 1 + budget
    # blocks in each GDN group and at least one in every other group
    blocks = gdn_groups * (1 + budget) + len(groups) - gdn_groups
    most = kv_cache_config.num_blocks // max(blocks, 1)
    if gdn_groups and most < max_num_seqs:
        logger.warning(
            "DDTree: with %d state slots per Gated DeltaNet layer (budget %d + 1), the KV "
            "cache holds at most %d requests at once (max_num_seqs=%d), in plain steps as "
            "well. A smaller num_speculative_tokens or more KV-cache memory lets more "
            "requests decode together.", 1 + budget, budget, most, max_num_seqs)


def target_kv_cache_groups(kv_cache_config,
                           target_layers: frozenset[str]) -> dict[int, frozenset[str]]:
    """The KV-cache groups holding the target's attention layers, with the
    target layers of each (one group for uniform targets; several when vLLM
    groups layers by attention kind, e.g. sliding-window and full layers).
    Each group has its own block table, so compaction moves each group's
    layers by that group's slots."""
    groups = {}
    for g, grp in enumerate(kv_cache_config.kv_cache_groups):
        layers = target_layers & set(grp.layer_names)
        if layers:
            groups[g] = frozenset(layers)
    if not groups:
        raise DDTreeSeamError("DDTree found none of the target's attention layers in vLLM's "
                              "KV-cache groups. Use method 'dflash' for this model.")
    return groups


def make_runner_class(base: type) -> type:
    """``DDTree<Base>``: the mixin in front of a vLLM runner class."""
    return type(f"DDTree{base.__name__}", (DDTreeRunnerMixin, base),
                {"__module__": __name__, "__qualname__": f"DDTree{base.__name__}"})
