"""Setup hooks (``benchmarks.run_llm``) for the adaptive-budget engine tests.

They run in the engine's process before the engine starts, so the job must
set ``VLLM_ENABLE_V1_MULTIPROCESSING=0``.
"""

from __future__ import annotations

import json
import os

ENV_LOG = "DDTREE_TEST_TREE_LOG"


def record_trees() -> None:
    """Append every proposed tree to ``$DDTREE_TEST_TREE_LOG`` as one JSON line
    per request: the root's position, whether the drafter skipped its block on
    the step before (the policy was in plain mode), and the first nodes'
    tokens and log q."""
    from vllm_ddtree import runner as runner_mod

    path = os.environ[ENV_LOG]
    real = runner_mod.DDTreeRunnerMixin.propose_draft_token_ids

    def recorded(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        policy = self.ddtree_policy
        after_plain = bool(policy is not None and policy.plain)
        drafts = real(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        trees = self.ddtree_trees
        if trees is None or self.drafter.skip_block:
            return drafts
        sampled = sampled_token_ids.tolist()
        tree = trees.tree
        with open(path, "a") as f:
            for i, rid in enumerate(trees.req_ids):
                req = self.requests[rid]
                valid = sum(1 for t in sampled[i] if t != -1)
                if not valid:
                    continue
                root = len(req.prompt_token_ids) + len(req.output_token_ids) + valid - 1
                f.write(json.dumps({
                    "prompt": req.prompt_token_ids[:16], "root": root,
                    "after_plain": after_plain, "tokens": tree.tokens[i, :4].tolist(),
                    "logq": tree.logq[i, :4].tolist()}) + "\n")
        return drafts

    runner_mod.DDTreeRunnerMixin.propose_draft_token_ids = recorded


def record_trees_without_context() -> None:
    """:func:`record_trees`, with plain steps that skip the drafter's context
    K/V as well (a broken plain mode: later trees miss that context)."""
    import torch

    from vllm_ddtree.proposer import DDTreeProposer

    def no_context(self, depth, *args, **kwargs):
        cad = kwargs["common_attn_metadata"]
        return torch.zeros(cad.batch_size(), self.ddtree.budget, dtype=torch.long)

    DDTreeProposer._store_context = no_context
    DDTreeProposer.store_context = lambda self, *args, **kwargs: None
    record_trees()


def record_trees_dropping_released_rows() -> None:
    """:func:`record_trees`, with the pending rows of finished requests
    dropped even where their blocks stay in the prefix cache (a broken
    release: a later request that hits those blocks drafts without their
    drafter context)."""
    from vllm_ddtree import runner as runner_mod

    real = runner_mod.DDTreeRunnerMixin._ddtree_settle_pending_context

    def dropping(self, scheduler_output):
        cfg = self.cache_config
        caching, cfg.enable_prefix_caching = cfg.enable_prefix_caching, False
        try:
            real(self, scheduler_output)
        finally:
            cfg.enable_prefix_caching = caching

    runner_mod.DDTreeRunnerMixin._ddtree_settle_pending_context = dropping
    record_trees()


ENV_STEP_LOG = "DDTREE_TEST_STEP_LOG"


def record_trees_and_steps() -> None:
    """:func:`record_trees`, and one line per runner event in
    ``$DDTREE_TEST_STEP_LOG``: ``meta spec`` / ``meta plain`` (the step's
    attention metadata built with vLLM's speculative metadata or without),
    ``propose`` (vLLM's drafting hook ran) and ``kept`` (a plain step's
    tokens kept for the drafter's context)."""
    from vllm_ddtree import runner as runner_mod

    path = os.environ[ENV_STEP_LOG]
    cls = runner_mod.DDTreeRunnerMixin

    def logged(name, label):
        real = getattr(cls, name)

        def wrapper(self, *args, **kwargs):
            tag = label(self, kwargs) if callable(label) else label
            with open(path, "a") as f:
                f.write(tag + "\n")
            return real(self, *args, **kwargs)
        setattr(cls, name, wrapper)

    logged("_build_attention_metadata",
           lambda self, kw: "meta spec" if kw.get("use_spec_decode") else "meta plain")
    logged("_ddtree_plain_step", "kept")
    record_trees()
    logged("propose_draft_token_ids", "propose")


ENV_SHADOW_LOG = "DDTREE_TEST_SHADOW_LOG"


def record_shadows() -> None:
    """One JSON line per step the rate tuner observes, in
    ``$DDTREE_TEST_SHADOW_LOG``: the running trial's arm, the step's
    requests and committed tokens, and the shadow counts the runner reported;
    and one per drafted batch of trees: the arm and the trees' width."""
    from vllm_ddtree.core.tuner import RateTuner

    path = os.environ[ENV_SHADOW_LOG]
    real = RateTuner.observe

    def observed(self, num_reqs, tokens, seconds, *args, shadow=None, **kwargs):
        trial = self._trial
        with open(path, "a") as f:
            f.write(json.dumps({
                "arm": trial.arm.name if trial is not None else None,
                "budget": trial.arm.budget if trial is not None else 0,
                "reqs": num_reqs, "tokens": tokens,
                "shadow": None if shadow is None else {str(b): n for b, n in shadow.items()},
            }) + "\n")
        return real(self, num_reqs, tokens, seconds, *args, shadow=shadow, **kwargs)

    RateTuner.observe = observed

    # and one line per drafted batch of trees: the arm that drafted them and
    # the trees' width (a fixed arm builds only the nodes it verifies)
    from vllm_ddtree import runner as runner_mod

    real_propose = runner_mod.DDTreeRunnerMixin.propose_draft_token_ids

    def proposed(self, *args, **kwargs):
        drafts = real_propose(self, *args, **kwargs)
        trees, tuner = self.ddtree_trees, self.ddtree_tuner
        trial = tuner._trial if tuner is not None else None
        if trees is not None and trial is not None:
            with open(path, "a") as f:
                f.write(json.dumps({"built": trees.tree.tokens.shape[1],
                                    "arm": trial.arm.name, "budget": trial.arm.budget})
                        + "\n")
        return drafts

    runner_mod.DDTreeRunnerMixin.propose_draft_token_ids = proposed


def record_shadows_and_draft_calls() -> None:
    """:func:`record_shadows`, and one line ``{"executor_take": n}`` per call
    the engine core makes to its executor for a step's drafts (none when the
    drafts ride on the steps' outputs: ``patches/step_drafts.py``)."""
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    record_shadows()
    path = os.environ[ENV_SHADOW_LOG]
    real = UniProcExecutor.take_draft_token_ids

    def counted(self):
        drafts = real(self)
        with open(path, "a") as f:
            f.write(json.dumps({"executor_take": 0 if drafts is None else
                                len(drafts.req_ids)}) + "\n")
        return drafts

    UniProcExecutor.take_draft_token_ids = counted
