from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.shared_engines import PLAIN_ENGINES, PLAIN_RUNS

ROOT = Path(__file__).resolve().parents[1]
MODELS = Path(os.environ.get("DDTREE_TEST_MODELS", ROOT / "models"))
TARGET = MODELS / "tiny-qwen3"
DRAFTER = MODELS / "tiny-qwen3-dflash"
HYBRID = MODELS / "tiny-qwen35"
HYBRID_DRAFTER = MODELS / "tiny-qwen35-dflash"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Without a GPU the Triton kernel tests run in Triton's interpreter. The switch
# is read when triton (and its standard library of @jit helpers) is first
# imported, which any test module may trigger through vLLM, so it is set here,
# before collection. Engine subprocesses drop it (benchmarks/run_llm.py).
if "TRITON_INTERPRET" not in os.environ and not os.path.exists("/dev/nvidiactl"):
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# Under pytest-xdist (scripts/test.sh) each worker compiles into its own vLLM
# cache folder: two engines writing one torch.compile artifact at once could
# hand a reader a half-written file.
if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("VLLM_CACHE_ROOT"):
    os.environ["VLLM_CACHE_ROOT"] = os.path.join(os.environ["VLLM_CACHE_ROOT"],
                                                 os.environ["PYTEST_XDIST_WORKER"])


def _module_rank(items) -> int:
    marks = {m.name for item in items for m in item.iter_markers()}
    return 0 if "server" in marks else 1 if "engine" in marks else 2


def pytest_collection_modifyitems(config, items):
    """Server files, then engine files, then the rest (each group in file
    order): with the files spread over workers (``--dist loadfile``), the long
    ones start first and the short ones fill the gaps at the end."""
    by_module: dict[str, list] = {}
    for item in items:
        by_module.setdefault(item.nodeid.split("::")[0], []).append(item)
    ranked = sorted(by_module.values(), key=_module_rank)
    items[:] = [item for group in ranked for item in group]


@pytest.fixture(scope="module")
def one_thread():
    """Small tensors: a single intra-op thread avoids spinning on a busy CPU."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="session")
def tiny_pair() -> tuple[str, str]:
    assert (TARGET / "config.json").exists(), "bundled target model missing"
    assert (DRAFTER / "config.json").exists(), "bundled drafter missing"
    return str(TARGET), str(DRAFTER)


@pytest.fixture(scope="session")
def tiny_hybrid() -> tuple[str, str]:
    """The bundled hybrid pair: a Qwen3.5-architecture target (Gated DeltaNet +
    full attention, bf16) and its DFlash drafter."""
    assert (HYBRID / "config.json").exists(), "bundled hybrid target missing"
    assert (HYBRID_DRAFTER / "config.json").exists(), "bundled hybrid drafter missing"
    return str(HYBRID), str(HYBRID_DRAFTER)


def token_id(text: str, model: Path = TARGET) -> int:
    """The id of ``text`` in ``model``'s tokenizer; it must be one token."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(model / "tokenizer.json")).encode(
        text, add_special_tokens=False).ids
    assert len(ids) == 1, f"{text!r} is not a single token of {model}: {ids}"
    return ids[0]


# Engine core and worker in the job's own process, with one OpenMP thread: a
# tiny-pair engine starts in about 20 s instead of 55 s (compiled: 75 s instead
# of 120 s) on the 2-core CI machine, and decodes as fast. vLLM's default
# multiprocess layout keeps its own tests: the server tests, and
# test_e2e_greedy's compiled DDTree run (multiprocess=True).
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}


def cpu_fp8_kv_unavailable(head_size: int = 32) -> str | None:
    """vLLM's own reason why its CPU attention keeps no fp8 KV cache here
    (x86 with AVX-512 or AMX only), or None."""
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    try:
        _get_attn_isa(torch.float32, 32, head_size, "fp8")
    except NotImplementedError as e:
        return str(e)
    return None


def run_job(job: dict, tmp_path: Path, timeout: float = 900, multiprocess: bool = False) -> dict:
    """Run ``benchmarks.run_llm`` on ``job`` in a fresh process; return its result."""
    from benchmarks.run_llm import run_in_subprocess

    if not multiprocess:
        job = dict(job, env=dict(IN_PROCESS, **(job.get("env") or {})))
    return run_in_subprocess(job, tmp_path, timeout=timeout)


@pytest.fixture(scope="session")
def plain_reference(tiny_pair, tmp_path_factory):
    """``plain_reference(engine, name)``: that run's result, from the shared
    plain engine (started on first use, once per session)."""
    done: dict[str, dict | Exception] = {}

    def get(engine: str, name: str) -> dict:
        if engine not in done:
            job = dict(PLAIN_ENGINES[engine], model=tiny_pair[0], runs=PLAIN_RUNS[engine])
            try:
                done[engine] = run_job(job, tmp_path_factory.mktemp(f"plain_{engine}"))
            except Exception as e:  # noqa: BLE001 - re-raised for every user
                done[engine] = e
        if isinstance(done[engine], Exception):
            raise RuntimeError(f"the shared plain {engine} engine failed") from done[engine]
        runs = done[engine]["runs"]
        if name not in runs:
            raise KeyError(f"plain run {engine}/{name} was declared after the shared engine "
                           f"ran; declare it with plain_run() at import time")
        return runs[name]

    return get
