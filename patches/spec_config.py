"""Accept ``method: "ddtree"`` in ``--speculative-config``.

vLLM's ``SpeculativeConfig`` is a pydantic dataclass with ``extra="forbid"``
and a closed list of methods, and vLLM has no registry for new methods. We
wrap ``EngineArgs.create_speculative_config`` (it runs in the front-end
process, after plugins are loaded and before any engine process starts):
a ``ddtree`` config is validated by :class:`vllm_ddtree.config.DDTreeConfig`,
built as ``dflash`` and tagged with ``speculative_config.ddtree``.
Everything else passes through untouched.
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
from vllm_ddtree.patches.base import Patch
from vllm_ddtree.stats import new_stats_dir


def _user_dict(args: Any) -> dict[str, Any] | None:
    spec = args.speculative_config
    if getattr(args, "spec_method", None) == METHOD:
        spec = dict(spec or {}, method=METHOD)
        args.spec_method = None
    if isinstance(spec, dict) and spec.get("method") == METHOD:
        return {k.replace("-", "_"): v for k, v in spec.items()}
    return None


def _configure_engine(args: Any) -> None:
    """Engine-wide settings that DDTree needs (documented in docs/design.md)."""
    if getattr(args, "async_scheduling", None):
        raise DDTreeConfigError(
            "async_scheduling: DDTree needs the tree of step N on the runner before step N "
            "is scheduled; drop --async-scheduling (it is turned off automatically).")
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
        _configure_engine(self)
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

