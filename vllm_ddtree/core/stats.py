"""DDTree's per-engine counters, and the shared file that carries them.

The tree walk runs in the model runner (an engine-core or worker process),
while ``/metrics`` and the periodic log line live in the front-end process.
vLLM 0.32 has no channel for a speculative method's own statistics from the
one to the other (``SchedulerStats`` is decoded field by field, so extra data
is dropped). DDTree's counters therefore live in a small memory-mapped file
per engine:

* the front end makes a directory per deployment (:func:`new_stats_dir`)
  and passes its path in ``speculative_config.ddtree``;
* the runner (tensor-parallel rank 0, last pipeline stage) creates
  ``engine-<data-parallel index>.bin`` there and adds one step's numbers at
  a time (:class:`CounterWriter`);
* the front end's stat logger maps the same file read-only and turns the
  cumulative values into Prometheus counters (:class:`CounterReader`).

The file is a float64 array: ``[magic, version, sequence, <fields>, <accepted
depth histogram>]``. Writes follow a sequence lock (odd while a step is being
added), so a reader never sees half of a step.

Every value counts "drafts" the way vLLM's ``spec_decode_*`` counters do: one
per request per step that verified at least one draft node.

* ``steps``: verify steps with at least one draft.
* ``drafts``: (request, step) pairs with draft nodes.
* ``tree_drafts``: the drafts that were a tree from the drafter (the rest are
  vLLM's placeholder drafts for a request's first decode step).
* ``nodes``: draft nodes verified.
* ``accepted``: draft nodes accepted (the bonus token is not counted).
* ``expected``: the drafter's own expectation of ``accepted``: for every tree,
  the sum over its verified nodes of the drafter's probability of the node's
  prefix. Realised and expected acceptance length are ``1 + accepted/drafts``
  and ``1 + expected/drafts``; when the realised one falls well short, the
  drafter is over-confident on this traffic.
* ``depth_hist[d]``: drafts whose accepted path had ``d`` nodes.

The adaptive budget adds, per decision (one per drafting or skipped step):

* ``decided_steps``: decisions taken; ``plain_steps``: of those, the ones that
  verify nothing (a plain decoding step follows); ``chosen_nodes``: nodes
  chosen over the batch, summed; ``chosen_hist[k]``: decisions with 0 nodes
  (k = 0) or ``2**(k-1) <= N < 2**k`` nodes;
* gauges (the latest value, not summed): ``calibration[k]``, the realised
  acceptance probability of a node with ``log q`` in ``(-(k+1)/2, -k/2]``;
  ``cost``: the cost model at the last decision's batch, in seconds (a plain
  step, a tree step with the chosen nodes, the drafter's share, one more node);
* ``arm_steps[k]``: decisions that ran the delivered-rate tuner's arm ``k``
  (``core.tuner.RateTuner.arms`` order: plain, fixed 2, 4, ..., fixed B,
  model); gauge ``arm_rate[k]``: the arm's measured tokens/s per request at
  the batch size of the last measurement (0: not measured there).
"""

from __future__ import annotations

import atexit
import mmap
import os
import shutil
import tempfile
from dataclasses import dataclass, field

import numpy as np

FIELDS = ("steps", "drafts", "tree_drafts", "nodes", "accepted", "expected")
HIST_BINS = 64  # accepted depths 0..63; DFlash blocks are at most 32 wide in practice
POLICY_FIELDS = ("decided_steps", "plain_steps", "chosen_nodes")
CHOSEN_BINS = 16  # 0, 1, 2-3, 4-7, ..., >= 2**14 nodes per decision
CAL_BINS = 32  # = vllm_ddtree.core.budget.CAL_BINS
COST_GAUGES = ("plain_step", "tree_step", "draft", "per_node")
ARM_SLOTS = 12  # plain, fixed 2 .. 256 and B (<= 512), model
_MAGIC = 0x44445453  # "DDTS"
_VERSION = 3
_HEADER = 3  # magic, version, sequence
_OFFSET = {f: _HEADER + i for i, f in enumerate(FIELDS)}
_HIST = _HEADER + len(FIELDS)
_POLICY = _HIST + HIST_BINS
_CHOSEN = _POLICY + len(POLICY_FIELDS)
_CAL = _CHOSEN + CHOSEN_BINS
_COST = _CAL + CAL_BINS
_ARMS = _COST + len(COST_GAUGES)
_ARM_RATE = _ARMS + ARM_SLOTS
_SIZE = _ARM_RATE + ARM_SLOTS
_NBYTES = _SIZE * 8


@dataclass
class Snapshot:
    """Cumulative (or, after subtraction, interval) DDTree counters."""

    steps: float = 0.0
    drafts: float = 0.0
    tree_drafts: float = 0.0
    nodes: float = 0.0
    accepted: float = 0.0
    expected: float = 0.0
    depth_hist: np.ndarray = field(default_factory=lambda: np.zeros(HIST_BINS))
    decided_steps: float = 0.0
    plain_steps: float = 0.0
    chosen_nodes: float = 0.0
    chosen_hist: np.ndarray = field(default_factory=lambda: np.zeros(CHOSEN_BINS))
    calibration: np.ndarray = field(default_factory=lambda: np.zeros(CAL_BINS))
    cost: np.ndarray = field(default_factory=lambda: np.zeros(len(COST_GAUGES)))
    arm_steps: np.ndarray = field(default_factory=lambda: np.zeros(ARM_SLOTS))
    arm_rate: np.ndarray = field(default_factory=lambda: np.zeros(ARM_SLOTS))

    @classmethod
    def from_array(cls, a: np.ndarray) -> "Snapshot":
        return cls(**{f: float(a[i]) for f, i in _OFFSET.items()},
                   depth_hist=a[_HIST:_POLICY].copy(),
                   **{f: float(a[_POLICY + i]) for i, f in enumerate(POLICY_FIELDS)},
                   chosen_hist=a[_CHOSEN:_CAL].copy(), calibration=a[_CAL:_COST].copy(),
                   cost=a[_COST:_ARMS].copy(), arm_steps=a[_ARMS:_ARM_RATE].copy(),
                   arm_rate=a[_ARM_RATE:_SIZE].copy())

    def __sub__(self, other: "Snapshot") -> "Snapshot":
        """The increase of every counter; gauges keep this snapshot's value."""
        return Snapshot(*(getattr(self, f) - getattr(other, f) for f in FIELDS),
                        depth_hist=self.depth_hist - other.depth_hist,
                        **{f: getattr(self, f) - getattr(other, f) for f in POLICY_FIELDS},
                        chosen_hist=self.chosen_hist - other.chosen_hist,
                        calibration=self.calibration.copy(), cost=self.cost.copy(),
                        arm_steps=self.arm_steps - other.arm_steps,
                        arm_rate=self.arm_rate.copy())

    @property
    def nodes_per_decision(self) -> float | None:
        """Mean nodes the adaptive budget chose per step (whole batch)."""
        return self.chosen_nodes / self.decided_steps if self.decided_steps else None

    @property
    def acceptance_length(self) -> float | None:
        """Realised mean acceptance length, bonus token included."""
        return 1.0 + self.accepted / self.drafts if self.drafts else None

    @property
    def expected_acceptance_length(self) -> float | None:
        """The drafter's expected acceptance length over the same drafts."""
        return 1.0 + self.expected / self.drafts if self.drafts else None

    @property
    def nodes_per_draft(self) -> float | None:
        return self.nodes / self.drafts if self.drafts else None


ENV_STATS_DIR = "VLLM_DDTREE_STATS_DIR"
_ENV_STATS_OWNER = "VLLM_DDTREE_STATS_OWNER"


def new_stats_dir() -> str:
    """The directory for one deployment's counter files.

    The process that builds the first engine configuration makes a fresh one
    (removed when it exits) and records it in its environment, which the
    processes it starts inherit. A front-end process of the same deployment
    that builds the configuration again (the API servers of ``vllm serve
    --data-parallel-size N`` or ``--api-server-count N``) reads the counters
    of the engines its parent started, so it gets the inherited directory.
    The creating process itself gets a fresh directory for every further
    configuration (one offline engine after another).
    """
    inherited = os.environ.get(ENV_STATS_DIR)
    if (inherited and os.path.isdir(inherited)
            and os.environ.get(_ENV_STATS_OWNER) != str(os.getpid())):
        return inherited
    path = tempfile.mkdtemp(prefix="vllm-ddtree-stats-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    os.environ[ENV_STATS_DIR] = path
    os.environ[_ENV_STATS_OWNER] = str(os.getpid())
    return path


def stats_file(stats_dir: str, engine_index: int) -> str:
    return os.path.join(stats_dir, f"engine-{int(engine_index)}.bin")


class CounterWriter:
    """The runner's side: creates the file and adds one step at a time."""

    def __init__(self, path: str):
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(np.zeros(_SIZE, dtype="<f8").tobytes())
        self._fd = os.open(tmp, os.O_RDWR)
        self._mm = mmap.mmap(self._fd, _NBYTES)
        self._a = np.frombuffer(self._mm, dtype="<f8")
        self._a[0], self._a[1] = _MAGIC, _VERSION
        # A reader maps the file only once it exists with its final size.
        os.replace(tmp, path)
        self.path = path

    def add(self, num_nodes, num_accepted, expected, is_tree) -> None:
        """One verify step: per-draft sequences (requests with >= 1 node only)."""
        n = np.asarray(num_nodes, dtype=np.float64)
        if n.size == 0:
            return
        acc = np.asarray(num_accepted, dtype=np.int64)
        if np.any(acc < 0) or np.any(acc > n):
            raise ValueError("DDTree stats: accepted nodes must be in [0, num_nodes]")
        hist = np.bincount(np.minimum(acc, HIST_BINS - 1), minlength=HIST_BINS)
        inc = {"steps": 1, "drafts": n.size,
               "tree_drafts": np.count_nonzero(np.asarray(is_tree, dtype=bool)),
               "nodes": n.sum(), "accepted": acc.sum(),
               "expected": np.asarray(expected, dtype=np.float64).sum()}
        a = self._a
        a[2] += 1  # odd: step in progress
        for f, v in inc.items():
            a[_OFFSET[f]] += v
        a[_HIST:_POLICY] += hist
        a[2] += 1  # even: consistent

    def add_totals(self, totals) -> None:
        """One verify step given as its totals: the ``FIELDS`` in order (steps
        first), then the ``HIST_BINS`` bins of accepted depths (the runner
        sums them on the device and copies them to the host at once)."""
        t = np.asarray(totals, dtype=np.float64)
        if t.shape != (len(FIELDS) + HIST_BINS,):
            raise ValueError(f"DDTree stats: {len(FIELDS) + HIST_BINS} totals expected, "
                             f"got shape {t.shape}")
        if t[_OFFSET["drafts"] - _HEADER] == 0:
            return
        a = self._a
        a[2] += 1  # odd: step in progress
        a[_HEADER:_POLICY] += t
        a[2] += 1  # even: consistent

    def add_choice(self, nodes: int, calibration=None, cost=None) -> None:
        """One adaptive-budget decision: ``nodes`` chosen over the batch; the
        calibration table and the cost gauges (``COST_GAUGES``, seconds) when
        they are known."""
        nodes = int(nodes)
        if nodes < 0:
            raise ValueError("DDTree stats: chosen nodes must be >= 0")
        a = self._a
        a[2] += 1
        a[_POLICY] += 1
        a[_POLICY + 1] += nodes == 0
        a[_POLICY + 2] += nodes
        a[_CHOSEN + min(nodes.bit_length(), CHOSEN_BINS - 1)] += 1
        if calibration is not None:
            a[_CAL:_COST] = np.asarray(calibration, dtype=np.float64)[:CAL_BINS]
        if cost is not None:
            a[_COST:_ARMS] = np.asarray(cost, dtype=np.float64)
        a[2] += 1

    def add_arm(self, index: int, rates=None) -> None:
        """One decision of the delivered-rate tuner: it ran arm ``index``;
        ``rates`` (tokens/s per arm, 0 when not measured) at this batch size,
        or None when they have not changed since the last decision."""
        if not 0 <= index < ARM_SLOTS:
            raise ValueError(f"DDTree stats: arm index {index} outside 0..{ARM_SLOTS - 1}")
        a = self._a
        a[2] += 1
        a[_ARMS + index] += 1
        if rates is not None:
            r = np.zeros(ARM_SLOTS)
            r[: len(rates)] = np.asarray(rates, dtype=np.float64)[:ARM_SLOTS]
            a[_ARM_RATE:_SIZE] = r
        a[2] += 1

    def snapshot(self) -> Snapshot:
        return Snapshot.from_array(self._a)

    def close(self) -> None:
        # Drop the array view first: an mmap with exported buffers cannot close.
        self._a = None
        self._mm.close()
        os.close(self._fd)


class CounterReader:
    """The front end's side: maps the file read-only once it exists."""

    def __init__(self, path: str):
        self.path = path
        self._a: np.ndarray | None = None
        self._mm: mmap.mmap | None = None

    def _open(self) -> bool:
        try:
            if os.path.getsize(self.path) != _NBYTES:
                return False
            with open(self.path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), _NBYTES, access=mmap.ACCESS_READ)
        except OSError:
            return False
        a = np.frombuffer(self._mm, dtype="<f8")
        if a[0] != _MAGIC or a[1] != _VERSION:
            raise RuntimeError(f"{self.path} is not a DDTree stats file of version {_VERSION}")
        self._a = a
        return True

    def read(self, retries: int = 100) -> Snapshot | None:
        """The current counters, or None while the engine has not created the file."""
        if self._a is None and not self._open():
            return None
        a = self._a
        for _ in range(retries):
            seq = a[2]
            if seq % 2 == 0:
                snap = Snapshot.from_array(a)
                if a[2] == seq:
                    return snap
            os.sched_yield()
        raise RuntimeError(f"DDTree stats: {self.path} stayed mid-update")
