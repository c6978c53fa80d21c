"""Add DDTree's stat logger (``/metrics``, the periodic log line) when DDTree is on.

vLLM has a stat-logger extension point, the ``vllm.stat_logger_plugins``
entry-point group, but it does not fit: a logger installed there is loaded by
every ``AsyncLLM`` in the environment whether or not DDTree is configured, it
turns stats on even under ``--disable-log-stats``, and the offline ``LLM``
(``LLMEngine``) never loads it. Wrapping ``StatLoggerManager.__init__``
(which both engines build only when stats are on) adds
:class:`vllm_ddtree.metrics.DDTreeStatLogger` exactly when the engine's config
carries ``speculative_config.ddtree``.

With several API-server processes (``vllm serve --data-parallel-size N``
starts N by default, or ``--api-server-count``), every process builds its own
manager over all engines, and Prometheus sums counters across processes; the
ddtree counters are read from each engine's shared file, so only the first
API server exports them (it refreshes every engine's numbers whenever it
records), and they are counted once.
"""

from __future__ import annotations

from vllm_ddtree.patches.base import ALL_PLATFORMS, Patch


def _build(original):
    def __init__(self, vllm_config, *args, **kwargs):
        original(self, vllm_config, *args, **kwargs)
        from vllm_ddtree.core.config import ddtree_runtime

        runtime = ddtree_runtime(vllm_config)
        first_api_server = getattr(vllm_config.parallel_config, "_api_process_rank", 0) <= 0
        if runtime is not None and runtime.stats_dir and first_api_server:
            from vllm_ddtree.metrics import DDTreeStatLogger

            self.stat_loggers.append(DDTreeStatLogger(vllm_config, self.engine_indexes))

    __init__.__wrapped__ = original
    return __init__


PATCH = Patch(
    name="stat-loggers-ddtree",
    target="vllm.v1.metrics.loggers:StatLoggerManager.__init__",
    why="Export the ddtree metrics only when DDTree is on, in AsyncLLM and LLMEngine alike.",
    upstream="vllm.stat_logger_plugins exists but is unconditional and AsyncLLM-only",
    vllm_versions=ALL_PLATFORMS,
    build=_build,
)
