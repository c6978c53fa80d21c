"""DDTree metrics on ``/metrics`` and in the periodic log line (front end).

:class:`DDTreeStatLogger` is one more of vLLM's stat loggers (installed next to
the Prometheus logger when DDTree is on, see ``patches/stat_loggers.py``). On
every engine step it reads the engine's cumulative counters from the file the
runner writes (:mod:`vllm_ddtree.core.stats`) and exports the increase:

=====================================  =========  ===============================
metric                                 type       meaning
=====================================  =========  ===============================
``vllm:ddtree_num_drafts``             counter    (request, step) pairs verified
``vllm:ddtree_num_tree_drafts``        counter    of those, trees from the drafter
``vllm:ddtree_num_nodes_verified``     counter    draft nodes verified
``vllm:ddtree_num_accepted_tokens``    counter    draft nodes accepted
``vllm:ddtree_expected_accepted_tokens`` counter  the drafter's expectation of it
``vllm:ddtree_accepted_depth``         histogram  accepted path length per draft
``vllm:ddtree_acceptance_length``      gauge      realised tau since start
``vllm:ddtree_expected_acceptance_length`` gauge  expected tau since start
``vllm:ddtree_budget_decisions``       counter    adaptive budget decisions
``vllm:ddtree_budget_plain_steps``     counter    of those, plain steps (0 nodes)
``vllm:ddtree_budget_chosen_nodes``    counter    nodes chosen, whole batch
``vllm:ddtree_budget_nodes_per_step``  histogram  nodes chosen per decision
``vllm:ddtree_budget_calibration``     gauge      realised acceptance probability
                                                  per ``log q`` bin (label
                                                  ``logq_upper``)
``vllm:ddtree_budget_cost_seconds``    gauge      cost model at the last batch
                                                  (label ``component``:
                                                  plain_step, tree_step, draft,
                                                  per_node)
``vllm:ddtree_budget_arm_steps``       counter    decisions per arm of the
                                                  delivered-rate tuner (label
                                                  ``arm``: plain, fixed2, ...,
                                                  model)
``vllm:ddtree_budget_arm_request_rate`` gauge  each arm's measured
                                                  tokens/s per request at the
                                                  batch size measured last
                                                  (label ``arm``)
=====================================  =========  ===============================

Counters carry the ``_total`` suffix on the wire. Acceptance length over a
window, as for vLLM's own counters::

    1 + rate(vllm:ddtree_num_accepted_tokens_total[1m])
        / rate(vllm:ddtree_num_drafts_total[1m])

``drafts``, ``nodes`` and ``accepted`` equal vLLM's
``vllm:spec_decode_num_drafts`` / ``_num_draft_tokens`` /
``_num_accepted_tokens`` (the tests check it); the extra information is the
accepted-depth distribution and the expectation.
"""

from __future__ import annotations

import math
import time

import numpy as np
import prometheus_client
from vllm.logger import init_logger
from vllm.v1.metrics.loggers import AggregateStatLoggerBase

from vllm_ddtree.core.config import ddtree_runtime
from vllm_ddtree.core.stats import (CAL_BINS, CHOSEN_BINS, COST_GAUGES, CounterReader, Snapshot,
                               stats_file)
from vllm_ddtree.core.tuner import tuner_arms

logger = init_logger("vllm.ddtree")

_COUNTERS = (
    # (name, Snapshot field, documentation)
    ("vllm:ddtree_num_drafts", "drafts",
     "DDTree drafts verified: one per request per step with draft nodes."),
    ("vllm:ddtree_num_tree_drafts", "tree_drafts",
     "DDTree drafts that were a tree from the drafter (the rest are placeholder drafts)."),
    ("vllm:ddtree_num_nodes_verified", "nodes", "DDTree draft-tree nodes verified."),
    ("vllm:ddtree_num_accepted_tokens", "accepted",
     "DDTree draft nodes accepted by the tree walk (bonus tokens not counted)."),
    ("vllm:ddtree_expected_accepted_tokens", "expected",
     "Sum over drafts of the drafter's expected accepted nodes (sum of the "
     "prefix probabilities of the verified nodes)."),
    ("vllm:ddtree_budget_decisions", "decided_steps",
     "DDTree adaptive budget: decisions taken (one per engine step)."),
    ("vllm:ddtree_budget_plain_steps", "plain_steps",
     "DDTree adaptive budget: decisions that verify no node (plain decoding steps)."),
    ("vllm:ddtree_budget_chosen_nodes", "chosen_nodes",
     "DDTree adaptive budget: draft nodes chosen over the batch, summed over decisions."),
)
# Under load the counters are exported at most this often (see record()).
REFRESH_SECONDS = 0.25
_CHOSEN_BUCKETS = [0.0] + [float(2 ** k - 1) for k in range(1, CHOSEN_BINS)]


class DDTreeStatLogger(AggregateStatLoggerBase):
    def __init__(self, vllm_config, engine_indexes: list[int] | None = None):
        runtime = ddtree_runtime(vllm_config)
        if runtime is None or not runtime.stats_dir:
            raise ValueError("DDTreeStatLogger needs speculative_config.ddtree.stats_dir")
        self.engine_indexes = list(engine_indexes or [0])
        self.depth = runtime.depth
        self.readers = {i: CounterReader(stats_file(runtime.stats_dir, i))
                        for i in self.engine_indexes}
        self.last = {i: Snapshot() for i in self.engine_indexes}
        self.logged = {i: Snapshot() for i in self.engine_indexes}
        self.last_log = time.monotonic()
        self.last_refresh = -math.inf

        labelnames = ["model_name", "engine"]
        model_name = vllm_config.model_config.served_model_name
        values = {i: [model_name, str(i)] for i in self.engine_indexes}
        names = [n for n, _, _ in _COUNTERS] + [
            "vllm:ddtree_accepted_depth", "vllm:ddtree_acceptance_length",
            "vllm:ddtree_expected_acceptance_length", "vllm:ddtree_budget_nodes_per_step",
            "vllm:ddtree_budget_calibration", "vllm:ddtree_budget_cost_seconds",
            "vllm:ddtree_budget_arm_steps", "vllm:ddtree_budget_arm_request_rate"]
        _unregister(names)
        self.counters = {}
        for name, attr, doc in _COUNTERS:
            c = prometheus_client.Counter(name=name, documentation=doc, labelnames=labelnames)
            self.counters[attr] = {i: c.labels(*values[i]) for i in self.engine_indexes}
        hist = prometheus_client.Histogram(
            name="vllm:ddtree_accepted_depth",
            documentation="DDTree accepted path length (draft nodes) per draft.",
            labelnames=labelnames, buckets=[float(d) for d in range(self.depth + 1)])
        self.hist = {i: hist.labels(*values[i]) for i in self.engine_indexes}
        self.gauges = {}
        for name, attr, doc in (
                ("vllm:ddtree_acceptance_length", "acceptance_length",
                 "DDTree realised mean acceptance length since start (bonus included)."),
                ("vllm:ddtree_expected_acceptance_length", "expected_acceptance_length",
                 "The drafter's expected mean acceptance length since start.")):
            g = prometheus_client.Gauge(name=name, documentation=doc, labelnames=labelnames,
                                        multiprocess_mode="mostrecent")
            self.gauges[attr] = {i: g.labels(*values[i]) for i in self.engine_indexes}
        chosen = prometheus_client.Histogram(
            name="vllm:ddtree_budget_nodes_per_step",
            documentation="DDTree adaptive budget: draft nodes chosen per decision (whole "
                          "batch; 0 = a plain decoding step). Buckets are upper bounds of "
                          "0, 1, 2-3, 4-7, ... nodes.",
            labelnames=labelnames, buckets=_CHOSEN_BUCKETS)
        self.chosen = {i: chosen.labels(*values[i]) for i in self.engine_indexes}
        def labelled_gauges(name, doc, label, label_values):
            g = prometheus_client.Gauge(name=name, documentation=doc,
                                        labelnames=labelnames + [label],
                                        multiprocess_mode="mostrecent")
            return {i: [g.labels(*values[i], v) for v in label_values]
                    for i in self.engine_indexes}

        self.calibration = labelled_gauges(
            "vllm:ddtree_budget_calibration",
            "DDTree adaptive budget: realised acceptance probability of a draft node whose "
            "prefix log-probability is at most logq_upper (and above logq_upper - 0.5).",
            "logq_upper", [f"{-k / 2:g}" for k in range(CAL_BINS)])
        self.cost = labelled_gauges(
            "vllm:ddtree_budget_cost_seconds",
            "DDTree adaptive budget: the cost model at the last decision's batch (plain_step, "
            "tree_step with the chosen nodes, the drafter's share, and one more node).",
            "component", COST_GAUGES)
        self.arm_names = [a.name for a in tuner_arms(runtime.budget)]
        arm_steps = prometheus_client.Counter(
            name="vllm:ddtree_budget_arm_steps",
            documentation="DDTree adaptive budget: decisions that ran each arm of the "
                          "delivered-rate tuner (plain, fixed b, model).",
            labelnames=labelnames + ["arm"])
        self.arm_steps = {i: [arm_steps.labels(*values[i], n) for n in self.arm_names]
                          for i in self.engine_indexes}
        self.arm_rate = labelled_gauges(
            "vllm:ddtree_budget_arm_request_rate",
            "DDTree adaptive budget: each arm's measured output tokens per second per "
            "request at the batch size measured last (0: not measured there yet).",
            "arm", self.arm_names)

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
        # vLLM records every engine step; reading and exporting the counters
        # costs tens of microseconds, a few percent of a small model's step,
        # so they are exported every REFRESH_SECONDS under load (counters and
        # histograms add up the steps in between) and whenever the engine has
        # nothing left to run, so that an idle engine's metrics are complete.
        now = time.monotonic()
        busy = scheduler_stats is not None and (scheduler_stats.num_running_reqs
                                                or scheduler_stats.num_waiting_reqs)
        if busy and now - self.last_refresh < REFRESH_SECONDS:
            return
        self.last_refresh = now
        self._refresh_all()

    def _refresh_all(self) -> None:
        # Every engine's file, whichever engine's output arrived: with several
        # API servers only the first exports ddtree metrics (see
        # patches/stat_loggers.py), and it may see one engine's outputs only.
        for i in self.engine_indexes:
            self._refresh(i)

    def _refresh(self, engine_idx: int) -> None:
        reader = self.readers.get(engine_idx)
        snap = reader.read() if reader is not None else None
        if snap is None:
            return
        prev = self.last[engine_idx]
        delta = snap - prev
        self.last[engine_idx] = snap
        for attr, children in self.counters.items():
            inc = getattr(delta, attr)
            if inc > 0:
                children[engine_idx].inc(inc)
        hist = self.hist[engine_idx]
        for d, count in enumerate(delta.depth_hist):
            for _ in range(int(count)):
                hist.observe(float(d))
        if snap.drafts:
            for attr, children in self.gauges.items():
                children[engine_idx].set(getattr(snap, attr))
        chosen = self.chosen[engine_idx]
        for k, count in enumerate(delta.chosen_hist):
            for _ in range(int(count)):
                chosen.observe(_CHOSEN_BUCKETS[k])
        if snap.decided_steps:  # gauges: set when they changed
            if not np.array_equal(snap.calibration, prev.calibration):
                for g, v in zip(self.calibration[engine_idx], snap.calibration):
                    g.set(float(v))
            if not np.array_equal(snap.cost, prev.cost):
                for g, v in zip(self.cost[engine_idx], snap.cost):
                    g.set(float(v))
        for c, inc in zip(self.arm_steps[engine_idx], delta.arm_steps):
            if inc > 0:
                c.inc(float(inc))
        if snap.arm_steps.any() and not (prev.arm_steps.any()
                                         and np.array_equal(snap.arm_rate, prev.arm_rate)):
            for g, v in zip(self.arm_rate[engine_idx], snap.arm_rate):
                g.set(float(v))

    def log(self):
        now = time.monotonic()
        self.last_refresh = now
        self._refresh_all()
        for i in self.engine_indexes:
            delta = self.last[i] - self.logged[i]
            self.logged[i] = self.last[i]
            if delta.decided_steps:
                plain, tree, draft, per_node = delta.cost
                logger.info(
                    "DDTree adaptive budget (engine %d): %.1f nodes per step, %.0f%% plain "
                    "steps; cost model at the last batch: plain step %.2f ms, tree step "
                    "%.2f ms (drafter %.2f ms), %.1f us per extra node.",
                    i, delta.nodes_per_decision, 100 * delta.plain_steps / delta.decided_steps,
                    1e3 * plain, 1e3 * tree, 1e3 * draft, 1e6 * per_node)
            if not delta.drafts:
                continue
            hist = delta.depth_hist[: self.depth + 1]
            total = hist.sum()
            cdf = hist.cumsum() / total
            median = int((cdf >= 0.5).argmax())
            p90 = int((cdf >= 0.9).argmax())
            logger.info(
                "DDTree metrics (engine %d, last %.0f s): mean acceptance length %.2f "
                "(drafter expected %.2f), %.1f nodes verified per draft, accepted depth "
                "median %d / p90 %d, %d drafts (%d trees).",
                i, now - self.last_log, delta.acceptance_length,
                delta.expected_acceptance_length, delta.nodes_per_draft, median, p90,
                int(delta.drafts), int(delta.tree_drafts))
        self.last_log = now

    def log_engine_initialized(self):
        pass


def _unregister(names: list[str]) -> None:
    """Drop collectors left by an earlier engine in this process (e.g. a second LLM)."""
    registry = prometheus_client.REGISTRY
    for name in names:
        collector = registry._names_to_collectors.get(name)  # noqa: SLF001
        if collector is None:
            collector = registry._names_to_collectors.get(name + "_total")  # noqa: SLF001
        if collector is not None:
            registry.unregister(collector)
