"""Rewind the per-request generators of discarded samples on CPU by their state.

Target: ``vllm.v1.worker.cpu_model_runner:CPUModelRunner.sample_tokens`` and
``CPUModelRunner._bookkeeping_sync`` (both inherited from ``GPUModelRunner``;
setting them on ``CPUModelRunner`` changes the CPU runner only, and the DDTree
CPU runner, a subclass made at plugin load, inherits them).

Why: every step samples a token for every scheduled request, including
requests whose prompt is only partly prefilled; those tokens are dropped
(``discard_request_mask``). A request with ``SamplingParams(seed=...)`` draws
from its own ``torch.Generator``, so the dropped sample still advanced it.
``_bookkeeping_sync`` undoes that with ``gen.set_offset(gen.get_offset() - 4)``,
which is the CUDA Philox rewind; a CPU generator (mt19937) has no offset and
raises ``RuntimeError: CPU Generator does not use offset``, which kills the
engine core. Any seeded request whose prompt is prefilled in more than one
step (long prompts, ``n > 1``, a busy batch) triggers it, with or without
speculative decoding.

Fix, exact rather than approximate: with the CPU's synchronous scheduling,
``execute_model`` prepares the step (``_prepare_inputs`` sets
``discard_request_mask``) and runs the forward, then ``sample_tokens`` draws
(vLLM's sampler or rejection sampler, or DDTree's node sampler) and calls
``_bookkeeping_sync``. The ``sample_tokens`` wrapper snapshots ``get_state()``
of the CPU generators of the requests whose sample will be discarded, before
any draw. The ``_bookkeeping_sync`` wrapper restores those states, then runs
vLLM's body with those generators hidden from ``input_batch.generators`` (the
dict is put back in ``finally``), so the offset rewind never sees a CPU
generator. A discarded step thus leaves the generator exactly where it was,
and a seeded request gives the same tokens whether or not its prompt was
prefilled in chunks (with DDTree, where a step's draws also depend on whether
the batch holds drafts, the rewind is just as exact).

Upstream status: not fixed in vLLM 0.32; the offset rewind relies on CUDA
generator internals (it dates from vllm-project/vllm#10097). Drop this patch
when vLLM rewinds CPU generators itself (or stops drawing for discarded rows).
"""

from __future__ import annotations

import functools

import numpy as np

from vllm_ddtree.patches.base import CPU_ONLY, Patch, on_cpu

_TARGET = "vllm.v1.worker.cpu_model_runner:CPUModelRunner"
# Runner attribute holding {batch row: (generator, state)} between the two hooks.
_SAVED = "_ddtree_discard_gen_states"


def _discarded_cpu_generators(runner) -> dict:
    """``{batch row: generator}`` of this step's discarded rows with a CPU generator."""
    gens = runner.input_batch.generators
    if not gens:
        return {}
    num_reqs = runner.input_batch.num_reqs
    rows = np.flatnonzero(runner.discard_request_mask.np[:num_reqs])
    out = {}
    for r in rows.tolist():
        g = gens.get(r)
        if g is not None and g.device.type == "cpu":
            out[r] = g
    return out


def _build_sample_tokens(original):
    @functools.wraps(original)
    def sample_tokens(self, *args, **kwargs):
        saved = None
        if self.execute_model_state is not None:
            saved = {r: (g, g.get_state())
                     for r, g in _discarded_cpu_generators(self).items()}
        setattr(self, _SAVED, saved)
        try:
            return original(self, *args, **kwargs)
        finally:
            setattr(self, _SAVED, None)

    return sample_tokens


def _build_bookkeeping_sync(original):
    @functools.wraps(original)
    def _bookkeeping_sync(self, *args, **kwargs):
        saved = getattr(self, _SAVED, None) or {}
        setattr(self, _SAVED, None)
        hidden = _discarded_cpu_generators(self)
        if not hidden:
            return original(self, *args, **kwargs)
        for r, g in hidden.items():
            snap = saved.get(r)
            if snap is not None and snap[0] is g:
                g.set_state(snap[1])
        gens = self.input_batch.generators
        self.input_batch.generators = {r: g for r, g in gens.items() if r not in hidden}
        try:
            return original(self, *args, **kwargs)
        finally:
            self.input_batch.generators = gens

    return _bookkeeping_sync


SNAPSHOT = Patch(
    name="cpu-seed-rewind-snapshot",
    target=f"{_TARGET}.sample_tokens",
    why="Snapshot the CPU generators of discarded (partial-prefill) rows before the "
        "step draws from them.",
    upstream="not fixed in vLLM 0.32 (CUDA-only offset rewind in _bookkeeping_sync)",
    vllm_versions=CPU_ONLY,
    build=_build_sample_tokens,
    when=on_cpu,
)

REWIND = Patch(
    name="cpu-seed-rewind",
    target=f"{_TARGET}._bookkeeping_sync",
    why="Restore those generators by state and keep vLLM's set_offset rewind (CUDA "
        "Philox only; raises on CPU generators) away from them.",
    upstream="not fixed in vLLM 0.32 (CUDA-only offset rewind in _bookkeeping_sync)",
    vllm_versions=CPU_ONLY,
    build=_build_bookkeeping_sync,
    when=on_cpu,
)
