"""Which DFlash drafter serves a target when ``speculative_config`` names none.

``{"method": "ddtree"}`` alone is resolved, in order:

1. **Beside a local target**: a directory next to it named after it with a
   ``-dflash``, ``-DFlash`` or ``-DFlash-b16`` suffix whose ``config.json`` is
   a DFlash drafter's (``DFlashDraftModel`` with a ``dflash_config``), e.g.
   ``models/tiny-qwen3`` -> ``models/tiny-qwen3-dflash``.
2. **Published drafters**: :data:`PUBLISHED`, by the target's Hugging Face id
   (case-insensitive), or for a local directory by its name (``/models/Qwen3-8B``
   is ``Qwen/Qwen3-8B``).
3. Otherwise :class:`DrafterNotFound`, naming the target, what was tried and
   how to set ``model``.

Nothing here imports vLLM; the caller logs the choice.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

__all__ = ["PUBLISHED", "PUBLISHED_SOURCE", "REFUSED", "BESIDE_SUFFIXES", "Drafter",
           "DrafterNotFound", "TargetRefused", "find_drafter"]

# The DFlash drafters z-lab publishes, by target. Source: the "Supported Models"
# table of https://github.com/z-lab/dflash (README.md at commit 0a2da23), whose
# drafter links are the Hugging Face ids below; the targets' organisations are
# those of the model cards the drafters name (e.g. "must be used in conjunction
# with the target model Qwen/Qwen3-8B"). The Qwen3-4B / Qwen3-8B drafters are
# trained for non-thinking mode.
PUBLISHED: dict[str, str] = {
    "Qwen/Qwen3-4B": "z-lab/Qwen3-4B-DFlash-b16",
    "Qwen/Qwen3-8B": "z-lab/Qwen3-8B-DFlash-b16",
    "Qwen/Qwen3-Coder-30B-A3B-Instruct": "z-lab/Qwen3-Coder-30B-A3B-DFlash",
    "Qwen/Qwen3-Coder-Next": "z-lab/Qwen3-Coder-Next-DFlash",
    "Qwen/Qwen3.5-4B": "z-lab/Qwen3.5-4B-DFlash",
    "Qwen/Qwen3.5-9B": "z-lab/Qwen3.5-9B-DFlash",
    "Qwen/Qwen3.5-27B": "z-lab/Qwen3.5-27B-DFlash",
    "Qwen/Qwen3.5-35B-A3B": "z-lab/Qwen3.5-35B-A3B-DFlash",
    "Qwen/Qwen3.5-122B-A10B": "z-lab/Qwen3.5-122B-A10B-DFlash",
    "Qwen/Qwen3.6-27B": "z-lab/Qwen3.6-27B-DFlash",
    "Qwen/Qwen3.6-35B-A3B": "z-lab/Qwen3.6-35B-A3B-DFlash",
    "openai/gpt-oss-20b": "z-lab/gpt-oss-20b-DFlash",
    "openai/gpt-oss-120b": "z-lab/gpt-oss-120b-DFlash",
    "meta-llama/Llama-3.1-8B-Instruct": "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat",
    "moonshotai/Kimi-K2.5": "z-lab/Kimi-K2.5-DFlash",
}
PUBLISHED_SOURCE = "https://github.com/z-lab/dflash (README, Supported Models)"

# Published targets DDTree cannot serve, with the reason: resolution refuses
# them up front (the engine would otherwise load the model and then refuse).
REFUSED: dict[str, str] = {
    "moonshotai/Kimi-K2.5": "it uses multi-head latent attention (MLA, DeepSeek-style), "
                            "which DDTree's tree attention does not implement",
}
BESIDE_SUFFIXES = ("-dflash", "-DFlash", "-DFlash-b16")
DFLASH_ARCHITECTURE = "DFlashDraftModel"


class DrafterNotFound(ValueError):
    pass


class TargetRefused(DrafterNotFound):
    """A published target DDTree cannot serve (see :data:`REFUSED`)."""


@dataclass(frozen=True)
class Drafter:
    model: str
    why: str  # for the log: how it was found


def _dflash_config_problem(path: str) -> str | None:
    """None if ``path`` holds a DFlash drafter's config.json, else what is wrong."""
    cfg = os.path.join(path, "config.json")
    try:
        with open(cfg) as f:
            data = json.load(f)
    except FileNotFoundError:
        return "has no config.json"
    except (OSError, ValueError) as e:
        return f"has an unreadable config.json ({e})"
    if DFLASH_ARCHITECTURE not in (data.get("architectures") or []) \
            or not isinstance(data.get("dflash_config"), dict):
        return (f"is not a DFlash drafter (architectures {data.get('architectures')}, "
                f"dflash_config {'present' if 'dflash_config' in data else 'missing'})")
    return None


def find_drafter(target: str) -> Drafter:
    """The drafter for ``target`` (a local directory or a Hugging Face id)."""
    tried: list[str] = []
    local = os.path.isdir(target)
    if local:
        base = os.path.normpath(target)
        for suffix in BESIDE_SUFFIXES:
            cand = base + suffix
            if not os.path.isdir(cand):
                tried.append(f"{cand} (no such directory)")
                continue
            problem = _dflash_config_problem(cand)
            if problem is None:
                return Drafter(cand, f"found beside the target ({os.path.basename(cand)})")
            tried.append(f"{cand} ({problem})")
    by_id = {k.lower(): (k, v) for k, v in PUBLISHED.items()}
    key = target.strip("/").lower()
    hit = by_id.get(key)
    if hit is None and local:
        name = os.path.basename(os.path.normpath(target)).lower()
        matches = [kv for k, kv in by_id.items() if k.rsplit("/", 1)[-1] == name]
        hit = matches[0] if len(matches) == 1 else None
    if hit is not None:
        refused = {k.lower(): (k, why) for k, why in REFUSED.items()}.get(hit[0].lower())
        if refused is not None:
            raise TargetRefused(
                f"model: DDTree cannot serve {refused[0]}: {refused[1]}. Use method 'dflash' "
                f"with its published drafter: '{{\"method\": \"dflash\", \"model\": "
                f"\"{hit[1]}\"}}'.")
        return Drafter(hit[1], f"the published DFlash drafter for {hit[0]} ({PUBLISHED_SOURCE})")
    tried.append(f"the published DFlash drafters ({len(PUBLISHED)} targets, "
                 f"{PUBLISHED_SOURCE}): none for {target!r}")
    raise DrafterNotFound(
        f"speculative_config.model: no DFlash drafter found for the target {target!r}. "
        f"Tried: {'; '.join(tried)}. Set \"model\" in --speculative-config to a DFlash "
        f"checkpoint for this target (a local directory or a Hugging Face id), e.g. "
        f"'{{\"method\": \"ddtree\", \"model\": \"z-lab/Qwen3-8B-DFlash-b16\"}}' for Qwen/Qwen3-8B.")
