"""Structured output with DDTree: grammar checks and masks per tree node.

Three scheduler-side seams, each active only when the engine's speculative
config is DDTree (the logic is in ``vllm_ddtree/structured.py``):

- ``Scheduler.update_draft_token_ids``: drafts are a tree; nodes whose path
  the grammar rejects are dropped (vLLM keeps the longest valid prefix of a
  chain).
- ``StructuredOutputManager.grammar_bitmask``: one bitmask row per tree node,
  filled with the grammar state after the node's path (vLLM advances along a
  chain).
- ``Scheduler.schedule``: the scheduler output carries the dropped nodes
  (``ddtree_pruned``) so the runner verifies the same tree.
"""

from __future__ import annotations

from vllm_ddtree.patches.base import ALL_PLATFORMS, Patch


def _ddtree_on(vllm_config) -> bool:
    from vllm_ddtree.core.config import ddtree_runtime

    return ddtree_runtime(vllm_config) is not None


def _build_update(original):
    def update_draft_token_ids(self, draft_token_ids):
        if not _ddtree_on(self.vllm_config):
            return original(self, draft_token_ids)
        from vllm_ddtree.structured import update_drafts

        update_drafts(self, draft_token_ids)

    update_draft_token_ids.__wrapped__ = original
    return update_draft_token_ids


def _build_bitmask(original):
    def grammar_bitmask(self, requests, structured_output_request_ids,
                        scheduled_spec_decode_tokens):
        if not _ddtree_on(self.vllm_config):
            return original(self, requests, structured_output_request_ids,
                            scheduled_spec_decode_tokens)
        from vllm_ddtree.structured import fill_bitmask

        return fill_bitmask(self, requests, structured_output_request_ids,
                            scheduled_spec_decode_tokens)

    grammar_bitmask.__wrapped__ = original
    return grammar_bitmask


def _build_schedule(original):
    def schedule(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if _ddtree_on(self.vllm_config):
            from vllm_ddtree.structured import pruned_for

            out.ddtree_pruned = pruned_for(self, out)
        return out

    schedule.__wrapped__ = original
    return schedule


UPDATE_DRAFTS = Patch(
    name="tree-draft-validation",
    target="vllm.v1.core.sched.scheduler:Scheduler.update_draft_token_ids",
    why="Check drafts against the grammar per tree path and drop rejected nodes.",
    upstream="none (vLLM validates drafts as a chain)",
    vllm_versions=ALL_PLATFORMS,
    build=_build_update,
)

BITMASK = Patch(
    name="tree-grammar-bitmask",
    target="vllm.v1.structured_output:StructuredOutputManager.grammar_bitmask",
    why="Fill each tree node's bitmask row with the grammar state after its path.",
    upstream="none (vLLM fills the rows along a chain)",
    vllm_versions=ALL_PLATFORMS,
    build=_build_bitmask,
)

SCHEDULE = Patch(
    name="tree-pruned-nodes",
    target="vllm.v1.core.sched.scheduler:Scheduler.schedule",
    why="Tell the runner which tree nodes the grammar check dropped.",
    upstream="none",
    vllm_versions=ALL_PLATFORMS,
    build=_build_schedule,
)
