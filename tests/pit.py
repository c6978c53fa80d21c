"""Randomized probability integral transform (PIT) checks of sampled tokens.

If token ``t`` is drawn from a distribution ``p`` over token ids, then

    u = F(t - 1) + V * p(t),    F(t) = sum_{s <= t} p(s),    V ~ U(0, 1)

is exactly uniform on [0, 1]. For a generated sequence, taking ``p`` to be the
sampling distribution given the sequence's own prefix at every step (the
Rosenblatt transform), the ``u`` are i.i.d. uniform, because each is uniform
given everything before it. A sampler that draws any token from a different
conditional distribution shifts the law of ``u``, which a Kolmogorov-Smirnov
test against U(0, 1) detects given enough tokens.

:func:`rescore` recomputes the sampling distributions of generated tokens with
an independent forward of the target in transformers (fp32) and the sampler
steps of plain vLLM decoding: temperature, then vLLM's own torch top-k/top-p
(``apply_top_k_top_p_pytorch``).

Token order. ``F`` may run over tokens in any order fixed by the context;
uniformity holds for each. Two are used:

* ``"id"``: token ids ascending;
* ``"rank"``: probability descending (ties by id), so ``u`` is the mass of
  the tokens more probable than ``t`` plus ``V * p(t)``. A sampler that draws
  tokens the target finds less likely than it should (in particular tokens
  outside the target's top-k/top-p support, which get ``u = 1``) pushes ``u``
  towards 1 in every context alike, so deviations add up across tokens
  instead of being scattered over [0, 1] by arbitrary token ids. This is the
  order with power against wrong tree-node distributions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from scipy.stats import kstest


def randomized_pit(probs: np.ndarray, tokens: np.ndarray, v: np.ndarray,
                   order: str = "rank") -> np.ndarray:
    """``u = F(t-1) + v * p(t)`` per row of ``probs`` ``[N, V]``, ``F`` in ``order``."""
    probs = np.asarray(probs, dtype=np.float64)
    tokens = np.asarray(tokens, dtype=np.int64)
    rows = np.arange(len(tokens))
    pt = probs[rows, tokens]
    if order == "id":
        below = np.cumsum(probs, axis=1)[rows, tokens] - pt
    elif order == "rank":
        ids = np.arange(probs.shape[1])
        before = (probs > pt[:, None]) | ((probs == pt[:, None]) & (ids[None, :] < tokens[:, None]))
        below = (probs * before).sum(axis=1)
    else:
        raise ValueError(f"unknown token order {order!r}")
    u = below + np.asarray(v, dtype=np.float64) * pt
    return np.clip(u, 0.0, 1.0)


def ks_uniform_p(u: np.ndarray) -> float:
    """Two-sided KS p-value of ``u`` against U(0, 1)."""
    return float(kstest(np.asarray(u, dtype=np.float64), "uniform").pvalue)


def vllm_processed_probs(logits: torch.Tensor, temperature: float, top_k: int | None = None,
                         top_p: float | None = None, min_p: float | None = None) -> torch.Tensor:
    """fp64 probabilities of plain vLLM sampling for ``[N, V]`` fp32 logits.

    Temperature division as ``Sampler.apply_temperature``, then min-p (tokens
    below ``min_p`` times the top probability are dropped, as vLLM's min-p
    logits processor does), then vLLM's torch top-k/top-p
    (``apply_top_k_top_p_pytorch``, with CPU sync allowed as on a CPU host);
    ``top_k`` / ``top_p`` / ``min_p`` of None means the filter is off.
    """
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    x = logits.float().clone()
    n = x.shape[0]
    x.div_(torch.full((n, 1), float(temperature)))
    if min_p:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))
    k = None if top_k is None else torch.full((n,), int(top_k), dtype=torch.int32)
    p = None if top_p is None else torch.full((n,), float(top_p), dtype=torch.float32)
    x = apply_top_k_top_p_pytorch(x, k, p, allow_cpu_sync=True)
    return torch.softmax(x.double(), dim=-1)


@dataclass
class Rescored:
    """PIT values of rescored tokens (one entry per token, same order in each field)."""

    u_rank: np.ndarray  # PIT value, tokens ordered by probability (see the module docstring)
    u_id: np.ndarray  # PIT value, tokens ordered by id
    p_token: np.ndarray  # rescored probability of the token

    @property
    def count(self) -> int:
        return len(self.p_token)

    @property
    def nucleus_misses(self) -> int:
        """Tokens outside the rescored sampling support (probability exactly 0)."""
        return int((self.p_token == 0).sum())

    @property
    def miss_fraction(self) -> float:
        return self.nucleus_misses / max(self.count, 1)

    @property
    def ks_p(self) -> float:
        """KS p-value of the probability-ordered PIT (the test statistic)."""
        return ks_uniform_p(self.u_rank)

    @property
    def ks_p_id(self) -> float:
        """KS p-value of the id-ordered PIT."""
        return ks_uniform_p(self.u_id)

    def summary(self) -> str:
        return (f"{self.count} tokens, KS p = {self.ks_p:.3g} (probability order), "
                f"{self.ks_p_id:.3g} (id order), outside the nucleus: {self.nucleus_misses} "
                f"({100 * self.miss_fraction:.2f}%)")


def load_target(model_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


@torch.inference_mode()
def rescore(model, prompts: list[list[int]], completions: list[list[list[int]]], *,
            start: int, temperature: float, top_k: int | None = None,
            top_p: float | None = None, seed: int = 0, batch: int = 64) -> Rescored:
    """PIT values of ``completions[i][j][start:]`` given ``prompts[i]``.

    ``completions[i]`` are the samples of prompt ``i``; samples of one prompt
    with the same length are scored in one batched forward (no padding).
    """
    rng = np.random.default_rng(seed)
    u_rank, u_id, ps = [], [], []
    for prompt, comps in zip(prompts, completions):
        by_len: dict[int, list[list[int]]] = {}
        for c in comps:
            if len(c) > start:
                by_len.setdefault(len(c), []).append(list(c))
        for length, group in sorted(by_len.items()):
            for b0 in range(0, len(group), batch):
                chunk = group[b0:b0 + batch]
                ids = torch.tensor([list(prompt) + c for c in chunk], dtype=torch.long)
                logits = model(input_ids=ids[:, :-1]).logits.float()  # [n, L-1, V]
                lp = len(prompt)
                # the logits at position lp + j - 1 give completion token j
                rows = logits[:, lp + start - 1:lp + length - 1].reshape(-1, logits.shape[-1])
                toks = ids[:, lp + start:].reshape(-1).numpy()
                probs = vllm_processed_probs(rows, temperature, top_k, top_p).numpy()
                v = rng.random(len(toks))
                u_rank.append(randomized_pit(probs, toks, v, "rank"))
                u_id.append(randomized_pit(probs, toks, v, "id"))
                ps.append(probs[np.arange(len(toks)), toks])
    return Rescored(np.concatenate(u_rank), np.concatenate(u_id), np.concatenate(ps))
