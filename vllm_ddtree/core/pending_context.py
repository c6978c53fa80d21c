"""Plain steps' drafter context, kept until the drafter next needs it.

In plain mode (the adaptive budget running no tree) every token a step
computes is drafter context: the drafter's K/V of it, made from the
target's auxiliary hidden states, its position and its drafter slot. Making
that K/V on every plain step would make plain steps cost more than plain
decoding, so the rows are kept (:class:`PendingContext`) and stored in one
batched call when drafting resumes (:meth:`PendingContext.take`).

Requests that finish or are preempted give their blocks back, and another
request may own them from the next step on, so their rows are settled
first (:meth:`PendingContext.release`): rows of a block the prefix cache may
hand out again (a full block, with prefix caching on) are returned for
storing now; every other row of theirs is dropped, since nothing reads that
context again. Releasing marks rows dead in place: the rows still pending
are never copied, so a release costs the rows it stores, not every pending
row (at high load a request finishes on almost every step).

A step's rows are one ``[n, k * H]`` tensor, or (CPU) the forward's own
``k`` auxiliary outputs ``[n, H]`` each, kept by reference; positions and
slots are tensors or numpy arrays. Memory is what the rows hold, dead rows
of a step included until all of its rows are settled or the steps are
joined (every ``MAX_STEPS`` steps, which also keeps a release's per-step
work bounded); :attr:`PendingContext.held_rows` counts it, and the caller
stores everything once that passes its cap.

Imports nothing from vLLM.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

__all__ = ["MAX_STEPS", "PendingContext", "PendingStep", "joined_rows"]

# Steps kept apart before their live rows are joined into one.
MAX_STEPS = 256


class PendingStep(NamedTuple):
    """One plain step's rows; ``live`` marks those still pending (None: all)."""
    hidden: torch.Tensor | tuple[torch.Tensor, ...]
    positions: torch.Tensor | np.ndarray
    slots: torch.Tensor | np.ndarray
    live: torch.Tensor | None = None


class PendingContext:
    def __init__(self) -> None:
        self.steps: list[PendingStep] = []
        self.held_rows = 0  # rows whose memory is held, dead ones included
        self.live_rows = 0

    def __bool__(self) -> bool:
        return bool(self.steps)

    def add(self, hidden, positions, slots) -> None:
        n = len(slots)
        if len(self.steps) >= MAX_STEPS:
            # one step of the live rows: settling costs per step (at one
            # request a plain step adds one row), and dead rows are let go
            self.steps = [PendingStep(*joined_rows(self.steps))]
            self.held_rows = self.live_rows
        self.steps.append(PendingStep(hidden, positions, slots))
        self.held_rows += n
        self.live_rows += n

    def take(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Every pending row, ``(hidden [N, k * H], positions [N], slots [N])``
        in step order (a slot that changed hands between plain steps gets its
        last owner's values when stored in this order); nothing pending after."""
        if not self.steps:
            return None
        rows = joined_rows(self.steps)
        self.clear()
        return rows

    def clear(self) -> None:
        self.steps = []
        self.held_rows = self.live_rows = 0

    def release(self, freed_blocks: torch.Tensor, block_size: int, keep_full: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Settle the rows in ``freed_blocks`` (blocks that requests gave
        back). With ``keep_full`` (prefix caching: the cache keeps full blocks
        only) the rows of each freed block whose last slot is pending are
        returned for storing now, in step order; a freed block's other rows
        are dropped. Returns None when nothing is to be stored."""
        if not self.steps:
            return None
        slots = _cat_ids([s.slots for s in self.steps])
        live = _cat_live(self.steps, slots.device)
        block = slots // block_size
        theirs = torch.isin(block, freed_blocks.to(slots.device)) & live
        if not bool(theirs.any()):
            return None
        stored = None
        if keep_full:
            full = block[theirs & (slots % block_size == block_size - 1)]
            if full.numel():
                cached = theirs & torch.isin(block, full)
                stored = joined_rows(self._masked(cached))
        left = live & ~theirs
        self.steps = self._masked(left)
        self.held_rows = sum(len(s.slots) for s in self.steps)
        self.live_rows = int(left.sum())
        return stored

    def _masked(self, mask: torch.Tensor) -> list[PendingStep]:
        """The steps with ``mask`` (over every held row, in step order) as
        their live rows; steps without any left out."""
        sizes = np.array([len(s.slots) for s in self.steps])
        ends = np.cumsum(sizes)
        # live rows per step: differences of the running count at step ends
        running = torch.cat([mask.new_zeros(1, dtype=torch.long), mask.long().cumsum(0)]).cpu()
        per_step = (running[torch.from_numpy(ends)]
                    - running[torch.from_numpy(ends - sizes)]).tolist()
        out = []
        for step, n, end, k in zip(self.steps, sizes.tolist(), ends.tolist(), per_step):
            if k:
                out.append(step._replace(live=None if k == n else mask[end - n:end]))
        return out


def joined_rows(steps: list[PendingStep]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The live rows of ``steps`` as one ``(hidden [N, k * H], positions [N],
    slots [N])`` (int64), in step order. Runs of steps kept as the forward's
    outputs are joined per output (one concatenation each, not one per step);
    only steps with dead rows are indexed."""
    steps = [_live_only(s) for s in steps]
    hidden = torch.cat(_joined_runs(
        [s.hidden for s in steps], lambda h: isinstance(h, tuple),
        lambda run: torch.cat([torch.cat(parts) for parts in zip(*run)], dim=-1)))
    return hidden, _cat_ids([s.positions for s in steps]), _cat_ids([s.slots for s in steps])


def _live_only(step: PendingStep) -> PendingStep:
    if step.live is None:
        return step
    live = step.live

    def pick(x):
        if isinstance(x, np.ndarray):
            return x[live.cpu().numpy()]
        return x[live.to(x.device)]
    hidden = (tuple(pick(h) for h in step.hidden) if isinstance(step.hidden, tuple)
              else pick(step.hidden))
    return PendingStep(hidden, pick(step.positions), pick(step.slots))


def _cat_live(steps: list[PendingStep], device) -> torch.Tensor:
    return torch.cat([torch.ones(len(s.slots), dtype=torch.bool, device=device)
                      if s.live is None else s.live.to(device) for s in steps])


def _cat_ids(xs: list) -> torch.Tensor:
    """Positions or slots of several steps, ``[N]`` int64 in step order (runs
    of numpy arrays joined by numpy first)."""
    return torch.cat([torch.from_numpy(x) if isinstance(x, np.ndarray) else x
                      for x in _joined_runs(xs, lambda x: isinstance(x, np.ndarray),
                                            np.concatenate)]).long()


def _joined_runs(items: list, is_run, join) -> list:
    """``items`` with every run of consecutive ``is_run`` items joined into one."""
    out, run = [], []
    for x in items:
        if is_run(x):
            run.append(x)
            continue
        if run:
            out.append(join(run))
            run = []
        out.append(x)
    if run:
        out.append(join(run))
    return out
