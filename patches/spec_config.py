"""Accept ``method: "ddtree"`` in ``--speculative-config``.

vLLM's ``SpeculativeConfig`` is a pydantic dataclass with ``extra="forbid"``
and a closed list of methods, and vLLM has no registry for new methods. We
wrap ``EngineArgs.create_speculative_config`` (it runs in the front-end
process, after plugins are loaded and before any engine process starts):
a ``ddtree`` config is validated by :class:`vllm_ddtree.config.DDTreeConfig`,
built as ``dflash`` and tagged with ``speculative_config.ddtree``.
Everything else passes through untouched.

It is also where DDTree configures the rest of the engine, because it runs
before vLLM builds the attention, scheduler and parallel configs:

* targets and engine settings DDTree cannot serve correctly are refused here,
  with an error that names the setting and the alternative
  (:func:`check_engine_args`);
* on CUDA the target's attention backend becomes ``DDTREE``
  (:func:`select_target_backend`); the drafter keeps a backend vLLM selects
  for DFlash's non-causal block, because vLLM builds the drafter's config
  with ``speculative_config.attention_backend`` (None: automatic);
* scheduling is synchronous and the model runner is V1.
"""

from __future__ import annotations

import os
from typing import Any

from vllm_ddtree.config import (
    METHOD,
    DDTreeConfig,
    DDTreeConfigError,
    read_drafter_config,
    resolve,
)
from vllm_ddtree.attention import CUDA_BACKEND_NAME
from vllm_ddtree.patches.base import Patch
from vllm_ddtree.stats import new_stats_dir


TREE_KV_CACHE_DTYPES = ("auto", "float16", "bfloat16")


def _user_dict(args: Any) -> dict[str, Any] | None:
    spec = args.speculative_config
    if args.spec_method == METHOD:
        spec = dict(spec or {}, method=METHOD)
        args.spec_method = None
    if isinstance(spec, dict) and spec.get("method") == METHOD:
        return {k.replace("-", "_"): v for k, v in spec.items()}
    return None


def _refuse(setting: str, reason: str, fix: str) -> DDTreeConfigError:
    return DDTreeConfigError(f"{setting}: {reason}. {fix}")


def check_engine_args(args: Any, model_config: Any, parallel_config: Any) -> None:
    """Refuse, before any engine process starts, what DDTree would serve wrongly."""
    dflash = "Use method 'dflash' (the DFlash chain) for this setup."
    if parallel_config.pipeline_parallel_size > 1:
        raise _refuse("pipeline_parallel_size",
                      f"DDTree does not support pipeline parallelism (got "
                      f"{parallel_config.pipeline_parallel_size}): only the last stage walks "
                      f"the tree, so earlier stages would keep rejected nodes' KV",
                      f"Serve with --pipeline-parallel-size 1. {dflash}")
    if parallel_config.tensor_parallel_size > 1:
        raise _refuse("tensor_parallel_size",
                      f"DDTree does not support tensor parallelism yet (got "
                      f"{parallel_config.tensor_parallel_size}): every rank would walk and "
                      f"compact on its own, with nothing proving the ranks agree",
                      f"Serve with --tensor-parallel-size 1. {dflash}")
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(parallel_config, name) > 1:
            raise _refuse(name, "DDTree does not support context parallelism",
                          f"Leave {name} at 1. {dflash}")
    if model_config.uses_mrope:
        raise _refuse("model", "the target uses M-RoPE (multimodal rotary positions), "
                      "which DDTree's depth positions do not handle yet", dflash)
    if model_config.is_hybrid or model_config.is_attention_free:
        raise _refuse("model", "the target has non-attention (e.g. Gated DeltaNet or Mamba) "
                      "layers, whose state DDTree cannot verify per tree node yet", dflash)
    text = model_config.hf_text_config
    if model_config.get_sliding_window() is not None or "sliding_attention" in (
            getattr(text, "layer_types", None) or ()):
        raise _refuse("model", "the target uses sliding-window attention, which the tree "
                      "attention kernel does not implement", dflash)
    if getattr(text, "attn_logit_softcapping", None):
        raise _refuse("model", "the target soft-caps attention logits, which the tree "
                      "attention kernel does not implement", dflash)
    if model_config.uses_alibi:
        raise _refuse("model", "the target uses ALiBi, which the tree attention kernel does "
                      "not implement", dflash)
    if args.kv_cache_dtype not in TREE_KV_CACHE_DTYPES:
        raise _refuse("kv_cache_dtype", f"DDTree does not support a quantized KV cache (got "
                      f"{args.kv_cache_dtype!r}): the tree kernel reads K/V unscaled",
                      f"Use --kv-cache-dtype auto. {dflash}")
    if args.async_scheduling:
        raise _refuse("async_scheduling", "DDTree needs the tree of step N on the runner "
                      "before step N is scheduled",
                      "Drop --async-scheduling (DDTree turns it off by itself).")


def _backend_name(value: Any) -> str | None:
    if value is None:
        return None
    name = value.name if hasattr(value, "name") else str(value).upper()
    return None if name == "AUTO" else name


def select_target_backend(args: Any, is_cuda: bool) -> None:
    """On CUDA, give the target's attention layers the ``DDTREE`` backend.

    vLLM's CUDA selector would otherwise pick FLASH_ATTN or FLASHINFER, which
    ignore the tree mask. A user's ``--attention-backend`` (or
    ``attention_config.backend`` / ``backend_per_kind``) other than DDTREE is
    refused. On CPU vLLM always uses CPU_ATTN, which the plugin overrides.
    """
    if not is_cuda:
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    chosen = {"--attention-backend": _backend_name(args.attention_backend),
              "attention_config.backend": _backend_name(args.attention_config.backend)}
    chosen.update({f"attention_config.backend_per_kind[{kind!r}]": _backend_name(v)
                   for kind, v in args.attention_config.backend_per_kind.items()})
    for flag, name in chosen.items():
        if name is not None and name != CUDA_BACKEND_NAME:
            raise _refuse(flag, f"DDTree verifies trees with its own attention backend "
                          f"{CUDA_BACKEND_NAME}; {name} would ignore the tree mask and "
                          f"produce wrong tokens",
                          f"Drop {flag} (DDTree selects {CUDA_BACKEND_NAME} for the target "
                          f"by itself), or use method 'dflash' to keep {name}.")
    if CUDA_BACKEND_NAME not in AttentionBackendEnum.__members__:
        raise RuntimeError(f"DDTree: the {CUDA_BACKEND_NAME} attention backend is not "
                           f"registered; the plugin's register() did not run in this process")
    if chosen["attention_config.backend"] is None:
        args.attention_backend = AttentionBackendEnum[CUDA_BACKEND_NAME]


def _configure_engine(args: Any, model_config: Any, parallel_config: Any) -> None:
    """Engine-wide settings that DDTree needs (documented in docs/design.md)."""
    from vllm.platforms import current_platform

    check_engine_args(args, model_config, parallel_config)
    select_target_backend(args, current_platform.is_cuda())
    args.async_scheduling = False
    # The tree seams live in the V1 model runner (vLLM picks V2 on CUDA by default).
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"


def _build(original):
    def create_speculative_config(self, target_model_config, target_parallel_config):
        user = _user_dict(self)
        if user is None:
            return original(self, target_model_config, target_parallel_config)
        cfg, vllm_dict = DDTreeConfig.from_speculative_dict(user)
        # Check the drafter before vLLM does, so a wrong model gets our message.
        runtime = resolve(cfg, read_drafter_config(vllm_dict["model"], vllm_dict.get("revision")))
        _configure_engine(self, target_model_config, target_parallel_config)
        self.speculative_config = vllm_dict
        spec = original(self, target_model_config, target_parallel_config)
        # Post-construction attributes are not validated by pydantic and survive
        # pickling to the engine and worker processes.
        spec.ddtree = runtime.model_copy(update={"stats_dir": new_stats_dir()})
        return spec

    create_speculative_config.__wrapped__ = original
    return create_speculative_config


PATCH = Patch(
    name="spec-config-ddtree-method",
    target="vllm.engine.arg_utils:EngineArgs.create_speculative_config",
    why="SpeculativeConfig forbids unknown methods/keys and has no method registry.",
    upstream="none: vLLM has no plugin hook for new speculative methods",
    vllm_versions="==0.32.*",
    build=_build,
)

