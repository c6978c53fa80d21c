"""Reject, per request, sampling features DDTree does not verify losslessly yet.

``SamplingParams._validate_spec_decode`` is where vLLM itself refuses
sampling parameters that speculative decoding cannot honour (min_p,
logit_bias). It runs in the front end for every request, so a refusal becomes
a clear HTTP 400 / ``ValueError`` for that request while the server keeps
running. With DDTree on we add the parameters whose effect depends on the
token prefix (penalties, bad words, min_tokens), structured output (grammar
masks assume a chain), and logprobs (not computed by the tree walk yet).
"""

from __future__ import annotations

from vllm_ddtree.patches.base import Patch

_EPS = 1e-6


def unsupported_reason(params) -> tuple[str, str] | None:
    """``(parameter, reason)`` if DDTree cannot serve these SamplingParams."""
    if params.structured_outputs is not None:
        return ("structured_outputs",
                "structured output (guided decoding / response_format with a schema) is not "
                "supported with DDTree speculative decoding yet; send the request without it "
                "or serve with method 'dflash'")
    for name, neutral in (("repetition_penalty", 1.0), ("frequency_penalty", 0.0),
                          ("presence_penalty", 0.0)):
        if abs(getattr(params, name) - neutral) > _EPS:
            return (name, f"{name} is not supported with DDTree speculative decoding yet "
                          f"(penalties depend on each tree node's prefix); leave it at {neutral}")
    if params.bad_words:
        return ("bad_words", "bad_words is not supported with DDTree speculative decoding yet")
    if params.min_tokens:
        return ("min_tokens", "min_tokens is not supported with DDTree speculative decoding yet")
    if params.allowed_token_ids:
        return ("allowed_token_ids",
                "allowed_token_ids is not supported with DDTree speculative decoding yet")
    if params.logprobs is not None:
        return ("logprobs", "logprobs of generated tokens are not supported with DDTree "
                            "speculative decoding yet (prompt_logprobs are)")
    if params.logprob_token_ids:
        return ("logprob_token_ids", "logprob_token_ids of generated tokens are not supported "
                                     "with DDTree speculative decoding yet")
    if params.thinking_token_budget is not None:
        return ("thinking_token_budget",
                "thinking_token_budget is not supported with DDTree speculative decoding yet "
                "(vLLM enforces it inside the rejection sampler, which the tree walk replaces); "
                "send the request without it or serve with method 'dflash'")
    return None


def _build(original):
    def _validate_spec_decode(self, speculative_config):
        original(self, speculative_config)
        if getattr(speculative_config, "ddtree", None) is None:
            return
        bad = unsupported_reason(self)
        if bad is not None:
            from vllm.exceptions import VLLMValidationError

            raise VLLMValidationError(bad[1], parameter=bad[0])

    _validate_spec_decode.__wrapped__ = original
    return _validate_spec_decode


PATCH = Patch(
    name="request-params-ddtree",
    target="vllm.sampling_params:SamplingParams._validate_spec_decode",
    why="Refuse per request the sampling features the tree walk does not honour yet.",
    upstream="none (vLLM's own spec-decode parameter check)",
    vllm_versions="==0.32.*",
    build=_build,
)
