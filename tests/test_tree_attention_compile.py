"""The kernel compiles for NVIDIA targets (sm90, sm80), checked without a GPU.

The interpreter runs the kernel as Python, so it cannot catch what only the
compiler rejects (types of loop-carried values, unsupported constructs,
shared-memory budget). Triton ships ptxas, so the whole pipeline down to a
cubin runs here; this is done in a subprocess without TRITON_INTERPRET.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = r"""
import json, sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vllm_ddtree.kernels import tree_attention as ta

assert not ta.INTERPRETED
fn = ta._tree_attention_kernel
ptr = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32"}
results = []
for (dtype, head_size, qpk, page, has_tree, tree_only, max_q, window, sinks, kv_quant,
     cap) in json.loads(sys.argv[1]):
    dtype = getattr(torch, dtype)
    consts = ta.kernel_constexprs(dtype, head_size, qpk, page, has_tree, tree_only, max_q,
                                  window, sinks, kv_quant)
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in ("k_ptr", "v_ptr") and kv_quant is not None:
            sig[name] = "*u8"
        elif name in ("out_ptr", "q_ptr", "k_ptr", "v_ptr"):
            sig[name] = ptr[dtype]
        elif name == "is_tree_ptr":
            sig[name] = "*u8"
        elif name == "sinks_ptr":
            sig[name] = "*fp32"
        elif name.endswith("_ptr"):
            sig[name] = "*i32"
        elif name in ("qk_scale", "v_scale"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    kernel = triton.compile(
        ASTSource(fn=fn, signature=sig, constexprs=consts),
        target=GPUTarget("cuda", cap, 32),
    )
    results.append({"cap": cap, "shared": kernel.metadata.shared,
                    "cubin": len(kernel.asm.get("cubin", b""))})
print(json.dumps(results))
"""

# (dtype, head_size, queries_per_kv, page_size, has_tree, tree_only,
#  max_query_len, sliding window, sinks, fp8 KV kind, compute capability)
VARIANTS = [
    ("bfloat16", 128, 4, 16, True, False, 257, False, False, None, 90),
    ("float32", 80, 5, 32, True, True, None, False, False, None, 80),
    ("bfloat16", 64, 8, 16, True, False, 257, True, True, None, 90),
    ("float16", 128, 4, 16, True, False, 1, True, False, None, 80),
    ("bfloat16", 128, 4, 16, True, False, 257, False, False, "e4m3", 90),
    ("float16", 64, 8, 16, True, False, 257, True, True, "e5m2", 80),
]


def _ptxas_available() -> bool:
    import triton

    nvidia = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return nvidia.exists()


@pytest.mark.skipif(not _ptxas_available(), reason="triton ships no ptxas here")
def test_kernel_compiles_for_nvidia_targets():
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(VARIANTS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == len(VARIANTS)
    for res in results:
        assert res["cubin"] > 0
        # fits the smallest per-block shared memory of sm80+ parts (99 KiB)
        assert res["shared"] <= 99 * 1024, res
