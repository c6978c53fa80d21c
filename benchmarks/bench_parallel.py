"""Tensor parallelism on vLLM CPU, side by side: TP = 2 against TP = 1.

    python -m benchmarks.bench_parallel --concurrency 1 16 --rounds 3

Six offline engines alive at once (``benchmarks/interleave.py``): plain
decoding, the DFlash chain (K = 15) and DDTree (B = 16, fixed) on the bundled
tiny pair, each at TP = 1 and TP = 2 (one core per rank:
``VLLM_CPU_OMP_THREADS_BIND="0|1"``; TP = 1 uses both cores for one rank),
compiled, greedy, driven in turn round by round. Reports output tokens/s
(median over rounds) per arm and concurrency, and TP2/TP1 per method; the
greedy outputs of every arm must equal plain TP = 1's. CPU tensor
parallelism is not a speed feature (two ranks of one core each trade
compute for communication): this is the sanity figure that DDTree's agreement
mechanism (rank 0's decisions broadcast, a per-step fingerprint gather) costs
about what vLLM's own TP costs the chain.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.interleave import Arms
from benchmarks.run_llm import humaneval_prompts

ROOT = Path(__file__).resolve().parents[1]


def arms(target: str, drafter: str) -> dict[str, dict]:
    specs = {"plain": None,
             "chain": {"method": "dflash", "model": drafter, "num_speculative_tokens": 15},
             "ddtree": {"method": "ddtree", "model": drafter, "num_speculative_tokens": 16,
                        "ddtree_adaptive": False}}
    out = {}
    for name, spec in specs.items():
        for tp in (1, 2):
            env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
            if tp == 2:
                env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
            out[f"{name}/tp{tp}"] = {"model": target, "speculative_config": spec, "env": env,
                                     "llm": {"tensor_parallel_size": tp,
                                             "enforce_eager": False}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=str(ROOT / "models" / "tiny-qwen3"))
    ap.add_argument("--drafter", default=str(ROOT / "models" / "tiny-qwen3-dflash"))
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--min-tokens", type=int, default=1024,
                    help="output tokens per measurement (at least)")
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "parallel.json"))
    args = ap.parse_args()

    jobs = arms(args.target, args.drafter)
    results: dict[str, dict] = {}
    with Arms(jobs) as engines:
        for c in args.concurrency:
            max_tokens = max(64, -(-args.min_tokens // c))
            prompts = humaneval_prompts(c)
            sampling = {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}
            for name in engines.names:  # warm-up (and the greedy outputs)
                results.setdefault(name, {})[c] = {"rates": [], "outputs": engines.run(
                    name, prompts, sampling)["outputs"]}
            for _ in range(args.rounds):
                for name in engines.names:
                    r = engines.run(name, prompts, sampling)
                    rec = results[name][c]
                    rec["rates"].append(r["num_tokens"] / r["seconds"])
                    if r["drafts"]:
                        rec.setdefault("tau", []).append(1 + r["accepted_tokens"] / r["drafts"])
    rows = []
    for c in args.concurrency:
        ref = results["plain/tp1"][c]["outputs"]
        for name in jobs:
            rec = results[name][c]
            rec["median"] = statistics.median(rec["rates"])
            rec["identical"] = rec["outputs"] == ref
        for method in ("plain", "chain", "ddtree"):
            one, two = results[f"{method}/tp1"][c], results[f"{method}/tp2"][c]
            rows.append((c, method, one["median"], two["median"], two["median"] / one["median"],
                         one["identical"] and two["identical"]))
    print("| concurrency | method | TP=1 tok/s | TP=2 tok/s | TP2/TP1 | greedy = plain |")
    print("| ---: | --- | ---: | ---: | ---: | --- |")
    for c, m, a, b, ratio, same in rows:
        print(f"| {c} | {m} | {a:.1f} | {b:.1f} | {ratio:.2f}x | {'yes' if same else 'NO'} |")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    for arm in results.values():
        for rec in arm.values():
            rec.pop("outputs", None)
    out.write_text(json.dumps({"args": vars(args), "results": results, "rows": rows},
                              indent=1))
    print(f"results: {out}")


if __name__ == "__main__":
    main()
