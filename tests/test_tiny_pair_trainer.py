"""The tiny-pair trainer runs end to end (at toy scale) and exports exactly the
checkpoint layout of the bundled models."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from tests.conftest import DRAFTER, HYBRID, HYBRID_DRAFTER, ROOT, TARGET


def _keys(path):
    with safe_open(str(path), "pt") as f:
        return set(f.keys())


TOY = ["--threads", "1", "--target-steps", "2", "--target-seq", "32", "--target-batch", "2",
       "--distill-seqs", "128", "--distill-new", "24", "--drafter-steps", "2",
       "--drafter-batch", "2", "--distill-fn-seqs", "16"]


def _train(out, work, *extra):
    cmd = [sys.executable, "-m", "benchmarks.tiny_pair.train", "--out", str(out), "--work",
           str(work), *TOY, *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_trainer_smoke(tmp_path):
    out, work = tmp_path / "models", tmp_path / "work"
    _train(out, work)
    for name in ("tiny-qwen3", "tiny-qwen3-dflash"):
        bundled = TARGET if name == "tiny-qwen3" else DRAFTER
        assert _keys(out / name / "model.safetensors") == _keys(bundled / "model.safetensors")
        new_cfg = json.loads((out / name / "config.json").read_text())
        old_cfg = json.loads((bundled / "config.json").read_text())
        assert new_cfg["architectures"] == old_cfg["architectures"]
    dcfg = json.loads((out / "tiny-qwen3-dflash" / "config.json").read_text())
    assert dcfg["block_size"] == 16 and dcfg["dflash_config"]["mask_token_id"] == 1
    assert (out / "tiny-qwen3-dflash" / "mask_embedding.pt").exists()
    log = json.loads((out / "training_log.json").read_text())
    assert len(log["target_train"]) == 2 and len(log["drafter_train"]) == 2
    # A prompt cut at a line end must end in the token training saw before
    # indentation: newlines never merge with the spaces after them, in the
    # trainer's tokenizer and in the bundled one.
    from transformers import PreTrainedTokenizerFast

    code = "def f(x):\n    if x:\n        return x\n\n\nclass A:\n    pass\n"
    for path in (out / "tiny-qwen3", TARGET):
        tok = PreTrainedTokenizerFast.from_pretrained(path)
        pieces = [tok.decode([i]) for i in tok(code, add_special_tokens=False)["input_ids"]]
        assert "".join(pieces) == code
        assert not any("\n " in p for p in pieces), (path, pieces)

    # The hybrid pair (--arch qwen3_5), from the same tokenizer and corpus.
    hwork = tmp_path / "work_hybrid"
    hwork.mkdir()
    shutil.copytree(work / "tokenizer", hwork / "tokenizer")
    shutil.copy(work / "tokens.pt", hwork / "tokens.pt")
    _train(out, hwork, "--arch", "qwen3_5")
    for name, bundled in (("tiny-qwen35", HYBRID), ("tiny-qwen35-dflash", HYBRID_DRAFTER)):
        assert _keys(out / name / "model.safetensors") == _keys(bundled / "model.safetensors")
        new_cfg = json.loads((out / name / "config.json").read_text())
        old_cfg = json.loads((bundled / "config.json").read_text())
        assert new_cfg["architectures"] == old_cfg["architectures"]
    tcfg = json.loads((out / "tiny-qwen35" / "config.json").read_text())
    assert tcfg["dtype"] == "bfloat16" and "linear_attention" in tcfg["layer_types"]
    with safe_open(str(out / "tiny-qwen35" / "model.safetensors"), "pt") as f:
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16
    hlog = json.loads((out / "training_log_qwen35.json").read_text())
    assert len(hlog["target_train"]) == 2 and len(hlog["drafter_train"]) == 2


def test_drafter_init_from_target_copies_the_top_layers():
    from benchmarks.tiny_pair import train
    from benchmarks.tiny_pair.dflash_torch import DFlashDrafter

    n = train.ARCH.drafter["layers"]
    cfg = train.ARCH.config()
    cfg.num_hidden_layers, cfg.vocab_size = n + 1, 64
    torch.manual_seed(0)
    model = train.ARCH.model_cls()(cfg)
    drafter = DFlashDrafter(hidden=cfg.hidden_size, num_features=3, rope_theta=10000.0,
                            **train.ARCH.drafter)
    train.init_from_target(drafter, model)
    assert len(drafter.layers) == n
    for mine, theirs in zip(drafter.layers, model.model.layers[1:], strict=True):
        assert torch.equal(mine.q_proj.weight, theirs.self_attn.q_proj.weight)
        assert torch.equal(mine.k_norm.weight, theirs.self_attn.k_norm.weight)
        assert torch.equal(mine.down_proj.weight, theirs.mlp.down_proj.weight)
        assert torch.equal(mine.post_attention_layernorm.weight,
                           theirs.post_attention_layernorm.weight)
    assert torch.equal(drafter.norm.weight, model.model.norm.weight)
    # a drafter of another shape is refused with the alternative named
    small = DFlashDrafter(hidden=cfg.hidden_size, num_features=3, rope_theta=10000.0,
                          **dict(train.ARCH.drafter, inter=8))
    with pytest.raises(ValueError, match="--drafter-init random"):
        train.init_from_target(small, model)


def test_features_are_the_pre_norm_residuals_and_skip_later_layers():
    """The drafter trains on what vLLM hands it: the residual stream after each
    layer in TARGET_LAYER_IDS. The trainer stops the target after the last of
    them; the values must equal a full forward's hidden states."""
    from benchmarks.tiny_pair import train

    cfg = train.ARCH.config()
    cfg.num_hidden_layers, cfg.vocab_size = max(train.ARCH.layer_ids) + 2, 64
    torch.manual_seed(0)
    model = train.ARCH.model_cls()(cfg).eval()
    ids = torch.randint(0, 64, (2, 12))
    hooks = [len(layer._forward_hooks) for layer in model.model.layers]
    ran = []
    last = model.model.layers[-1].register_forward_hook(lambda *_: ran.append(1))
    with torch.no_grad():
        got = train.features(model, ids)
        # the trainer's hooks are gone (the last layer keeps only this test's)
        assert [len(layer._forward_hooks) for layer in model.model.layers[:-1]] == hooks[:-1]
        assert ran == []  # the layer after the last feature layer never ran
        hs = model(input_ids=ids, output_hidden_states=True).hidden_states
    last.remove()
    want = torch.cat([hs[i + 1] for i in train.ARCH.layer_ids], dim=-1)
    assert torch.equal(got, want)
