"""Plain steps' drafter context, kept until the drafter next needs it.

In plain mode (the adaptive budget running no tree) every token a step
computes is drafter context: the drafter's K/V of it, made from the
target's auxiliary hidden states, its position and its drafter slot. Making
that K/V on every plain step would make plain steps cost more than plain
decoding, so the rows are kept (:class:`PendingContext`) and stored in one
batched call when drafting resumes (:meth:`PendingContext.take`).

A row may be stored only into a block that has not changed hands since the
row was made. Requests that finish or are preempted give their blocks
back, and the scheduler may hand a block to another request (or, on a
hybrid target, to another KV-cache group sharing its memory: a Gated
DeltaNet state block) from the next step on. So the context keeps a clock
of steps (:meth:`PendingContext.tick`, once per engine step) and, per
block, the step at which it last changed hands (:meth:`PendingContext.renew`:
every block the scheduler hands out fresh, and every freed block whose rows
nobody reads again). A row is live while its block was not renewed after
the step that made it; only live rows are stored, the others are dropped
when the rows are next joined. Settling a finished request therefore costs
the blocks it frees, not the rows pending: at high load a request finishes
on almost every step.

A freed block the prefix cache keeps (a full block, with prefix caching on)
is not renewed: a later request may hit it, and then reads its drafter
context, which its rows still hold. They are stored when drafting resumes,
or dropped unstored if the cache hands the block to someone else first.

A step's rows are one ``[n, k * H]`` tensor, or (CPU) the forward's own
``k`` auxiliary outputs ``[n, H]`` each, kept by reference; positions and
slots are tensors or numpy arrays. Memory is what the rows hold, dead rows
included until the steps are compacted (:meth:`PendingContext.compact`,
by the caller once :attr:`PendingContext.held_rows` passes its cap, and
every ``MAX_STEPS`` steps, which keeps the per-step work of a join
bounded): small steps' live rows are joined in groups of halving size,
large mostly-live steps kept by reference, so that a row is copied a number
of times logarithmic in the rows held.

Imports nothing from vLLM.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

__all__ = ["JOIN_ROWS", "MAX_STEPS", "PendingContext", "PendingStep", "joined_rows"]

# Steps kept apart before they are compacted. Compacting copies the live
# rows; at high load most rows die (their requests finish) before it comes,
# so the rarer it is the fewer rows it copies: at 16 requests, every 256
# steps cost 86 us a step (2 % of a plain step), every 4096 a few.
MAX_STEPS = 4096
# Steps at least this long, mostly live, are kept as they are when compacting.
JOIN_ROWS = 4096


class PendingStep(NamedTuple):
    """One plain step's rows, made at step ``epoch`` of the context's clock."""
    hidden: torch.Tensor | tuple[torch.Tensor, ...]
    positions: torch.Tensor | np.ndarray
    slots: torch.Tensor | np.ndarray
    epoch: int = 0


class PendingContext:
    def __init__(self, block_size: int = 0) -> None:
        # the drafter's KV-cache block size (slot // block_size is a block);
        # set before the first row is added
        self.block_size = block_size
        self.steps: list[PendingStep] = []
        self.held_rows = 0  # rows whose memory is held, dead ones included
        self.now = 0  # the step clock
        # per block, the step at which it last changed hands (0: never)
        self._renewed = np.zeros(0, dtype=np.int64)

    def __bool__(self) -> bool:
        return bool(self.steps)

    def tick(self) -> None:
        """A new engine step: rows added from now on belong to it."""
        self.now += 1

    def renew(self, blocks) -> None:
        """``blocks`` (block ids) change hands at this step: the rows made in
        them before it are dead."""
        ids = np.asarray(blocks, dtype=np.int64).reshape(-1)
        if not ids.size:
            return
        top = int(ids.max()) + 1
        if top > self._renewed.size:
            grown = np.zeros(max(top, 2 * self._renewed.size), dtype=np.int64)
            grown[:self._renewed.size] = self._renewed
            self._renewed = grown
        self._renewed[ids] = self.now

    def add(self, hidden, positions, slots) -> None:
        if not len(slots):
            return
        if len(self.steps) >= MAX_STEPS:
            self.compact()
        self.steps.append(PendingStep(hidden, positions, slots, self.now))
        self.held_rows += len(slots)

    def take(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Every live row, ``(hidden [N, k * H], positions [N], slots [N])``
        in step order (a slot that changed hands between plain steps and was
        not renewed, a cached block hit again, gets its last row's values
        when stored in this order); nothing pending after. None when no row
        is live."""
        rows = self._live_rows()
        self.clear()
        return rows

    def take_chunks(self, max_rows: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """:meth:`take` in pieces of whole steps, each of at most ``max_rows``
        live rows or one step, in step order (stored in this order, they
        write what :meth:`take`'s rows would). Joining tens of thousands of
        rows at once costs about three times as much per row (fresh memory
        for every copy), and so does storing them."""
        if not self.steps:
            return []
        chunks, run, rows = [], [], 0
        for step, keep in zip(self.steps, self._live_masks()):
            n = len(step.slots) if keep is None else int(keep.sum())
            if not n:
                continue
            if run and rows + n > max_rows:
                chunks.append(joined_rows([s for s, _ in run], [k for _, k in run]))
                run, rows = [], 0
            run.append((step, keep))
            rows += n
        if run:
            chunks.append(joined_rows([s for s, _ in run], [k for _, k in run]))
        self.clear()
        return chunks

    def compact(self) -> None:
        """Let go of the dead rows, copying as few live ones as it can. A
        step without live rows goes; a step of at least ``JOIN_ROWS`` rows,
        at least half of them live, stays as it is (a prefill's rows, or
        rows joined before). The other steps are grouped in step order as a
        stack whose live sizes at least halve from each group to the next
        (a group merges into the one before it while that one is at most
        twice its size): each group of several steps becomes one step of
        its live rows, made now (they are live now); a group of one step
        stays as it is while at least half of it is live. Rows joined by
        one compaction are then copied again only when as many rows have
        come after them, so a row that stays pending is copied a number of
        times logarithmic in the rows held, and the steps left are few."""
        out: list[PendingStep] = []
        stack: list[list] = []  # [live rows, [(step, keep), ...]] per group

        def settle() -> None:
            for _, members in stack:
                out.append(self._grouped(members))
            stack.clear()

        for step, keep in zip(self.steps, self._live_masks()):
            n = len(step.slots)
            live = n if keep is None else int(keep.sum())
            if not live:
                continue
            if n >= JOIN_ROWS and 2 * live >= n:
                settle()
                out.append(step)
                continue
            stack.append([live, [(step, keep)]])
            while len(stack) > 1 and stack[-2][0] <= 2 * stack[-1][0]:
                live_top, members = stack.pop()
                stack[-1][0] += live_top
                stack[-1][1].extend(members)
        settle()
        self.steps = out
        self.held_rows = sum(len(s.slots) for s in out)

    def _grouped(self, members: list[tuple[PendingStep, np.ndarray | None]]) -> PendingStep:
        if len(members) == 1:
            step, keep = members[0]
            if keep is None or 2 * int(keep.sum()) >= len(step.slots):
                return step
        rows = joined_rows([s for s, _ in members], [k for _, k in members], by_output=True)
        return PendingStep(*rows, self.now)

    def clear(self) -> None:
        self.steps = []
        self.held_rows = 0

    def _live_rows(self):
        if not self.steps:
            return None
        keep = self._live_masks()
        if not any(k is None or k.any() for k in keep):
            return None
        return joined_rows(self.steps, keep)

    def _live_masks(self) -> list[np.ndarray | None]:
        """Per step, which of its rows are live (None: all of them)."""
        if not self.block_size:
            raise RuntimeError("PendingContext.block_size is not set")
        slots = _host_ids([s.slots for s in self.steps])
        sizes = np.array([len(s.slots) for s in self.steps])
        blocks = slots // self.block_size
        renewed = np.zeros_like(blocks)
        known = blocks < self._renewed.size
        renewed[known] = self._renewed[blocks[known]]
        live = renewed <= np.repeat([s.epoch for s in self.steps], sizes)
        if live.all():  # the common case: nothing to split
            return [None] * len(sizes)
        starts = np.zeros(len(sizes), dtype=np.int64)
        np.cumsum(sizes[:-1], out=starts[1:])
        whole = (np.add.reduceat(live, starts) == sizes).tolist()
        return [None if w else live[a:a + n]
                for w, a, n in zip(whole, starts.tolist(), sizes.tolist())]


def joined_rows(steps: list[PendingStep], keep: list[np.ndarray | None] | None = None,
                by_output: bool = False) -> tuple:
    """The rows of ``steps`` (with ``keep``, per step, only the rows it
    marks; None: all) as one ``(hidden [N, k * H], positions [N], slots
    [N])`` (int64), in step order. Runs of steps kept as the forward's
    outputs are joined per output (one concatenation each, not one per
    step); only steps with dropped rows are indexed, and steps without a
    kept row are left out. With ``by_output``, rows that are all kept as
    the forward's outputs stay a tuple of ``k`` joined outputs (one copy
    less, for rows that stay pending)."""
    if keep is not None:
        steps = [s if k is None else _picked(s, k) for s, k in zip(steps, keep)
                 if k is None or k.any()]
    if by_output and all(isinstance(s.hidden, tuple) for s in steps):
        hidden = tuple(torch.cat(parts) for parts in zip(*[s.hidden for s in steps]))
        return hidden, _cat_ids([s.positions for s in steps]), _cat_ids([s.slots for s in steps])
    hidden = torch.cat(_joined_runs(
        [s.hidden for s in steps], lambda h: isinstance(h, tuple),
        lambda run: torch.cat([torch.cat(parts) for parts in zip(*run)], dim=-1)))
    return hidden, _cat_ids([s.positions for s in steps]), _cat_ids([s.slots for s in steps])


def _picked(step: PendingStep, keep: np.ndarray) -> PendingStep:
    index = torch.from_numpy(np.flatnonzero(keep))

    def pick(x):
        if isinstance(x, np.ndarray):
            return x[keep]
        return x.index_select(0, index.to(x.device))
    hidden = (tuple(pick(h) for h in step.hidden) if isinstance(step.hidden, tuple)
              else pick(step.hidden))
    return PendingStep(hidden, pick(step.positions), pick(step.slots), step.epoch)


def _host_ids(xs: list) -> np.ndarray:
    """Slots of several steps on the host, ``[N]`` int64 in step order."""
    return np.concatenate([x if isinstance(x, np.ndarray) else x.cpu().numpy()
                           for x in xs]).astype(np.int64, copy=False)


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
