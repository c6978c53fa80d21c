"""The shared plain engines' runs (``plain_reference`` in conftest.py).

A module of its own, so that pytest's ``conftest`` and the test files (which
import ``tests.conftest``, another module object) see one registry.
"""

from __future__ import annotations

# Every plain-decoding reference of the tiny pair that more than one test file
# compares against, by engine: each engine starts once per session and
# generates all of its runs (run_llm's "runs"). The eager engine carries the
# structured-output settings test_e2e_api needs; they do not touch requests
# without structured output.
GREEDY_128 = {"temperature": 0.0, "max_tokens": 128, "ignore_eos": True}
PLAIN_ENGINES = {
    "eager": {"llm": {"enforce_eager": True,
                      "structured_outputs_config": {"backend": "xgrammar",
                                                    "disable_any_whitespace": True}}},
    "compiled": {"llm": {"enforce_eager": False}},
}
PLAIN_RUNS: dict[str, dict[str, dict]] = {"eager": {}, "compiled": {}}


def plain_run(engine: str, name: str, prompts, sampling) -> None:
    """Declare a run of the shared plain ``engine`` (at import of a test file)."""
    runs = PLAIN_RUNS[engine]
    run = {"prompts": prompts, "sampling": sampling}
    if name in runs and runs[name] != run:
        raise ValueError(f"shared plain run {engine}/{name} declared twice, differently")
    runs[name] = run


plain_run("eager", "humaneval16", "humaneval:16", GREEDY_128)
plain_run("compiled", "humaneval16", "humaneval:16", GREEDY_128)
