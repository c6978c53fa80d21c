"""The adaptive tree budget: how many draft nodes each request verifies per step.

Pure torch and Python (no vLLM import). The runner owns one
:class:`AdaptivePolicy`; per step it asks three questions:

1. *Draft at all?* (:meth:`AdaptivePolicy.should_draft`). The policy is in
   tree mode or in plain mode. In plain mode the drafter's block forward is
   skipped; only the drafter's context K/V is stored, so that a later
   drafting step sees the whole context. The mode follows a prediction from
   recent trees: do tree steps (drafter included) beat plain steps at the
   current batch size? Plain mode drafts every ``probe_every`` steps in any
   case (a probe, which verifies a few nodes per request).
2. *How many nodes, for whom?* (:meth:`AdaptivePolicy.choose`). Given the
   fresh trees, every node gets a value: its calibrated acceptance
   probability. Because a node's prefix probability never exceeds its
   parent's, and the calibration is monotone, the top ``n`` nodes of a request
   in flat order are its ``n`` most valuable nodes, and the global top ``N``
   over the batch is a set of per-request trees. :func:`choose_budgets` picks
   the ``N`` (0 allowed) that maximises expected committed tokens per second,
   ``(R + sum of the chosen values) / cost(R + N)``, the drafter included.
3. *What did it cost, and what was accepted?* (:meth:`AdaptivePolicy.observe`,
   :meth:`Calibration.observe`). Measured step times refine the cost model;
   the walk's outcome per node refines the calibration. While trees are
   chosen every step, one decision in ``probe_every`` verifies nothing when
   the cost of a plain step at the current batch size has not been measured
   lately.

Value of a node
    The drafter's prefix probability ``q(u)`` is its own estimate of the
    chance that node ``u`` is accepted. :class:`Calibration` keeps, per bin
    of ``log q``, decayed counts of verified and accepted nodes, blends them
    with a prior (``q`` times the global realised/expected ratio) and makes the
    table monotone in ``q`` (pool-adjacent-violators).

Cost of a step
    :class:`CostModel`: seconds per engine step as a piecewise-linear curve of
    the step's query tokens ``T`` (target forward, sampling, the walk and the
    engine's own per-step work), plus the drafter's forward as a curve of the
    number of requests. Both are profiled at engine start from dummy forwards
    over a ladder of sizes and refined online from measured steps.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["AdaptivePolicy", "Calibration", "CostModel", "PiecewiseLinear",
           "choose_budgets", "ladder", "parse_pinned_cost"]

# Calibration bins over log q: bin k covers (-(k+1) w, -k w].
CAL_BINS = 32
CAL_WIDTH = 0.5


def ladder(hi: int) -> list[int]:
    """1, 2, 4, ... up to and including ``hi``."""
    out, x = [], 1
    while x < hi:
        out.append(x)
        x *= 2
    out.append(max(int(hi), 1))
    return sorted(set(out))


# Steps a mode prediction is reused for at one batch size (its inputs, the
# cost curves and the trees' values, move slowly; a probe comes every 32).
PREDICTION_STEPS = 16


# ---------------------------------------------------------------- cost curves
class PiecewiseLinear:
    """Seconds as a non-decreasing piecewise-linear function of a size ``x``
    on fixed knots (extrapolated with the last segment's slope).

    A profile (measured at start) gives the shape; measured steps give the
    values. Each knot keeps a learnt value ``Y`` (moved towards every
    measurement nearest to it), a confidence ``W`` (how much it has been measured,
    decayed) and its profiled value ``P``. A knot's value is
    ``(W*Y + P*r) / (W + 1)``, where ``r`` is the measured/profiled ratio of
    the nearest measured knots on either side (interpolated in log size):
    knots no step has reached follow the level of those that steps did reach
    (a profile taken on a busy machine is slow, not wrong in shape).
    """

    def __init__(self, xs: list[int], ys: list[float], decay: float = 0.998):
        if len(xs) != len(ys) or not xs:
            raise ValueError("PiecewiseLinear: one value per knot")
        self.xs = [float(x) for x in xs]
        self.profile = [max(float(y), 1e-7) for y in ys]
        self.learnt = list(self.profile)
        self.weight = [0.0] * len(xs)
        self.decay = decay
        self._logx = [math.log2(max(x, 1e-9)) for x in self.xs]
        self._ys: list[float] | None = None

    @property
    def ys(self) -> list[float]:
        """The knots' values, recomputed when read after a measurement (a
        step measures once, and only the policy's decisions read them)."""
        if self._ys is None:
            self._refresh()
        return self._ys

    def _nearest(self, x: float) -> int:
        """The knot nearest to ``x`` in log size."""
        lx = math.log2(max(float(x), 1e-9))
        i = bisect.bisect_left(self._logx, lx)
        if i == 0:
            return 0
        if i == len(self._logx):
            return i - 1
        return i if self._logx[i] - lx < lx - self._logx[i - 1] else i - 1

    def _refresh(self) -> None:
        seen = [j for j, w in enumerate(self.weight) if w > 0.05]
        logr = {j: math.log(self.learnt[j] / self.profile[j]) for j in seen}
        ys, run = [], 0.0
        for k in range(len(self.xs)):
            left = max((j for j in seen if j <= k), default=None)
            right = min((j for j in seen if j >= k), default=None)
            if left is None and right is None:
                lr = 0.0
            elif left is None or right is None or left == right:
                lr = logr[left if right is None else right]
            else:  # between two measured knots: interpolate in log size
                f = (self._logx[k] - self._logx[left]) / (self._logx[right] - self._logx[left])
                lr = logr[left] + (logr[right] - logr[left]) * f
            w = self.weight[k]
            y = (w * self.learnt[k] + self.profile[k] * math.exp(lr)) / (w + 1.0)
            run = max(run, y, 1e-7)  # non-decreasing
            ys.append(run)
        self._ys = ys

    def _bracket(self, x: float) -> tuple[int, int, float]:
        xs = self.xs
        if len(xs) == 1:
            return 0, 0, 0.0
        i = 0
        while i < len(xs) - 2 and x > xs[i + 1]:
            i += 1
        f = (x - xs[i]) / (xs[i + 1] - xs[i])
        return i, i + 1, max(f, 0.0)  # f > 1: extrapolate

    def _interp(self, ys: list[float], x: float) -> float:
        i, j, f = self._bracket(float(x))
        if i == j:
            return ys[0]
        return ys[i] + (ys[j] - ys[i]) * f

    def __call__(self, x: float) -> float:
        return self._interp(self.ys, x)

    def confidence(self, x: float) -> float:
        """How much the curve has been measured near ``x`` (decayed count of
        the nearest knot)."""
        return self.weight[self._nearest(x)]

    def at(self, x: Tensor) -> Tensor:
        """The curve at every element of ``x`` (float64, same device)."""
        xs = torch.tensor(self.xs, dtype=torch.float64, device=x.device)
        ys = torch.tensor(self.ys, dtype=torch.float64, device=x.device)
        x = x.double()
        if len(self.xs) == 1:
            return ys[0].expand_as(x).clone()
        i = (torch.searchsorted(xs, x, right=True) - 1).clamp(0, len(self.xs) - 2)
        f = ((x - xs[i]) / (xs[i + 1] - xs[i])).clamp(min=0.0)
        return ys[i] + (ys[i + 1] - ys[i]) * f

    def update(self, x: float, y: float, rate: float) -> None:
        """One measurement ``y`` at ``x``: the knot nearest to ``x`` (in log
        size) moves a fraction ``rate`` of the way (outliers clipped to 0.5-2x
        its value) and gains confidence; each knot thus averages the steps of
        its own cell."""
        k = self._nearest(x)
        cur = self.learnt[k]
        self.learnt[k] = cur + rate * (min(max(y, 0.5 * cur), 2.0 * cur) - cur)
        self.weight = [w * self.decay for w in self.weight]
        self.weight[k] += 1.0
        self._ys = None


@dataclass
class CostModel:
    """Seconds per engine step.

    * ``verify(T)``: a step with ``T`` query tokens, without the drafter
      (target forward, sampling or the walk, the engine's per-step work);
    * ``draft(R)``: the drafter's forward for ``R`` requests (context K/V plus
      one block).

    A plain step costs ``verify(R)``; a tree step with ``N`` nodes in total
    ``verify(R + N) + draft(R)``.
    """

    verify: PiecewiseLinear
    draft: PiecewiseLinear
    pinned: bool = False  # set from VLLM_DDTREE_COST_MODEL: never refined
    rate: float = 0.2  # online refinement per measured step
    measured: int = 0

    def plain_step(self, num_reqs: int) -> float:
        return self.verify(num_reqs)

    def tree_steps(self, num_reqs: int, max_nodes: int, device) -> Tensor:
        """``[max_nodes + 1]`` float64: a tree step's seconds with N = 0..max_nodes."""
        t = torch.arange(num_reqs, num_reqs + max_nodes + 1, device=device)
        return self.verify.at(t) + self.draft(num_reqs)

    def observe(self, num_reqs: int, num_tokens: int, step_s: float, draft_s: float) -> None:
        """One measured engine step (``draft_s`` = 0 when the drafter's block
        forward was skipped)."""
        if self.pinned or step_s <= 0:
            return
        self.measured += 1
        if draft_s > 0:
            self.draft.update(num_reqs, draft_s, self.rate)
        self.verify.update(num_tokens, max(step_s - draft_s, 1e-6), self.rate)


def parse_pinned_cost(text: str, max_tokens: int, max_reqs: int) -> CostModel:
    """``"A,B,D"`` (milliseconds): a step costs ``A + B * T``, plus ``D`` when
    the drafter runs. For experiments and tests; never refined."""
    try:
        a, b, d = (float(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"VLLM_DDTREE_COST_MODEL must be 'A,B,D' in milliseconds (a step "
                         f"costs A + B * tokens, plus D with the drafter), got {text!r}") from None
    if min(a, b, d) < 0 or a + b <= 0:
        raise ValueError(f"VLLM_DDTREE_COST_MODEL: A, B, D must be >= 0 and A + B > 0, "
                         f"got {text!r}")
    xs = [1, max(max_tokens, 2)]
    verify = PiecewiseLinear(xs, [(a + b * x) / 1e3 for x in xs])
    draft = PiecewiseLinear([1, max(max_reqs, 2)], [d / 1e3, d / 1e3])
    return CostModel(verify, draft, pinned=True)


# ---------------------------------------------------------------- the choice
def choose_budgets(values: Tensor, tree_step_s: Tensor, plain_step_s: float | None,
                   min_nodes: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """The batch-optimal number of nodes per request.

    ``values``: ``[R, B]`` each node's value (expected accepted tokens), per
    request in flat order (made non-increasing along the row here; 0 for
    nodes that do not exist). ``tree_step_s``: ``[R*B + 1]`` a tree step's
    cost with ``N = 0..R*B`` nodes. ``plain_step_s``: a plain step's cost, or
    None when the choice is among tree steps only (the drafter runs anyway).
    ``min_nodes``: verify at least this many nodes even if a plain step would
    pay more (exploration).

    Returns ``(budgets [R] int64, nodes 0-d int64, tokens_per_s 0-d float64)``
    where ``tokens_per_s`` is the expected rate of the choice. No host sync.
    """
    num_reqs, width = values.shape
    v = values.double().clamp(min=0.0).cummin(dim=1).values
    flat = v.reshape(-1)
    # Stable: equal values keep flat order, so each request's share is a prefix.
    order = torch.argsort(flat, descending=True, stable=True)
    gain = F.pad(flat[order].cumsum(0), (1, 0))
    rate = (num_reqs + gain) / tree_step_s
    if min_nodes > 0:
        rate = rate.masked_fill(torch.arange(rate.shape[0], device=rate.device)
                                < min(min_nodes, rate.shape[0] - 1), -1.0)
    best = rate.argmax()  # the first (smallest N) of equal rates
    if plain_step_s is None:
        plain_rate = rate[0]
        take = torch.ones((), dtype=torch.bool, device=values.device)
    else:
        plain_rate = torch.tensor(num_reqs / plain_step_s, dtype=torch.float64,
                                  device=values.device)
        take = (rate[best] > plain_rate) | (min_nodes > 0)
    nodes = torch.where(take, best, torch.zeros_like(best))
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.shape[0], device=order.device)
    budgets = (rank < nodes).view(num_reqs, width).sum(1)
    return budgets, nodes, torch.where(take, rate[best], plain_rate)


# ---------------------------------------------------------------- calibration
def _bins(logq: Tensor) -> Tensor:
    return (-logq.float() / CAL_WIDTH).floor().clamp(0, CAL_BINS - 1).long()


def isotonic_decreasing(y: list[float], w: list[float]) -> list[float]:
    """Weighted least-squares fit of ``y`` that is non-increasing in the index
    (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for yi, wi in zip(y, w):
        blocks.append([yi, max(wi, 1e-12), 1])
        while len(blocks) > 1 and blocks[-2][0] < blocks[-1][0]:
            m2, w2, c2 = blocks.pop()
            m1, w1, c1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, c1 + c2])
    out: list[float] = []
    for m, _, c in blocks:
        out += [m] * c
    return out


class Calibration:
    """Realised acceptance probability as a function of the drafter's ``q``.

    Counts per bin of ``log q`` decay by ``decay`` per observed step, so the
    table follows the traffic. Before data, a node is worth its ``q``.
    """

    def __init__(self, device, decay: float = 0.995, prior_weight: float = 4.0):
        self.device = torch.device(device)
        self.decay = decay
        self.prior_weight = prior_weight
        self.counts = torch.zeros(3, CAL_BINS, dtype=torch.float64, device=self.device)
        centres = [math.exp(-(k + 0.5) * CAL_WIDTH) for k in range(CAL_BINS)]
        self.table = list(centres)  # host: acceptance probability per bin
        self._table_dev = torch.tensor(self.table, dtype=torch.float64, device=self.device)
        self.observed_steps = 0

    def observe(self, logq: Tensor, verified: Tensor, accepted: Tensor) -> None:
        """One walked step: ``[R, B]`` log q, verified and accepted flags of the
        drafter's nodes. Device only."""
        b = _bins(logq).reshape(-1)
        w = verified.reshape(-1).double()
        upd = torch.stack([
            torch.bincount(b, weights=w, minlength=CAL_BINS),
            torch.bincount(b, weights=w * accepted.reshape(-1).double(), minlength=CAL_BINS),
            torch.bincount(b, weights=w * logq.reshape(-1).double().exp(), minlength=CAL_BINS),
        ])
        self.counts.mul_(self.decay).add_(upd)
        self.observed_steps += 1

    def refresh(self) -> list[float]:
        """Recompute the table from the counts (one small host copy)."""
        trials, hits, qsum = self.counts.tolist()
        prior_ratio = (sum(hits) + self.prior_weight) / (sum(qsum) + self.prior_weight)
        rates, weights = [], []
        for k in range(CAL_BINS):
            centre = math.exp(-(k + 0.5) * CAL_WIDTH)
            qbar = qsum[k] / trials[k] if trials[k] > 1e-9 else centre
            prior = min(1.0, qbar * prior_ratio)
            rates.append((hits[k] + self.prior_weight * prior) / (trials[k] + self.prior_weight))
            weights.append(trials[k] + self.prior_weight)
        self.table = [min(max(r, 0.0), 1.0) for r in isotonic_decreasing(rates, weights)]
        self._table_dev = torch.tensor(self.table, dtype=torch.float64, device=self.device)
        return self.table

    def value(self, logq: Tensor) -> Tensor:
        """Calibrated acceptance probability of nodes with prefix log-prob
        ``logq`` (linear between bin centres, monotone in ``q``)."""
        x = (-logq.double() / CAL_WIDTH - 0.5).clamp(0, CAL_BINS - 1)
        i = x.floor().long().clamp(max=CAL_BINS - 2)
        f = x - i
        t = self._table_dev
        return t[i] * (1 - f) + t[i + 1] * f


# ---------------------------------------------------------------- the policy
@dataclass
class Decision:
    """What the policy chose for the next step (device values)."""

    budgets: Tensor  # [R] int64 nodes per request
    nodes: Tensor  # 0-d int64 total
    rate: Tensor  # 0-d float64 expected tokens/s of the choice
    probe: bool


class AdaptivePolicy:
    """Per-step tree budgets for a batch (see the module docstring).

    Two levels. The *mode* (:meth:`should_draft`, once per step before the
    drafter runs): tree mode drafts every step; plain mode skips the drafter's
    block. It compares the predicted tokens/s of tree steps (recent trees'
    mean calibrated value per flat rank, at the current batch size) with a
    plain step's, with a small hysteresis. In tree mode, :meth:`choose` then
    picks the best ``N`` for the fresh trees, 0 included, at the tree-mode cost
    (the drafter runs in either case).
    """

    def __init__(self, budget: int, cost: CostModel, device, probe_every: int = 32,
                 refresh_every: int = 8, hysteresis: float = 0.03):
        self.budget = budget
        self.cost = cost
        self.device = torch.device(device)
        self.calibration = Calibration(device)
        self.probe_every = probe_every
        self.refresh_every = refresh_every
        self.hysteresis = hysteresis
        self.plain = False  # plain mode: the drafter's block is skipped
        self.plain_run = 0  # steps since the drafter last drafted
        self.tree_run = 0  # decisions since the last one that verified nothing
        # Mean calibrated value of a request's k-th node over recent trees.
        self.rank_values = torch.zeros(budget, dtype=torch.float64, device=self.device)
        self._rank_values_host: list[float] | None = None
        self._seen_trees = False
        self._steps = 0
        self._prediction: tuple[int, int, float, float] | None = None  # (reqs, step, tree, plain)

    # -- 1. draft at all?
    def should_draft(self, num_reqs: int) -> bool:
        """The mode for this step; True: run the drafter's block."""
        if not self._seen_trees:
            return True
        if self.plain and self.plain_run >= self.probe_every:
            return True  # a probe: fresh trees for the prediction and the calibration
        tree, plain = self.predicted_rates(num_reqs)
        if self.plain:
            self.plain = not tree > plain * (1 + self.hysteresis)
        else:
            self.plain = tree < plain * (1 - self.hysteresis)
        return not self.plain

    def predicted_rates(self, num_reqs: int) -> tuple[float, float]:
        """(tree mode, plain mode) tokens/s for ``num_reqs`` requests whose trees
        look like the recent ones; recomputed every few steps or when the batch
        size changes."""
        cached = self._prediction
        if (cached is not None and cached[0] == num_reqs
                and self._steps - cached[1] < PREDICTION_STEPS):
            return cached[2], cached[3]
        if self._rank_values_host is None:
            self._rank_values_host = self.rank_values.tolist()
        best, cum = 0.0, 0.0
        draft = self.cost.draft(num_reqs)
        for n, v in enumerate(self._rank_values_host, start=1):
            cum += v
            rate = num_reqs * (1 + cum) / (self.cost.verify(num_reqs * (1 + n)) + draft)
            best = max(best, rate)
        plain = num_reqs / self.cost.plain_step(num_reqs)
        self._prediction = (num_reqs, self._steps, best, plain)
        return best, plain

    def skipped(self) -> None:
        """The drafter's block was skipped this step."""
        self.plain_run += 1
        self._steps += 1

    # -- 2. how many nodes, for whom?
    def choose(self, logq: Tensor, valid: Tensor) -> Decision:
        """Budgets for the trees just drafted (``[R, B]`` log q and validity)."""
        num_reqs, width = logq.shape
        self._steps += 1
        if self._steps % self.refresh_every == 1:
            self.calibration.refresh()
        values = self.calibration.value(logq) * valid
        probe = self.plain
        self.plain_run = 0
        mean = values.cummin(dim=1).values.mean(0)
        self.rank_values[:width].mul_(0.9).add_(0.1 * mean)
        self._rank_values_host = None
        self._prediction = None
        self._seen_trees = True
        if (not probe and self.tree_run >= self.probe_every and not self.cost.pinned
                and self.cost.verify.confidence(num_reqs) < 1.0):
            # Trees every step: a plain step now and then measures what one
            # costs at this batch size (nothing else would).
            zeros = torch.zeros(num_reqs, dtype=torch.long, device=values.device)
            rate = torch.tensor(num_reqs / self.cost.plain_step(num_reqs), dtype=torch.float64,
                                device=values.device)
            return Decision(zeros, zeros.sum(), rate, True)
        tree_s = self.cost.tree_steps(num_reqs, num_reqs * width, values.device)
        min_nodes = num_reqs * min(width, 4) if probe else 0
        budgets, nodes, rate = choose_budgets(values, tree_s, None, min_nodes=min_nodes)
        return Decision(budgets, nodes, rate, probe)

    def decided(self, total_nodes: int) -> None:
        """The host learnt the choice (when the scheduler takes the drafts)."""
        self.tree_run = 0 if total_nodes == 0 else self.tree_run + 1

    # -- 3. what did it cost?
    def observe(self, num_reqs: int, num_tokens: int, step_s: float, draft_s: float) -> None:
        self.cost.observe(num_reqs, num_tokens, step_s, draft_s)
