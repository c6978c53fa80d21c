"""The DFlash drafter's context K/V projection on vLLM CPU's oneDNN GEMM.

Target: ``vllm.model_executor.models.qwen3_dflash:DFlashQwen3Model._project_context_kv``.

Why: a DFlash drafter turns the target's hidden states of every context token
(every prompt and every generated token) into K/V for each of its layers.
vLLM does this outside the compiled forward, with one ``F.linear`` over the
drafter layers' fused K/V weights, then one strided copy that splits K from V
and puts the layer first. On CPU, ``F.linear`` is not the GEMM vLLM uses for
every other linear layer there (``dispatch_cpu_unquantized_gemm`` packs
weights for oneDNN), and the split copy is a second pass over the result. For
13.7k context tokens on the bundled drafter (3 layers, 192 -> 576) the stock
projection took 56 ms of GEMM plus a 10-40 ms copy; oneDNN took 24 ms for the
same GEMM. A DDTree engine stores the context of every token it serves,
drafting or not (plain steps keep it for when drafting resumes), so at 64
requests this projection was about a fifth of a round.

The replacement: the same normalisation, then one oneDNN GEMM per layer and
per K/V, each writing its ``[num_ctx, kv]`` block straight into the layer-major
K and V tensors the caller expects (no split copy). The packed weights are
made once per drafter (and again if its fused weight is replaced). A probe,
once per weight dtype, checks that vLLM's oneDNN op writes into a given
output in that dtype as the patch relies on; where it does not (bf16 on a CPU
without AVX-512, whose oneDNN has no bf16 matmul), or vLLM has no oneDNN, or the drafter has no
fused weight (its per-layer projections are then vLLM's own linear layers),
the stock function runs. It applies to every DFlash drafter on CPU, the DFlash
chain included.

Upstream status: vLLM 0.32.0 projects the context with ``F.linear``. Drop this
patch when it dispatches the context projection like its other CPU linears.
"""

from __future__ import annotations

import functools

import torch

from vllm_ddtree.patches.base import CPU_ONLY, Patch, on_cpu

_TARGET = "vllm.model_executor.models.qwen3_dflash:DFlashQwen3Model._project_context_kv"


def _mm_into(out: torch.Tensor, x: torch.Tensor, handler, bias) -> None:
    """``out = x @ W.T + bias`` with a oneDNN handler, written in place."""
    torch.ops._C.onednn_mm(out, x, bias, handler.handler_tensor)


@functools.lru_cache(maxsize=None)
def onednn_into_ok(dtype: torch.dtype = torch.float32) -> bool:
    """Whether vLLM's oneDNN GEMM is there and writes ``x @ W.T + b`` into a
    given contiguous output in ``dtype`` (probed once per dtype on small CPU
    tensors: oneDNN has no bf16 matmul on CPUs without AVX-512, where the
    handler cannot be made)."""
    from vllm import _custom_ops as ops

    if not getattr(ops, "_supports_onednn", False):
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w, x, b = (torch.randn(*shape, generator=gen).to(dtype)
                   for shape in ((24, 16), (5, 16), (24,)))
        handler = ops.create_onednn_mm(w[8:16].t(), 4)
        out = torch.full((2, 5, 8), float("nan"), dtype=dtype)
        _mm_into(out[1], x, handler, b[8:16])
        want = torch.nn.functional.linear(x.float(), w[8:16].float(), b[8:16].float())
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        return bool(torch.allclose(out[1].float(), want, rtol=tol, atol=tol * 0.1 + 1e-5)
                    and out[0].isnan().all())
    except (RuntimeError, AttributeError):
        return False


class ContextGemm:
    """Packed oneDNN weights of a drafter's fused context projection: for
    layer ``i``, the K rows and the V rows (``[L, 2, kv_heads, head_dim]``
    row order of vLLM's fused weight)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, num_layers: int,
                 kv: int) -> None:
        from vllm import _custom_ops as ops

        if weight.shape[0] != 2 * num_layers * kv:
            raise ValueError(f"fused context K/V weight has {weight.shape[0]} rows, expected "
                             f"2 x {num_layers} layers x {kv}")
        self.key = (weight.data_ptr(), weight._version, weight.dtype)
        self.kv = kv
        self.parts = []
        for i in range(num_layers):
            for j in range(2):  # K, V
                rows = slice((2 * i + j) * kv, (2 * i + j + 1) * kv)
                part_bias = None if bias is None else bias[rows].contiguous()
                self.parts.append((ops.create_onednn_mm(weight[rows].t(), 4), part_bias))

    def project(self, x: torch.Tensor, num_layers: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[L, n, kv]`` K and V of ``n`` normalised context states."""
        k = torch.empty(num_layers, x.shape[0], self.kv, dtype=x.dtype, device=x.device)
        v = torch.empty_like(k)
        for i in range(num_layers):
            _mm_into(k[i], x, *self.parts[2 * i])
            _mm_into(v[i], x, *self.parts[2 * i + 1])
        return k, v


def _build(original):
    from vllm import _custom_ops as ops

    @functools.wraps(original)
    def _project_context_kv(self, context_states, num_ctx, num_layers, num_kv_heads, head_dim):
        weight = getattr(self, "_fused_kv_weight", None)
        if (weight is None or context_states.dim() != 2
                or not onednn_into_ok(weight.dtype)):
            return original(self, context_states, num_ctx, num_layers, num_kv_heads, head_dim)
        kv = num_kv_heads * head_dim
        gemm = getattr(self, "_ddtree_context_gemm", None)
        if gemm is None or gemm.key != (weight.data_ptr(), weight._version, weight.dtype):
            gemm = self._ddtree_context_gemm = ContextGemm(
                weight, getattr(self, "_fused_kv_bias", None), num_layers, kv)
        normed = torch.empty_like(context_states)
        ops.rms_norm(normed, context_states, self._hidden_norm_weight, self._rms_norm_eps)
        k, v = gemm.project(normed.contiguous(), num_layers)
        shape = (num_layers, num_ctx, num_kv_heads, head_dim)
        return k.view(shape), v.view(shape)

    _project_context_kv.ddtree_context_gemm = True
    return _project_context_kv


PATCH = Patch(
    name="cpu-dflash-context-gemm",
    target=_TARGET,
    why="The DFlash drafter's context K/V projection on vLLM CPU's oneDNN GEMM, one GEMM per "
        "layer and K/V written in place, instead of F.linear and a split copy",
    upstream="vLLM 0.32.0 projects the DFlash context with F.linear",
    vllm_versions=CPU_ONLY,
    build=_build,
    when=on_cpu,
)
