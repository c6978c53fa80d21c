"""A DDTree step's drafts ride on its output (``patches/step_drafts.py``).

The engine core's two seams, on stand-ins for vLLM's scheduler and engine
core (the wrappers read and write plain attributes), and the runner's side:
drafts taken for the output are returned again to a call of the engine's own
until the next step, so an engine core without the seams gets the same
drafts. Through the engine: ``test_e2e_adaptive.py`` (no call of the engine
core's own in a run with tree and plain steps) and ``test_server.py``
(a server, whose worker is another process).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_ddtree.patches import all_patches, step_drafts


class Scheduler:
    def __init__(self):
        self.updates = []
        self.outputs = []

    def update_from_output(self, scheduler_output, model_runner_output):
        self.outputs.append(model_runner_output)
        return {"engine outputs": scheduler_output}

    def update_draft_token_ids(self, drafts):
        self.updates.append(drafts)


class Executor:
    def __init__(self, drafts):
        self.drafts = drafts
        self.calls = 0

    def take_draft_token_ids(self):
        self.calls += 1
        return self.drafts


class EngineCore:
    def __init__(self, scheduler, executor, async_scheduling=False, spec=True):
        self.scheduler = scheduler
        self.model_executor = executor
        self.async_scheduling = async_scheduling
        self.check_for_draft_tokens = spec

    def post_step(self, model_executed: bool) -> None:  # vLLM 0.32's body
        if self.check_for_draft_tokens and not self.async_scheduling and model_executed:
            drafts = self.model_executor.take_draft_token_ids()
            if drafts is not None:
                self.scheduler.update_draft_token_ids(drafts)


update_from_output = step_drafts._build_update_from_output(Scheduler.update_from_output)
post_step = step_drafts._build_post_step(EngineCore.post_step)


def _step(core, output, executed=True):
    """One engine step as vLLM's ``EngineCore.step`` and its caller run it."""
    update_from_output(core.scheduler, "sched", output)
    post_step(core, executed)


def test_the_patches_are_installed_with_the_plugin():
    targets = {p.target for p in all_patches()}
    assert {p.target for p in step_drafts.PATCHES} <= targets
    assert step_drafts.POST_STEP.target == "vllm.v1.engine.core:EngineCore.post_step"


def test_drafts_on_the_output_are_used_without_a_call_to_the_workers():
    sched, ex = Scheduler(), Executor("from the workers")
    core = EngineCore(sched, ex)
    _step(core, SimpleNamespace(ddtree_drafts="tree drafts"))
    assert sched.updates == ["tree drafts"] and ex.calls == 0
    # a plain step: the output says there are none, and nobody is asked
    _step(core, SimpleNamespace(ddtree_drafts=None))
    assert sched.updates == ["tree drafts"] and ex.calls == 0
    # the note is the last output's only: a later output without drafts of
    # DDTree's (vLLM's own empty output) falls back to vLLM's call
    _step(core, SimpleNamespace())
    assert sched.updates == ["tree drafts", "from the workers"] and ex.calls == 1


def test_vllms_own_conditions_still_hold():
    for core in (EngineCore(Scheduler(), Executor("x"), async_scheduling=True),
                 EngineCore(Scheduler(), Executor("x"), spec=False)):
        _step(core, SimpleNamespace(ddtree_drafts="tree drafts"))
        assert core.scheduler.updates == [] and core.model_executor.calls == 0
    core = EngineCore(Scheduler(), Executor("x"))
    _step(core, SimpleNamespace(ddtree_drafts="tree drafts"), executed=False)
    assert core.scheduler.updates == [] and core.model_executor.calls == 0
    # nothing noted is carried into the next step
    post_step(core, True)
    assert core.scheduler.updates == ["x"] and core.model_executor.calls == 1


def _runner(sent):
    from vllm_ddtree.runner import DDTreeRunnerMixin

    taken = []

    class Runner(DDTreeRunnerMixin):
        def __init__(self):  # no vLLM runner underneath: only the attributes read
            self.ddtree = object()
            self.ddtree_sent_drafts = sent

        def _ddtree_take_drafts(self):
            taken.append(1)
            return "fresh drafts"

    return Runner(), taken


def test_the_runner_answers_a_call_of_the_engines_own_with_the_drafts_it_sent():
    runner, taken = _runner(("sent drafts",))
    assert runner.take_draft_token_ids() == "sent drafts" and not taken
    # once: a second call in the same step takes the drafter's drafts
    assert runner.take_draft_token_ids() == "fresh drafts" and taken == [1]
    runner, taken = _runner((None,))  # a plain step sent "no drafts"
    assert runner.take_draft_token_ids() is None and not taken


@pytest.mark.parametrize("attr", [step_drafts.ATTR])
def test_the_attribute_survives_the_trip_between_processes(attr):
    """A server's worker pickles the output for the engine core: an attribute
    set on vLLM's ``ModelRunnerOutput`` must come through."""
    import pickle

    from vllm.v1.outputs import ModelRunnerOutput

    from vllm_ddtree.structured import DDTreeDraftTokenIds

    out = ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0})
    setattr(out, attr, DDTreeDraftTokenIds(["a"], [[5, 6]], [[-1, 0]]))
    back = pickle.loads(pickle.dumps(out))
    drafts = getattr(back, attr)
    assert drafts.req_ids == ["a"] and drafts.draft_token_ids == [[5, 6]]
    assert drafts.parents == [[-1, 0]]
