"""A DDTree step's drafts delivered with the step's output.

Without asynchronous scheduling (DDTree runs without it), vLLM's engine core
asks the workers for the drafts in a call of its own after every step
(``EngineCore.post_step`` -> ``take_draft_token_ids``). In a server the
workers are other processes, so every step pays one more round trip between
processes: on two cores at 16 requests, 0.8-1.6 ms of a 6-7 ms step, on
plain steps (which draft nothing) as much as on tree steps.

The DDTree runner puts the drafts on the step's ``ModelRunnerOutput``
instead (``ddtree_drafts``, None when nothing was drafted;
``DDTreeRunnerMixin._ddtree_send_drafts``), and two seams read them there:

- ``Scheduler.update_from_output``, which the engine core calls with every
  step's output, notes the output's drafts (or that it carries none);
- ``EngineCore.post_step`` hands noted drafts to the scheduler as vLLM's own
  call would, and makes vLLM's call when the output carried none (another
  speculative method, an output vLLM built itself).

If a seam did not take effect, the engine core makes vLLM's call and the
runner returns the same drafts it put on the output: slower, never wrong.
"""

from __future__ import annotations

from vllm_ddtree.patches.base import ALL_PLATFORMS, Patch

ATTR = "ddtree_drafts"  # the output's drafts (DDTreeDraftTokenIds | None)
NOTED = "_ddtree_step_drafts"  # on the scheduler: the last output's, until post_step
NOT_SENT = object()  # the output carried no drafts of DDTree's


def _build_update_from_output(original):
    def update_from_output(self, scheduler_output, model_runner_output):
        self.__dict__[NOTED] = getattr(model_runner_output, ATTR, NOT_SENT)
        return original(self, scheduler_output, model_runner_output)

    update_from_output.__wrapped__ = original
    return update_from_output


def _build_post_step(original):
    def post_step(self, model_executed: bool) -> None:
        sent = self.scheduler.__dict__.pop(NOTED, NOT_SENT)
        if (sent is NOT_SENT or not model_executed or self.async_scheduling
                or not self.check_for_draft_tokens):
            return original(self, model_executed)
        if sent is not None:
            self.scheduler.update_draft_token_ids(sent)

    post_step.__wrapped__ = original
    return post_step


UPDATE_FROM_OUTPUT = Patch(
    name="step-drafts-noted",
    target="vllm.v1.core.sched.scheduler:Scheduler.update_from_output",
    why="Note the drafts a DDTree step's output carries, for post_step.",
    upstream="none (drafts are fetched from the workers in a call of their own)",
    vllm_versions=ALL_PLATFORMS,
    build=_build_update_from_output,
)

POST_STEP = Patch(
    name="step-drafts-from-output",
    target="vllm.v1.engine.core:EngineCore.post_step",
    why="Take a DDTree step's drafts from its output instead of a second call to the workers.",
    upstream="none (drafts are fetched from the workers in a call of their own)",
    vllm_versions=ALL_PLATFORMS,
    build=_build_post_step,
)

PATCHES = [UPDATE_FROM_OUTPUT, POST_STEP]
