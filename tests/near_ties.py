"""Judge a greedy divergence on a bf16 target: a near-tie, or a bug?

vLLM CPU runs Gated DeltaNet targets in bf16 only, and its speculative path
uses other kernels than plain decoding (multi-token conv and recurrence calls,
the tree attention kernel), so two correct greedy runs can pick different
tokens where the target's top two logits are within bf16 noise. After the
first such position the two sequences continue from different prefixes, so
only the first divergence of each prompt can be judged: it must be a near-tie
under an independent fp32 rescoring of the shared prefix (transformers, the
bf16 checkpoint upcast): both chosen tokens' fp32 logits are within ``tol`` of
the fp32 maximum. (Where three or more tokens are that close, the two runs
may pick any two of them, so "the fp32 top two" alone would be too strict:
which two come out on top depends on the CPU's bf16 kernels.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Divergence:
    prompt: int
    position: int  # index into the completions
    gap: float  # |fp32 logit(a) - fp32 logit(b)| at that position
    top2: bool  # the two tokens are the fp32 top two
    below_top: float  # how far the lower of the two is below the fp32 maximum

    def near_tie(self, tol: float) -> bool:
        return self.below_top <= tol


@torch.inference_mode()
def first_divergences(model, prompts: list[list[int]], ref: list[list[int]],
                      got: list[list[int]]) -> list[Divergence]:
    """The first position where ``got[i]`` leaves ``ref[i]``, per prompt that
    diverges, with the fp32 logit gap there."""
    out = []
    for i, (p, a, b) in enumerate(zip(prompts, ref, got)):
        k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if k is None:
            if len(a) != len(b):
                raise AssertionError(f"prompt {i}: outputs of different lengths "
                                     f"{len(a)} and {len(b)} agree on their common prefix")
            continue
        logits = model(input_ids=torch.tensor([list(p) + list(a[:k])])).logits[0, -1].float()
        top2 = set(logits.topk(2).indices.tolist())
        lower = min(float(logits[a[k]]), float(logits[b[k]]))
        out.append(Divergence(i, k, abs(float(logits[a[k]] - logits[b[k]])),
                              top2 == {a[k], b[k]}, float(logits.max()) - lower))
    return out


def describe(divs: list[Divergence]) -> str:
    return ", ".join(f"prompt {d.prompt} @ {d.position}: gap {d.gap:.4f}"
                     + ("" if d.top2 else f" (not the fp32 top two; {d.below_top:.4f} below "
                        f"the top)") for d in divs) or "none"
