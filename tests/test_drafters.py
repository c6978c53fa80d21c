"""Drafter resolution for ``{"method": "ddtree"}`` without a model (``vllm_ddtree/drafters.py``)."""

from __future__ import annotations

import json

import pytest

from vllm_ddtree.drafters import (PUBLISHED, REFUSED, DrafterNotFound, TargetRefused,
                                  find_drafter)

DFLASH = {"architectures": ["DFlashDraftModel"], "dflash_config": {"mask_token_id": 5},
          "block_size": 16}


def _model_dir(path, config):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_beside_the_target_first(tmp_path):
    target = _model_dir(tmp_path / "Qwen3-8B", {"architectures": ["Qwen3ForCausalLM"]})
    beside = _model_dir(tmp_path / "Qwen3-8B-DFlash", DFLASH)
    d = find_drafter(str(target))
    assert d.model == str(beside) and "beside the target" in d.why
    # "-dflash" comes before "-DFlash"
    lower = _model_dir(tmp_path / "Qwen3-8B-dflash", DFLASH)
    assert find_drafter(str(target) + "/").model == str(lower)


def test_a_local_target_falls_back_to_the_table_by_name(tmp_path):
    target = _model_dir(tmp_path / "Qwen3-8B", {"architectures": ["Qwen3ForCausalLM"]})
    _model_dir(tmp_path / "Qwen3-8B-dflash", {"architectures": ["Qwen3ForCausalLM"]})
    d = find_drafter(str(target))
    assert d.model == "z-lab/Qwen3-8B-DFlash-b16" and "Qwen/Qwen3-8B" in d.why


@pytest.mark.parametrize("target,drafter", [
    ("Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16"),
    ("qwen/qwen3.6-27b", "z-lab/Qwen3.6-27B-DFlash"),
    ("openai/gpt-oss-20b", "z-lab/gpt-oss-20b-DFlash"),
    ("meta-llama/Llama-3.1-8B-Instruct", "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat"),
])
def test_published_drafters(target, drafter):
    assert find_drafter(target).model == drafter


def test_refused_targets_are_refused_before_any_model_loads(tmp_path):
    """A published target DDTree cannot serve (MLA) is refused at resolution,
    by id and by a local directory's name, naming the reason and the chain
    with its published drafter."""
    assert set(REFUSED) <= set(PUBLISHED)
    for target in ("moonshotai/Kimi-K2.5", "moonshotai/kimi-k2.5"):
        with pytest.raises(TargetRefused, match=r"^model: DDTree cannot serve "
                                                r"moonshotai/Kimi-K2\.5: .*MLA.*\"dflash\".*"
                                                r"z-lab/Kimi-K2\.5-DFlash"):
            find_drafter(target)
    local = tmp_path / "Kimi-K2.5"
    local.mkdir()
    with pytest.raises(TargetRefused, match="MLA"):
        find_drafter(str(local))


def test_mla_targets_are_refused_at_configuration():
    from types import SimpleNamespace

    from vllm_ddtree.core.config import DDTreeConfigError
    from vllm_ddtree.patches.spec_config import check_engine_args

    model = SimpleNamespace(is_attention_free=False, use_mla=True, is_hybrid=False,
                            is_encoder_decoder=False)
    parallel = SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1,
                               decode_context_parallel_size=1,
                               prefill_context_parallel_size=1)
    with pytest.raises(DDTreeConfigError, match=r"^model: .*multi-head latent attention.*"
                                                r"dflash"):
        check_engine_args(SimpleNamespace(), model, parallel)


def test_table_is_well_formed():
    for target, drafter in PUBLISHED.items():
        assert target.count("/") == 1 and drafter.startswith("z-lab/"), (target, drafter)
    names = [t.rsplit("/", 1)[1].lower() for t in PUBLISHED]
    assert len(names) == len(set(names))  # a local directory's name matches one entry


def test_error_names_target_attempts_and_fix(tmp_path):
    target = _model_dir(tmp_path / "my-model", {"architectures": ["Qwen3ForCausalLM"]})
    _model_dir(tmp_path / "my-model-DFlash", {"architectures": ["Qwen3ForCausalLM"]})
    with pytest.raises(DrafterNotFound) as err:
        find_drafter(str(target))
    msg = str(err.value)
    assert str(target) in msg and "speculative_config.model" in msg
    assert f"{target}-dflash (no such directory)" in msg
    assert f"{target}-DFlash (is not a DFlash drafter" in msg
    assert "published DFlash drafters" in msg and '"model"' in msg
    with pytest.raises(DrafterNotFound, match="org/unknown-model"):
        find_drafter("org/unknown-model")


def test_engine_config_finds_the_bundled_drafter(tiny_pair):
    """``{"method": "ddtree"}`` alone on the bundled target: its drafter beside it."""
    from vllm.engine.arg_utils import EngineArgs

    target, drafter = tiny_pair
    cfg = EngineArgs(model=target, speculative_config={"method": "ddtree"}, dtype="float32",
                     max_model_len=512, enforce_eager=True).create_engine_config()
    assert cfg.speculative_config.draft_model_config.model == drafter
    assert cfg.speculative_config.ddtree is not None


def test_engine_config_refuses_an_unknown_target_clearly(tiny_pair, tmp_path):
    import shutil

    from vllm.engine.arg_utils import EngineArgs

    from vllm_ddtree.core.config import DDTreeConfigError

    lone = tmp_path / "lone-target"
    shutil.copytree(tiny_pair[0], lone)
    args = EngineArgs(model=str(lone), speculative_config={"method": "ddtree"},
                      dtype="float32", max_model_len=512, enforce_eager=True)
    with pytest.raises(DDTreeConfigError, match="no DFlash drafter found for the target"):
        args.create_engine_config()
