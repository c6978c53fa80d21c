"""Per request: what DDTree serves, and a clear refusal for what it does not.

``SamplingParams._validate_spec_decode`` is where vLLM refuses sampling
parameters speculative decoding cannot honour (``min_p``, ``logit_bias``). It
runs in the front end for every request, so a refusal is an HTTP 400 /
``ValueError`` for that request while the server keeps running.

DDTree applies every per-request logits transformation at each tree node
with the node's own history (``vllm_ddtree/node_sampling.py``), so ``min_p``
and ``logit_bias`` are served, and so are penalties, ``bad_words``,
``min_tokens``, ``allowed_token_ids``, logprobs and structured output. What
is still refused is listed in :func:`unsupported_reason`.
"""

from __future__ import annotations

from vllm_ddtree.patches.base import ALL_PLATFORMS, Patch


def unsupported_reason(params) -> tuple[str, str] | None:
    """``(parameter, reason)`` if DDTree cannot serve these SamplingParams."""
    if params.logprobs is not None and params.logprobs < 0:
        return ("logprobs", "logprobs=-1 (the whole vocabulary) is not supported with DDTree "
                            "speculative decoding; ask for a number of top logprobs instead")
    if params.logprob_token_ids:
        return ("logprob_token_ids", "logprob_token_ids of generated tokens are not supported "
                                     "with DDTree speculative decoding; use logprobs, or serve "
                                     "with method 'dflash'")
    if params.thinking_token_budget is not None:
        return ("thinking_token_budget",
                "thinking_token_budget is not supported with DDTree speculative decoding "
                "(vLLM enforces it inside the rejection sampler, which the tree walk replaces); "
                "send the request without it or serve with method 'dflash'")
    return None


def _build(original):
    def _validate_spec_decode(self, speculative_config):
        if getattr(speculative_config, "ddtree", None) is None:
            return original(self, speculative_config)
        # vLLM's own check refuses min_p and logit_bias, which DDTree serves.
        bad = unsupported_reason(self)
        if bad is not None:
            from vllm.exceptions import VLLMValidationError

            raise VLLMValidationError(bad[1], parameter=bad[0])

    _validate_spec_decode.__wrapped__ = original
    return _validate_spec_decode


PATCH = Patch(
    name="request-params-ddtree",
    target="vllm.sampling_params:SamplingParams._validate_spec_decode",
    why="Serve min_p and logit_bias with DDTree; refuse per request what the walk does not "
        "honour.",
    upstream="none (vLLM's own spec-decode parameter check)",
    vllm_versions=ALL_PLATFORMS,
    build=_build,
)
