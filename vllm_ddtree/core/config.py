"""User-facing DDTree options and their validation.

Users write::

    --speculative-config '{"method": "ddtree", "model": "<DFlash drafter>",
                           "num_speculative_tokens": 32, "ddtree_max_depth": 8}'

* ``num_speculative_tokens`` is the **tree budget** B: the most draft nodes
  the target verifies per request and step (the root is extra). Default 32,
  at most 512.
* ``ddtree_adaptive`` (default true): per step, the batch-optimal number of
  nodes for each request, 0 to B (``vllm_ddtree/core/budget.py``); false verifies
  B nodes per request on every step.
* ``ddtree_*`` keys are DDTree's own options (see :class:`DDTreeConfig`).
  Unknown ``ddtree_*`` keys are an error, never silently ignored.
* Every other key goes to vLLM's ``SpeculativeConfig`` unchanged.

Internally the engine is configured as vLLM's ``dflash`` method (drafter KV
cache, auxiliary hidden states, lookahead slots and CPU kernels all key off
it) and the resolved options ride along as ``speculative_config.ddtree``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

METHOD = "ddtree"
OPTION_PREFIX = "ddtree_"
DEFAULT_BUDGET = 32
MAX_BUDGET = 512
DFLASH_ARCHITECTURES = ("DFlashDraftModel",)
# vLLM keys that choose how drafts are verified or drawn. DDTree's tree walk
# replaces both (lossless at every temperature, trees built from the drafter's
# distribution), so only their defaults are accepted: anything else would be
# ignored silently, and vLLM's other rejection methods ("synthetic", "block",
# and 0.33's lossy "fly") promise outputs the walk does not give.
WALK_OWNED_KEYS = {"rejection_sample_method": "standard", "draft_sample_method": "greedy"}


class DDTreeConfigError(ValueError):
    """A bad DDTree speculative config; the message names the field and the fix."""


class DDTreeConfig(BaseModel):
    """Validated DDTree options (the ``ddtree_*`` keys plus the budget)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    budget: int = Field(
        DEFAULT_BUDGET, gt=0, le=MAX_BUDGET,
        description="Tree budget B = num_speculative_tokens: draft nodes verified per step.")
    max_depth: int | None = Field(
        None, gt=0,
        description="Use at most this many drafter positions (tree depth). "
                    "Default: all of the drafter's block_size - 1.")
    adaptive: bool = Field(
        True, strict=True,
        description="Choose the nodes per request and step from the drafter's confidence "
                    "and the measured step cost (B is the maximum); false: always B.")

    @classmethod
    def from_speculative_dict(cls, spec: dict[str, Any]) -> tuple["DDTreeConfig", dict[str, Any]]:
        """Split a user ``speculative_config`` dict into DDTree options and the
        keys that go to vLLM. Raises :class:`DDTreeConfigError`."""
        rest = {k: v for k, v in spec.items() if not k.startswith(OPTION_PREFIX)}
        opts = {k[len(OPTION_PREFIX):]: v for k, v in spec.items() if k.startswith(OPTION_PREFIX)}
        known = sorted(OPTION_PREFIX + f for f in cls.model_fields if f != "budget")
        unknown = sorted(OPTION_PREFIX + k for k in opts if k not in cls.model_fields or k == "budget")
        if unknown:
            raise DDTreeConfigError(
                f"speculative_config: unknown DDTree option(s) {unknown}. "
                f"Known options: {known}; the tree budget is num_speculative_tokens.")
        if not rest.get("model"):
            raise DDTreeConfigError(
                "speculative_config.model: method 'ddtree' needs a DFlash drafter; set "
                "\"model\" to a DFlash checkpoint (e.g. z-lab/Qwen3-8B-DFlash-b16), or leave it "
                "out for the plugin to find one (vllm_ddtree/drafters.py).")
        for key, default in WALK_OWNED_KEYS.items():
            if rest.get(key, default) != default:
                raise DDTreeConfigError(
                    f"speculative_config.{key}: DDTree verifies with its own lossless tree "
                    f"walk and builds trees from the drafter's distribution, so {key} must "
                    f"be {default!r} (or left out), got {rest[key]!r}. Use method 'dflash' "
                    f"for {key}={rest[key]!r}.")
        budget = rest.get("num_speculative_tokens")
        if budget is None:
            budget = DEFAULT_BUDGET
        if isinstance(budget, bool) or not isinstance(budget, int):
            raise DDTreeConfigError(
                f"speculative_config.num_speculative_tokens: the DDTree tree budget must be "
                f"an integer in [1, {MAX_BUDGET}], got {budget!r}.")
        try:
            cfg = cls(budget=budget, **opts)
        except ValidationError as e:
            err = e.errors()[0]
            field = err["loc"][0] if err["loc"] else "?"
            name = ("num_speculative_tokens" if field == "budget" else OPTION_PREFIX + str(field))
            hint = (f" The tree budget must be in [1, {MAX_BUDGET}]." if field == "budget" else "")
            raise DDTreeConfigError(
                f"speculative_config.{name}: {err['msg']} (got {err.get('input')!r}).{hint}"
            ) from None
        rest = dict(rest, method="dflash", num_speculative_tokens=cfg.budget)
        return cfg, rest


class DDTreeRuntime(BaseModel):
    """What the engine needs at run time; attached as ``speculative_config.ddtree``."""

    model_config = ConfigDict(frozen=True)

    budget: int
    depth: int  # drafter positions used per round (the deepest tree level)
    block_size: int  # the drafter's trained block size (K_max + 1)
    adaptive: bool = True  # per-step budgets from vllm_ddtree/core/budget.py
    # Where the runner publishes its counters for /metrics (see stats.py);
    # None: no ddtree metrics.
    stats_dir: str | None = None


def read_drafter_config(model: str, revision: str | None = None) -> dict[str, Any]:
    """The drafter's raw ``config.json`` (local directory or hub repository)."""
    from transformers import PretrainedConfig

    try:
        return PretrainedConfig.get_config_dict(model, revision=revision)[0]
    except Exception as e:  # noqa: BLE001 - re-raised with the field named
        raise DDTreeConfigError(
            f"speculative_config.model: cannot read the drafter's config.json from {model!r} "
            f"({e}).") from e


def resolve(cfg: DDTreeConfig, draft_config: dict[str, Any]) -> DDTreeRuntime:
    """Check the drafter's raw config and fix the tree depth.
    Raises :class:`DDTreeConfigError`."""
    archs = list(draft_config.get("architectures") or [])
    dflash_cfg = draft_config.get("dflash_config")
    if not any(a in DFLASH_ARCHITECTURES for a in archs) or not isinstance(dflash_cfg, dict):
        raise DDTreeConfigError(
            f"speculative_config.model: DDTree needs a DFlash drafter (architecture "
            f"{list(DFLASH_ARCHITECTURES)} with a 'dflash_config'), but the drafter's "
            f"architectures are {archs}. Use a DFlash checkpoint, or another method.")
    block_size = draft_config.get("block_size")
    if not isinstance(block_size, int) or block_size < 2:
        raise DDTreeConfigError(
            f"speculative_config.model: the DFlash drafter's block_size must be an integer "
            f">= 2 (one anchor plus at least one masked position), got {block_size!r}.")
    max_depth = block_size - 1
    depth = max_depth if cfg.max_depth is None else cfg.max_depth
    if depth > max_depth:
        raise DDTreeConfigError(
            f"speculative_config.ddtree_max_depth: {depth} exceeds what the drafter predicts "
            f"(block_size - 1 = {max_depth}); use a value in [1, {max_depth}].")
    return DDTreeRuntime(budget=cfg.budget, depth=depth, block_size=block_size,
                         adaptive=cfg.adaptive)


def ddtree_runtime(vllm_config: Any) -> DDTreeRuntime | None:
    """The attached :class:`DDTreeRuntime`, or None when DDTree is off."""
    spec = vllm_config.speculative_config
    # ``ddtree`` is this plugin's attribute; other methods' configs lack it.
    return getattr(spec, "ddtree", None) if spec is not None else None
