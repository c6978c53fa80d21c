"""The DFlash chain's acceptance, computed in plain PyTorch: an independent
check that vLLM runs the drafter that was trained.

    python -m benchmarks.tiny_pair.chain_oracle                  # 32 HumanEval prompts x 128
    python -m benchmarks.tiny_pair.chain_oracle --prompts 8

At T = 0 the target's output does not depend on the drafter, so the chain's
rounds are a function of the target's greedy continuation alone: a round
anchored at position ``p`` (the last token the target produced) accepts the
longest prefix of the drafter's block that equals the target's tokens at
``p+1 ..``, and the next round is anchored one past that prefix. This module
runs the target (Hugging Face) once per prompt and the exported drafter
(``dflash_torch.DFlashDrafter``, loaded from the files vLLM loads) on every
anchor, then walks the rounds. Its ``drafts`` and ``accepted`` must equal
vLLM's spec-decode counters for ``{"method": "dflash",
"num_speculative_tokens": block_size - 1}`` in fp32, up to float rounding at
near-ties.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.tiny_pair.dflash_torch import DFlashDrafter


def load_drafter(drafter_dir: str | Path) -> tuple[DFlashDrafter, dict]:
    """The exported drafter (z-lab layout, as vLLM loads it) as a DFlashDrafter."""
    from safetensors.torch import load_file

    drafter_dir = Path(drafter_dir)
    cfg = json.loads((drafter_dir / "config.json").read_text())
    drafter = DFlashDrafter(
        hidden=cfg["hidden_size"], layers=cfg["num_hidden_layers"],
        heads=cfg["num_attention_heads"], kv_heads=cfg["num_key_value_heads"],
        head_dim=cfg["head_dim"], inter=cfg["intermediate_size"],
        num_features=len(cfg["dflash_config"]["target_layer_ids"]),
        block_size=cfg["block_size"], rope_theta=cfg["rope_theta"], eps=cfg["rms_norm_eps"])
    # export_state_dict's names, back to the module's: drop the HF sub-module prefixes
    state = {k.replace("self_attn.", "").replace("mlp.", ""): v.float()
             for k, v in load_file(str(drafter_dir / "model.safetensors")).items()}
    mask = torch.load(drafter_dir / "mask_embedding.pt")["embedding"].float()
    drafter.load_state_dict({**state, "mask_embedding": mask})
    return drafter.eval(), cfg


@torch.no_grad()
def chain_acceptance(target_dir: str | Path, drafter_dir: str | Path, prompts: list[str],
                     max_tokens: int = 128) -> dict:
    """``{"drafts", "accepted", "tau", "accepted_per_depth"}`` of the DFlash chain."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.tiny_pair.train import features

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    drafter, cfg = load_drafter(drafter_dir)
    k = cfg["block_size"] - 1
    layer_ids = cfg["dflash_config"]["target_layer_ids"]
    embed, lm_head = model.model.embed_tokens, model.lm_head
    drafts, per_depth = 0, [0] * k
    for prompt in prompts:
        ids = torch.tensor([tok(prompt)["input_ids"]])
        n = ids.shape[1]
        seq = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_tokens + k, min_new_tokens=max_tokens + k,
                             do_sample=False, pad_token_id=tok.eos_token_id, eos_token_id=None)
        # the first token comes from the prefill; each round anchors at the last token
        anchors = torch.arange(n, n + max_tokens - 1)[None]
        hidden = drafter(features(model, seq, layer_ids), anchors, seq.gather(1, anchors),
                         embed)[:, :, 1:]
        guess = lm_head(hidden).argmax(-1)[0]
        truth = seq[0, anchors[0, :, None] + torch.arange(1, k + 1)]
        accepted = (guess == truth).int().cumprod(-1).sum(-1).tolist()
        a = 0
        while a < max_tokens - 1:  # tokens produced so far: a + 1
            drafts += 1
            for d in range(accepted[a]):
                per_depth[d] += 1
            a += 1 + accepted[a]
    total = sum(per_depth)
    return {"drafts": drafts, "accepted": total, "tau": 1 + total / drafts,
            "accepted_per_depth": per_depth}


def main() -> None:
    from benchmarks.run_llm import humaneval_prompts

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="models/tiny-qwen3")
    ap.add_argument("--drafter", default=None, help="default: <target>-dflash")
    ap.add_argument("--prompts", type=int, default=32, help="first N HumanEval prompts")
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    res = chain_acceptance(args.target, args.drafter or f"{args.target}-dflash",
                           humaneval_prompts(args.prompts), args.max_tokens)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
