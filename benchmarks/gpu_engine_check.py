"""DDTree's whole engine on a CUDA GPU, in one run: what the CPU suite cannot show.

    python -m benchmarks.gpu_engine_check --out DIR      # on a machine with a GPU and vLLM
    python -m benchmarks.gpu_engine_check --dry-run      # anywhere: the plan, configs checked

``benchmarks/gpu_engine_check.sh`` is the entry point (it finds the Python
and writes into ``$OUT`` when set). Every engine runs compiled with CUDA
graphs on (``FULL_AND_PIECEWISE``: full graphs for uniform verification
batches, piecewise for the rest), each in its own process
(``benchmarks.run_llm``). The steps, each recorded with ``ok`` and its
numbers in one JSON results file:

``greedy_dense``
    The bundled dense pair (fp32), 16 HumanEval prompts x 128 tokens: plain
    decoding, the DFlash chain, DDTree at a fixed budget of 16 and DDTree's
    default (adaptive, at most 32). Every arm must be token-identical to plain.
``greedy_hybrid``
    The bundled Gated DeltaNet hybrid (bf16, prefix caching off), 12 prompts x
    64 tokens: plain, DDTree fixed 16 and default. Each prompt's first
    divergence from plain, if any, must be a near-tie under an fp32 rescoring
    (the two tokens are the fp32 top two, their logits within 0.1).
``greedy_fp8``
    An fp8 KV cache (``kv_cache_dtype="fp8"``, e4m3, bf16 model) on the bundled
    dense pair with its heads padded to 64 dims, 12 prompts x 96 tokens: plain
    and DDTree fixed 16, judged like the hybrid at a logit gap of 0.5 (what fp8
    rounding moves stock decoding by). Skipped below compute capability 8.9,
    where vLLM's Triton backend keeps no fp8 cache.
``sampling_pit``
    DDTree (fixed 16) at T = 0.8, top-k 5, top-p 0.95: 4 prompts x 32 samples
    x 40 tokens, rescored in fp32; the randomized PIT values of the tokens past
    the first two must look uniform (KS p >= 1e-3), and a deliberately wrong
    mask (every node sees only the root) must be rejected (p < 1e-3).
``guards``
    A backend that ignores tree masks is refused at configuration; a target
    left on vLLM's stock Triton attention is refused at start-up; with that
    guard disabled too, the first full CUDA graph of a tree batch (or the
    first tree step) is refused.
``serve``
    ``vllm bench serve`` (``benchmarks.bench_serve``): plain, the chain, DDTree
    fixed 16 and default, at concurrency 1, 4 and 16, two interleaved rounds.

The exit status is 0 only when every step that ran is ok. ``--steps`` runs a
subset. ``--dry-run`` starts no engine: it builds every job, checks that the
models and prompts are there and that every DDTree engine configuration
passes the plugin's checks on this machine, and writes the results file with
each step ``planned``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DENSE = ("models/tiny-qwen3", "models/tiny-qwen3-dflash")
HYBRID = ("models/tiny-qwen35", "models/tiny-qwen35-dflash")
STEPS = ("greedy_dense", "greedy_hybrid", "greedy_fp8", "sampling_pit", "guards", "serve")
GRAPHS = {"enforce_eager": False, "compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE"}}
NEAR_TIE = 0.1
FP8_NEAR_TIE = 0.5  # as tests/test_e2e_targets.py: fp8 rounding moves stock choices this far
PIT = dict(prompts=4, samples=32, tokens=40, first=2, temperature=0.8, top_k=5, top_p=0.95,
           p_min=1e-3, max_miss=0.002, seed=20240601)


def _ddtree(drafter: str, budget: int | None, adaptive: bool) -> dict:
    spec = {"method": "ddtree", "model": drafter}
    if budget is not None:
        spec["num_speculative_tokens"] = budget
    if not adaptive:
        spec["ddtree_adaptive"] = False
    return spec


def _arms(pair: tuple[str, str], chain: bool) -> dict[str, dict | None]:
    target, drafter = pair
    arms: dict[str, dict | None] = {"plain": None}
    if chain:
        arms["chain"] = {"method": "dflash", "model": drafter, "num_speculative_tokens": 15}
    arms["ddtree_fixed16"] = _ddtree(drafter, 16, adaptive=False)
    arms["ddtree_default"] = _ddtree(drafter, None, adaptive=True)
    return arms


def plan() -> dict[str, dict]:
    """Every step's engine jobs (``benchmarks.run_llm`` job dicts)."""
    greedy = {"temperature": 0.0, "ignore_eos": True}
    dense = {name: {"model": DENSE[0], "prompts": "humaneval:16",
                    "sampling": dict(greedy, max_tokens=128),
                    "llm": dict(GRAPHS, dtype="float32", max_model_len=2048),
                    "speculative_config": spec}
             for name, spec in _arms(DENSE, chain=True).items()}
    hybrid = {name: {"model": HYBRID[0], "prompts": "humaneval:12",
                     "sampling": dict(greedy, max_tokens=64),
                     "llm": dict(GRAPHS, dtype="bfloat16", enable_prefix_caching=False,
                                 max_model_len=1024),
                     "speculative_config": spec}
              for name, spec in _arms(HYBRID, chain=False).items()}
    from benchmarks.tiny_pair.head_pad import make_head64_pair

    head64 = str(make_head64_pair())  # fp8 KV caches need head sizes that are multiples of 32
    fp8 = {name: {"model": head64, "prompts": "humaneval:12",
                  "sampling": dict(greedy, max_tokens=96),
                  "llm": dict(GRAPHS, dtype="bfloat16", kv_cache_dtype="fp8",
                              max_model_len=2048),
                  "speculative_config": spec}
           for name, spec in (("plain", None),
                              ("ddtree_fixed16", _ddtree(f"{head64}-dflash", 16, False)))}
    sampling = {"temperature": PIT["temperature"], "top_k": PIT["top_k"], "top_p": PIT["top_p"],
                "max_tokens": PIT["tokens"], "ignore_eos": True, "n": PIT["samples"]}
    pit_job = {"model": DENSE[0], "prompts": f"humaneval:{PIT['prompts']}",
               "sampling": sampling, "llm": dict(GRAPHS, dtype="float32", max_num_seqs=256,
                                                 seed=1234),
               "speculative_config": _ddtree(DENSE[1], 16, adaptive=False)}
    in_process = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    guard = {"model": DENSE[0], "prompts": ["def add(a, b):\n"],
             "sampling": dict(greedy, max_tokens=8), "llm": dict(GRAPHS, dtype="float32"),
             "speculative_config": _ddtree(DENSE[1], 8, adaptive=False)}
    return {
        "greedy_dense": dense,
        "greedy_hybrid": hybrid,
        "greedy_fp8": fp8,
        "sampling_pit": {"ddtree": pit_job,
                         "root_only_mask": dict(pit_job, setup="tests.broken_paths:root_only_mask",
                                                env=in_process)},
        "guards": {
            "backend_refused": dict(guard, llm=dict(guard["llm"], attention_backend="FLASH_ATTN")),
            "stock_attention_refused": dict(guard, setup="tests.seam_breakers:"
                                            "stock_cuda_attention", env=in_process),
            "stock_attention_unguarded": dict(guard, setup="tests.seam_breakers:"
                                              "stock_cuda_attention_unguarded", env=in_process),
        },
        "serve": {"command": [sys.executable, "-m", "benchmarks.bench_serve", "--budgets", "16",
                              "--adaptive", "32", "--concurrency", "1", "4", "16",
                              "--rounds", "2", "--num-prompts", "16", "--output-len", "64"]},
    }


# What each guard job must fail with (any of these).
GUARD_MESSAGES = {
    "backend_refused": ("would ignore the tree mask",),
    "stock_attention_refused": ("cannot apply a tree mask",),
    # a full CUDA graph of a tree batch is captured first; eagerly, the first step
    "stock_attention_unguarded": ("captured without the tree path",
                                  "did not run the tree path"),
}


def _run(job: dict, workdir: Path, timeout: float = 900) -> dict:
    from benchmarks.run_llm import run_in_subprocess

    return run_in_subprocess(job, workdir, timeout=timeout)


def _tokenized(target: str, spec: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    from benchmarks.run_llm import resolve_prompts

    tok = AutoTokenizer.from_pretrained(target)
    return [tok(p)["input_ids"] for p in resolve_prompts(spec)]


def step_greedy_dense(jobs: dict, workdir: Path) -> dict:
    results = {name: _run(job, workdir) for name, job in jobs.items()}
    ref = results["plain"]["outputs"]
    arms = {}
    for name, res in results.items():
        same = sum(a == b for a, b in zip(res["outputs"], ref))
        arms[name] = {"identical": f"{same}/{len(ref)}", "tau": res["spec"]["tau"],
                      "seconds": res["seconds"]}
    ok = all(res["outputs"] == ref for res in results.values())
    return {"ok": ok, "arms": arms}


def _near_tie_step(jobs: dict, workdir: Path, tie: float) -> dict:
    """Every arm against the plain arm: each prompt's first divergence, if
    any, must be a near-tie (logit gap ``tie``) under an fp32 rescoring."""
    from tests.near_ties import describe, first_divergences
    from tests.pit import load_target

    target = jobs["plain"]["model"]
    prompts = _tokenized(target, jobs["plain"]["prompts"])
    results = {name: _run(dict(job, prompts=prompts), workdir) for name, job in jobs.items()}
    model = load_target(target)
    ref = results["plain"]["outputs"]
    arms, ok = {}, True
    for name, res in results.items():
        divs = first_divergences(model, prompts, ref, res["outputs"])
        ties = all(d.near_tie(tie) for d in divs)
        ok &= ties
        arms[name] = {"diverging_prompts": len(divs), "all_near_ties": ties,
                      "divergences": describe(divs), "tau": res["spec"]["tau"]}
    return {"ok": ok, "near_tie_logit_gap": tie, "arms": arms}


def step_greedy_hybrid(jobs: dict, workdir: Path) -> dict:
    return _near_tie_step(jobs, workdir, NEAR_TIE)


def step_greedy_fp8(jobs: dict, workdir: Path) -> dict:
    import torch

    if torch.cuda.get_device_capability() < (8, 9):
        return {"ok": True, "skipped": "vLLM's Triton backend keeps fp8 KV caches on "
                                       "compute capability 8.9 and newer only"}
    return _near_tie_step(jobs, workdir, FP8_NEAR_TIE)


def step_sampling_pit(jobs: dict, workdir: Path) -> dict:
    from tests.pit import load_target, rescore

    prompts = _tokenized(DENSE[0], jobs["ddtree"]["prompts"])
    model = load_target(DENSE[0])
    arms = {}
    for name, job in jobs.items():
        res = _run(dict(job, prompts=prompts), workdir)
        scored = rescore(model, prompts, res["outputs"], start=PIT["first"],
                         temperature=PIT["temperature"], top_k=PIT["top_k"],
                         top_p=PIT["top_p"], seed=PIT["seed"])
        per_pos = res["spec"]["accepted_per_pos"] or []
        arms[name] = {"tokens": scored.count, "ks_p": scored.ks_p, "ks_p_id": scored.ks_p_id,
                      "outside_nucleus": scored.miss_fraction,
                      "accepted_depth_ge_2": int(sum(per_pos[1:])), "tau": res["spec"]["tau"]}
    good, bad = arms["ddtree"], arms["root_only_mask"]
    ok = (good["ks_p"] >= PIT["p_min"] and good["outside_nucleus"] <= PIT["max_miss"]
          and bad["ks_p"] < PIT["p_min"])
    return {"ok": ok, "p_min": PIT["p_min"], "arms": arms}


def step_guards(jobs: dict, workdir: Path) -> dict:
    checks, ok = {}, True
    for name, job in jobs.items():
        try:
            _run(job, workdir, timeout=600)
            checks[name] = {"ok": False, "error": "the engine ran"}
        except RuntimeError as e:
            text = str(e)
            hit = any(m in text for m in GUARD_MESSAGES[name])
            checks[name] = {"ok": hit, "message": text[-800:]}
        ok &= checks[name]["ok"]
    return {"ok": ok, "checks": checks}


def step_serve(jobs: dict, workdir: Path) -> dict:
    out = workdir / "serve.json"
    cmd = jobs["command"] + ["--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        return {"ok": False, "error": proc.stderr[-3000:]}
    return {"ok": True, "results": json.loads(out.read_text())}


RUNNERS = {"greedy_dense": step_greedy_dense, "greedy_hybrid": step_greedy_hybrid,
           "greedy_fp8": step_greedy_fp8,
           "sampling_pit": step_sampling_pit, "guards": step_guards, "serve": step_serve}


def environment() -> dict:
    info = {"python": sys.version.split()[0], "platform": platform.platform()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.cuda.is_available()
        if info["cuda"]:
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        info["torch"] = None
    try:
        from vllm_ddtree.version import installed_vllm

        info["vllm"] = "{}=={}".format(*installed_vllm())
    except Exception as e:  # noqa: BLE001 - reported, not raised
        info["vllm"] = f"unavailable: {e}"
    return info


def dry_check(steps: dict[str, dict]) -> dict:
    """Without engines: the models and prompts exist, the setup hooks and the
    analysis helpers import, and every DDTree configuration passes the
    plugin's checks on this machine."""
    import importlib

    from vllm.engine.arg_utils import EngineArgs

    import benchmarks.bench_serve  # noqa: F401  (the serve step's driver)
    import tests.near_ties  # noqa: F401  (the hybrid step's judge)
    import tests.pit  # noqa: F401  (the sampling step's rescoring)

    from benchmarks.run_llm import resolve_prompts
    from vllm_ddtree.plugin import register

    register()
    out = {}
    for step, jobs in steps.items():
        checked = []
        for name, job in jobs.items():
            if "setup" in job:
                mod, _, fn = job["setup"].partition(":")
                assert callable(getattr(importlib.import_module(mod), fn)), job["setup"]
            if "model" not in job:
                continue
            assert (ROOT / job["model"]).is_dir(), f"{job['model']} is missing"
            assert resolve_prompts(job["prompts"]), f"{step}/{name}: no prompts"
            spec = job.get("speculative_config")
            if spec is None or step == "guards":
                continue
            # (an fp8 KV cache follows CPU rules here, not CUDA's: checked without it)
            llm = {k: v for k, v in job["llm"].items()
                   if k not in ("compilation_config", "kv_cache_dtype")}
            cfg = EngineArgs(model=str(ROOT / job["model"]), speculative_config=dict(
                spec, model=str(ROOT / spec["model"])), **llm).create_engine_config()
            if spec["method"] == "ddtree":
                assert getattr(cfg.speculative_config, "ddtree", None) is not None, name
            checked.append(name)
        out[step] = {"status": "planned", "jobs": sorted(jobs), "configs_checked": checked}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or
                                                     ROOT / "benchmarks" / "results"))
    ap.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS))
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    result_file = args.out / f"gpu_engine_check-{stamp}.json"
    steps = {k: v for k, v in plan().items() if k in args.steps}
    report = {"dry_run": args.dry_run, "environment": environment(), "steps": {}}
    t0 = time.time()
    if args.dry_run:
        report["steps"] = dry_check(steps)
        ok = True
    else:
        env = report["environment"]
        if not env.get("cuda"):
            report["error"] = "no CUDA GPU visible to torch"
            result_file.write_text(json.dumps(report, indent=1))
            print(f"[gpu-engine-check] {report['error']}; wrote {result_file}")
            return 1
        work = args.out / f"gpu_engine_check-{stamp}"
        ok = True
        for name, jobs in steps.items():
            s0 = time.time()
            print(f"[gpu-engine-check] {name} ...", flush=True)
            workdir = work / name
            workdir.mkdir(parents=True, exist_ok=True)
            try:
                res = RUNNERS[name](jobs, workdir)
            except Exception as e:  # noqa: BLE001 - one step's failure is recorded
                res = {"ok": False, "error": f"{type(e).__name__}: {str(e)[-3000:]}"}
            res["seconds"] = round(time.time() - s0, 1)
            report["steps"][name] = res
            ok &= bool(res["ok"])
            print(f"[gpu-engine-check] {name}: {'ok' if res['ok'] else 'FAILED'} "
                  f"({res['seconds']} s)", flush=True)
            result_file.write_text(json.dumps(report, indent=1, default=str))
    report["ok"] = ok
    report["seconds"] = round(time.time() - t0, 1)
    result_file.write_text(json.dumps(report, indent=1, default=str))
    print(f"[gpu-engine-check] {'all ok' if ok else 'FAILED'}; results: {result_file}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
