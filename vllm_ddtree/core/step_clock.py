"""The engine's busy time between two runner steps.

A step's cost, as the cost model and the tuner see it, runs from the start
of the runner's step to the start of the next one: the runner's own work
plus the engine's between steps (scheduling, drafts to check, outputs to
detokenize), which differs between arms. When no request is waiting the
engine sleeps between steps, for milliseconds or for hours, and that time
is no step's cost: counted, it would make a trial that spans it look many
times slower than it is and charge exploring for time nobody lost.

:class:`BusyGap` keeps a running mean of the gap and counts at most
``slack`` times it, plus ``floor_s``, of any one gap; a longer gap is idle
time. The mean follows the counted part of every gap, so a regime whose
gaps are persistently longer (an arm that schedules many drafts) is
learnt within tens of steps (the cap grows by about a fifth each step),
while one idle gap moves it by a few percent.

Imports nothing from vLLM.
"""

from __future__ import annotations

__all__ = ["BusyGap"]


class BusyGap:
    def __init__(self, slack: float = 3.0, floor_s: float = 2e-3, weight: float = 0.1) -> None:
        if slack < 1.0 or floor_s <= 0.0 or not 0.0 < weight <= 1.0:
            raise ValueError(f"BusyGap: need slack >= 1, floor_s > 0 and weight in (0, 1], got "
                             f"slack={slack}, floor_s={floor_s}, weight={weight}")
        self.slack = slack
        self.floor_s = floor_s
        self.weight = weight
        self.mean = 0.0  # seconds

    def cap(self) -> float:
        """The longest gap counted as busy now."""
        return self.slack * self.mean + self.floor_s

    def busy(self, gap: float) -> float:
        """The busy part of one gap between steps (seconds), learnt from."""
        if gap < 0.0:
            raise ValueError(f"BusyGap.busy: a gap cannot be negative, got {gap}")
        counted = min(gap, self.cap())
        self.mean += self.weight * (counted - self.mean)
        return counted
