"""``vllm-ddtree trace``: run one prompt through DDTree and record every round.

    vllm-ddtree trace --model models/tiny-qwen3 --prompt "def fibonacci(n):" --out trace/

runs the prompt through vLLM's offline engine (in this process) with DDTree
and writes, in ``--out``:

* ``trace.json``: per verification round, the drafter's tree (each node's
  token and text, parent, depth, q = the drafter's probability of the node's
  prefix, whether it was verified and accepted), the accepted count, the
  drafter's expected accepted nodes and the bonus token; the generated text;
  the totals, next to vLLM's own spec-decode counters for the same run;
* ``round_NNN.png``: the trees of the chosen rounds (``--rounds``), the
  accepted path highlighted;
* ``summary.png``: acceptance length per round, and expected vs realised.

Rounds are recorded through :data:`vllm_ddtree.core.round.ROUND_OBSERVERS`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

__all__ = ["TraceRecorder", "main", "run_trace"]


class TraceRecorder:
    """A round observer: keeps one record per (round, request with nodes)."""

    def __init__(self) -> None:
        self.records: list[dict] = []
        self.rounds = 0

    def __call__(self, rnd, output_tokens) -> None:
        from vllm_ddtree.core.node_history import node_depths

        self.rounds += 1
        counts = rnd.node_counts
        parents = rnd.parents.tolist()
        tokens = rnd.tokens.tolist()
        logq = rnd.logq.tolist() if rnd.logq is not None else None
        from_drafter = rnd.from_drafter.tolist()
        paths, accepted = rnd.path.tolist(), rnd.num_accepted.tolist()
        out = output_tokens.tolist()
        for r, req_id in enumerate(rnd.req_ids):
            n = counts[r]
            if n == 0:
                continue
            size = len(parents[r]) if from_drafter[r] else n
            par = [int(p) for p in parents[r][:size]]
            depth = node_depths(par)
            on_path = set(paths[r][1: accepted[r] + 1])
            q = [math.exp(lq) if lq is not None and from_drafter[r] else None
                 for lq in (logq[r][:size] if logq is not None else [None] * size)]
            nodes = [{"id": j, "token": int(tokens[r][j - 1]), "parent": par[j - 1],
                      "depth": depth[j], "q": q[j - 1], "verified": j <= n,
                      "accepted": j in on_path} for j in range(1, size + 1)]
            self.records.append({
                "round": len(self.records) + 1, "engine_step": self.rounds, "request": req_id, "tree_from_drafter": bool(from_drafter[r]),
                "num_nodes_verified": n, "num_accepted": accepted[r],
                "expected": sum(nd["q"] or 0.0 for nd in nodes if nd["verified"]),
                "bonus": int(out[r][accepted[r]]), "nodes": nodes})


def run_trace(model: str, speculative_config: dict, prompt: str, max_tokens: int,
              llm_kwargs: dict | None = None) -> dict:
    """Generate ``prompt`` greedily with DDTree in this process; return the trace."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the observer runs here
    from vllm import LLM, SamplingParams

    from vllm_ddtree.core import round as round_mod

    recorder = TraceRecorder()
    round_mod.ROUND_OBSERVERS.append(recorder)
    try:
        kwargs = dict(max_model_len=2048, disable_log_stats=False)
        kwargs.update(llm_kwargs or {})
        llm = LLM(model=model, speculative_config=speculative_config, **kwargs)
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens),
                           use_tqdm=False)[0].outputs[0]
        counters = {m.name.removeprefix("vllm:"): m.value for m in llm.get_metrics()
                    if m.name.removeprefix("vllm:") in (
                        "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                        "spec_decode_num_accepted_tokens")}
        tok = llm.get_tokenizer()
    finally:
        round_mod.ROUND_OBSERVERS.remove(recorder)
    generated = list(out.token_ids)
    # The first generated token (from the prefill) is the first round's root,
    # and each round adds its accepted tokens and its bonus. With plain steps
    # in between (the adaptive budget) the roots are not known: left out.
    consecutive = 1 + sum(r["num_accepted"] + 1 for r in recorder.records) >= len(generated) \
        and all(b["engine_step"] == a["engine_step"] + 1
                for a, b in zip(recorder.records, recorder.records[1:]))
    pos = 0
    for rec in recorder.records:
        rec["root_text"] = tok.decode(generated[pos:pos + 1]) if consecutive else None
        for nd in rec["nodes"]:
            nd["text"] = tok.decode([nd["token"]])
        rec["bonus_text"] = tok.decode([rec["bonus"]])
        pos += rec["num_accepted"] + 1
    return {
        "model": model, "speculative_config": speculative_config, "prompt": prompt,
        "output_text": out.text, "output_token_ids": generated, "rounds": recorder.records,
        "totals": {"rounds": len(recorder.records),
                   "verified_nodes": sum(r["num_nodes_verified"] for r in recorder.records),
                   "accepted_tokens": sum(r["num_accepted"] for r in recorder.records)},
        "engine_counters": {"drafts": counters.get("spec_decode_num_drafts"),
                            "draft_tokens": counters.get("spec_decode_num_draft_tokens"),
                            "accepted_tokens": counters.get("spec_decode_num_accepted_tokens")},
    }


def _chosen_rounds(spec: str, total: int) -> list[int]:
    if spec == "all":
        return list(range(1, total + 1))
    out = []
    for part in spec.split(","):
        part = part.strip()
        if "-" in part:
            a, b = part.split("-", 1)
            out.extend(range(int(a), int(b) + 1))
        elif part:
            out.append(int(part))
    bad = [r for r in out if not 1 <= r <= total]
    if bad:
        raise SystemExit(f"vllm-ddtree trace: --rounds {spec!r}: the trace has rounds 1..{total}, "
                         f"not {bad}")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="vllm-ddtree", description="vllm-ddtree tools")
    sub = ap.add_subparsers(dest="command", required=True)
    tr = sub.add_parser("trace", help="record and draw the trees of one prompt's rounds",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    tr.add_argument("--model", required=True, help="the target model (directory or hub id)")
    tr.add_argument("--speculative-config",
                    default='{"method": "ddtree", "ddtree_adaptive": false}',
                    help="JSON, as for vllm serve (default: %(default)s: the drafter found "
                         "for the target, every step a full tree; with the adaptive budget, "
                         "steps that verify nothing leave no round)")
    tr.add_argument("--prompt", required=True)
    tr.add_argument("--max-tokens", type=int, default=64)
    tr.add_argument("--out", required=True, help="output directory")
    tr.add_argument("--rounds", default="1-4",
                    help="rounds to draw: 'all', a list '1,3,5' or a range '2-6' "
                         "(default: %(default)s)")
    tr.add_argument("--dtype", default="auto")
    args = ap.parse_args(argv)
    try:
        spec = json.loads(args.speculative_config)
    except json.JSONDecodeError as e:
        raise SystemExit(f"vllm-ddtree trace: --speculative-config is not JSON ({e})") from None
    if not isinstance(spec, dict) or spec.get("method") != "ddtree":
        raise SystemExit("vllm-ddtree trace: --speculative-config must be a JSON object with "
                         "\"method\": \"ddtree\"")
    if args.max_tokens < 1:
        raise SystemExit("vllm-ddtree trace: --max-tokens must be at least 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace = run_trace(args.model, spec, args.prompt, args.max_tokens, {"dtype": args.dtype})
    (out / "trace.json").write_text(json.dumps(trace, indent=1))
    from vllm_ddtree.trace_plot import draw_round, draw_summary

    records = trace["rounds"]
    if not records:
        print("vllm-ddtree trace: no tree was verified (the adaptive budget chose plain steps "
              "throughout?); trace.json written", file=sys.stderr)
        return
    chosen = _chosen_rounds(args.rounds, len(records))
    from tqdm import tqdm

    for i in tqdm(chosen, desc="drawing rounds", disable=len(chosen) < 8):
        draw_round(records[i - 1], str(out / f"round_{i:03d}.png"))
    draw_summary(records, str(out / "summary.png"))
    t = trace["totals"]
    print(f"{t['rounds']} rounds, {t['verified_nodes']} nodes verified, {t['accepted_tokens']} "
          f"accepted; wrote {out / 'trace.json'}, {len(chosen)} round pictures and "
          f"{out / 'summary.png'}")


if __name__ == "__main__":
    main()
