"""The CPU seeded-generator rewind (patches/cpu_seed_rewind.py) on a stand-in runner.

The stand-in keeps the two methods' contract in vLLM 0.32's V1 runner:
``sample_tokens`` draws from every request's generator and then calls
``_bookkeeping_sync``, whose stock body rewinds the generators of discarded
rows with ``set_offset`` (CUDA only). The end-to-end check is test_e2e_seeded.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_ddtree.patches import cpu_seed_rewind
from vllm_ddtree.patches.base import on_cpu


class _StockRunner:
    def __init__(self, seeds: dict[int, int], discard: list[bool]):
        gens = {r: torch.Generator().manual_seed(s) for r, s in seeds.items()}
        self.input_batch = SimpleNamespace(generators=gens, num_reqs=len(discard))
        self.discard_request_mask = SimpleNamespace(np=np.array(discard + [False] * 4))
        self.execute_model_state = object()
        self.seen_in_bookkeeping: dict[int, torch.Generator] = {}

    def sample_tokens(self, grammar_output):
        self.execute_model_state = None
        draws = {r: torch.rand(3, generator=g) for r, g in self.input_batch.generators.items()}
        self._bookkeeping_sync(grammar_output)
        return draws

    def _bookkeeping_sync(self, scheduler_output):
        self.seen_in_bookkeeping = dict(self.input_batch.generators)
        num_reqs = self.input_batch.num_reqs
        for i in np.nonzero(self.discard_request_mask.np[:num_reqs])[0]:
            gen = self.input_batch.generators.get(int(i))
            if gen is not None:
                gen.set_offset(gen.get_offset() - 4)
        return "bookkeeping"


class _PatchedRunner(_StockRunner):
    sample_tokens = cpu_seed_rewind._build_sample_tokens(_StockRunner.sample_tokens)
    _bookkeeping_sync = cpu_seed_rewind._build_bookkeeping_sync(_StockRunner._bookkeeping_sync)


def test_stock_rewind_fails_on_cpu_generators():
    with pytest.raises(RuntimeError, match="CPU Generator does not use offset"):
        _StockRunner({0: 1}, [True]).sample_tokens(None)


def test_discarded_rows_are_rewound_exactly():
    runner = _PatchedRunner({0: 1, 1: 2, 3: 4}, [True, False, False, True])
    gens = runner.input_batch.generators
    before = {r: g.get_state() for r, g in gens.items()}
    first = runner.sample_tokens(None)
    # Rows 0 and 3 were discarded: their generators are back where they were.
    assert torch.equal(gens[0].get_state(), before[0])
    assert torch.equal(gens[3].get_state(), before[3])
    assert not torch.equal(gens[1].get_state(), before[1])
    # vLLM's body saw only the generators it can rewind; the dict is restored.
    assert set(runner.seen_in_bookkeeping) == {1}
    assert runner.input_batch.generators is gens and set(gens) == {0, 1, 3}
    # The next step draws what the discarded one drew: as if it never happened.
    runner.execute_model_state = object()
    runner.discard_request_mask.np[:] = False
    second = runner.sample_tokens(None)
    assert torch.equal(second[0], first[0]) and torch.equal(second[3], first[3])
    assert not torch.equal(second[1], first[1])
    assert getattr(runner, cpu_seed_rewind._SAVED) is None


def test_bookkeeping_without_snapshot_does_not_crash():
    runner = _PatchedRunner({0: 1}, [True])
    assert runner._bookkeeping_sync(None) == "bookkeeping"
    assert set(runner.input_batch.generators) == {0}


def test_patches_target_the_cpu_runner_only():
    for p in (cpu_seed_rewind.SNAPSHOT, cpu_seed_rewind.REWIND):
        assert p.target.startswith("vllm.v1.worker.cpu_model_runner:CPUModelRunner.")
        assert p.when is on_cpu
