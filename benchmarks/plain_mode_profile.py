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
run and each part's share of the measured time.

A diagnosis (sequential runs, one engine alive at a time), not a verdict:
``bench_default`` is that (arms alive together, interleaved, several rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("_ddtree_plain_step", "_ddtree_store_pending_context",
         "_ddtree_settle_pending_context")


def _timed(cls, name: str, acc: dict) -> None:
    fn = getattr(cls, name)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            calls, secs = acc.get(name, (0, 0.0))
            acc[name] = (calls + 1, secs + time.perf_counter() - t0)

    setattr(cls, name, timed)


def run_one(config: str, arm: str, c: int, warmup: int, batches: int) -> dict:
    """One engine in this process: tokens/s and the timed parts."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from benchmarks.bench_default import arms, configuration
    from benchmarks.run_llm import humaneval_prompts

    job = arms(configuration(config))[arm]
    os.environ.update({k: str(v) for k, v in job["env"].items()})
    acc: dict[str, tuple[int, float]] = {}
    rows = [0]
    if arm == "default":
        from vllm_ddtree import runner as runner_mod
        from vllm_ddtree.core import tuner
        from vllm_ddtree.proposer import DDTreeProposer

        tuner.RateTuner.arm = lambda self, num_reqs: self.arms[0]  # plain, always
        for name in PARTS:
            _timed(runner_mod.DDTreeRunnerMixin, name, acc)
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
    rows[0] = 0
    tokens, t0 = 0, time.perf_counter()
    for b in range(batches):
        tokens += batch(7 * (b + 1))
    seconds = time.perf_counter() - t0
    return {"arm": arm, "tok_s": tokens / seconds, "seconds": seconds, "stored_rows": rows[0],
            "parts": {k: {"calls": n, "seconds": s} for k, (n, s) in acc.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="dense",
                    help="a bench_default configuration (dense, dense_k7, hybrid, heavy)")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2,
                    help="runs per arm, alternating default and plain")
    ap.add_argument("--out", help="JSON: every run")
    ap.add_argument("--one", nargs=2, metavar=("ARM", "JSON"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if min(args.concurrency, args.batches, args.repeats) < 1 or args.warmup < 0:
        raise SystemExit("--concurrency, --batches and --repeats must be at least 1, "
                         "--warmup at least 0")
    if args.one:  # a child's run (vLLM logs to stdout: the result goes to a file)
        arm, path = args.one
        Path(path).write_text(json.dumps(run_one(args.config, arm, args.concurrency,
                                                 args.warmup, args.batches)))
        return 0
    runs = []
    for r in range(args.repeats):
        for arm in ("default", "plain"):
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "run.json"
                cmd = [sys.executable, "-m", "benchmarks.plain_mode_profile",
                       "--one", arm, str(path), "--config", args.config,
                       "--concurrency", str(args.concurrency), "--warmup", str(args.warmup),
                       "--batches", str(args.batches)]
                out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
                if out.returncode or not path.exists():
                    sys.stderr.write(out.stdout[-2000:] + out.stderr[-4000:])
                    raise SystemExit(f"the {arm} run failed ({out.returncode})")
                res = json.loads(path.read_text())
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
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
