"""The model-runner seams of DDTree (vLLM V1 runner; CPU and CUDA).

:class:`DDTreeRunnerMixin` behaves exactly like the stock runner unless
``speculative_config.ddtree`` is set. With DDTree on, one step is:

``_prepare_inputs``
    Stock inputs (token ids, sequential positions, slot mapping), then for
    every request whose drafts are a tree from the previous round: RoPE
    positions become ``p0 + depth`` (node ``j`` keeps its KV slot
    ``slot(p0 + j)``), and the packed ancestor masks are built.
``_build_attention_metadata``
    The tree masks ride on the target's attention metadata (``.ddtree``);
    the attention backend reads them.
``_model_forward``
    The backend records each layer's fresh K/V (for compaction).
``_sample``
    Instead of the rejection sampler: the target's token at every node
    (argmax, or one sample from the request's processed distribution), the
    tree walk, and KV compaction of the accepted path into contiguous slots.
``propose_draft_token_ids``
    The drafter is conditioned on the accepted path only: its rows are moved
    in front and positions become sequential again, so the stock DFlash
    "rejected suffix" logic applies unchanged. The new trees stay on the
    proposer until the next step.

Requests whose drafts are not a tree of ours (new requests padded with
placeholders, drafts zeroed near ``max_model_len``) are verified as a chain.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from vllm.logger import init_logger
from vllm.v1.outputs import SamplerOutput

from vllm_ddtree.attention import kv_capture
from vllm_ddtree.config import ddtree_runtime
from vllm_ddtree.kernels import TreeAttentionInfo
from vllm_ddtree.proposer import DDTreeProposer
from vllm_ddtree.stats import CounterWriter, stats_file
from vllm_ddtree.tree import ancestor_mask, sample_posterior, walk

logger = init_logger("vllm.ddtree")


@dataclass
class _TreeStep:
    """The trees verified in the current step (one row per request)."""

    req_ids: list[str]
    num_nodes: torch.Tensor  # [R] int64 scheduled draft nodes per request
    parents: torch.Tensor  # [R, B] flat parent index (chain for non-tree requests)
    is_tree: torch.Tensor  # [R] bool: drafts are a non-chain tree of ours
    any_tree: bool
    seq_positions: torch.Tensor | None  # stock sequential positions, if rewritten
    info: TreeAttentionInfo | None
    # [R * (1+B)] token rows of every request's root and nodes (clamped to the
    # request), whose fresh K/V are kept for compaction.
    capture_rows: torch.Tensor | None = None
    from_drafter: torch.Tensor | None = None  # [R] bool: drafts are a tree of ours
    expected: torch.Tensor | None = None  # [R] drafter's expected accepted nodes
    # Filled by _sample:
    path: torch.Tensor | None = None  # [R, B+1]
    num_accepted: torch.Tensor | None = None  # [R]


class DDTreeRunnerMixin:
    """Mixed in front of vLLM's ``GPUModelRunner`` / ``CPUModelRunner``."""

    def __init__(self, vllm_config, device, *args, **kwargs):
        super().__init__(vllm_config, device, *args, **kwargs)
        self.ddtree = ddtree_runtime(vllm_config)
        self._ddtree_stats: CounterWriter | None = None
        # The last walked step's counts, added to the stats after the drafter ran.
        self._ddtree_unrecorded: tuple[torch.Tensor, ...] | None = None
        if self.ddtree is None:
            return
        if self.uses_mrope:
            raise NotImplementedError(
                "DDTree does not support M-RoPE target models yet; use method 'dflash'.")
        # Replace the stock DFlash proposer with the tree proposer.
        self.drafter = DDTreeProposer(vllm_config, self.device, self)
        self._ddtree_step: _TreeStep | None = None
        # (request ids, tree) proposed in the last step, consumed by the next one.
        self._ddtree_pending: tuple[list[str], Any] | None = None
        self._ddtree_single_group_checked = False
        self._ddtree_stats = self._ddtree_open_stats()
        logger.info("DDTree: tree budget %d, drafter depth %d (block size %d)",
                    self.ddtree.budget, self.ddtree.depth, self.ddtree.block_size)

    # ------------------------------------------------------------------ verify inputs
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        self._ddtree_flush_stats()
        out = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        if self.ddtree is not None:
            self._ddtree_step = self._plan_tree_step(scheduler_output)
        return out

    def _plan_tree_step(self, scheduler_output) -> _TreeStep | None:
        pending, self._ddtree_pending = self._ddtree_pending, None
        scheduled = scheduler_output.scheduled_spec_decode_tokens
        if not scheduled:
            return None
        num_reqs = self.input_batch.num_reqs
        req_ids = list(self.input_batch.req_ids[:num_reqs])
        budget = self.ddtree.budget
        dev = self.device
        num_nodes_l = [len(scheduled.get(r, ())) for r in req_ids]
        if max(num_nodes_l) > budget:
            raise RuntimeError(f"DDTree: {max(num_nodes_l)} draft nodes scheduled, "
                               f"budget is {budget}")
        num_nodes = torch.tensor(num_nodes_l, dtype=torch.int64, device=dev)
        ar = torch.arange(budget, device=dev)
        parents = ar.expand(num_reqs, budget).clone()  # chain: node j+1's parent is j
        depth = (ar + 1).expand(num_reqs, budget).clone()
        rows, src = [], []
        if pending is not None:
            where = {rid: i for i, rid in enumerate(pending[0])}
            for r, rid in enumerate(req_ids):
                if num_nodes_l[r] > 0 and rid in where:
                    rows.append(r)
                    src.append(where[rid])
        from_drafter = torch.zeros(num_reqs, dtype=torch.bool, device=dev)
        expected = torch.zeros(num_reqs, dtype=torch.float64, device=dev)
        if not rows:
            return _TreeStep(req_ids, num_nodes, parents, from_drafter.clone(), False, None,
                             None, None, from_drafter, expected)
        tree = pending[1]
        rows_t = torch.tensor(rows, device=dev)
        src_t = torch.tensor(src, device=dev)
        parents[rows_t] = tree.parents[src_t]
        depth[rows_t] = tree.depth[src_t]
        if dev.type == "cpu":
            self._check_scheduled_tokens(scheduled, req_ids, rows, tree.tokens[src_t])
        in_sched = ar[None, :] < num_nodes[:, None]
        from_drafter[rows_t] = True
        if self._ddtree_stats is not None:
            # The drafter's expected number of accepted nodes: the sum, over the
            # scheduled nodes, of the probability of each node's prefix.
            expected[rows_t] = (tree.logq[src_t].double().exp() * in_sched[rows_t]).sum(-1)
        # A chain-shaped (prefix of the) tree is plain causal attention.
        is_tree = ((parents != ar) & in_sched).any(-1)
        any_tree = bool(is_tree.any()) if dev.type == "cpu" else True
        if not any_tree:
            return _TreeStep(req_ids, num_nodes, parents, is_tree, False, None, None, None,
                             from_drafter, expected)

        total = scheduler_output.total_num_scheduled_tokens
        ridx = self.req_indices.gpu[:total].long()
        qpos = self.query_pos.gpu[:total].long()
        node = qpos.clamp(max=budget)
        tok_tree = is_tree[ridx] & (qpos <= num_nodes[ridx])
        depth_full = torch.cat([torch.zeros_like(depth[:, :1]), depth], dim=1)  # root depth 0
        seq_positions = self.positions[:total].clone()
        # node j of a tree sits at RoPE position p0 + depth(j); its KV slot is
        # still slot(p0 + j), computed by the stock code from the sequential positions.
        shift = torch.where(tok_tree, depth_full[ridx, node] - node, 0)
        self.positions[:total] += shift
        anc = ancestor_mask(parents, depth)  # [R, 1+B, W]
        mask = anc[ridx, node]
        info = TreeAttentionInfo.create(mask.contiguous(), is_tree)
        qs = self.query_start_loc.gpu[:num_reqs].long()
        ar1 = torch.arange(budget + 1, device=dev)
        capture_rows = (qs[:, None] + torch.minimum(ar1[None, :], num_nodes[:, None])).flatten()
        return _TreeStep(req_ids, num_nodes, parents, is_tree, True, seq_positions, info,
                         capture_rows, from_drafter, expected)

    @staticmethod
    def _check_scheduled_tokens(scheduled, req_ids, rows, tree_tokens) -> None:
        for k, r in enumerate(rows):
            sched = list(scheduled[req_ids[r]])
            have = tree_tokens[k, : len(sched)].tolist()
            if have != sched:
                raise RuntimeError(
                    f"DDTree: scheduled drafts of request {req_ids[r]} are not the prefix of "
                    f"its tree (scheduled {sched[:8]}..., tree {have[:8]}...)")

    def _build_attention_metadata(self, *args, **kwargs):
        attn_metadata, spec_cad = super()._build_attention_metadata(*args, **kwargs)
        if self.ddtree is not None:
            step = self._ddtree_step
            info = step.info if step is not None else None
            draft_layers = getattr(self.drafter, "_draft_attn_layer_names", set())
            per_layer = attn_metadata if isinstance(attn_metadata, list) else [attn_metadata]
            for d in per_layer:
                for name, md in d.items():
                    if name not in draft_layers:
                        md.ddtree = info
        return attn_metadata, spec_cad

    def _model_forward(self, *args, **kwargs):
        step = self._ddtree_step if self.ddtree is not None else None
        if step is None or not step.any_tree:
            return super()._model_forward(*args, **kwargs)
        kv_capture.start(step.capture_rows)
        try:
            return super()._model_forward(*args, **kwargs)
        finally:
            kv_capture.stop()

    # ------------------------------------------------------------------ walk
    def _sample(self, logits, spec_decode_metadata):
        step = self._ddtree_step if self.ddtree is not None else None
        if step is None or spec_decode_metadata is None:
            return super()._sample(logits, spec_decode_metadata)
        md = spec_decode_metadata
        sm = self.input_batch.sampling_metadata
        budget = self.ddtree.budget
        num_reqs = len(md.num_draft_tokens)
        dev = logits.device
        counts = torch.tensor([n + 1 for n in md.num_draft_tokens], device=dev)

        # The target's token at every node, from the request's own distribution.
        if sm.all_greedy:
            # What sample_posterior returns for greedy rows, without drawing noise.
            post_flat = logits.float().argmax(-1)
        else:
            post_flat = self._ddtree_sample_nodes(logits, md, sm, counts)

        # Pad to [R, 1+B] / [R, B] per request.
        starts = torch.cumsum(counts, 0) - counts
        ar = torch.arange(budget + 1, device=dev)
        n = step.num_nodes
        node_rows = starts[:, None] + torch.minimum(ar[None, :], n[:, None])
        post = post_flat[node_rows]
        draft_starts = starts - torch.arange(num_reqs, device=dev)  # drafts exclude bonus rows
        dr = (draft_starts[:, None] + ar[None, :budget]).clamp(max=max(md.draft_token_ids.numel() - 1, 0))
        tokens = md.draft_token_ids.long()[dr] if md.draft_token_ids.numel() else \
            torch.full((num_reqs, budget), -1, device=dev, dtype=torch.long)
        res = walk(tokens, step.parents, post, num_nodes=n)
        step.path, step.num_accepted = res.path, res.num_accepted
        if self._ddtree_stats is not None:
            self._ddtree_unrecorded = (n, res.num_accepted, step.expected, step.from_drafter)
        if step.any_tree:
            self._compact_kv(step, starts_tok=self.query_start_loc.gpu[:num_reqs].long())
        out = res.output_tokens[:, : md.max_spec_len + 1].to(torch.int32)
        return SamplerOutput(sampled_token_ids=out, logprobs_tensors=None)

    @staticmethod
    def _ddtree_sample_nodes(logits, md, sm, counts) -> torch.Tensor:
        """One draw per node row from its request's processed distribution."""
        num_reqs, rows = len(md.num_draft_tokens), logits.shape[0]

        def per_row(t):
            return None if t is None else torch.repeat_interleave(t[:num_reqs], counts,
                                                                  output_size=rows)
        temp = sm.temperature
        if temp is None:
            temp = torch.zeros(num_reqs, device=logits.device)
        gens = {}
        if sm.generators:
            offs = 0
            for r, n in enumerate(md.num_draft_tokens):
                if r in sm.generators:
                    gens.update({offs + j: sm.generators[r] for j in range(n + 1)})
                offs += n + 1
        return sample_posterior(logits[:, None, :], per_row(temp), per_row(sm.top_k),
                                per_row(sm.top_p), None, gens or None)[:, 0]

    def _compact_kv(self, step: _TreeStep, starts_tok: torch.Tensor) -> None:
        """Move the accepted nodes' K/V from slot(p0 + path[k]) to slot(p0 + k)."""
        path, a = step.path, step.num_accepted
        depth = self.ddtree.depth
        k = torch.arange(1, min(depth, path.shape[1] - 1) + 1, device=path.device)
        src_node = path[:, k]
        move = (k[None, :] <= a[:, None]) & (src_node != k[None, :]) & step.is_tree[:, None]
        if path.device.type == "cpu" and not bool(move.any()):
            kv_capture.clear()
            return
        # Pairs that do not move rewrite the root onto its own slot (a no-op),
        # which keeps the shapes static. Source K/V come from the captured copies
        # (request r's node j is capture row r * (1 + B) + j), so the order of
        # the writes does not matter.
        dst_rows = starts_tok[:, None] + torch.where(move, k[None, :], 0)
        stride = self.ddtree.budget + 1
        cap_base = torch.arange(path.shape[0], device=path.device)[:, None] * stride
        src_cap = cap_base + torch.where(move, src_node, 0)
        slot_mapping = self._ddtree_target_slot_mapping()
        kv_capture.rewrite(src_cap.flatten(), slot_mapping[dst_rows.flatten()])
        kv_capture.clear()

    def _ddtree_target_slot_mapping(self) -> torch.Tensor:
        groups = self.kv_cache_config.kv_cache_groups
        draft_layers = getattr(self.drafter, "_draft_attn_layer_names", set())
        target_groups = [g for g, grp in enumerate(groups)
                         if any(n not in draft_layers for n in grp.layer_names)]
        if len(target_groups) != 1:
            raise NotImplementedError(
                f"DDTree KV compaction supports targets with one KV-cache group; this model "
                f"has {len(target_groups)} (e.g. sliding-window or hybrid layers).")
        return self.input_batch.block_table[target_groups[0]].slot_mapping.gpu

    # ------------------------------------------------------------------ next round
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata,
                                hidden_states, sample_hidden_states, aux_hidden_states,
                                spec_decode_metadata, common_attn_metadata, slot_mappings):
        step = self._ddtree_step if self.ddtree is not None else None
        if step is not None and step.any_tree and step.path is not None:
            self._condition_on_accepted(step, aux_hidden_states)
        drafts = super().propose_draft_token_ids(
            scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
            sample_hidden_states, aux_hidden_states, spec_decode_metadata,
            common_attn_metadata, slot_mappings)
        if self.ddtree is not None and isinstance(self.drafter, DDTreeProposer):
            tree = self.drafter.last_tree
            if tree is not None:
                num_reqs = self.input_batch.num_reqs
                self._ddtree_pending = (list(self.input_batch.req_ids[:num_reqs]), tree)
                self.drafter.last_tree = None
        self._ddtree_flush_stats()
        return drafts

    # ------------------------------------------------------------------ stats
    def _ddtree_open_stats(self) -> CounterWriter | None:
        """The counter file /metrics reads (one writer per engine; see stats.py)."""
        stats_dir = self.ddtree.stats_dir
        if not stats_dir:
            return None
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        if get_tp_group().rank_in_group != 0 or not get_pp_group().is_last_rank:
            return None
        if not os.path.isdir(stats_dir):
            logger.warning("DDTree: stats directory %s is not on this machine; the ddtree "
                           "metrics stay empty", stats_dir)
            return None
        return CounterWriter(stats_file(stats_dir,
                                        self.vllm_config.parallel_config.data_parallel_rank))

    def _ddtree_flush_stats(self) -> None:
        """Add the last walked step to the counters (host sync deferred until
        after the drafter has been launched)."""
        pending, self._ddtree_unrecorded = self._ddtree_unrecorded, None
        if pending is None:
            return
        n, a, expected, from_drafter = pending
        walked = n > 0
        self._ddtree_stats.add(n[walked].tolist(), a[walked].tolist(),
                               expected[walked].tolist(), from_drafter[walked].tolist())

    def _condition_on_accepted(self, step: _TreeStep, aux_hidden_states) -> None:
        """Rows p0..p0+a of each tree request become the accepted path, in order."""
        num_reqs = step.path.shape[0]
        qs = self.query_start_loc.gpu[:num_reqs].long()
        k = torch.arange(step.path.shape[1], device=qs.device)[None, :]
        # Only rows inside the request move; the others map onto the root row
        # with its own value (duplicates then carry identical data).
        inside = torch.where(k <= step.num_nodes[:, None], k, 0)
        take = (k <= step.num_accepted[:, None]) & step.is_tree[:, None]
        src = (qs[:, None] + torch.where(take, step.path, inside)).flatten()
        dst = (qs[:, None] + inside).flatten()
        total = step.seq_positions.shape[0]
        if aux_hidden_states is not None:
            for h in aux_hidden_states:
                h[dst] = h[src]
        self.positions[:total] = step.seq_positions


def make_runner_class(base: type) -> type:
    """``DDTree<Base>``: the mixin in front of a vLLM runner class."""
    return type(f"DDTree{base.__name__}", (DDTreeRunnerMixin, base),
                {"__module__": __name__, "__qualname__": f"DDTree{base.__name__}"})
