"""Train the bundled tiny model pair from scratch, on CPU, reproducibly.

    python -m benchmarks.tiny_pair.train --out models            # everything
    python -m benchmarks.tiny_pair.train --stages drafter        # one stage
    python -m benchmarks.tiny_pair.train --arch qwen3_5          # the hybrid pair

Stages (each caches its result under --work, so a rerun skips what is done):

1. ``tokenizer``: byte-level BPE over the Python standard library's own source
   (the interpreter running this script), split first the way Qwen's
   tokenizers split (``QWEN_SPLIT``), with ``<|endoftext|>`` (eos),
   ``<|mask|>`` (the DFlash mask token) and a minimal chat template.
2. ``target``: a small ``Qwen3ForCausalLM`` (GQA) trained on that corpus.
3. ``distill``: the target's own greedy continuations of corpus prefixes, and
   of prompts that end after a function's signature and docstring (the shape
   of a code-completion request such as HumanEval's).
4. ``drafter``: a z-lab-format DFlash drafter (``DFlashDraftModel``,
   ``block_size`` 16, 3 layers started as copies of the target's top 3)
   trained on those continuations with the block objective
   ``[anchor, MASK x 15] -> next 15 target tokens``, conditioned on the
   target's hidden states at ``target_layer_ids``; it shares the target's
   ``embed_tokens`` and ``lm_head``. ``benchmarks/tiny_pair/chain_oracle.py``
   scores the exported drafter's chain acceptance in plain PyTorch.

Outputs: ``<out>/tiny-qwen3`` (target + tokenizer), ``<out>/tiny-qwen3-dflash``
(drafter), and ``<out>/training_log.json`` with the loss curves.

``--arch qwen3_5`` trains the hybrid pair instead: a ``Qwen3_5ForCausalLM``
target (Gated DeltaNet layers ``[linear x3, full]``, GDN head dim 128, partial
M-RoPE) exported in bf16, because vLLM CPU's GDN kernels take bf16 only, and a
DFlash drafter for it. Outputs ``<out>/tiny-qwen35``, ``<out>/tiny-qwen35-dflash``
and ``<out>/training_log_qwen35.json``; its default work folder is
``runs/tiny_hybrid``. Each pair's step counts default to the schedule it was
trained with (``SCHEDULE``, ``HYBRID_SCHEDULE``).
All randomness is seeded; results are reproducible on the same interpreter,
torch version and thread count.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import random
import shutil
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from benchmarks.tiny_pair.dflash_torch import DFlashDrafter

SPECIALS = ["<|endoftext|>", "<|mask|>", "<|im_start|>", "<|im_end|>"]
EOS_ID, MASK_ID = 0, 1
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TARGET = dict(vocab_size=4096, hidden_size=192, intermediate_size=576, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=48,
              max_position_embeddings=2048, rope_theta=10000.0)
TARGET_LAYER_IDS = [0, 1, 2]  # strictly below the last layer (see docs/design.md)
DRAFTER = dict(layers=3, heads=4, kv_heads=2, head_dim=48, inter=576, block_size=16)

# The hybrid pair: the Qwen3.5 / 3.6 text architecture in miniature. GDN with one
# K head and three V heads (the 16:48 ratio of Qwen3.6-27B) at head dim 128 (vLLM
# CPU's GDN kernels take 64 or 128), conv kernel 4, then one full-attention layer
# with partial rotary 0.25 and an interleaved M-RoPE section (8 frequencies).
HYBRID_TARGET = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=1, head_dim=64,
                     linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                     linear_num_key_heads=1, linear_num_value_heads=3,
                     layer_types=["linear_attention"] * 3 + ["full_attention"],
                     max_position_embeddings=2048,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                      "partial_rotary_factor": 0.25, "mrope_section": [3, 3, 2],
                                      "mrope_interleaved": True})
# The drafter's K/V layout equals the target attention layer's (1 KV head of 64),
# so vLLM's hybrid KV-cache grouping puts all three attention layers in one group
# (with 2 KV heads the drafter's layers would be split across groups, which
# vLLM's DFlash refuses).
HYBRID_DRAFTER = dict(layers=2, heads=4, kv_heads=1, head_dim=64, inter=768, block_size=16)


# Training schedules of the bundled pairs (the CLI's defaults for --arch).
SCHEDULE = dict(pretokenizer="qwen", target_steps=2400, target_seq=384, target_batch=12,
                distill_seqs=8192, distill_fn_seqs=2048, drafter_steps=4000, drafter_init="target")
HYBRID_SCHEDULE = dict(pretokenizer="bytelevel", target_steps=600, target_seq=256, target_batch=8,
                       distill_seqs=2048, distill_fn_seqs=0, drafter_steps=700,
                       drafter_init="random")

# Pre-tokenization before byte-level BPE. "bytelevel" is GPT-2's split, which
# glues a newline to the indentation after it ("\n    "), so a prompt ending in
# "\n" (every code-completion prompt) ends in a token the model never saw
# followed by indentation. "qwen" splits the way Qwen's tokenizers do: runs of
# newlines are their own pre-token or close a run of punctuation (":\n"), and the
# indentation that follows is a separate token, so prompts cut at a line end
# tokenize as they did in training.
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


class Arch:
    """What differs between the bundled pairs; everything else is shared."""

    def __init__(self, name: str):
        self.name = name
        self.hybrid = name == "qwen3_5"
        self.target = HYBRID_TARGET if self.hybrid else TARGET
        self.drafter = dict(HYBRID_DRAFTER if self.hybrid else DRAFTER)
        self.layer_ids = TARGET_LAYER_IDS
        self.target_dir = "tiny-qwen35" if self.hybrid else "tiny-qwen3"
        self.log_name = "training_log_qwen35.json" if self.hybrid else "training_log.json"
        self.export_dtype = torch.bfloat16 if self.hybrid else torch.float32

    def config(self):
        common = dict(tie_word_embeddings=False, rms_norm_eps=1e-6, bos_token_id=EOS_ID,
                      eos_token_id=EOS_ID, pad_token_id=EOS_ID, attention_dropout=0.0,
                      use_cache=True)
        if self.hybrid:
            from transformers import Qwen3_5TextConfig
            return Qwen3_5TextConfig(**self.target, **common)
        from transformers import Qwen3Config
        return Qwen3Config(**self.target, **common)

    def model_cls(self):
        if self.hybrid:
            from transformers import Qwen3_5ForCausalLM
            return Qwen3_5ForCausalLM
        from transformers import Qwen3ForCausalLM
        return Qwen3ForCausalLM


ARCH = Arch("qwen3")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------- corpus
def corpus_files() -> tuple[list[str], list[str]]:
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(f for f in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
                   if "site-packages" not in f)
    rng = random.Random(1234)
    rng.shuffle(files)
    n_val = max(1, len(files) // 50)
    return files[n_val:], files[:n_val]


def read(f: str) -> str:
    with open(f, encoding="utf-8", errors="replace") as fh:
        return fh.read()


# --------------------------------------------------------------------------- stage 1
def train_tokenizer(work: Path, vocab: int, pretokenizer: str = "qwen"):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tdir = work / "tokenizer"
    if (tdir / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(tdir)
    train, _ = corpus_files()
    tok = Tokenizer(models.BPE())
    if pretokenizer == "qwen":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    log(f"tokenizer: training BPE (vocab {vocab}, {pretokenizer} pre-tokenizer) "
        f"on {len(train)} files")
    tok.train_from_iterator((read(f) for f in train), trainer=trainer)
    assert tok.token_to_id("<|endoftext|>") == EOS_ID and tok.token_to_id("<|mask|>") == MASK_ID
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", mask_token="<|mask|>",
                                   additional_special_tokens=SPECIALS[2:])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(tdir)
    return fast


def token_stream(tok, files: list[str]) -> torch.Tensor:
    ids: list[int] = []
    for enc in tok(list(read(f) for f in files), add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.int32)


def streams(tok, work: Path) -> tuple[torch.Tensor, torch.Tensor]:
    path = work / "tokens.pt"
    if path.exists():
        d = torch.load(path)
        return d["train"], d["val"]
    train, val = corpus_files()
    d = {"train": token_stream(tok, train), "val": token_stream(tok, val)}
    torch.save(d, path)
    log(f"corpus: {d['train'].numel()/1e6:.2f}M train tokens, {d['val'].numel()/1e6:.2f}M val")
    return d["train"], d["val"]


# --------------------------------------------------------------------------- training
def optimizer(module, lr: float, steps: int, weight_decay: float):
    """AdamW with 5% linear warm-up, then cosine decay to zero."""
    opt = torch.optim.AdamW(module.parameters(), lr=lr, betas=(0.9, 0.95),
                            weight_decay=weight_decay)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    return opt, sched


def update(module, loss, opt, sched) -> None:
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
    opt.step()
    sched.step()


# --------------------------------------------------------------------------- stage 2
def target_config():
    return ARCH.config()


def batches(stream: torch.Tensor, seq: int, bsz: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, stream.numel() - seq - 1, (bsz,), generator=gen)
        yield torch.stack([stream[s:s + seq + 1] for s in starts.tolist()]).long()


@torch.no_grad()
def eval_loss(model, val: torch.Tensor, seq: int, n: int = 16) -> float:
    model.eval()
    gen = torch.Generator().manual_seed(7)
    x = next(batches(val, seq, n, gen))
    out = model(input_ids=x[:, :-1]).logits
    model.train()
    return F.cross_entropy(out.flatten(0, 1), x[:, 1:].flatten()).item()


def train_target(tok, work: Path, steps: int, seq: int, bsz: int, lr: float, curves: dict):
    model_cls = ARCH.model_cls()
    tdir = work / "target"
    if (tdir / "config.json").exists():
        # the cached stage's curves travel with it, so a later run logs them too
        if (tdir / "curves.json").exists():
            curves.update(json.loads((tdir / "curves.json").read_text()))
        return model_cls.from_pretrained(tdir, dtype=torch.float32)
    train, val = streams(tok, work)
    torch.manual_seed(0)
    model = model_cls(target_config()).float()
    log(f"target: {sum(p.numel() for p in model.parameters())/1e6:.2f}M params, "
        f"{steps} steps x {bsz} x {seq} tokens")
    opt, sched = optimizer(model, lr, steps, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    it = batches(train, seq, bsz, gen)
    curves["target_train"], curves["target_val"] = [], []
    bar = tqdm(range(steps), desc="target", mininterval=10)
    for step in bar:
        x = next(it)
        loss = F.cross_entropy(model(input_ids=x[:, :-1]).logits.flatten(0, 1), x[:, 1:].flatten())
        update(model, loss, opt, sched)
        curves["target_train"].append([step, loss.item()])
        if step % 100 == 0 or step == steps - 1:
            v = eval_loss(model, val, seq)
            curves["target_val"].append([step, v])
            bar.set_postfix(loss=f"{loss.item():.3f}", val=f"{v:.3f}")
    model.save_pretrained(tdir, safe_serialization=True)
    (tdir / "curves.json").write_text(json.dumps(
        {k: curves[k] for k in ("target_train", "target_val")}))
    return model


# --------------------------------------------------------------------------- stage 3
def greedy_continuations(model, prompts: torch.Tensor, new_tokens: int) -> list[torch.Tensor]:
    """``[prompt_len, *prompt, *continuation]`` int32 rows: the target's own greedy
    continuation of each (equal-length) prompt."""
    out = model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts),
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=EOS_ID, eos_token_id=None)
    head = torch.tensor([prompts.shape[1]])
    return [torch.cat([head, row]).to(torch.int32) for row in out]


@torch.no_grad()
def distill(model, tok, work: Path, n_seqs: int, new_tokens: int, bsz: int) -> list[torch.Tensor]:
    path = work / "distill.pt"
    if path.exists():
        return torch.load(path)
    train, _ = streams(tok, work)
    gen = torch.Generator().manual_seed(2)
    model.eval()
    seqs: list[torch.Tensor] = []
    for _ in tqdm(range(math.ceil(n_seqs / bsz)), desc="distill", mininterval=10):
        plen = int(torch.randint(16, 257, (1,), generator=gen))
        starts = torch.randint(0, train.numel() - plen, (bsz,), generator=gen)
        prompts = torch.stack([train[s:s + plen] for s in starts.tolist()]).long()
        seqs.extend(greedy_continuations(model, prompts, new_tokens))
    torch.save(seqs, path)
    return seqs


_DEF_DOC = None


def function_start_prompts(tok, max_len: int = 256) -> list[list[int]]:
    """Prompts that end right after a function's signature and docstring, the
    shape of a code-completion request ("write the body"), cut from the
    training split of the corpus."""
    import re

    global _DEF_DOC
    _DEF_DOC = _DEF_DOC or re.compile(r'\n([ \t]*)def [^\n]*:\n\1[ \t]+(?:"""|\'\'\')[\s\S]{0,1200}?(?:"""|\'\'\')\n')
    train, _ = corpus_files()
    out: list[list[int]] = []
    for f in train:
        text = read(f)
        for m in _DEF_DOC.finditer(text):
            start = max(0, m.start() - 1500)
            ids = tok(text[start:m.end()], add_special_tokens=False)["input_ids"][-max_len:]
            if len(ids) >= 48:
                out.append(ids)
    return out


@torch.no_grad()
def distill_function_starts(model, tok, work: Path, n_seqs: int, new_tokens: int,
                            bsz: int) -> list[torch.Tensor]:
    path = work / "distill_fn.pt"
    if path.exists():
        return torch.load(path)
    pool = function_start_prompts(tok)
    rng = random.Random(6)
    rng.shuffle(pool)
    pool = pool[:n_seqs]
    pool.sort(key=len)  # similar lengths per batch; left-truncate to the shortest
    model.eval()
    seqs: list[torch.Tensor] = []
    for i in tqdm(range(0, len(pool), bsz), desc="distill (function starts)", mininterval=10):
        group = pool[i:i + bsz]
        plen = min(len(g) for g in group)
        prompts = torch.tensor([g[-plen:] for g in group])
        seqs.extend(greedy_continuations(model, prompts, new_tokens))
    torch.save(seqs, path)
    log(f"distill: {len(seqs)} function-start continuations")
    return seqs


# --------------------------------------------------------------------------- stage 4
class _FeaturesDone(Exception):
    pass


def features(model, ids: torch.Tensor, layer_ids: list[int] | None = None) -> torch.Tensor:
    """The target's residual stream after each layer in TARGET_LAYER_IDS (before the
    final norm): what vLLM hands the drafter as auxiliary hidden states. Runs the
    target's layers only up to the last one needed (no later layers, no lm_head)."""
    wanted = ARCH.layer_ids if layer_ids is None else layer_ids
    layers = model.model.layers
    taken: dict[int, torch.Tensor] = {}

    def keep(i: int):
        def hook(_module, _args, output):
            taken[i] = output[0] if isinstance(output, tuple) else output
            if len(taken) == len(wanted):
                raise _FeaturesDone
        return hook

    handles = [layers[i].register_forward_hook(keep(i)) for i in wanted]
    try:
        model.model(input_ids=ids, use_cache=False)
    except _FeaturesDone:
        pass
    finally:
        for h in handles:
            h.remove()
    return torch.cat([taken[i] for i in wanted], dim=-1)


@torch.no_grad()
def init_from_target(drafter: DFlashDrafter, model) -> None:
    """Start the drafter's layers as copies of the target's top layers (and its
    final norm): the block rows begin by computing what the target's last
    layers would. Needs equal layer shapes (true for the attention-only pair)."""
    top = model.model.layers[-len(drafter.layers):]
    for mine, theirs in zip(drafter.layers, top):
        pairs = [(mine.input_layernorm, theirs.input_layernorm),
                 (mine.post_attention_layernorm, theirs.post_attention_layernorm)]
        pairs += [(getattr(mine, n), getattr(theirs.self_attn, n))
                  for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
        pairs += [(getattr(mine, n), getattr(theirs.mlp, n))
                  for n in ("gate_proj", "up_proj", "down_proj")]
        for dst, src in pairs:
            if dst.weight.shape != src.weight.shape:
                raise ValueError(f"--drafter-init target: drafter weight {tuple(dst.weight.shape)}"
                                 f" vs target {tuple(src.weight.shape)}; use --drafter-init random")
            dst.weight.copy_(src.weight)
    drafter.norm.weight.copy_(model.model.norm.weight)


def train_drafter(model, seqs, work: Path, steps: int, bsz: int, anchors: int, lr: float,
                  decay: float, curves: dict, init: str = "random") -> DFlashDrafter:
    path = work / "drafter.pt"
    cfg = model.config
    torch.manual_seed(3)
    drafter = DFlashDrafter(hidden=cfg.hidden_size, num_features=len(ARCH.layer_ids),
                            rope_theta=cfg.rope_parameters["rope_theta"], **ARCH.drafter)
    with torch.no_grad():
        drafter.mask_embedding.copy_(model.model.embed_tokens.weight[MASK_ID])
    if path.exists():
        drafter.load_state_dict(torch.load(path))
        if path.with_suffix(".curves.json").exists():
            curves.update(json.loads(path.with_suffix(".curves.json").read_text()))
        return drafter
    if init == "target":
        init_from_target(drafter, model)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    embed, lm_head = model.model.embed_tokens, model.lm_head
    K = ARCH.drafter["block_size"] - 1
    weights = torch.exp(-torch.arange(K, dtype=torch.float32) / decay)
    opt, sched = optimizer(drafter, lr, steps, weight_decay=0.01)
    rng = random.Random(4)
    n_val = 64
    val, train = seqs[:n_val], seqs[n_val:]
    curves["drafter_train"], curves["drafter_val"], curves["drafter_val_acc"] = [], [], []

    def make_batch(pool, r: random.Random):
        rows = [pool[r.randrange(len(pool))] for _ in range(bsz)]
        n = max(len(s) - 1 for s in rows)
        ids = torch.full((bsz, n), EOS_ID, dtype=torch.long)
        anc = torch.zeros(bsz, anchors, dtype=torch.long)
        for i, s in enumerate(rows):
            plen, toks = int(s[0]), s[1:].long()
            ids[i, :len(toks)] = toks
            # anchors inside the greedy region; labels must be greedy tokens too
            hi = len(toks) - 1 - K
            anc[i] = torch.tensor(sorted(r.sample(range(plen, hi + 1), anchors)))
        lab_idx = anc[:, :, None] + torch.arange(1, K + 1)
        return ids, anc, ids.gather(1, lab_idx.flatten(1)).view(bsz, anchors, K)

    def step_loss(ids, anc, labels):
        with torch.no_grad():
            feats = features(model, ids)
        h = drafter(feats, anc, ids.gather(1, anc), embed)[:, :, 1:]  # [b, A, K, H]
        logits = lm_head(h)
        ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none")
        ce = ce.view(labels.shape)
        acc = (logits.argmax(-1) == labels).float()
        return (ce * weights).sum(-1).mean() / weights.sum(), acc

    vr = random.Random(5)
    vbatch = make_batch(val, vr)
    log(f"drafter: {sum(p.numel() for p in drafter.parameters())/1e6:.2f}M params, "
        f"{steps} steps x {bsz} seqs x {anchors} anchors, K={K}")
    bar = tqdm(range(steps), desc="drafter", mininterval=10)
    for step in bar:
        loss, _ = step_loss(*make_batch(train, rng))
        update(drafter, loss, opt, sched)
        curves["drafter_train"].append([step, loss.item()])
        if step % 100 == 0 or step == steps - 1:
            with torch.no_grad():
                vl, acc = step_loss(*vbatch)
            # expected chain acceptance on the validation batch: sum_k prod_{i<=k} acc_i
            tau = 1 + acc.cumprod(-1).sum(-1).mean().item()
            curves["drafter_val"].append([step, vl.item()])
            curves["drafter_val_acc"].append([step, acc.mean(dim=(0, 1)).tolist(), tau])
            bar.set_postfix(loss=f"{loss.item():.3f}", val=f"{vl.item():.3f}", tau=f"{tau:.2f}")
    torch.save(drafter.state_dict(), path)
    path.with_suffix(".curves.json").write_text(json.dumps(
        {k: curves[k] for k in ("drafter_train", "drafter_val", "drafter_val_acc")}))
    return drafter


# --------------------------------------------------------------------------- export
def export(model, tok, drafter: DFlashDrafter, out: Path) -> None:
    from safetensors.torch import save_file
    tdir, ddir = out / ARCH.target_dir, out / f"{ARCH.target_dir}-dflash"
    tdir.mkdir(parents=True, exist_ok=True)
    ddir.mkdir(parents=True, exist_ok=True)
    model.generation_config.do_sample = False
    model.to(ARCH.export_dtype).save_pretrained(tdir, safe_serialization=True)
    tok.save_pretrained(tdir)
    cfg = model.config
    dcfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": ARCH.drafter["block_size"],
        "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": ARCH.layer_ids},
        "hidden_size": cfg.hidden_size,
        "intermediate_size": ARCH.drafter["inter"],
        "num_hidden_layers": ARCH.drafter["layers"],
        "num_attention_heads": ARCH.drafter["heads"],
        "num_key_value_heads": ARCH.drafter["kv_heads"],
        "head_dim": ARCH.drafter["head_dim"],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": cfg.rope_parameters["rope_theta"],
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "num_target_layers": cfg.num_hidden_layers,
        "tie_word_embeddings": False,
        "torch_dtype": str(ARCH.export_dtype).removeprefix("torch."),
        "bos_token_id": EOS_ID,
        "eos_token_id": EOS_ID,
    }
    (ddir / "config.json").write_text(json.dumps(dcfg, indent=2) + "\n")
    save_file({k: v.to(ARCH.export_dtype) for k, v in drafter.export_state_dict().items()},
              str(ddir / "model.safetensors"))
    torch.save({"mask_token_id": MASK_ID, "embedding": drafter.mask_embedding.detach().clone()},
               ddir / "mask_embedding.pt")
    log(f"exported {tdir} and {ddir}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=("qwen3", "qwen3_5"), default="qwen3",
                    help="qwen3: the bundled attention-only pair; qwen3_5: the hybrid GDN pair")
    ap.add_argument("--out", default="models")
    ap.add_argument("--work", default=None, help="cache folder (default runs/tiny_pair, "
                    "or runs/tiny_hybrid with --arch qwen3_5)")
    ap.add_argument("--stages", default="all", help="comma list of tokenizer,target,distill,drafter,export")
    ap.add_argument("--redo", default="", help="comma list of cached stages to recompute")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pretokenizer", choices=("qwen", "bytelevel"), default=None,
                    help="split before BPE (default per --arch; see QWEN_SPLIT)")
    ap.add_argument("--target-steps", type=int, default=None)
    ap.add_argument("--target-seq", type=int, default=None)
    ap.add_argument("--target-batch", type=int, default=None)
    ap.add_argument("--target-lr", type=float, default=3e-3)
    ap.add_argument("--distill-seqs", type=int, default=None)
    ap.add_argument("--distill-new", type=int, default=96)
    ap.add_argument("--distill-fn-seqs", type=int, default=None,
                    help="extra continuations of function-signature+docstring prompts, "
                         "the shape of a code-completion request (0 = none)")
    ap.add_argument("--drafter-steps", type=int, default=None)
    ap.add_argument("--drafter-layers", type=int, default=None,
                    help="drafter decoder layers (default: the pair's DRAFTER shape)")
    ap.add_argument("--drafter-batch", type=int, default=16)
    ap.add_argument("--drafter-anchors", type=int, default=4)
    ap.add_argument("--drafter-lr", type=float, default=2e-3)
    ap.add_argument("--drafter-init", choices=("random", "target"), default=None,
                    help="target: start the drafter's layers as copies of the target's top layers")
    ap.add_argument("--drafter-decay", type=float, default=5.0,
                    help="per-position loss weight exp(-(k-1)/decay)")
    args = ap.parse_args()
    global ARCH
    ARCH = Arch(args.arch)
    if args.work is None:
        args.work = "runs/tiny_hybrid" if ARCH.hybrid else "runs/tiny_pair"
    # Defaults per pair: what the bundled models were trained with.
    for key, value in (HYBRID_SCHEDULE if ARCH.hybrid else SCHEDULE).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.drafter_layers is not None:
        ARCH.drafter["layers"] = args.drafter_layers
    torch.set_num_threads(args.threads)
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    stages = {"tokenizer", "target", "distill", "drafter", "export"} if args.stages == "all" \
        else set(args.stages.split(","))
    cached = {"tokenizer": ["tokenizer", "tokens.pt"], "target": ["target"],
              "distill": ["distill.pt", "distill_fn.pt"], "drafter": ["drafter.pt"]}
    for stage in filter(None, args.redo.split(",")):
        for path in (work / name for name in cached[stage]):
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
    log_path = out / ARCH.log_name
    curves = json.loads(log_path.read_text()) if log_path.exists() else {}
    curves["args"] = vars(args)
    t0 = time.time()
    tok = train_tokenizer(work, ARCH.target["vocab_size"], args.pretokenizer)
    if stages <= {"tokenizer"}:
        return
    model = train_target(tok, work, args.target_steps, args.target_seq, args.target_batch,
                         args.target_lr, curves)
    if "target_val" in curves and curves["target_val"]:
        curves["target_final_val_loss"] = curves["target_val"][-1][1]
    if stages & {"distill", "drafter", "export"}:
        seqs = distill(model, tok, work, args.distill_seqs, args.distill_new, 64)
        if args.distill_fn_seqs:
            seqs = seqs + distill_function_starts(model, tok, work, args.distill_fn_seqs,
                                                  args.distill_new, 64)
            random.Random(8).shuffle(seqs)
    if stages & {"drafter", "export"}:
        drafter = train_drafter(model, seqs, work, args.drafter_steps, args.drafter_batch,
                                args.drafter_anchors, args.drafter_lr, args.drafter_decay, curves,
                                args.drafter_init)
    if "export" in stages:
        export(model, tok, drafter, out)
    curves["wall_seconds"] = curves.get("wall_seconds", 0) + time.time() - t0
    out.mkdir(parents=True, exist_ok=True)
    log_path.write_text(json.dumps(curves) + "\n")


if __name__ == "__main__":
    main()
