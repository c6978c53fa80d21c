"""Install the DDTree runner (``vllm_ddtree.runner.DDTreeRunnerMixin``).

The mixin is stock unless ``speculative_config.ddtree`` is set, so these
patches are harmless for every other configuration.

* CPU: ``CPUWorker.init_device`` constructs ``CPUModelRunner`` through its
  module-global name, and there is no hook to choose another class short of
  ``--worker-cls`` (which users would have to remember). We rebind that name.
* CUDA: ``Worker._make_model_runner`` is documented as the override point for
  subclasses; we wrap it to return the DDTree V1 runner when DDTree is on.
"""

from __future__ import annotations

from vllm_ddtree.patches.base import ALL_PLATFORMS, CPU_ONLY, Patch, on_cpu, on_cuda


def _build_cpu(original):
    from vllm_ddtree.runner import make_runner_class

    return make_runner_class(original)


def _build_cuda(original):
    def _make_model_runner(self):
        from vllm_ddtree.core.config import ddtree_runtime

        if ddtree_runtime(self.vllm_config) is None:
            return original(self)
        if self.use_v2_model_runner:
            raise RuntimeError(
                "DDTree needs vLLM's V1 model runner, but V2 was selected; unset "
                "VLLM_USE_V2_MODEL_RUNNER or set it to 0.")
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        from vllm_ddtree.runner import make_runner_class

        return make_runner_class(GPUModelRunner)(self.vllm_config, self.device)

    _make_model_runner.__wrapped__ = original
    return _make_model_runner


CPU_RUNNER = Patch(
    name="cpu-worker-runner",
    target="vllm.v1.worker.cpu_worker:CPUModelRunner",
    why="CPUWorker builds its V1 runner by module-global name; no selection hook.",
    upstream="none",
    vllm_versions=CPU_ONLY,
    build=_build_cpu,
    when=on_cpu,
)

CUDA_RUNNER = Patch(
    name="cuda-worker-runner",
    target="vllm.v1.worker.gpu_worker:Worker._make_model_runner",
    why="Select the DDTree V1 runner on CUDA without requiring --worker-cls.",
    upstream="Worker._make_model_runner is the documented subclass hook",
    vllm_versions=ALL_PLATFORMS,
    build=_build_cuda,
    when=on_cuda,
)
