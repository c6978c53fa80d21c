"""Fault injection for the tensor-parallel agreement test (tests/test_e2e_parallel.py).

A directory on ``PYTHONPATH`` whose ``sitecustomize`` runs at the start of
every Python process of the engine, tensor-parallel workers included (a
``run_llm`` setup hook reaches only the engine's own process). With
``DDTREE_TEST_FAULT=desync_rank1`` it wraps ``vllm_ddtree.core.tree.sample_posterior``
so that on tensor-parallel rank 1 every draw first consumes one extra number
from torch's default generator: that rank's random stream runs ahead of the
others', as a rank seeded differently would. Anything else leaves the
process untouched.
"""

import os

if os.environ.get("DDTREE_TEST_FAULT") == "desync_rank1":
    import torch

    import vllm_ddtree.core.tree as _tree

    _real = _tree.sample_posterior

    def _desynced(*args, **kwargs):
        from vllm.distributed.parallel_state import get_tp_group

        if get_tp_group().rank_in_group == 1:
            torch.rand(1)
        return _real(*args, **kwargs)

    _tree.sample_posterior = _desynced
