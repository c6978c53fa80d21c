"""Build all of vLLM's built-in logits processors when DDTree is on.

vLLM 0.32's ``build_logitsprocs`` builds only ``min_tokens`` when any
speculative config is present, and ``SamplingParams._validate_spec_decode``
refuses ``min_p`` and ``logit_bias``. DDTree applies both at every tree node
(``vllm_ddtree/node_sampling.py``) and needs the processors' per-request state
for that; plain steps of a DDTree engine then apply them through vLLM's own
sampler. Custom logits processors stay refused, as vLLM refuses them for
every speculative method; installed logits-processor plugins (the
``vllm.logits_processors`` entry points), which vLLM silently leaves out of
speculative engines, are refused too: they would apply in plain steps only.
"""

from __future__ import annotations

from vllm_ddtree.patches.base import ALL_PLATFORMS, Patch


def _build(original):
    def build_logitsprocs(vllm_config, device, is_pin_memory, is_pooling_model,
                          custom_logitsprocs=()):
        from vllm_ddtree.core.config import ddtree_runtime

        if ddtree_runtime(vllm_config) is None or is_pooling_model or custom_logitsprocs:
            return original(vllm_config, device, is_pin_memory, is_pooling_model,
                            custom_logitsprocs)
        from importlib.metadata import entry_points

        from vllm.v1.sample.logits_processor import (BUILTIN_LOGITS_PROCESSORS,
                                                     LOGITSPROCS_GROUP, LogitsProcessors)

        plugins = [f"{e.name} ({e.value})" for e in entry_points(group=LOGITSPROCS_GROUP)]
        if plugins:
            raise ValueError(
                f"DDTree cannot apply logits-processor plugins per tree node; installed "
                f"({LOGITSPROCS_GROUP}): {', '.join(plugins)}. Uninstall them, or serve "
                f"without speculative decoding.")
        return LogitsProcessors(cls(vllm_config, device, is_pin_memory)
                                for cls in BUILTIN_LOGITS_PROCESSORS)

    build_logitsprocs.__wrapped__ = original
    return build_logitsprocs


PATCH = Patch(
    name="builtin-logitsprocs-ddtree",
    target="vllm.v1.worker.gpu_model_runner:build_logitsprocs",
    why="Keep min_p and logit_bias with DDTree, which applies them per tree node.",
    upstream="none (vLLM drops them for every speculative method)",
    vllm_versions=ALL_PLATFORMS,
    build=_build,
)
