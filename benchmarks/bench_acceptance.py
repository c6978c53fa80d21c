"""Acceptance length tau: DFlash chain vs DDTree at several budgets.

    python -m benchmarks.bench_acceptance                    # 32 HumanEval prompts x 128 tokens
    python -m benchmarks.bench_acceptance --budgets 8 16 32 64 128 --plot docs/acceptance.png

tau = 1 + accepted / drafts, from vLLM's own spec-decode counters (the same
numbers `vllm bench serve` reports), at T = 0 in float32 with the bundled tiny
pair. Each configuration runs in a fresh engine process. Every run also
checks that the output is token-identical to the first (plain or chain) run.
For DDTree it also records the drafter-expected tau and the accepted-depth
histogram from the ``vllm:ddtree_*`` metrics.

``--hybrid`` runs the bundled hybrid pair (``models/tiny-qwen35``, Gated
DeltaNet + M-RoPE attention) in bf16 with prefix caching off, and adds each
budget's Gated DeltaNet state memory per request; in bf16 "same output" counts
the prompts whose output equals the chain's (the rest differ at near-ties)::

    python -m benchmarks.bench_acceptance --hybrid --budgets 8 16 32 64
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from tqdm import tqdm

from benchmarks.run_llm import run_in_subprocess

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hybrid", action="store_true",
                    help="the bundled hybrid GDN pair (bf16, prefix caching off)")
    ap.add_argument("--target", default=None)
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--chain-k", type=int, default=15, help="DFlash chain length")
    ap.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    name = "tiny-qwen35" if args.hybrid else "tiny-qwen3"
    suffix = "_hybrid" if args.hybrid else ""
    args.target = args.target or str(ROOT / "models" / name)
    args.drafter = args.drafter or str(ROOT / "models" / f"{name}-dflash")
    args.json = args.json or str(ROOT / f"benchmarks/results/acceptance{suffix}.json")
    args.plot = args.plot if args.plot is not None else str(ROOT / f"docs/acceptance{suffix}.png")
    dtype = "bfloat16" if args.hybrid else "float32"

    base = {"model": args.target, "prompts": f"humaneval:{args.prompts}",
            "sampling": {"temperature": 0.0, "max_tokens": args.max_tokens, "ignore_eos": True},
            "llm": {"dtype": dtype, **({"enable_prefix_caching": False} if args.hybrid else {})}}
    arms = [("dflash chain", {"method": "dflash", "model": args.drafter,
                              "num_speculative_tokens": args.chain_k})]
    arms += [(f"ddtree B={b}", {"method": "ddtree", "model": args.drafter,
                                "num_speculative_tokens": b, "ddtree_adaptive": False})
             for b in args.budgets]
    rows = []
    ref = None
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in tqdm(arms, desc="configs"):
            res = run_in_subprocess(dict(base, speculative_config=spec), tmp)
            if ref is None:
                ref = res["outputs"]
            dd = res["spec"].get("ddtree") or {}
            same = sum(a == b for a, b in zip(res["outputs"], ref))
            rows.append({"config": name, "spec": spec, "tau": res["spec"]["tau"],
                         "same_prompts": same,
                         "state_mib": _state_mib(args.target, spec["num_speculative_tokens"])
                         if args.hybrid else None,
                         "expected_tau": dd.get("expected_acceptance_length"),
                         "accepted_depth": dd.get("accepted_depth"),
                         "drafts": res["spec"]["drafts"], "accepted": res["spec"]["accepted"],
                         "same_output_as_chain": res["outputs"] == ref,
                         "accepted_per_pos": res["spec"]["accepted_per_pos"]})
    chain_tau = rows[0]["tau"]
    print(f"\n{args.prompts} HumanEval prompts x {args.max_tokens} tokens, T=0, {dtype}\n")
    state = " GDN state / request |" if args.hybrid else ""
    print(f"| config | tau | tau / chain | drafter-expected tau | drafts | same output |{state}")
    print("| --- | ---: | ---: | ---: | ---: | --- |" + (" ---: |" if args.hybrid else ""))
    for r in rows:
        exp = f"{r['expected_tau']:.3f}" if r["expected_tau"] is not None else "-"
        same = (f"{r['same_prompts']}/{args.prompts}" if args.hybrid
                else "yes" if r["same_output_as_chain"] else "NO")
        mib = f" {r['state_mib']:.1f} MiB |" if args.hybrid else ""
        print(f"| {r['config']} | {r['tau']:.3f} | {r['tau'] / chain_tau:.2f}x | {exp} | "
              f"{r['drafts']} | {same} |{mib}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        b = [int(r["config"].split("=")[1]) for r in rows[1:]]
        ax.plot(b, [r["tau"] for r in rows[1:]], "o-", label="DDTree (realised)")
        ax.plot(b, [r["expected_tau"] for r in rows[1:]], "s:", color="C1",
                label="DDTree (drafter-expected, vllm:ddtree_*)")
        ax.axhline(chain_tau, color="gray", ls="--", label=f"DFlash chain (K={args.chain_k})")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tree budget B (draft nodes verified per step)")
        ax.set_ylabel("acceptance length tau")
        ax.set_title(f"{'Tiny hybrid (GDN) pair, bf16' if args.hybrid else 'Tiny pair'}, "
                     f"{args.prompts} HumanEval prompts, T=0")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot: {args.plot}")


def _state_mib(target: str, budget: int) -> float:
    """One request's Gated DeltaNet state memory at ``budget`` (bf16 conv and
    recurrent state, vLLM CPU's default for a bf16 target)."""
    from types import SimpleNamespace

    from vllm_ddtree.patches.spec_config import gdn_state_bytes

    cfg = json.loads((Path(target) / "config.json").read_text())
    return gdn_state_bytes(SimpleNamespace(**cfg), budget, 2, 2) / 2**20


if __name__ == "__main__":
    main()
