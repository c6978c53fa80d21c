"""DDTree under tensor parallelism: every rank takes the same path.

Each tensor-parallel rank runs the whole round on its own: it drafts, builds
the trees, verifies them, walks them, compacts its own shard of the KV heads
(and commits its own Gated DeltaNet heads) and conditions the drafter. If two
ranks ever accepted different paths they would compact different slots, feed
different tokens into the next step, and the output (rank 0's) would be wrong
with no error. Agreement holds by construction:

* **Identical inputs to every decision.** vLLM gathers the vocab-parallel
  logits of the target and of the drafter onto every rank, so all ranks hold
  the same logits tensors: the trees, the greedy walk and every node's
  processed distribution are computed from identical values by identical ops.
* **Identical random draws.** At T > 0 the walk draws each node's token with
  ``core.tree.sample_posterior``: from the request's own ``torch.Generator``
  when it has a seed (vLLM creates it from the request's seed on every rank),
  else from torch's default generator, which vLLM seeds with the engine seed
  on every rank. Every rank runs the same draws in the same order, so both
  streams advance alike -- the same property vLLM's own sampler relies on
  under tensor parallelism.
* **One adaptive policy.** The budget policy reads the measured step time,
  which differs between ranks, so only rank 0's choices count: each step
  the mode (run the drafter or not: a host bool, broadcast over the CPU
  group before any rank launches the drafter) and the per-request budgets
  (broadcast over the device group) come from rank 0.

And it is checked: after each walk every rank gathers a fingerprint of every
rank's accepted paths and output tokens (one all-gather of three numbers per
rank: two weighted sums of the output tokens and the accepted count); it is read after vLLM's own end-of-step sync, and a step where ranks
differ is refused (``DDTreeSeamError``) before its output leaves the runner.

Data parallelism needs none of this: each DP engine has its own runner,
policy and counters (``engine-<dp rank>``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from vllm_ddtree.core.round import DDTreeSeamError

__all__ = ["TPAgreement"]

_MOD = 16777213  # a prime below 2^24


class TPAgreement:
    """Rank agreement for one runner; None-able (see :meth:`for_runner`)."""

    def __init__(self, group: Any, device) -> None:
        self.group = group
        self.rank = group.rank_in_group
        self.size = group.world_size
        self.device = torch.device(device)
        self._gathered: Tensor | None = None
        pin = self.device.type == "cuda"
        self._host = torch.zeros(self.size, 3, dtype=torch.float32, pin_memory=pin)

    @classmethod
    def for_runner(cls, device) -> TPAgreement | None:
        """The tensor-parallel group's agreement, or None on one rank."""
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        return cls(group, device) if group.world_size > 1 else None

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def mode(self, draft: bool) -> bool:
        """Rank 0's choice of running the drafter this step."""
        return bool(self.group.broadcast_object(bool(draft) if self.leader else None, src=0))

    def budgets(self, budgets: Tensor) -> Tensor:
        """Rank 0's per-request budgets (in place on the other ranks)."""
        budgets = budgets.contiguous()
        self.group.broadcast(budgets, src=0)
        return budgets

    def check_walk(self, output_tokens: Tensor, num_accepted: Tensor) -> None:
        """Gather this step's fingerprints from every rank (read in :meth:`verify`)."""
        out = (output_tokens.long() + 2).flatten()  # -1 padding counts too
        idx = torch.arange(1, out.numel() + 1, device=out.device, dtype=torch.int64)
        fp = torch.stack([(out * idx).sum(), (out * (idx * idx % _MOD + 7)).sum(),
                          num_accepted.long().sum()])
        # float32 holds integers below 2^24 exactly, and every communicator
        # gathers it (vLLM CPU's gathers no integer type)
        fp = (fp % _MOD).to(torch.float32)
        gathered = self.group.all_gather(fp.unsqueeze(0), dim=0)  # [ranks, 3]
        self._host.copy_(gathered, non_blocking=True)
        self._gathered = gathered

    def verify(self) -> None:
        """After the step's results reached the host: every rank walked the
        same paths, or ``DDTreeSeamError``."""
        if self._gathered is None:
            return
        self._gathered = None
        rows = self._host.tolist()
        if any(r != rows[0] for r in rows):
            accepted = [int(r[2]) for r in rows]
            raise DDTreeSeamError(
                f"DDTree: tensor-parallel ranks accepted different tree paths in one step "
                f"(accepted nodes per rank: {accepted}); their KV caches and inputs would "
                f"diverge. Its tokens were not returned. Check that every rank runs the same "
                f"vLLM, plugin and seed, or serve with --tensor-parallel-size 1 or method "
                f"'dflash'.")
