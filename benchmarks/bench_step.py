"""Per-step cost of a verification step: DFlash chain vs DDTree at the same width.

    python -m benchmarks.bench_step --concurrency 1 4 16 --rounds 3

Two offline engines (the chain with K draft tokens, DDTree with budget B = K,
so both verify 1 + K tokens per request) run in two worker processes that are
alive at once, compiled (vLLM's default). The driver interleaves them (chain,
tree, chain, tree, ...), so machine noise hits both alike. Each worker runs
its engine in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and times the
model runner's hooks per step:

======================  =====================================================
stage                   what it covers
======================  =====================================================
``step``                ``execute_model`` + ``sample_tokens`` (the runner's
                        whole step, scheduler and detokenizer excluded)
``prepare``             ``_prepare_inputs`` (vLLM's inputs, then DDTree's plan)
``plan``                ``TreeRound.plan`` (positions, match, mask; DDTree)
``mask``                ``tree.ancestor_mask`` (inside ``plan``)
``metadata``            ``_build_attention_metadata`` (+ ``TreeRound.attach``)
``forward``             ``_model_forward``: the target forward
``attention``           the target's attention calls (inside ``forward``)
``verify``              ``_sample``: rejection sampler, or DDTree's node
                        samples, walk and compaction
``walk``                ``tree.walk`` (inside ``verify``)
``compaction``          ``TreeRound.compact`` (inside ``verify``)
``draft``               ``propose_draft_token_ids``: the drafter
``condition``           ``TreeRound.condition`` (inside ``draft``)
``build``               ``build_tree`` or its native CPU kernel (inside
                        ``draft``; the log-softmax before it is not included)
======================  =====================================================

Only steps in which every one of the ``c`` requests of a round is verifying
drafts (no prefill, none finished yet) count.

``--plain-mode`` compares instead a plain engine (no speculation) with a
DDTree engine held in plain mode (a pinned cost model under which trees never
pay, so the adaptive budget verifies nothing: ``VLLM_DDTREE_COST_MODEL=1,1,5``),
counting the steps in which every request decodes one token without drafts
(the plain-mode engine's probe steps are left out; ``--plain-sync`` runs
the plain engine without vLLM's asynchronous scheduling, as DDTree runs).
A plain-mode step must cost what a plain step costs::

    python -m benchmarks.bench_step --plain-mode --concurrency 1 4 16 --rounds 3

and, for a Gated DeltaNet hybrid (bf16), add ``--target models/tiny-qwen35
--drafter models/tiny-qwen35-dflash --dtype bfloat16``. Per (arm, concurrency) the
script reports the median over rounds of each round's median per stage, the
tree/chain ratio of the step time, and tokens/s and acceptance length of the
same runs. Results: ``benchmarks/results/step_<tag>.json`` and a Markdown
table on stdout (``--markdown`` writes it to a file too).

``--held B`` compares instead a fixed-budget engine (budget ``B``, no
adaptive budget) with the default engine (budget ``--max-budget``, adaptive)
whose rate tuner is held at the fixed arm ``B``: the cost of a step of the
default's fixed arm over the same step of an engine built for it::

    python -m benchmarks.bench_step --held 4 --concurrency 1 4 16 --rounds 3

    python -m benchmarks.bench_step --plot BEFORE.json AFTER.json --out docs/step_cost.png

draws, from recorded results, DDTree's extra time per stage over the chain
at each concurrency, one bar per result file.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
from collections import defaultdict
from pathlib import Path

from vllm_ddtree.core.tuner import budget_ladder

ROOT = Path(__file__).resolve().parents[1]

STAGES = ["step", "prepare", "plan", "mask", "metadata", "forward", "attention", "verify",
          "walk", "compaction", "draft", "condition", "build"]


# ---------------------------------------------------------------------------
# Worker: one engine, instrumented
# ---------------------------------------------------------------------------


class StepTimer:
    """Per-step stage times of one runner (seconds), recorded on the host."""

    def __init__(self) -> None:
        self.cur: dict[str, float] | None = None
        self.steps: list[dict] = []
        self.in_forward = False
        self.keep = False

    def timed(self, fn, stage: str):
        """``fn``, adding its wall time to ``stage`` of the current step."""
        timer = self

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if timer.cur is not None:
                    timer.cur[stage] = timer.cur.get(stage, 0.0) + time.perf_counter() - t0

        return timed

    def wrap(self, owner, name: str, stage: str) -> None:
        setattr(owner, name, self.timed(getattr(owner, name), stage))


def _instrument(llm, timer: StepTimer, ddtree: bool, c_ref: list[int], plain_steps: bool):
    import vllm_ddtree.proposer as proposer_mod
    import vllm_ddtree.core.tree as tree_mod
    from vllm.model_executor.layers.attention import Attention

    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner

    execute = runner.execute_model
    sample_tokens = runner.sample_tokens

    def execute_model(scheduler_output, *args, **kwargs):
        so = scheduler_output
        spec = so.scheduled_spec_decode_tokens
        n = so.num_scheduled_tokens
        decoding = (not so.scheduled_new_reqs and len(n) == c_ref[0]
                    and all(n[r] == 1 + len(spec.get(r, ())) for r in n))
        # drafts verified by every request, or (plain mode) by none
        timer.keep = decoding and len(spec) == (0 if plain_steps else len(n))
        timer.cur = {"_t0": time.perf_counter()}
        return execute(scheduler_output, *args, **kwargs)

    def sample(*args, **kwargs):
        try:
            return sample_tokens(*args, **kwargs)
        finally:
            cur, timer.cur = timer.cur, None
            if cur is not None and timer.keep:
                cur["step"] = time.perf_counter() - cur.pop("_t0")
                timer.steps.append(cur)

    runner.execute_model = execute_model
    runner.sample_tokens = sample
    timer.wrap(runner, "_prepare_inputs", "prepare")
    timer.wrap(runner, "_build_attention_metadata", "metadata")
    timer.wrap(runner, "_sample", "verify")
    timer.wrap(runner, "propose_draft_token_ids", "draft")

    fwd = timer.timed(runner._model_forward, "forward")

    def model_forward(*args, **kwargs):
        timer.in_forward = True
        try:
            return fwd(*args, **kwargs)
        finally:
            timer.in_forward = False

    runner._model_forward = model_forward

    seen = set()
    for module in runner.model.modules():
        if isinstance(module, Attention) and id(module.impl) not in seen:
            seen.add(id(module.impl))
            inner = module.impl.forward
            timed = timer.timed(inner, "attention")

            def attn_forward(*args, _inner=inner, _timed=timed, **kwargs):
                # the target's layers only: the drafter's run outside _model_forward
                return (_timed if timer.in_forward else _inner)(*args, **kwargs)

            module.impl.forward = attn_forward

    if ddtree:
        from vllm_ddtree.core.round import TreeRound

        TreeRound.plan = classmethod(timer.timed(TreeRound.plan.__func__, "plan"))
        timer.wrap(TreeRound, "compact", "compaction")
        timer.wrap(TreeRound, "condition", "condition")
        timer.wrap(tree_mod, "ancestor_mask", "mask")
        timer.wrap(tree_mod, "walk", "walk")
        timer.wrap(proposer_mod, "build_tree", "build")
        timer.wrap(proposer_mod.cpu_native, "build_tree_native", "build")


def step_arms(args) -> dict[str, dict]:
    """The two engines compared: the chain and DDTree at the same width, or
    (``--plain-mode``) a plain engine and DDTree held in plain mode, the
    plain one without asynchronous scheduling with ``--plain-sync``; or
    (``--held B``) a fixed-B engine and the default held at its fixed arm B."""
    if args.plain_sync and not args.plain_mode:
        raise SystemExit("--plain-sync compares plain-mode steps: add --plain-mode")
    if args.held:
        if args.plain_mode:
            raise SystemExit("--held and --plain-mode are two different comparisons")
        if args.held not in budget_ladder(args.max_budget):
            raise SystemExit(f"--held {args.held} is not an arm of the default with budget "
                             f"{args.max_budget} (its fixed arms: "
                             f"{budget_ladder(args.max_budget)})")
        return {"fixed": {"spec": {"method": "ddtree", "model": args.drafter,
                                   "num_speculative_tokens": args.held,
                                   "ddtree_adaptive": False}},
                "default_held": {"spec": {"method": "ddtree", "model": args.drafter,
                                          "num_speculative_tokens": args.max_budget},
                                 "hold": args.held}}
    if args.plain_mode:
        plain = {"spec": None}
        if args.plain_sync:
            plain["llm"] = {"async_scheduling": False}
        return {"plain": plain,
                "ddtree_plain_mode": {"spec": {"method": "ddtree", "model": args.drafter,
                                               "num_speculative_tokens": args.k},
                                      "env": {"VLLM_DDTREE_COST_MODEL": "1,1,5"}}}
    return {
        "chain": {"spec": {"method": "dflash", "model": args.drafter,
                           "num_speculative_tokens": args.k}},
        "ddtree": {"spec": {"method": "ddtree", "model": args.drafter,
                            "num_speculative_tokens": args.k, "ddtree_adaptive": False}},
    }


def _hold_tuner(budget: int) -> None:
    """Every rate tuner created from now on picks the fixed arm ``budget``
    at every step (its trials still run and close as usual)."""
    from vllm_ddtree.core.tuner import RateTuner

    def arm(self, num_reqs):
        held = self._by_name[f"fixed{budget}"]
        RateTuner.arm.__wrapped__(self, num_reqs)  # keep the trials' bookkeeping
        self._trial.arm = held
        return held

    arm.__wrapped__ = RateTuner.arm
    RateTuner.arm = arm


def worker(arm: dict, conn) -> None:
    """Build one engine, then serve ``("run", prompts, c, max_tokens)``
    requests on ``conn`` until ``("stop",)``."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.update(arm.get("env") or {})
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.pop("TRITON_INTERPRET", None)
    try:
        from vllm import LLM

        if arm.get("hold"):
            _hold_tuner(arm["hold"])

        llm = LLM(model=arm["target"], speculative_config=arm["spec"], dtype=arm["dtype"],
                  max_model_len=2048, seed=0, enable_prefix_caching=False,
                  max_num_seqs=max(arm["max_c"], 1), disable_log_stats=False,
                  **(arm.get("llm") or {}))
        timer = StepTimer()
        c_ref = [0]
        ddtree = arm["spec"] is not None and arm["spec"]["method"] == "ddtree"
        _instrument(llm, timer, ddtree, c_ref, arm.get("plain_steps", False))
        conn.send(("ready",))
    except Exception as e:  # report, then exit
        conn.send(("error", repr(e)))
        raise
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            break
        _, prompts, c, max_tokens = msg
        try:
            conn.send(("done", _run(llm, timer, c_ref, prompts, c, max_tokens)))
        except Exception:
            conn.send(("error", traceback.format_exc()))
            raise
    conn.close()


def _run(llm, timer: StepTimer, c_ref: list[int], prompts, c: int, max_tokens: int) -> dict:
    from vllm import SamplingParams

    from benchmarks.run_llm import spec_metrics

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    before = spec_metrics(llm)
    timer.steps.clear()
    c_ref[0] = c
    t0 = time.perf_counter()
    outputs, tokens = [], 0
    for i in range(0, len(prompts), c):
        res = llm.generate(prompts[i:i + c], sp, use_tqdm=False)
        outputs += [list(r.outputs[0].token_ids) for r in res]
        tokens += sum(len(r.outputs[0].token_ids) for r in res)
    seconds = time.perf_counter() - t0
    after = spec_metrics(llm)
    drafts = after["drafts"] - before["drafts"]
    accepted = after["accepted"] - before["accepted"]
    return {"steps": list(timer.steps), "seconds": seconds, "tokens": tokens,
            "tau": 1 + accepted / drafts if drafts else None, "outputs": outputs}


# ---------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------


def summarize(runs: list[dict]) -> dict:
    """Median over rounds of each round's per-stage median (milliseconds)."""
    per_stage = defaultdict(list)
    for run in runs:
        steps = run["steps"]
        if not steps:
            continue
        for s in STAGES:
            per_stage[s].append(statistics.median(st.get(s, 0.0) for st in steps) * 1e3)
    out = {s: statistics.median(v) for s, v in per_stage.items()}
    out["steps"] = sum(len(r["steps"]) for r in runs)
    out["tok_s"] = statistics.median(r["tokens"] / r["seconds"] for r in runs)
    taus = [r["tau"] for r in runs if r["tau"] is not None]
    out["tau"] = statistics.median(taus) if taus else None
    return out


def paired_step_ratio(first: list[dict], second: list[dict]) -> float | None:
    """Median over rounds of the second arm's median step over the first's,
    each round's two runs adjacent in time."""
    ratios = [statistics.median(s["step"] for s in b["steps"])
              / statistics.median(s["step"] for s in a["steps"])
              for a, b in zip(first, second) if a["steps"] and b["steps"]]
    return statistics.median(ratios) if ratios else None


def markdown_plain(results: dict, concurrencies) -> str:
    lines = []
    for c in concurrencies:
        plain, mode = results["plain"][c], results["ddtree_plain_mode"][c]
        lines.append(f"\n**c = {c}** (plain engine vs DDTree engine in plain mode; medians, "
                     f"ms per step; {plain['steps']} / {mode['steps']} steps)\n")
        lines.append("| stage | plain | DDTree plain mode | difference |")
        lines.append("| --- | ---: | ---: | ---: |")
        for s in ("step", "prepare", "metadata", "forward", "verify", "draft"):
            a, b = plain.get(s, 0.0), mode.get(s, 0.0)
            lines.append(f"| {s} | {a:.3f} | {b:.3f} | {b - a:+.3f} |")
        lines.append(f"| step ratio (of the medians) | | {mode['step'] / plain['step']:.3f}x | |")
        paired = mode.get("paired_step_ratio")
        if paired is not None:
            lines.append(f"| **step ratio** (per round, median) | | **{paired:.3f}x** | |")
        lines.append(f"| tokens/s | {plain['tok_s']:.0f} | {mode['tok_s']:.0f} | "
                     f"{mode['tok_s'] / plain['tok_s']:.2f}x |")
    return "\n".join(lines) + "\n"


def markdown(results: dict, concurrencies, k: int, held: int = 0) -> str:
    lines = []
    first, second = list(results)
    if held:
        title, head = (f"fixed B = {held} engine, default held at fixed {held}",
                       "| stage | fixed engine | default held | held - fixed |")
    else:
        title, head = (f"chain K = {k}, DDTree B = {k}",
                       "| stage | chain | DDTree | DDTree - chain |")
    for c in concurrencies:
        chain, tree = results[first][c], results[second][c]
        lines.append(f"\n**c = {c}** ({title}; medians, ms per step; "
                     f"{chain['steps']} / {tree['steps']} steps)\n")
        lines.append(head)
        lines.append("| --- | ---: | ---: | ---: |")
        for s in STAGES:
            a, b = chain.get(s, 0.0), tree.get(s, 0.0)
            if a == 0.0 and b == 0.0:
                continue
            lines.append(f"| {s} | {a:.3f} | {b:.3f} | {b - a:+.3f} |")
        ratio = tree["step"] / chain["step"]
        lines.append(f"| **step ratio** | | **{ratio:.3f}x** | |")
        paired = tree.get("paired_step_ratio")
        if paired is not None:
            lines.append(f"| step ratio (per round, median) | | {paired:.3f}x | |")
        lines.append(f"| tokens/s | {chain['tok_s']:.0f} | {tree['tok_s']:.0f} | "
                     f"{tree['tok_s'] / chain['tok_s']:.2f}x |")
        lines.append(f"| tau | {chain['tau']:.2f} | {tree['tau']:.2f} | |")
    return "\n".join(lines) + "\n"


PLOT_STAGES = ["attention", "build", "plan", "walk", "compaction", "condition"]


def plot(paths: list[str], out: str) -> None:
    """DDTree minus chain, ms per step, per stage and concurrency, one bar per
    recorded result (``step_<tag>.json``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(Path(p).stem.removeprefix("step_"), json.loads(Path(p).read_text())["summary"])
            for p in paths]
    concs = sorted({int(c) for _, summ in runs for c in summ["chain"]})
    labels = PLOT_STAGES + ["other", "whole step"]
    fig, axes = plt.subplots(1, len(concs), figsize=(4.2 * len(concs), 3.6), sharey=True)
    axes = [axes] if len(concs) == 1 else list(axes)
    width = 0.8 / len(runs)
    for ax, c in zip(axes, concs):
        for k, (tag, summ) in enumerate(runs):
            chain, tree = summ["chain"][str(c)], summ["ddtree"][str(c)]
            diff = {st: tree.get(st, 0.0) - chain.get(st, 0.0) for st in STAGES}
            vals = [diff[st] for st in PLOT_STAGES]
            vals += [diff["step"] - sum(vals), diff["step"]]
            xs = [i + (k - (len(runs) - 1) / 2) * width for i in range(len(labels))]
            ax.bar(xs, vals, width, label=f"{tag} ({tree['step'] / chain['step']:.2f}x)")
        ax.axhline(0, color="black", linewidth=0.6)
        ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=8)
        ax.set_title(f"c = {c}")
        ax.legend(fontsize=7, title="step ratio", title_fontsize=7)
    axes[0].set_ylabel("DDTree - chain, ms per step")
    fig.suptitle("Extra cost of a DDTree step over a chain step of the same width "
                 "(B = K = 15)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=str(ROOT / "models" / "tiny-qwen3"))
    p.add_argument("--drafter", default=str(ROOT / "models" / "tiny-qwen3-dflash"))
    p.add_argument("--dtype", default="float32",
                   help="the engines' dtype (bfloat16 for a Gated DeltaNet hybrid such as "
                        "models/tiny-qwen35)")
    p.add_argument("--k", type=int, default=15, help="chain K = DDTree budget B (default 15)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--c1-requests", type=int, default=4,
                   help="sequential requests per round at concurrency 1 (default 4)")
    p.add_argument("--plain-mode", action="store_true",
                   help="plain engine vs DDTree in plain mode (see the module docstring)")
    p.add_argument("--plain-sync", action="store_true",
                   help="with --plain-mode: the plain engine without vLLM's asynchronous "
                        "scheduling, which DDTree turns off")
    p.add_argument("--held", type=int, default=0, metavar="B",
                   help="a fixed-B engine vs the default held at its fixed arm B")
    p.add_argument("--max-budget", type=int, default=64,
                   help="with --held: the default engine's budget (default 64)")
    p.add_argument("--tag", default="latest")
    p.add_argument("--markdown", help="also write the Markdown table to this file")
    p.add_argument("--plot", nargs="+", metavar="JSON",
                   help="draw recorded results (step_<tag>.json) instead of measuring")
    p.add_argument("--out", default=str(ROOT / "docs" / "step_cost.png"),
                   help="the picture --plot writes")
    args = p.parse_args(argv)
    if args.plot:
        plot(args.plot, args.out)
        print(f"wrote {args.out}")
        return 0

    from benchmarks.run_llm import humaneval_prompts

    pool = humaneval_prompts(164)
    max_c = max(args.concurrency)
    arms = step_arms(args)
    ctx = mp.get_context("spawn")
    procs, conns = {}, {}
    for name, extra in arms.items():
        parent, child = ctx.Pipe()
        arm = dict(extra, target=args.target, dtype=args.dtype, max_c=max_c,
                   plain_steps=args.plain_mode)
        procs[name] = ctx.Process(target=worker, args=(arm, child), name=f"bench-{name}")
        procs[name].start()
        conns[name] = parent
    try:
        for name, conn in conns.items():
            msg = conn.recv()
            if msg[0] != "ready":
                raise RuntimeError(f"{name} engine failed to start: {msg[1]}")
        print(f"engines ready: {', '.join(arms)}", file=sys.stderr, flush=True)
        raw = {name: defaultdict(list) for name in arms}
        offset = 0
        for r in range(args.rounds):
            for c in args.concurrency:
                n = c * (args.c1_requests if c == 1 else 1)
                prompts = [pool[(offset + i) % len(pool)] for i in range(n)]
                offset += n
                outs = {}
                # interleaved, the order flipped every round (A B, B A, A B, ...)
                order = list(conns.items())
                for name, conn in (order if r % 2 == 0 else order[::-1]):
                    conn.send(("run", prompts, c, args.max_tokens))
                    msg = conn.recv()
                    if msg[0] != "done":
                        raise RuntimeError(f"{name} engine failed:\n{msg[1]}")
                    run = msg[1]
                    outs[name] = run.pop("outputs")
                    raw[name][c].append(run)
                    print(f"round {r + 1}/{args.rounds} c={c} {name}: {len(run['steps'])} "
                          f"steps, {run['tokens'] / run['seconds']:.0f} tok/s",
                          file=sys.stderr, flush=True)
                if len({json.dumps(o) for o in outs.values()}) > 1:
                    if args.dtype == "float32":
                        raise RuntimeError(f"greedy outputs differ between the arms at c={c}: "
                                           f"the benchmark would compare different work")
                    # bf16 (a hybrid): the arms' kernels break near-ties differently
                    # (judged by rescoring in tests/test_e2e_hybrid.py)
                    print(f"note: greedy outputs differ between the arms at c={c} (bf16 "
                          f"near-ties)", file=sys.stderr, flush=True)
    finally:
        for conn in conns.values():
            try:
                conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
        for proc in procs.values():
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()

    results = {name: {c: summarize(runs) for c, runs in by_c.items()}
               for name, by_c in raw.items()}
    first, second = list(arms)
    for c in args.concurrency:  # the step ratio within each round, median over rounds
        results[second][c]["paired_step_ratio"] = paired_step_ratio(raw[first][c],
                                                                    raw[second][c])
    table = (markdown_plain(results, args.concurrency) if args.plain_mode
             else markdown(results, args.concurrency, args.k, args.held))
    print(table)
    outdir = ROOT / "benchmarks" / "results"
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / f"step_{args.tag}.json").write_text(json.dumps(
        {"args": vars(args), "summary": results, "raw": raw}, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
