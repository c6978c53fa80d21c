"""A ``benchmarks.run_llm`` ``setup`` hook that watches seeded generators in discarded steps.

Installed in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) before the engine
starts, it wraps the CPU runner's ``sample_tokens``: for every row whose sample
the step discards (a partial prefill chunk) and that has its own generator, it
compares the generator's state before the step's draws with its state once the
step is done. It writes ``{"steps", "discarded", "moved"}`` (steps run, seeded
rows discarded, and how many of those left their generator moved) to the JSON
file named by ``DDTREE_SEED_PROBE``.
"""

from __future__ import annotations

import json
import os

PROBE_ENV = "DDTREE_SEED_PROBE"


def install() -> None:
    import numpy as np
    import torch
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    path = os.environ[PROBE_ENV]
    counts = {"steps": 0, "discarded": 0, "moved": 0}
    original = CPUModelRunner.sample_tokens

    def sample_tokens(self, *args, **kwargs):
        if self.execute_model_state is None:
            return original(self, *args, **kwargs)
        num_reqs = self.input_batch.num_reqs
        gens = self.input_batch.generators
        before = [(gens[r], gens[r].get_state())
                  for r in np.flatnonzero(self.discard_request_mask.np[:num_reqs]).tolist()
                  if r in gens]
        out = original(self, *args, **kwargs)
        counts["steps"] += 1
        counts["discarded"] += len(before)
        counts["moved"] += sum(not torch.equal(g.get_state(), s) for g, s in before)
        with open(path, "w") as f:
            json.dump(counts, f)
        return out

    CPUModelRunner.sample_tokens = sample_tokens
