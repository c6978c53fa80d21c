"""process_logits against vLLM 0.32's own sampler steps (temperature, min-p, top-k, top-p).

vLLM's torch path is used as the oracle: ``apply_top_k_top_p_pytorch`` (sort
path and the top-k-only path) and ``MinPLogitsProcessor.apply``.
"""

import pytest
import torch

from vllm_ddtree.core.tree import SAMPLING_EPS, process_logits


pytestmark = pytest.mark.usefixtures("one_thread")

topk_topp = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
builtin = pytest.importorskip("vllm.v1.sample.logits_processor.builtin")


def vllm_processed(logits, temperature, top_k, top_p, min_p, allow_cpu_sync):
    """The plain-decoding sampler's steps on [rows, V] logits, one row per request."""
    x = logits.float().clone()
    t = torch.where(temperature < SAMPLING_EPS, 1.0, temperature)
    x.div_(t.unsqueeze(1))  # Sampler.apply_temperature
    if min_p is not None:
        proc = builtin.MinPLogitsProcessor.__new__(builtin.MinPLogitsProcessor)
        proc.min_p_count = int((min_p > 0).sum())
        proc.min_p = min_p.unsqueeze(1)
        x = proc.apply(x)
    return topk_topp.apply_top_k_top_p_pytorch(x, top_k, top_p, allow_cpu_sync=allow_cpu_sync)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("use", ["k", "p", "kp", "minp_kp", "none"])
def test_matches_vllm_sampler_steps(seed, use):
    g = torch.Generator().manual_seed(seed)
    b, n, V = 6, 4, 48
    logits = torch.randn(b, n, V, generator=g) * 3
    if use == "k":  # exact ties matter for top-k thresholds
        logits = logits.round()
    logits[torch.rand(b, n, V, generator=g) < 0.1] = float("-inf")
    temperature = torch.rand(b, generator=g) * 1.5
    temperature[0] = 0.0
    top_k = top_p = min_p = None
    if "k" in use:
        top_k = torch.randint(1, V + 1, (b,), generator=g, dtype=torch.int32)
        top_k[1] = V  # vLLM's "off"
    if "p" in use:
        top_p = torch.rand(b, generator=g) * 0.9 + 0.1
        top_p[2] = 1.0
    if use.startswith("minp"):
        min_p = torch.rand(b, generator=g) * 0.3
        min_p[3] = 0.0
    ours = process_logits(logits, temperature, top_k, top_p, min_p)

    rows = lambda t: None if t is None else t.repeat_interleave(n)  # noqa: E731
    flat = logits.reshape(b * n, V)
    for allow_cpu_sync in (False, True):
        ref = vllm_processed(flat, rows(temperature), rows(top_k), rows(top_p), rows(min_p), allow_cpu_sync)
        ref = ref.reshape(b, n, V)
        assert torch.equal(torch.isinf(ours), torch.isinf(ref))
        torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    if use != "none":
        # filters must have removed something beyond the -inf logits
        assert torch.isinf(ours).sum() > torch.isinf(logits).sum()
