"""Seeded requests whose prompt is prefilled in chunks (patches/cpu_seed_rewind.py).

vLLM samples a token for every scheduled request, also for one whose prompt
is only partly prefilled, and drops it; a seeded request's generator must be
rewound after such a step. Stock vLLM 0.32 does that with a CUDA-only offset
rewind that kills the CPU engine. With the patch the engine survives, and the
rewind is exact: a discarded step leaves the generator where it was (checked
in the engine by tests/seed_probe.py), so a seeded request gives the same
tokens whether or not its prompt was chunked (checked end to end with plain
decoding).

The chunked runs use a 512-token step budget on four HumanEval prompts (the
plain runs add one longer than the budget, so that some seeded samples are
prefilled in several steps whatever the schedule). The reference run disables
chunked prefill, so no prompt is split and no sample is discarded.

DDTree is checked for survival and for the exact rewind, not for equal tokens
across the two schedules: with DDTree, a request's token in a step that holds
drafts (its own or another request's) is drawn by the tree walk's node
sampler, otherwise by vLLM's sampler, and the two consume the generator
differently. Which steps hold drafts depends on the schedule, so a seeded
DDTree request's tokens legitimately depend on it.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import IN_PROCESS, run_job
from tests.seed_probe import PROBE_ENV

pytestmark = pytest.mark.engine

SEEDED = {"n": 64, "seed": 5, "temperature": 0.8, "max_tokens": 16}
CHUNKED = {"max_num_batched_tokens": 512}
WHOLE = {"enable_chunked_prefill": False, "max_num_batched_tokens": 2048}


def _prompts(long: bool) -> list[str]:
    from benchmarks.run_llm import humaneval_prompts

    ps = humaneval_prompts(10)
    return ps[:4] + (["".join(ps[4:10])] if long else [])  # the long one is ~740 tokens


@pytest.fixture(scope="module")
def engine_runs(tiny_pair, tmp_path_factory):
    """Each configuration runs at most once per module, on first use (a failed
    run is not retried); the result carries the probe's counts under ``"probe"``."""
    target, drafter = tiny_pair
    tree = {"method": "ddtree", "model": drafter, "num_speculative_tokens": 16,
            "ddtree_adaptive": False}
    configs = {"plain-chunked": (None, CHUNKED, True), "plain-whole": (None, WHOLE, True),
               "tree-chunked": (tree, CHUNKED, False)}
    done: dict[str, dict | Exception] = {}

    def get(name: str) -> dict:
        if name not in done:
            spec, llm, long = configs[name]
            tmp = tmp_path_factory.mktemp(name)
            probe = tmp / "probe.json"
            job = {"model": target, "prompts": _prompts(long), "sampling": SEEDED,
                   "speculative_config": spec, "llm": llm,
                   "env": {**IN_PROCESS, PROBE_ENV: str(probe)},
                   "setup": "tests.seed_probe:install"}
            try:
                result = run_job(job, tmp)
                result["probe"] = json.loads(probe.read_text())
                done[name] = result
            except Exception as e:  # noqa: BLE001 - re-raised below, for every test using it
                done[name] = e
        if isinstance(done[name], Exception):
            raise RuntimeError(f"engine run {name!r} failed") from done[name]
        return done[name]

    return get


def _check(result: dict, num_prompts: int) -> None:
    outs = result["outputs"]
    assert len(outs) == num_prompts
    for per_prompt in outs:
        assert len(per_prompt) == SEEDED["n"]
        assert all(1 <= len(c) <= SEEDED["max_tokens"] for c in per_prompt)
    probe = result["probe"]
    assert probe["discarded"] > 0, "no seeded sample was discarded: nothing was chunked"
    assert probe["moved"] == 0, f"{probe['moved']} discarded steps moved a seeded generator"


def test_plain_seeded_chunked_prefill(engine_runs):
    _check(engine_runs("plain-chunked"), 5)


def test_ddtree_seeded_chunked_prefill(engine_runs):
    result = engine_runs("tree-chunked")
    _check(result, 4)
    assert result["spec"]["drafts"] > 0, "DDTree never verified a draft"


def test_plain_seeded_output_does_not_depend_on_chunking(engine_runs):
    chunked, whole = engine_runs("plain-chunked"), engine_runs("plain-whole")
    assert whole["probe"]["discarded"] == 0, "the reference run chunked a prompt"
    bad = [(p, k) for p, (xs, ys) in enumerate(zip(chunked["outputs"], whole["outputs"]))
           for k, (x, y) in enumerate(zip(xs, ys)) if x != y]
    assert len(whole["outputs"]) == len(chunked["outputs"])
    assert not bad, f"{len(bad)} of {5 * SEEDED['n']} seeded samples differ when chunked " \
                    f"(prompt, sample): {bad[:8]}"
