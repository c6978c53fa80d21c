"""A plain-torch DFlash drafter with exactly the forward semantics of vLLM's
``DFlashQwen3ForCausalLM`` (``vllm/model_executor/models/qwen3_dflash.py``).

It is used to *train* the tiny drafter and as an independent oracle in
benchmarks. Weight names match the z-lab checkpoint layout that vLLM loads
(``fc``, ``hidden_norm``, ``norm``, ``layers.{i}.*``); ``embed_tokens`` and
``lm_head`` are borrowed from the target and are never saved with the drafter.

Semantics (one block, anchored at position ``p0``):

* context features ``f_j`` (the target's residual stream after each layer in
  ``target_layer_ids``, concatenated) for ``j < p0`` are projected by ``fc``,
  normalised by ``hidden_norm`` and turned into per-layer K/V by each layer's
  ``k_proj``/``v_proj`` (+ ``k_norm`` and RoPE at position ``j``). The context
  does not pass through ``input_layernorm``.
* the block ``[t_p0, MASK x K]`` at positions ``p0 .. p0+K`` runs through the
  decoder layers; every block query sees the whole context and the whole block
  (non-causal).
* the final ``norm`` + the target's ``lm_head`` at block row ``i`` give the
  drafter's marginal for the token at position ``p0 + i`` (i = 1..K).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float):
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = positions.float()[..., None] * inv  # [..., hd/2]
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotary embedding. x [..., T, H, hd]; cos/sin [..., T, hd/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[..., None, :], sin[..., None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class DFlashLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int,
                 inter: int, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def kv(self, x: torch.Tensor, cos, sin):
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim))
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim)
        return apply_rope(k, cos, sin), v

    def forward(self, h, ctx_k, ctx_v, cos, sin, mask):
        """h [b, Q, H] block hidden; ctx_k/v [b, N, kvh, hd]; mask [b, Q, N+Q] bool."""
        b, q, _ = h.shape
        x = self.input_layernorm(h)
        qs = self.q_norm(self.q_proj(x).view(b, q, self.heads, self.head_dim))
        qs = apply_rope(qs, cos, sin)
        bk, bv = self.kv(x, cos, sin)
        k = torch.cat([ctx_k, bk], dim=1)
        v = torch.cat([ctx_v, bv], dim=1)
        rep = self.heads // self.kv_heads
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
        att = F.scaled_dot_product_attention(
            qs.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=mask[:, None], scale=1.0 / math.sqrt(self.head_dim))
        att = att.transpose(1, 2).reshape(b, q, -1)
        h = h + self.o_proj(att)
        x = self.post_attention_layernorm(h)
        h = h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return h


class DFlashDrafter(nn.Module):
    def __init__(self, *, hidden: int, layers: int, heads: int, kv_heads: int,
                 head_dim: int, inter: int, num_features: int, block_size: int,
                 rope_theta: float, eps: float = 1e-6):
        super().__init__()
        self.block_size = block_size
        self.head_dim = head_dim
        self.rope_theta = rope_theta
        self.fc = nn.Linear(num_features * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.layers = nn.ModuleList(
            DFlashLayer(hidden, heads, kv_heads, head_dim, inter, eps) for _ in range(layers))
        self.norm = RMSNorm(hidden, eps)
        self.mask_embedding = nn.Parameter(torch.zeros(hidden))

    def forward(self, feats: torch.Tensor, anchors: torch.Tensor, anchor_tokens: torch.Tensor,
                embed: nn.Embedding) -> torch.Tensor:
        """feats [b, N, F] target features; anchors [b, A] anchor positions p0;
        anchor_tokens [b, A] tokens t_p0. Returns final hidden [b, A, bs, H]."""
        b, n, _ = feats.shape
        a = anchors.shape[1]
        bs = self.block_size
        ctx = self.hidden_norm(self.fc(feats))
        ccos, csin = rope_cos_sin(torch.arange(n), self.head_dim, self.rope_theta)
        offs = torch.arange(bs)
        qpos = anchors[:, :, None] + offs  # [b, A, bs]
        qcos, qsin = rope_cos_sin(qpos.reshape(b, a * bs), self.head_dim, self.rope_theta)
        tok_emb = embed(anchor_tokens)  # [b, A, H]
        h = self.mask_embedding.expand(b, a, bs, -1).clone()
        h[:, :, 0] = tok_emb
        h = h.reshape(b, a * bs, -1)
        # mask: block rows of anchor i see context j < p0_i and their own block.
        ctx_ok = torch.arange(n)[None, None, :] < anchors[:, :, None]  # [b, A, N]
        ctx_ok = ctx_ok[:, :, None, :].expand(b, a, bs, n).reshape(b, a * bs, n)
        blk = torch.arange(a).repeat_interleave(bs)
        blk_ok = (blk[:, None] == blk[None, :]).expand(b, -1, -1)
        mask = torch.cat([ctx_ok, blk_ok], dim=2)
        for layer in self.layers:
            ck, cv = layer.kv(ctx, ccos, csin)
            h = layer(h, ck, cv, qcos, qsin, mask)
        return self.norm(h).view(b, a, bs, -1)

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights under the names vLLM's qwen3_dflash loader expects."""
        out = {
            "fc.weight": self.fc.weight,
            "hidden_norm.weight": self.hidden_norm.weight,
            "norm.weight": self.norm.weight,
        }
        for i, L in enumerate(self.layers):
            p = f"layers.{i}."
            out[p + "input_layernorm.weight"] = L.input_layernorm.weight
            out[p + "post_attention_layernorm.weight"] = L.post_attention_layernorm.weight
            for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
                out[p + f"self_attn.{n}.weight"] = getattr(L, n).weight
            out[p + "self_attn.q_norm.weight"] = L.q_norm.weight
            out[p + "self_attn.k_norm.weight"] = L.k_norm.weight
            for n in ("gate_proj", "up_proj", "down_proj"):
                out[p + f"mlp.{n}.weight"] = getattr(L, n).weight
        return {k: v.detach().contiguous().clone() for k, v in out.items()}
