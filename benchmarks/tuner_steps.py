"""What the default's rate tuner sees, step by step.

    python -m benchmarks.tuner_steps --config hybrid --concurrency 1 --batches 12 \\
        --out benchmarks/results/tuner_steps_hybrid_c1.json.gz

runs the default engine of one ``bench_default`` configuration (adaptive
DDTree, at most 64 nodes, compiled, greedy) in this process on
``--batches`` batches of ``--concurrency`` HumanEval prompts, and records
every step the tuner is told about (``RateTuner.observe``): the arm that
decided it, the requests, the tokens committed, the busy seconds charged
(the runner's step plus the engine's gap to the next one, idle left out),
the raw gap, the query tokens verified, whether the drafter ran, the shadow
counts the runner reported, and the bucket's incumbent and exploring budget.

It prints, per arm, the counted steps, the median step time and gap, the
tokens per request per step and the rate they make (tokens/s per request);
the plain steps by their position after a switch away from a tree arm
(does a plain step right after tree steps cost what a later one does?); and
per batch (one prompt at one request: one text) what the default delivered
against what plain delivered on the same text, with every arm's rate there.
With ``--out`` the steps are kept as JSON; ``--summary JSON`` prints the
tables of a saved run again.

``--alternate ARM N`` takes the choice away from the tuner: the engine runs
plain for ``N`` steps, then ``ARM`` (e.g. ``fixed8``) for ``N``, and so on,
so that the steps after a switch are not a selection of the text the tuner
happened to explore on. Each step also records the target's forward and the
scheduler's ``schedule`` (microseconds); the table of plain steps after a
switch shows them, telling a cost of the step's own work from a slowdown of
the whole process::

    python -m benchmarks.tuner_steps --config dense --batches 6 --alternate fixed8 12

A diagnosis of the tuner's inputs, not a speed verdict: the verdict is
``bench_default`` (arms interleaved, several rounds).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AFTER_SWITCH = 12  # plain steps after a switch shown one by one; later ones pooled


def _force_alternation(tuner_cls, arm: str, period: int) -> None:
    """``RateTuner.arm`` runs plain for ``period`` steps, then ``arm``, in turn."""
    count = [0]

    def alternate(self, num_reqs):
        count[0] += 1
        if (count[0] // period) % 2 == 0:
            return self.arms[0]
        for a in self.arms:
            if a.name == arm:
                return a
        raise SystemExit(f"--alternate: no arm {arm!r}; the tuner has "
                         f"{', '.join(a.name for a in self.arms)}")

    tuner_cls.arm = alternate


def _timed(cls, name: str, into: dict, key: str) -> None:
    """Add each call's microseconds to ``into[key]``."""
    fn = getattr(cls, name)

    def timed(*args, **kwargs):
        t0 = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            into[key] = into.get(key, 0.0) + (time.perf_counter_ns() - t0) / 1e3

    setattr(cls, name, timed)


def record(config: str, concurrency: int, batches: int, max_tokens: int | None,
           alternate: tuple[str, int] | None = None) -> list[dict]:
    """Every step the default engine's tuner observed, in order."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process
    # (bench_default's arm environments keep it so)
    from benchmarks.bench_default import arms, configuration
    from benchmarks.run_llm import humaneval_prompts
    from vllm_ddtree.core import step_clock, tuner

    steps: list[dict] = []
    last_gap = [0.0]
    batch = [0]
    busy = step_clock.BusyGap.busy
    observe = tuner.RateTuner.observe

    def busy_recorded(self, gap):
        last_gap[0] = gap
        return busy(self, gap)

    # the observed step's phases (observe runs as the next step starts, after
    # its schedule: that one belongs to the next step)
    phases: dict[str, float] = {}
    done: dict[str, float] = {}
    chosen = [None]

    def arm_recorded(self, num_reqs):
        a = arm_of(self, num_reqs)
        chosen[0] = a.name
        return a

    def observe_recorded(self, num_reqs, tokens, seconds, counted=True, verified=None,
                         drafted=False, shadow=None):
        bucket = self._buckets.get(tuner.bucket_of(num_reqs))
        steps.append({"arm": chosen[0], "reqs": num_reqs, "tokens": tokens,
                      "seconds": round(seconds, 7), "gap": round(last_gap[0], 7),
                      "counted": counted, "verified": verified, "drafted": drafted,
                      "shadow": None if shadow is None else {str(b): n for b, n in shadow.items()},
                      "best": bucket.best if bucket is not None else None,
                      "credit": round(bucket.credit, 4) if bucket is not None else None,
                      "texts": round(self._texts, 2),
                      "batch": batch[0], "forward_us": round(done.get("forward", 0.0), 1),
                      "schedule_us": round(done.get("schedule", 0.0), 1)})
        return observe(self, num_reqs, tokens, seconds, counted, verified, drafted, shadow)

    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    schedule = Scheduler.schedule

    def schedule_timed(self, *args, **kwargs):
        done.clear()
        done.update(phases)  # the step that just ended
        phases.clear()
        t0 = time.perf_counter_ns()
        try:
            return schedule(self, *args, **kwargs)
        finally:
            phases["schedule"] = (time.perf_counter_ns() - t0) / 1e3

    Scheduler.schedule = schedule_timed
    _timed(GPUModelRunner, "_model_forward", phases, "forward")
    step_clock.BusyGap.busy = busy_recorded
    if alternate is not None:
        _force_alternation(tuner.RateTuner, *alternate)
    arm_of = tuner.RateTuner.arm
    tuner.RateTuner.arm = arm_recorded
    tuner.RateTuner.observe = observe_recorded
    job = arms(configuration(config))["default"]
    os.environ.update({k: str(v) for k, v in job["env"].items()})
    from vllm import LLM, SamplingParams

    kwargs = dict(dtype="float32", max_model_len=2048, seed=0)
    kwargs.update(job["llm"])
    llm = LLM(model=job["model"], speculative_config=job["speculative_config"], **kwargs)
    pool = humaneval_prompts(164)
    params = SamplingParams(temperature=0.0, ignore_eos=True,
                            max_tokens=max_tokens or max(64, -(-1024 // concurrency)))
    t0 = time.perf_counter()
    for b in range(batches):
        batch[0] = b
        prompts = [pool[(b * concurrency + i) % len(pool)] for i in range(concurrency)]
        llm.generate(prompts, params, use_tqdm=False)
        print(f"[tuner_steps] batch {b + 1}/{batches}, {len(steps)} steps, "
              f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return steps


def runs_of(steps: list[dict]) -> list[tuple[str | None, list[dict]]]:
    """Consecutive steps of one arm, in order."""
    runs: list[tuple[str | None, list[dict]]] = []
    for s in steps:
        if not runs or runs[-1][0] != s["arm"]:
            runs.append((s["arm"], []))
        runs[-1][1].append(s)
    return runs


def arm_rates(steps: list[dict]) -> dict[str, float]:
    """Per arm, tokens/s per request over its counted steps past the first of
    each run of it (that one verifies the previous arm's drafts)."""
    sums: dict[str, list[float]] = {}
    for arm, run in runs_of(steps):
        for s in run[1:]:
            if s["counted"]:
                acc = sums.setdefault(str(arm), [0.0, 0.0])
                acc[0] += s["tokens"] / s["reqs"]
                acc[1] += s["seconds"]
    return {a: t / sec for a, (t, sec) in sums.items() if sec > 0}


def per_batch(steps: list[dict]) -> str:
    """Markdown: per batch, the default's rate against plain's on the same
    text, and the ratio of the time plain alone would have taken (at each
    batch's plain rate) to the time the default took. Empty without the
    batch of each step (runs recorded before it was kept)."""
    if not steps or "batch" not in steps[0]:
        return ""
    lines = ["| batch | steps | default | plain | other arms (tokens/s per request, counted "
             "steps) |", "| ---: | ---: | ---: | ---: | --- |"]
    took = plain_alone = 0.0
    for b in sorted({s["batch"] for s in steps}):
        ss = [s for s in steps if s["batch"] == b]
        counted = [s for s in ss if s["counted"]]
        per_req = sum(s["tokens"] / s["reqs"] for s in counted)
        seconds = sum(s["seconds"] for s in counted)
        rates = arm_rates(ss)
        steps_of = {}
        for arm, run in runs_of(ss):
            steps_of[str(arm)] = steps_of.get(str(arm), 0) + sum(s["counted"] for s in run[1:])
        plain = rates.get("plain")
        if plain and seconds:
            took += seconds
            plain_alone += per_req / plain
        others = ", ".join(f"{a} {r:.0f} ({steps_of[a]})" for a, r in
                           sorted(rates.items(), key=lambda kv: -kv[1]) if a != "plain")
        lines.append(f"| {b} | {len(ss)} | {per_req / seconds if seconds else 0:.0f} | "
                     f"{plain:.0f} | {others} |" if plain else
                     f"| {b} | {len(ss)} | {per_req / seconds if seconds else 0:.0f} | - | "
                     f"{others} |")
    if took:
        lines += ["", f"The default over plain on the same text (plain's time at each "
                  f"batch's plain rate over the default's time): {plain_alone / took:.3f}x"]
    return "\n".join(lines)


def summary(steps: list[dict]) -> str:
    """Markdown: per arm, and plain steps by their position after a switch."""
    runs = runs_of(steps)
    by_arm: dict[str, list[dict]] = {}
    for arm, run in runs:
        # a run's first step verifies what the previous arm drafted (the
        # tuner does not count it either)
        by_arm.setdefault(str(arm), []).extend(s for s in run[1:] if s["counted"])
    lines = [f"{len(steps)} steps, {len(runs)} runs of one arm", "",
             "| arm | counted steps | step, ms (median) | gap, ms | tokens/request/step "
             "| tokens/s per request |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for arm, ss in sorted(by_arm.items(), key=lambda kv: -len(kv[1])):
        if not ss:
            continue
        sec = statistics.median(s["seconds"] for s in ss)
        per = statistics.fmean(s["tokens"] / s["reqs"] for s in ss)
        lines.append(f"| {arm} | {len(ss)} | {1e3 * sec:.2f} | "
                     f"{1e3 * statistics.median(s['gap'] for s in ss):.2f} | {per:.2f} | "
                     f"{per / sec:.0f} |")
    after: dict[int, list[dict]] = {}
    for (prev, _), (arm, run) in zip(runs, runs[1:]):
        if arm != "plain" or prev in (None, "plain"):
            continue
        for i, s in enumerate(run[1:], start=1):
            if s["counted"]:
                after.setdefault(min(i, AFTER_SWITCH), []).append(s)
    if after:
        phased = "forward_us" in next(iter(after.values()))[0]
        lines += ["", "Plain steps after a switch from a tree arm (medians):", "",
                  "| step of the plain run | steps | ms | target forward, us | schedule, us |"
                  if phased else "| step of the plain run | steps | ms |",
                  "| ---: | ---: | ---: | ---: | ---: |" if phased else "| ---: | ---: | ---: |"]
        for i in sorted(after):
            ss = after[i]
            label = f"{i}+" if i == AFTER_SWITCH else str(i)
            row = f"| {label} | {len(ss)} | {1e3 * statistics.median(s['seconds'] for s in ss):.2f} |"
            if phased:
                row += (f" {statistics.median(s['forward_us'] for s in ss):.0f} |"
                        f" {statistics.median(s['schedule_us'] for s in ss):.0f} |")
            lines.append(row)
    batches = per_batch(steps)
    if batches:
        lines += ["", "Per batch (tokens/s per request):", "", batches]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="hybrid",
                    help="a bench_default configuration (dense, dense_k7, hybrid, heavy)")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--batches", type=int, default=12)
    ap.add_argument("--max-tokens", type=int,
                    help="per request (default: as bench_default, 1024 tokens a batch)")
    ap.add_argument("--out", help="JSON (gzipped if it ends in .gz): every step, with the "
                    "arguments")
    ap.add_argument("--summary", metavar="JSON", help="print the tables of a saved run")
    ap.add_argument("--alternate", nargs=2, metavar=("ARM", "N"),
                    help="run plain and ARM (e.g. fixed8) for N steps each, in turn, "
                    "instead of the tuner's choice")
    args = ap.parse_args()
    if args.summary:
        print(summary(json.loads(gzip.decompress(Path(args.summary).read_bytes())
                                 if args.summary.endswith(".gz")
                                 else Path(args.summary).read_text())["steps"]))
        return
    if args.concurrency < 1 or args.batches < 1:
        raise SystemExit("--concurrency and --batches must be at least 1")
    alternate = None
    if args.alternate:
        arm, period = args.alternate
        if not period.isdigit() or int(period) < 2:
            raise SystemExit(f"--alternate: N must be an integer >= 2, got {period!r}")
        alternate = (arm, int(period))
    steps = record(args.config, args.concurrency, args.batches, args.max_tokens, alternate)
    if args.out:
        text = json.dumps({"args": vars(args), "steps": steps}, separators=(",", ":"))
        Path(args.out).write_bytes(gzip.compress(text.encode()) if args.out.endswith(".gz")
                                   else text.encode())
    print(summary(steps))


if __name__ == "__main__":
    main()
