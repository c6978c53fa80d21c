"""Offline engines alive at once, driven in turn: ratios from one noisy machine.

Each *arm* is an offline ``vllm.LLM`` in a process of its own (spawned, with
the arm's environment set before vLLM is imported), built once and kept
alive. The driver sends every arm the same workload in turn, arm after arm,
round after round (A B C A B C ...), so machine noise and thermal drift hit
every arm alike; what comes back per (arm, workload, round) is the wall time,
the tokens generated, the spec-decode counters' growth, for an adaptive
DDTree engine the steps its rate tuner gave each arm (``arm_steps``), and the
first round's token ids (to check that the arms agree). Used by the serving-free
benchmarks (``bench_parallel``, ``bench_default``)::

    with Arms({"plain": {"model": ...}, "ddtree": {...}}) as arms:
        for rnd in range(3):
            for name in arms.names:
                res = arms.run(name, prompts, sampling)

An arm's job is a ``benchmarks.run_llm`` job without prompts (``model``,
``speculative_config``, ``llm``, ``env``). Engines start one at a time
(``start`` waits for each), so compilation does not overlap.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from typing import Any


def _worker(job: dict, conn) -> None:
    os.environ.update({k: str(v) for k, v in (job.get("env") or {}).items()})
    os.environ.pop("TRITON_INTERPRET", None)
    try:
        from vllm import LLM

        from benchmarks.run_llm import _params_for, _prompts_for, counter

        kwargs = dict(dtype="float32", max_model_len=2048, seed=0, disable_log_stats=False)
        kwargs.update(job.get("llm") or {})
        llm = LLM(model=job["model"], speculative_config=job.get("speculative_config"),
                  **kwargs)
        arms = _tuner_arms(llm)
        seen = llm.collective_rpc(_tuner_trials, args=(0,))[0][1] if arms is not None else 0
        conn.send(("ready", None))
    except Exception:  # noqa: BLE001 - reported to the driver
        conn.send(("error", traceback.format_exc()))
        return
    names = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
             "spec_decode_num_accepted_tokens")
    while True:
        msg = conn.recv()
        if msg is None:
            return
        prompts, sampling = msg
        try:
            before = {n: counter(llm, n) for n in names}
            steps0 = arms.steps() if arms is not None else None
            t0 = time.perf_counter()
            outs = llm.generate(_prompts_for(prompts), _params_for(sampling), use_tqdm=False)
            seconds = time.perf_counter() - t0
            grown = {n.removeprefix("spec_decode_num_"): counter(llm, n) - before[n]
                     for n in names}
            if arms is not None:  # the steps each of the tuner's arms decided
                grown["arm_steps"] = {a: float(x) for a, x in
                                      zip(arms.names, arms.steps() - steps0) if x}
                # and the trials that decided them, with the tuner's own numbers
                grown["trials"], seen = llm.collective_rpc(_tuner_trials, args=(seen,))[0]
            conn.send(("ok", {"seconds": seconds,
                              "num_tokens": sum(len(c.token_ids) for o in outs
                                                for c in o.outputs),
                              "outputs": [list(o.outputs[0].token_ids) for o in outs],
                              **grown}))
        except Exception:  # noqa: BLE001
            conn.send(("error", traceback.format_exc()))


def _tuner_trials(worker, seen: int) -> tuple[list[dict], int]:
    """(run on the worker) The rate tuner's trials closed since the first
    ``seen`` (``core/tuner.py``'s :class:`TrialRecord`), and the count now."""
    tuner = worker.model_runner.ddtree_tuner
    if tuner is None:
        return [], 0
    new = min(tuner.closed - seen, len(tuner.history))
    records = list(tuner.history)[len(tuner.history) - new:] if new > 0 else []
    return [rec._asdict() for rec in records], tuner.closed


class _TunerArms:
    """Steps per arm of an adaptive DDTree engine's rate tuner, from the
    counters its runner publishes for ``/metrics`` (``vllm_ddtree/core/stats.py``)."""

    def __init__(self, stats_file: str, names: list[str]):
        from vllm_ddtree.core.stats import CounterReader

        self.reader = CounterReader(stats_file)
        self.names = names

    def steps(self):
        import numpy as np

        snap = self.reader.read()
        if snap is None:  # the engine has not written yet
            return np.zeros(len(self.names))
        return snap.arm_steps[: len(self.names)].copy()


def _tuner_arms(llm) -> _TunerArms | None:
    """The tuner's arms of an in-process adaptive DDTree engine (None otherwise)."""
    spec = llm.llm_engine.vllm_config.speculative_config
    runtime = getattr(spec, "ddtree", None)
    if runtime is None or not runtime.adaptive or not runtime.stats_dir:
        return None
    from vllm_ddtree.core.stats import stats_file
    from vllm_ddtree.core.tuner import tuner_arms

    names = [a.name for a in tuner_arms(runtime.budget)]
    return _TunerArms(stats_file(runtime.stats_dir, 0), names)


class Arms:
    """Named offline engines in worker processes (see the module docstring)."""

    def __init__(self, jobs: dict[str, dict], start_timeout: float = 1200) -> None:
        self.jobs = jobs
        self.names = list(jobs)
        self.start_timeout = start_timeout
        self._procs: dict[str, tuple[Any, Any]] = {}

    def __enter__(self) -> Arms:
        ctx = mp.get_context("spawn")
        for name, job in self.jobs.items():
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(job, child), daemon=False)
            proc.start()
            if not parent.poll(self.start_timeout):
                proc.kill()
                raise TimeoutError(f"arm {name}: the engine did not start")
            status, detail = parent.recv()
            if status != "ready":
                proc.kill()
                raise RuntimeError(f"arm {name}: the engine failed to start:\n{detail}")
            self._procs[name] = (proc, parent)
        return self

    def run(self, name: str, prompts, sampling, timeout: float = 3600) -> dict:
        proc, conn = self._procs[name]
        conn.send((prompts, sampling))
        if not conn.poll(timeout):
            raise TimeoutError(f"arm {name}: no result in {timeout} s")
        status, detail = conn.recv()
        if status != "ok":
            raise RuntimeError(f"arm {name} failed:\n{detail}")
        return detail

    def __exit__(self, *exc) -> None:
        for proc, conn in self._procs.values():
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc, _ in self._procs.values():
            proc.join(timeout=120)
            if proc.is_alive():
                proc.kill()
