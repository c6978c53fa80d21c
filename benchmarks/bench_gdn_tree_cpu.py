"""One Gated DeltaNet layer's tree verification on CPU: native kernel, torch
path and vLLM's stock chain, side by side.

At the bundled tiny hybrid's GDN layer shape (1 key head, 3 value heads,
K = V = 128, conv width 4, bf16 activations and state), each of c requests
verifies 16 tokens, either as a chain or as a branching tree (a spine of 10
nodes with six side branches, two of them two nodes deep: three waves for
the torch path). Arms, timed in turn within every repeat (so drift hits all
of them alike):

* ``native``: ``cpu_tree_spec_forward`` through ``ddtree_gdn_tree``, one call;
* ``torch``: the same function on its torch path (``F.conv1d`` and vLLM's
  chain kernel, one call per wave);
* ``stock``: vLLM CPU's own ``_spec_forward`` over the same tokens as a chain
  (what the DFlash chain runs; for the tree shape it is the cost of a chain of
  the same width, not a correct tree).

Reports the median over repeats of each repeat's mean microseconds per layer
call, and writes JSON.

    python -m benchmarks.bench_gdn_tree_cpu [--concurrency 1 4 16] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
H, HV, K, V, W, S = 1, 3, 128, 128, 4, 16
DIM = 2 * H * K + HV * V
STATE_LEN = W - 1 + S
CHAIN = list(range(-1, S - 1))
TREE = [-1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 11, 0, 4, 11]


def gdn_layer(g):
    """A stand-in for vLLM's Qwen GDN layer at this shape (what the GDN
    forward reads of it), its weights drawn from ``g``."""
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        QwenGatedDeltaNetAttention,
    )

    class Layer(SimpleNamespace):
        rearrange_mixed_qkv = QwenGatedDeltaNetAttention.rearrange_mixed_qkv

    conv = SimpleNamespace(weight=(torch.randn(DIM, 1, W, generator=g) * 0.5).bfloat16(),
                           bias=(torch.randn(DIM, generator=g) * 0.1).bfloat16())
    return Layer(prefix="bench.linear_attn", conv1d=conv, activation="silu",
                 A_log=(torch.randn(HV, generator=g) * 0.5).bfloat16(),
                 dt_bias=torch.randn(HV, generator=g).bfloat16(),
                 key_dim=H * K, value_dim=HV * V, tp_size=1, head_k_dim=K, head_v_dim=V)


def _case(c: int, shape: list[int], g):
    n_slots = c * (S + 1)
    md = SimpleNamespace(
        num_spec_decodes=c, num_prefills=0, num_decodes=0, spec_token_indx=None,
        spec_sequence_masks=None,
        spec_state_indices_tensor=torch.arange(n_slots, dtype=torch.int32).view(c, S + 1),
        spec_query_start_loc=torch.arange(c + 1, dtype=torch.int32) * S,
        num_accepted_tokens=torch.ones(c, dtype=torch.int32))
    x = torch.randn(c * S, DIM, generator=g).bfloat16()
    b = torch.randn(c * S, HV, generator=g).bfloat16()
    a = torch.randn(c * S, HV, generator=g).bfloat16()
    conv = torch.randn(n_slots, STATE_LEN, DIM, generator=g).bfloat16().transpose(1, 2)
    ssm = (torch.randn(n_slots, HV, K, V, generator=g) * 0.1).bfloat16()
    return md, x, b, a, conv, ssm, torch.tensor(shape * c)


def measure(concurrency: list[int], repeats: int, calls: int) -> dict:
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

    from vllm_ddtree.gdn import GDNTreeStep, cpu_tree_spec_forward
    from vllm_ddtree.kernels import cpu_native

    if cpu_native.load() is None:
        raise SystemExit("the native CPU kernels are unavailable (no C compiler?)")
    torch.cpu._is_amx_tile_supported = lambda: False  # the stock path's torch conv everywhere
    g = torch.Generator().manual_seed(0)
    layer = gdn_layer(g)
    weight = layer.conv1d.weight.view(DIM, W)
    results = {}
    for c in concurrency:
        for name, shape in (("chain", CHAIN), ("tree", TREE)):
            md, x, b, a, conv, ssm, parent = _case(c, shape, g)

            def ours(native, md=md, x=x, b=b, a=a, conv=conv, ssm=ssm, parent=parent):
                step = GDNTreeStep(parent)
                cpu_tree_spec_forward(step, layer, md, x, b, a, conv, ssm, W, weight,
                                      native=native)

            arms = {"native": lambda: ours(True), "torch": lambda: ours(False),
                    "stock": lambda md=md, x=x, b=b, a=a, conv=conv, ssm=ssm:
                    gdn_attention._spec_forward(layer, md, x, b, a, conv, ssm, W, STATE_LEN)}
            times = {arm: [] for arm in arms}
            for fn in arms.values():  # warm-up
                for _ in range(5):
                    fn()
            for _ in range(repeats):
                for arm, fn in arms.items():
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        fn()
                    times[arm].append((time.perf_counter() - t0) / calls * 1e6)
            results[f"{name}/c={c}"] = {arm: statistics.median(v) for arm, v in times.items()}
            print(f"{name:5s} c={c:2d}: " + "  ".join(
                f"{arm} {us:7.0f} us" for arm, us in results[f"{name}/c={c}"].items()),
                flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--calls", type=int, default=40, help="layer calls per timing")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gdn_tree_cpu.json"))
    args = p.parse_args()
    results = measure(args.concurrency, args.repeats, args.calls)
    Path(args.out).write_text(json.dumps({"args": vars(args), "us_per_layer": results},
                                         indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
