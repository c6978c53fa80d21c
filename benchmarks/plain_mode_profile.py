"""Where a plain-mode round goes: the default held at plain against a plain engine.

    python -m benchmarks.plain_mode_profile --config dense --concurrency 64 \\
        --out benchmarks/results/plain_mode_profile_dense_c64.json

runs, one after the other in this process's children (``--repeats`` times,
alternating: default, plain, default, ...), the ``default`` and ``plain``
engines of one ``bench_default`` configuration on ``bench_default``'s
workload at one concurrency: ``--warmup`` batches, then ``--batches``
measured ones. The default's rate tuner is held at plain, so every step is a
plain-mode step, and the runner's parts of a plain-mode round are timed:
the plain steps' bookkeeping (compacting the pending rows at their cap
included), storing the pending drafter context (at the cap, or when
drafting resumes), settling the blocks that change hands at each step
(``_ddtree_settle_pending_context``), the drafter's context store itself,
and the rows it stored. Prints tokens/s per
run and each part's share of the measured time. With ``--engine-parts``,
vLLM's phases of a step are timed too, in both engines (the engine core's
step, the scheduler's, the runner's input preparation, attention metadata,
forward, sampling and drafting; wrapped at ``GPUModelRunner``, so a
DDTree override's own work counts in its phase), and a table gives each
phase and each DDTree part in microseconds per step, side by side (each
wrapper adds well under a microsecond per call).

A diagnosis (sequential runs, one engine alive at a time), not a verdict:
``bench_default`` is that (arms alive together, interleaved, several rounds).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("_ddtree_plain_step", "_ddtree_store_pending_context",
         "_ddtree_settle_pending_context", "_ddtree_step_clock", "take_draft_token_ids")
# (module, class, method) of vLLM's phases of a step, timed with --engine-parts
ENGINE_PARTS = (
    [("vllm.v1.engine.llm_engine", "LLMEngine", "step"),
     ("vllm.v1.engine.output_processor", "OutputProcessor", "process_outputs"),
     ("vllm.v1.engine.core", "EngineCore", "step"),
     ("vllm.v1.engine.core", "EngineCore", "step_with_batch_queue"),
     ("vllm.v1.engine.core", "EngineCore", "post_step")]
    + [("vllm.v1.core.sched.scheduler", "Scheduler", m)
       for m in ("schedule", "update_from_output", "update_draft_token_ids")]
    + [("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", m)
       for m in ("_prepare_inputs", "_preprocess", "_build_attention_metadata",
                 "_model_forward", "sample_tokens", "_sample", "propose_draft_token_ids")])
STEP = "LLMEngine.step"  # one per engine step, with or without async scheduling


def _timed(cls, name: str, acc: dict, label: str | None = None) -> None:
    fn = getattr(cls, name)
    label = label or name

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            calls, secs = acc.get(label, (0, 0.0))
            acc[label] = (calls + 1, secs + time.perf_counter() - t0)

    setattr(cls, name, timed)


def run_one(config: str, arm: str, c: int, warmup: int, batches: int,
            engine_parts: bool = False) -> dict:
    """One engine in this process: tokens/s and the timed parts."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from benchmarks.bench_default import arms, configuration
    from benchmarks.run_llm import humaneval_prompts

    job = arms(configuration(config), plain_sync=True)[arm]
    os.environ.update({k: str(v) for k, v in job["env"].items()})
    acc: dict[str, tuple[int, float]] = {}
    rows = [0]
    engine: dict[str, tuple[int, float]] = {}
    for module, cls_name, method in ENGINE_PARTS if engine_parts else ():
        cls = getattr(importlib.import_module(module), cls_name)
        _timed(cls, method, engine, f"{cls_name}.{method}")
    if arm == "default":
        from vllm_ddtree import runner as runner_mod
        from vllm_ddtree.core import tuner
        from vllm_ddtree.core.pending_context import PendingContext
        from vllm_ddtree.proposer import DDTreeProposer

        tuner.RateTuner.arm = lambda self, num_reqs: self.arms[0]  # plain, always
        for name in PARTS:
            _timed(runner_mod.DDTreeRunnerMixin, name, acc)
        for name in ("add", "compact"):  # inside the plain step's bookkeeping
            _timed(PendingContext, name, acc, f"PendingContext.{name}")
        store = DDTreeProposer.store_context

        def counted(self, hidden, positions, slots):
            rows[0] += hidden.shape[0]
            return store(self, hidden, positions, slots)
        DDTreeProposer.store_context = counted
        _timed(DDTreeProposer, "store_context", acc)
    from vllm import LLM, SamplingParams

    llm = LLM(model=job["model"], speculative_config=job["speculative_config"], seed=0,
              **job["llm"])
    pool = humaneval_prompts(164)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max(64, -(-1024 // c)))

    def batch(offset: int) -> int:
        outs = llm.generate([pool[(offset + i) % len(pool)] for i in range(c)], params,
                            use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    for w in range(warmup):  # bench_default's warm-up prompts, then its rounds'
        batch(0 if w == 0 else 100 + w)
    acc.clear()
    engine.clear()
    rows[0] = 0
    tokens, t0 = 0, time.perf_counter()
    for b in range(batches):
        tokens += batch(7 * (b + 1))
    seconds = time.perf_counter() - t0
    return {"arm": arm, "tok_s": tokens / seconds, "seconds": seconds, "stored_rows": rows[0],
            "parts": {k: {"calls": n, "seconds": s} for k, (n, s) in acc.items()},
            "engine_parts": {k: {"calls": n, "seconds": s} for k, (n, s) in engine.items()}}


def per_step_table(runs: list[dict]) -> str:
    """Microseconds per engine step of each timed part, means over each
    arm's runs, default and plain side by side."""
    def us(run: dict) -> dict[str, float]:
        steps = run["engine_parts"][STEP]["calls"]
        parts = {**run["engine_parts"], **run["parts"]}
        return {k: 1e6 * p["seconds"] / steps for k, p in parts.items()}
    by_arm = {arm: [us(r) for r in runs if r["arm"] == arm] for arm in ("default", "plain")}
    names = list(dict.fromkeys(k for arm in by_arm.values() for run in arm for k in run))
    lines = ["| part | default, us/step | plain, us/step | difference |",
             "| --- | ---: | ---: | ---: |"]
    for name in names:
        cells = []
        for arm in ("default", "plain"):
            vals = [run[name] for run in by_arm[arm] if name in run]
            cells.append(sum(vals) / len(vals) if vals else None)
        d, p = cells
        lines.append(f"| {name} | {'' if d is None else f'{d:.1f}'} | "
                     f"{'' if p is None else f'{p:.1f}'} | "
                     f"{'' if d is None or p is None else f'{d - p:+.1f}'} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="dense",
                    help="a bench_default configuration (dense, dense_k7, hybrid, heavy)")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2,
                    help="runs per arm, alternating default and plain")
    ap.add_argument("--plain-sync", action="store_true",
                    help="compare with plain decoding without vLLM's asynchronous "
                         "scheduling (DDTree turns it off), not vLLM's default")
    ap.add_argument("--engine-parts", action="store_true",
                    help="also time vLLM's phases of a step; print a table per step")
    ap.add_argument("--out", help="JSON: every run")
    ap.add_argument("--one", nargs=2, metavar=("ARM", "JSON"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if min(args.concurrency, args.batches, args.repeats) < 1 or args.warmup < 0:
        raise SystemExit("--concurrency, --batches and --repeats must be at least 1, "
                         "--warmup at least 0")
    if args.one:  # a child's run (vLLM logs to stdout: the result goes to a file)
        arm, path = args.one
        Path(path).write_text(json.dumps(run_one(args.config, arm, args.concurrency,
                                                 args.warmup, args.batches,
                                                 args.engine_parts)))
        return 0
    runs = []
    plain_arm = "plain_sync" if args.plain_sync else "plain"
    for r in range(args.repeats):
        for arm in ("default", plain_arm):
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "run.json"
                cmd = [sys.executable, "-m", "benchmarks.plain_mode_profile",
                       "--one", arm, str(path), "--config", args.config,
                       "--concurrency", str(args.concurrency), "--warmup", str(args.warmup),
                       "--batches", str(args.batches)] + (
                           ["--engine-parts"] if args.engine_parts else [])
                out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
                if out.returncode or not path.exists():
                    sys.stderr.write(out.stdout[-2000:] + out.stderr[-4000:])
                    raise SystemExit(f"the {arm} run failed ({out.returncode})")
                res = json.loads(path.read_text())
            res["arm"] = "plain" if arm == plain_arm else arm  # the tables' column
            runs.append(res)
            line = f"{arm}: {res['tok_s']:.0f} tokens/s"
            if res["parts"]:
                line += f", stored rows {res['stored_rows']}" + "".join(
                    f", {k} {100 * p['seconds'] / res['seconds']:.1f} % ({p['calls']} calls)"
                    for k, p in sorted(res["parts"].items(), key=lambda kv: -kv[1]["seconds"]))
            print(f"[{r + 1}/{args.repeats}] {line}", flush=True)
    default = [x["tok_s"] for x in runs if x["arm"] == "default"]
    plain = [x["tok_s"] for x in runs if x["arm"] == "plain"]
    print(f"default held at plain over plain (means of the runs): "
          f"{sum(default) / len(default) / (sum(plain) / len(plain)):.3f}x")
    if args.engine_parts:
        print(per_step_table(runs))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
