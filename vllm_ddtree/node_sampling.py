"""vLLM's per-request logits transformations at every tree node, and the
logprobs of the tokens a tree walk outputs.

vLLM's ``Sampler`` transforms one row per request; a verification step has
one row per tree node (see :mod:`vllm_ddtree.core.node_history` for the row
layout). :func:`process_nodes` applies, to every node row, what the sampler
would have applied to that request had the node's path been generated, in
the sampler's order (``Sampler.apply_logits_processors``):

1. ``allowed_token_ids`` (the request's mask);
2. ``bad_words`` (matched against the node's history);
3. the non-argmax-invariant logits processors: ``min_tokens`` (the node's
   depth counts as generated tokens) and ``logit_bias``;
4. repetition, frequency and presence penalties (the output so far plus the
   node's path).

Temperature, ``min_p``, top-k and top-p follow in
:func:`vllm_ddtree.core.tree.sample_posterior`. A grammar's bitmask has been
applied to every node row before (``patches/structured_output.py``).

With DDTree the runner builds all three built-in logits processors (vLLM
builds only ``min_tokens`` for speculative decoding, ``patches/logitsprocs.py``),
so plain steps apply ``min_p`` and ``logit_bias`` through vLLM's own sampler
and tree steps read their per-request state here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from vllm.v1.sample.logits_processor.builtin import (LogitBiasLogitsProcessor,
                                                     MinPLogitsProcessor,
                                                     MinTokensLogitsProcessor)
from vllm.v1.sample.ops.bad_words import apply_bad_words

from vllm_ddtree.core.node_history import node_depths, node_paths, path_token_counts
from vllm_ddtree.core.round import DDTreeSeamError

__all__ = ["NodeRows", "logprobs_of_outputs", "min_p_per_request", "needs_processing",
           "process_nodes"]

_KNOWN = (MinTokensLogitsProcessor, LogitBiasLogitsProcessor, MinPLogitsProcessor)


@dataclass
class NodeRows:
    """The logits rows of one verification step."""

    counts: list[int]  # scheduled nodes per request (host)
    starts: list[int]  # each request's first row (host)
    req_of_row: Tensor  # [N] int64
    node_of_row: Tensor  # [N] int64
    parents: list[list[int]]  # per request, its nodes' parents (host)
    tokens: list[list[int]]  # per request, its nodes' tokens (host)
    tokens_dev: Tensor  # [R, B] the nodes' tokens
    parents_dev: Tensor  # [R, B] their parents
    max_depth: int

    def rows_of(self, r: int) -> range:
        return range(self.starts[r], self.starts[r] + self.counts[r] + 1)


def _check_processors(md) -> None:
    for proc in md.logitsprocs.all:
        if not isinstance(proc, _KNOWN):
            raise DDTreeSeamError(
                f"DDTree: logits processor {type(proc).__name__} cannot be applied per tree "
                "node; serve without custom logits processors or with method 'dflash'")


def needs_processing(md) -> bool:
    """Whether any request of the batch transforms its logits before sampling
    (and that every logits processor is one DDTree applies per node)."""
    _check_processors(md)
    if md.allowed_token_ids_mask is not None or md.bad_words_token_ids or not md.no_penalties:
        return True
    for proc in md.logitsprocs.all:
        if isinstance(proc, MinTokensLogitsProcessor) and proc.min_toks:
            return True
        if isinstance(proc, LogitBiasLogitsProcessor) and proc.biases:
            return True
    return False


def min_p_per_request(md, num_reqs: int) -> Tensor | None:
    """``[R]`` min-p of each request, or None when no request sets it."""
    for proc in md.logitsprocs.argmax_invariant:
        if isinstance(proc, MinPLogitsProcessor) and proc.min_p_count:
            return proc.min_p[:num_reqs, 0]
    return None


def process_nodes(x: Tensor, md, rows: NodeRows) -> Tensor:
    """Apply the requests' transformations to the fp32 node rows ``x``
    ``[N, V]`` in place and return it."""
    neg_inf = float("-inf")
    if md.allowed_token_ids_mask is not None:
        x.masked_fill_(md.allowed_token_ids_mask[rows.req_of_row], neg_inf)

    if md.bad_words_token_ids:
        words, pasts = {}, {}
        for r, bad in md.bad_words_token_ids.items():
            longest = max((len(w) for w in bad), default=1)
            # Only the last len(word) - 1 tokens are compared: keep that many.
            tail = list(md.output_token_ids[r][-(longest - 1):]) if longest > 1 else []
            paths = node_paths(rows.parents[r], rows.tokens[r])
            for row, path in zip(rows.rows_of(r), paths):
                words[row] = bad
                pasts[row] = tail + path
        apply_bad_words(x, words, pasts)

    for proc in md.logitsprocs.non_argmax_invariant:
        if isinstance(proc, MinTokensLogitsProcessor):
            _min_tokens(x, proc, rows)
        elif isinstance(proc, LogitBiasLogitsProcessor):
            _logit_bias(x, proc, rows)

    if not md.no_penalties:
        _penalties(x, md, rows)
    return x


def _min_tokens(x: Tensor, proc: MinTokensLogitsProcessor, rows: NodeRows) -> None:
    if not proc.min_toks:
        return
    mask_rows, mask_toks, keep_rows, keep_toks = [], [], [], []
    for r, (min_tok, out, stop, uses_grammar) in proc.min_toks.items():
        if not stop or r >= len(rows.counts):
            continue
        remaining = min_tok - len(out)
        depth = node_depths(rows.parents[r])
        for row, d in zip(rows.rows_of(r), depth):
            if d < remaining:  # the node's token would be generated token len(out)+d+1
                mask_rows.extend([row] * len(stop))
                mask_toks.extend(stop)
                if uses_grammar:
                    keep_rows.extend([row] * len(stop))
                    keep_toks.extend(stop)
    if not mask_rows:
        return
    dev = x.device
    sl = (torch.tensor(mask_rows, device=dev), torch.tensor(mask_toks, device=dev))
    if keep_rows:
        # vLLM's own rule: a grammar row left without any token keeps its stop tokens.
        proc._mask_stop_token_logits(
            x, sl, (torch.tensor(keep_rows, device=dev), torch.tensor(keep_toks, device=dev)))
    else:
        x.index_put_(sl, proc.neg_inf_tensor.to(dev))


def _logit_bias(x: Tensor, proc: LogitBiasLogitsProcessor, rows: NodeRows) -> None:
    if not proc.biases:
        return
    rr, tt, bb = [], [], []
    for r, bias in proc.biases.items():
        if r >= len(rows.counts):
            continue
        for row in rows.rows_of(r):
            rr.extend([row] * len(bias))
            tt.extend(bias.keys())
            bb.extend(bias.values())
    if rr:
        dev = x.device
        x[torch.tensor(rr, device=dev), torch.tensor(tt, device=dev)] += torch.tensor(
            bb, dtype=torch.float32, device=dev)


def _penalties(x: Tensor, md, rows: NodeRows) -> None:
    from vllm._custom_ops import apply_repetition_penalties
    from vllm.model_executor.layers.utils import get_token_bin_counts_and_mask
    from vllm.utils.torch_utils import make_tensor_with_pad

    vocab = x.shape[1]
    num_reqs = len(rows.counts)
    out = make_tensor_with_pad(md.output_token_ids[:num_reqs], pad=vocab, device=x.device,
                               dtype=torch.int64)
    out.masked_fill_(out == -1, vocab)  # as vLLM's apply_all_penalties
    counts, _ = get_token_bin_counts_and_mask(out, vocab, num_reqs)
    counts = counts[rows.req_of_row] + path_token_counts(
        rows.tokens_dev, rows.parents_dev, rows.req_of_row, rows.node_of_row, vocab,
        rows.max_depth)
    _, prompt_mask = get_token_bin_counts_and_mask(md.prompt_token_ids[:num_reqs].long(), vocab,
                                                   num_reqs)
    prompt_mask = prompt_mask[rows.req_of_row]
    output_mask = counts > 0
    # The arithmetic of vLLM's apply_penalties, on the node rows.
    apply_repetition_penalties(x, prompt_mask, output_mask,
                               md.repetition_penalties[rows.req_of_row])
    x -= md.frequency_penalties[rows.req_of_row].unsqueeze(1) * counts
    x -= md.presence_penalties[rows.req_of_row].unsqueeze(1) * output_mask


def logprobs_of_outputs(source: Tensor, out_rows: Tensor, out_tokens: Tensor,
                        num_logprobs: int, as_logits: bool):
    """vLLM's ``LogprobsTensors`` for every output position ``[R, S+1]``:
    ``out_rows`` the logits row that produced it, ``out_tokens`` the token
    (-1 where there is none; those rows are dropped by vLLM's
    ``RejectionSampler.parse_output``). ``source`` are the rows' logits
    (raw or processed, per ``logprobs_mode``)."""
    from vllm.v1.sample.sampler import Sampler

    picked = source.index_select(0, out_rows.reshape(-1)).float()
    lp = picked if as_logits else picked.log_softmax(-1)
    return Sampler.gather_logprobs(lp, num_logprobs, out_tokens.reshape(-1).clamp(min=0).long())
