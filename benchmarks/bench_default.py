"""Is the default the fastest way to decode? Every arm, every load, several pairs.

    python -m benchmarks.bench_default --config dense dense_k7 hybrid heavy \\
        --concurrency 1 4 16 64 --rounds 3 --plot docs/default_speed.png

For each configuration, the arms run as offline engines alive at once
(``benchmarks/interleave.py``), compiled, greedy, and are driven in turn:
for every round, every concurrency ``c`` (``c`` HumanEval prompts at once,
at least ``--min-tokens`` output tokens per measurement), every arm. The
arms: plain decoding, the DFlash chain with the same drafter, DDTree at a
fixed budget of 4, 8, 16, 32 and 64, and DDTree's default (adaptive, at most
64 nodes). ``--warmup`` passes per concurrency come first, for every arm
alike (the first also checks that every arm's greedy output equals plain
decoding's; a mismatch stops the run in fp32, and is counted for the bf16
hybrid, whose near-ties tests/test_e2e_hybrid.py judges): the default learns what each arm
delivers while serving, as a server would over its first seconds. Because each engine sees the load change from one concurrency to the
next and back (1, 4, 16, 64, 1, ...), the default's adaptation to load is
part of what is measured.

Configurations:

``dense``     the bundled pair (fp32; chain K = 15)
``dense_k7``  the same pair limited to 7 drafter positions
              (``ddtree_max_depth: 7``; chain K = 7)
``hybrid``    the bundled Gated DeltaNet hybrid (bf16; chain K = 15)
``heavy``     the bundled pair with its target padded to about 80M parameters
              that add exactly zero (``benchmarks/tiny_pair/heavy.py``): a
              weight-bound step, the same predictions

Per (configuration, c): tokens/s per arm (median over rounds), the best
non-default arm, the default's ratio to it (of the medians, and the median of
the same ratio within each round; each round starts one arm further on), and
the steps the default's rate tuner gave each of its arms (plain, fixed
budgets, the cost model), read from the counters behind ``/metrics``, and
every trial the tuner closed, with its own numbers (``--trials JSON`` prints
them, one line per measurement). Results:
``benchmarks/results/default_<config>.json``, a Markdown table on stdout,
and with ``--plot`` tokens/s against concurrency per configuration.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.interleave import Arms
from benchmarks.run_llm import humaneval_prompts

ROOT = Path(__file__).resolve().parents[1]
FIXED = (4, 8, 16, 32, 64)
DEFAULT_BUDGET = 64


def configuration(name: str) -> dict:
    models = ROOT / "models"
    if name in ("dense", "dense_k7"):
        target, drafter, dtype = models / "tiny-qwen3", models / "tiny-qwen3-dflash", "float32"
    elif name == "hybrid":
        target, drafter, dtype = models / "tiny-qwen35", models / "tiny-qwen35-dflash", "bfloat16"
    elif name == "heavy":
        from benchmarks.tiny_pair.heavy import heavy_target

        target = heavy_target()
        drafter, dtype = Path(f"{target}-dflash"), "float32"
    else:
        raise SystemExit(f"--config: unknown configuration {name!r}; choose from dense, "
                         f"dense_k7, hybrid, heavy")
    depth = 7 if name == "dense_k7" else None
    llm = {"dtype": dtype, "enforce_eager": False, "max_model_len": 2048,
           "max_num_seqs": 128}
    if name == "hybrid":
        llm["enable_prefix_caching"] = False
    return {"target": str(target), "drafter": str(drafter), "depth": depth, "llm": llm}


def arms(cfg: dict, plain_sync: bool = False) -> dict[str, dict]:
    """Every arm's engine job; ``plain_sync`` adds ``plain_sync``, plain
    decoding without vLLM's asynchronous scheduling (DDTree runs without it)."""
    drafter, depth = cfg["drafter"], cfg["depth"]
    extra = {"ddtree_max_depth": depth} if depth else {}
    specs = {"plain": None,
             "chain": {"method": "dflash", "model": drafter,
                       "num_speculative_tokens": depth or 15}}
    for b in FIXED:
        specs[f"fixed{b}"] = {"method": "ddtree", "model": drafter, "num_speculative_tokens": b,
                              "ddtree_adaptive": False, **extra}
    specs["default"] = {"method": "ddtree", "model": drafter,
                        "num_speculative_tokens": DEFAULT_BUDGET, **extra}
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    jobs = {name: {"model": cfg["target"], "speculative_config": spec, "llm": cfg["llm"],
                   "env": env} for name, spec in specs.items()}
    if plain_sync:
        jobs["plain_sync"] = dict(jobs["plain"], llm=dict(cfg["llm"], async_scheduling=False))
    return jobs


def run_config(name: str, args) -> dict:
    cfg = configuration(name)
    jobs = arms(cfg, plain_sync=args.plain_sync)
    pool = humaneval_prompts(164)
    rates: dict[str, dict[int, list[float]]] = {a: {c: [] for c in args.concurrency}
                                                for a in jobs}
    taus: dict[str, dict[int, list[float]]] = {a: {c: [] for c in args.concurrency}
                                               for a in jobs}
    # the default's rate tuner: steps per arm in each measured round
    tuner: dict[int, list[dict[str, float]]] = {c: [] for c in args.concurrency}
    # and every trial its tuner closed, in order, with the tuner's own numbers
    trials: list[dict] = []

    def keep_trials(res: dict, phase: str, c: int) -> None:
        if res.get("trials"):
            trials.append({"phase": phase, "c": c, "trials": res["trials"]})
    t0 = time.time()
    with Arms(jobs) as engines:
        print(f"[{name}] {len(jobs)} engines ready in {time.time() - t0:.0f} s",
              file=sys.stderr, flush=True)

        def workload(c: int, offset: int):
            max_tokens = max(args.min_output, -(-args.min_tokens // c))
            prompts = [pool[(offset + i) % len(pool)] for i in range(c)]
            return prompts, {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}

        for c in args.concurrency:  # warm-up, and the arms must agree
            prompts, sampling = workload(c, 0)
            results = {a: engines.run(a, prompts, sampling) for a in engines.names}
            keep_trials(results["default"], "warm-up 1", c)
            outs = {a: res["outputs"] for a, res in results.items()}
            bad = [a for a in outs if outs[a] != outs["plain"]]
            if bad and cfg["llm"]["dtype"] == "float32":
                raise RuntimeError(f"[{name}] c={c}: greedy outputs of {bad} differ from "
                                   f"plain decoding")
            if bad:  # bf16 (the hybrid): near-ties, judged by tests/test_e2e_hybrid.py
                same = {a: sum(x == y for x, y in zip(outs[a], outs["plain"])) for a in bad}
                print(f"[{name}] c={c}: bf16 outputs identical to plain's on "
                      f"{same} of {len(prompts)} prompts (near-ties are judged with an fp32 "
                      f"rescoring in tests/test_e2e_hybrid.py)", file=sys.stderr, flush=True)
            for w in range(1, args.warmup):
                prompts, sampling = workload(c, 100 + w)
                for a in engines.names:
                    res = engines.run(a, prompts, sampling)
                    if a == "default":
                        keep_trials(res, f"warm-up {w + 1}", c)
        for r in range(args.rounds):
            # each round starts one arm further on: no arm always runs first
            # or right after the same neighbour
            order = engines.names[r % len(jobs):] + engines.names[:r % len(jobs)]
            for c in args.concurrency:
                prompts, sampling = workload(c, 7 * (r + 1))
                for a in order:
                    res = engines.run(a, prompts, sampling)
                    rates[a][c].append(res["num_tokens"] / res["seconds"])
                    if res["drafts"]:
                        taus[a][c].append(1 + res["accepted_tokens"] / res["drafts"])
                    if a == "default":
                        tuner[c].append(res.get("arm_steps", {}))
                        keep_trials(res, f"round {r + 1}", c)
                line = ", ".join(f"{a} {rates[a][c][-1]:.0f}" for a in engines.names)
                print(f"[{name}] round {r + 1} c={c}: {line}", file=sys.stderr, flush=True)
    cells = {}
    for c in args.concurrency:
        med = {a: statistics.median(rates[a][c]) for a in jobs}
        others = {a: v for a, v in med.items() if a != "default"}
        best = max(others, key=others.get)
        paired = [d / b for d, b in zip(rates["default"][c], rates[best][c])]
        steps: dict[str, float] = {}
        for rnd in tuner[c]:
            for arm, n in rnd.items():
                steps[arm] = steps.get(arm, 0.0) + n
        cells[c] = {"tok_s": med, "best_other": best,
                    "default_over_best": med["default"] / others[best],
                    # the same ratio within each round (the two arms minutes
                    # apart at most), median over rounds
                    "paired_ratio": statistics.median(paired),
                    "default_arm_steps": steps,
                    "tau": {a: statistics.median(t) if t else None
                            for a, t in ((a, taus[a][c]) for a in jobs)},
                    "rounds": {a: rates[a][c] for a in jobs}}
    return {"config": name, "models": cfg, "cells": cells, "default_trials": trials}


def markdown(result: dict) -> str:
    cells = result["cells"]
    concs = list(cells)
    arms_ = list(next(iter(cells.values()))["tok_s"])
    lines = [f"\n**{result['config']}** (tokens/s, median of rounds)\n",
             "| arm | " + " | ".join(f"c={c}" for c in concs) + " |",
             "| --- | " + " | ".join("---:" for _ in concs) + " |"]
    for a in arms_:
        row = []
        for c in concs:
            v = cells[c]["tok_s"][a]
            mark = "**" if a == cells[c]["best_other"] else ""
            row.append(f"{mark}{v:.1f}{mark}")
        lines.append(f"| {a} | " + " | ".join(row) + " |")
    lines.append("| default / best other | " + " | ".join(
        f"{cells[c]['default_over_best']:.2f}x" for c in concs) + " |")
    if "plain_sync" in arms_:  # a diagnosis arm: the verdict's arms without it
        lines.append("| default / best other but plain_sync | " + " | ".join(
            f"{_over_best(cells[c]['tok_s'], skip=('plain_sync',)):.2f}x" for c in concs)
            + " |")
    paired = all("paired_ratio" in cells[c] for c in concs)
    if paired:
        lines.append("| same, per round (median) | " + " | ".join(
            f"{cells[c]['paired_ratio']:.2f}x" for c in concs) + " |")
    if all("rounds" in cells[c] for c in concs):
        # how far the rounds spread: the default over the best other arm in
        # each round, and the best other arm's own fastest round over its
        # slowest (the machine's noise, with the arm's engine unchanged)
        spans = [_per_round(cells[c]) for c in concs]
        best = [cells[c]["rounds"][cells[c]["best_other"]] for c in concs]
        lines.append("| same, per round (range) | " + " | ".join(
            f"{min(r):.2f}-{max(r):.2f}" for r in spans) + " |")
        lines.append("| best other, fastest / slowest round | " + " | ".join(
            f"{max(r) / min(r):.2f}x" for r in best) + " |")
    if paired:
        lines.append("| default's steps by arm | " + " | ".join(
            _shares(cells[c]["default_arm_steps"]) for c in concs) + " |")
    return "\n".join(lines) + "\n"


def _over_best(med: dict[str, float], skip: tuple[str, ...] = ()) -> float:
    """The default's rate over the best other arm's, leaving out ``skip``."""
    return med["default"] / max(v for a, v in med.items() if a != "default" and a not in skip)


def _per_round(cell: dict) -> list[float]:
    """The default over the cell's best other arm, round by round."""
    rounds = cell["rounds"]
    return [d / b for d, b in zip(rounds["default"], rounds[cell["best_other"]])]


def trial_story(result: dict) -> str:
    """The default's tuner trials of a recorded run, one line per measurement:
    each trial as arm (its ratio over the incumbent's latest trial, if
    compared), ``->`` marking a new incumbent, ``[lo-hi]`` a trial in another
    batch-size bucket than the measurement's (a trial closes when the first
    step of another bucket comes, so the last trial of one measurement is
    listed with the next), ``$`` a trial after which exploring's budget
    was spent (the incumbent runs until it is earned back)."""
    from vllm_ddtree.core.tuner import bucket_of, bucket_range

    lines = [f"\n{result['config']}: the default's trials (ratio over the incumbent; "
             f"-> a switch; $ exploring's budget spent)"]
    for part in result.get("default_trials", []):
        items = []
        for t in part["trials"]:
            ratio = f" {t['ratio']:.2f}" if t["ratio"] is not None else ""
            switch = "->" if t["best"] == t["arm"] and t["ratio"] is not None else ""
            lo, hi = bucket_range(t["bucket"])
            other = (f"[{lo}]" if hi == lo else f"[{lo}-{hi or ''}]") \
                if t["bucket"] != bucket_of(part["c"]) else ""
            spent = "$" if t.get("credit", 0.0) < 0 else ""
            items.append(f"{switch}{t['arm']}{other}{ratio}{spent}")
        lines.append(f"  {part['phase']:>9} c={part['c']:<3} " + ", ".join(items))
    return "\n".join(lines) + "\n"


def _shares(steps: dict[str, float]) -> str:
    """The default's steps per arm as percentages, largest first."""
    total = sum(steps.values())
    if not total:
        return "-"
    top = sorted(steps.items(), key=lambda kv: -kv[1])
    return " ".join(f"{a} {100 * n / total:.0f}%" for a, n in top if n / total >= 0.005)


def plot(results: list[dict], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.4 * len(results), 3.8))
    axes = [axes] if len(results) == 1 else list(axes)
    # one colour per arm in every panel (a configuration run without an arm,
    # such as plain_sync, must not shift the others' colours)
    names = [a for res in results for a in next(iter(res["cells"].values()))["tok_s"]]
    colour = {a: f"C{i}" for i, a in enumerate(dict.fromkeys(n for n in names if n != "default"))}
    colour["default"] = "black"
    handles = {}
    for ax, res in zip(axes, results):
        concs = [int(c) for c in res["cells"]]
        arms_ = list(next(iter(res["cells"].values()))["tok_s"])
        for a in arms_:
            ys = [res["cells"][c if c in res["cells"] else str(c)]["tok_s"][a] for c in concs]
            width = 2.6 if a == "default" else 1
            (handles[a],) = ax.plot(concs, ys, marker="o", markersize=3, label=a,
                                    color=colour[a], linewidth=width)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(concs, [str(c) for c in concs])
        ax.set_xlabel("concurrency")
        ax.set_title(res["config"])
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("output tokens/s")
    axes[-1].legend(handles=[handles[a] for a in colour if a in handles], fontsize=7)
    fig.suptitle("DDTree's default against every arm (CPU, offline, interleaved)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", nargs="+", default=["dense", "dense_k7", "hybrid", "heavy"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--plain-sync", action="store_true",
                    help="one more arm: plain decoding without vLLM's asynchronous "
                         "scheduling, which DDTree turns off")
    ap.add_argument("--warmup", type=int, default=3,
                    help="warm-up passes per concurrency, every arm alike")
    ap.add_argument("--min-tokens", type=int, default=1024,
                    help="output tokens per measurement, at least")
    ap.add_argument("--min-output", type=int, default=64,
                    help="output tokens per request, at least")
    ap.add_argument("--tag", help="write default_<config>_<tag>.json (default: "
                                  "default_<config>.json, overwritten)")
    ap.add_argument("--plot", help="PNG: tokens/s against concurrency per configuration")
    ap.add_argument("--replot", nargs="+", metavar="JSON",
                    help="print the tables of recorded results and draw them (--plot) "
                         "instead of measuring")
    ap.add_argument("--trials", nargs="+", metavar="JSON",
                    help="print the default's tuner trials of recorded results")
    args = ap.parse_args()
    outdir = ROOT / "benchmarks" / "results"
    if args.trials:
        for p in args.trials:
            print(trial_story(json.loads(Path(p).read_text())))
        return 0
    if args.replot:
        recorded = [json.loads(Path(p).read_text()) for p in args.replot]
        for res in recorded:
            print(markdown(res))
        if args.plot:
            plot(recorded, args.plot)
            print(f"wrote {args.plot}")
        return 0
    outdir.mkdir(parents=True, exist_ok=True)
    results = []
    for name in args.config:
        res = run_config(name, args)
        res["args"] = vars(args)
        stem = f"default_{name}_{args.tag}" if args.tag else f"default_{name}"
        (outdir / f"{stem}.json").write_text(json.dumps(res, indent=1))
        print(markdown(res), flush=True)
        results.append(res)
    if args.plot:
        plot(results, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
