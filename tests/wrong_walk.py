"""A deliberately wrong tree walk, to show the sampling test has power.

It always accepts the drafter's most probable first token (flat node 1) as if
the target had sampled it. Installed in-process by ``benchmarks.run_llm``'s
``setup`` hook (with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
"""

import torch


def install() -> None:
    import vllm_ddtree.runner as runner

    real = runner.walk

    def argmax_walk(tokens, parents, post, num_nodes=None):
        post = post.clone()
        has = (num_nodes > 0) if num_nodes is not None else torch.ones_like(post[:, 0], dtype=torch.bool)
        post[:, 0] = torch.where(has, tokens[:, 0], post[:, 0])
        return real(tokens, parents, post, num_nodes)

    runner.walk = argmax_walk
