"""Acceptance and tokens/s with a JSON-schema grammar and a repetition penalty.

    python -m benchmarks.bench_api            # 16 HumanEval prompts x 64 tokens, T = 0

Each engine (plain, the DFlash chain with K = 15, DDTree at a fixed budget
of 16 and DDTree with its default adaptive budget up to 64) runs in its own
process, compiled (not eager), fp32, in process so that the grammar work
can be read. In each engine the three workloads run interleaved, two rounds:

- ``none``: greedy;
- ``json``: greedy under a JSON schema (xgrammar, compact whitespace);
- ``repetition``: greedy with ``repetition_penalty`` 1.2.

Every workload's outputs are compared with plain decoding's. Writes
``benchmarks/results/api.json`` and prints the markdown table recorded in
``docs/results.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from tqdm import tqdm

from benchmarks.run_llm import run_in_subprocess

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "language": {"enum": ["python", "c", "rust"]},
                         "lines": {"type": "integer", "minimum": 0, "maximum": 9999},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                  "maxItems": 4}},
          "required": ["name", "language", "lines", "tags"], "additionalProperties": False}


def workloads(max_tokens: int) -> dict:
    greedy = {"temperature": 0.0, "max_tokens": max_tokens}
    return {"none": dict(greedy, ignore_eos=True),
            "json": dict(greedy, structured_outputs={"json": SCHEMA}),
            "repetition": dict(greedy, ignore_eos=True, repetition_penalty=1.2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=str(ROOT / "benchmarks/results/api.json"))
    args = ap.parse_args()
    target, drafter = str(ROOT / "models/tiny-qwen3"), str(ROOT / "models/tiny-qwen3-dflash")
    engines = [
        ("plain", None),
        ("dflash chain (K=15)", {"method": "dflash", "model": drafter,
                                 "num_speculative_tokens": 15}),
        ("ddtree B=16", {"method": "ddtree", "model": drafter, "num_speculative_tokens": 16,
                         "ddtree_adaptive": False}),
        ("ddtree adaptive <=64", {"method": "ddtree", "model": drafter,
                                  "num_speculative_tokens": 64}),
    ]
    base = {"model": target, "prompts": f"humaneval:{args.prompts}",
            "sampling": {"temperature": 0.0, "max_tokens": 8},  # warm-up
            "llm": {"enforce_eager": False,
                    "structured_outputs_config": {"backend": "xgrammar",
                                                  "disable_any_whitespace": True}},
            "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
            "workloads": workloads(args.max_tokens), "rounds": args.rounds}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in tqdm(engines, desc="engines"):
            results[name] = run_in_subprocess(dict(base, speculative_config=spec), tmp)[
                "workloads"]
    plain = results["plain"]
    rows = []
    for name, res in results.items():
        for w, rec in res.items():
            tps = [n / s for n, s in zip(rec["num_tokens"], rec["seconds"])]
            same = sum(a == b for a, b in zip(rec["outputs"], plain[w]["outputs"]))
            g = rec["grammar"]
            rows.append({"engine": name, "workload": w, "tok_s": statistics.median(tps),
                         "tok_s_runs": tps, "tau": rec["tau"], "same_as_plain": same,
                         "prompts": len(rec["outputs"]),
                         "grammar_ms_per_request_step": (
                             1000 * (g["prune_s"] + g["fill_s"]) / max(rec["drafts"], 1)
                             if g["seen"] else None),
                         "nodes_pruned": g["pruned"], "nodes_seen": g["seen"]})
    Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    chain = {r["workload"]: r["tok_s"] for r in rows if r["engine"].startswith("dflash")}
    print("| engine | workload | tok/s | vs chain | tau | same as plain | grammar ms / "
          "request-step | tree nodes dropped |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        tau = "–" if r["tau"] is None else f"{r['tau']:.2f}"
        gm = "–" if r["grammar_ms_per_request_step"] is None \
            else f"{r['grammar_ms_per_request_step']:.2f}"
        drop = f"{r['nodes_pruned']}/{r['nodes_seen']}" if r["nodes_seen"] else "–"
        print(f"| {r['engine']} | {r['workload']} | {r['tok_s']:.1f} | "
              f"{r['tok_s'] / chain[r['workload']]:.2f}x | {tau} | "
              f"{r['same_as_plain']}/{r['prompts']} | {gm} | {drop} |")


if __name__ == "__main__":
    main()
