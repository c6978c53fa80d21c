from __future__ import annotations

import os
from pathlib import Path

import pytest

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


def run_job(job: dict, tmp_path: Path, timeout: float = 900) -> dict:
    """Run ``benchmarks.run_llm`` on ``job`` in a fresh process; return its result."""
    from benchmarks.run_llm import run_in_subprocess

    return run_in_subprocess(job, tmp_path, timeout=timeout)
