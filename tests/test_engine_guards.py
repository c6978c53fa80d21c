"""What DDTree refuses, and the guards that prove its seams took effect.

* Engine configuration: on CUDA (the platform reported as CUDA) the target's
  attention layers get the ``DDTREE`` backend and the drafter keeps vLLM's
  automatic choice; a user's ``--attention-backend`` that cannot serve trees
  is refused. Settings and targets DDTree would serve wrongly are refused
  before any engine process starts.
* Runtime guards (real engines on CPU): with ``CPU_ATTN`` left stock on the
  target's layers, the start-up guard refuses to start; with that guard also
  disabled, the first tree step raises.
"""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest

from tests.conftest import cpu_fp8_kv_unavailable, run_job
from vllm_ddtree.core.config import DDTreeConfigError
from vllm_ddtree.plugin import register


@pytest.fixture(scope="module", autouse=True)
def _plugin():
    register()


def _args(target, drafter, **kw):
    from vllm.engine.arg_utils import EngineArgs

    kw.setdefault("dtype", "float32")
    return EngineArgs(model=target, max_model_len=512, enforce_eager=True,
                      speculative_config={"method": "ddtree", "model": drafter}, **kw)


@pytest.fixture
def cuda_platform(monkeypatch):
    """The platform reported as CUDA to the plugin (its backend registration
    and the engine-config hook); vLLM itself keeps running on CPU."""
    from vllm.platforms import current_platform

    from vllm_ddtree.attention import register_backends

    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    assert register_backends() == ["DDTREE"]
    yield
    monkeypatch.undo()


def test_cuda_target_gets_the_tree_backend_and_drafter_stays_automatic(tiny_pair,
                                                                      cuda_platform):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    target, drafter = tiny_pair
    cfg = _args(target, drafter).create_engine_config()
    tree_backend = AttentionBackendEnum["DDTREE"]
    assert cfg.attention_config.backend is tree_backend
    assert cfg.speculative_config.ddtree is not None
    # vLLM builds the drafter's config with the spec's own attention_backend
    # (None: automatic, so DFlash gets a backend for its non-causal block).
    proposer = SimpleNamespace(speculative_config=cfg.speculative_config, vllm_config=cfg)
    draft_cfg = SpecDecodeBaseProposer._create_draft_vllm_config(proposer)
    assert draft_cfg.attention_config.backend is None
    # Asking for DDTREE explicitly is accepted.
    explicit = _args(target, drafter, attention_backend="DDTREE").create_engine_config()
    assert explicit.attention_config.backend is tree_backend


@pytest.mark.parametrize("kw,flag", [
    ({"attention_backend": "FLASH_ATTN"}, "--attention-backend"),
    ({"attention_config": {"backend": "FLASHINFER"}}, "attention_config.backend"),
])
def test_cuda_refuses_a_backend_that_ignores_tree_masks(tiny_pair, cuda_platform, kw, flag):
    target, drafter = tiny_pair
    with pytest.raises(DDTreeConfigError) as e:
        _args(target, drafter, **kw).create_engine_config()
    msg = str(e.value)
    assert msg.startswith(flag) and "DDTREE" in msg and "Drop" in msg


def test_cpu_keeps_vllms_backend_choice(tiny_pair):
    target, drafter = tiny_pair
    assert _args(target, drafter).create_engine_config().attention_config.backend is None


@pytest.mark.parametrize("kw,field", [
    ({"pipeline_parallel_size": 2}, "pipeline_parallel_size"),
    ({"kv_cache_dtype": "int8_per_token_head"}, "kv_cache_dtype"),
])
def test_refused_engine_settings(tiny_pair, kw, field):
    target, drafter = tiny_pair
    with pytest.raises(DDTreeConfigError, match=rf"^{field}:.*dflash"):
        _args(target, drafter, **kw).create_engine_config()


def _variant(tmp_path, target, **changes):
    """A copy of a tiny model whose config.json has ``changes``."""
    d = tmp_path / "target"
    shutil.copytree(target, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def _head_dim_64(tmp_path, target, drafter):
    """Configs of the tiny pair with head size 64 (the bundled pair's 48 is
    no multiple of 32, which vLLM's fp8 CPU cache needs); weights unread."""
    return (_variant(tmp_path, target, head_dim=64),
            _variant(tmp_path / "drafter", drafter, head_dim=64))


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_cache_is_served_where_vllms_cpu_attention_serves_it(tiny_pair, tmp_path,
                                                                     kv_cache_dtype):
    if cpu_fp8_kv_unavailable(64):
        pytest.skip(f"vLLM's CPU attention has no fp8 KV cache here: "
                    f"{cpu_fp8_kv_unavailable(64)}")
    target, drafter = _head_dim_64(tmp_path, *tiny_pair)
    cfg = _args(target, drafter, kv_cache_dtype=kv_cache_dtype).create_engine_config()
    assert cfg.cache_config.cache_dtype == kv_cache_dtype
    assert cfg.speculative_config.ddtree is not None


def test_fp8_kv_cache_refusals(tiny_pair, tmp_path, monkeypatch):
    import torch

    target, drafter = tiny_pair
    # vLLM's own rule, before any engine starts: head sizes must be multiples
    # of 32 (the bundled pair has 48), for the target and for the drafter
    with pytest.raises(DDTreeConfigError, match=r"^kv_cache_dtype:.*target \(head size 48\)"
                                                r".*divisible by 32.*--kv-cache-dtype auto"):
        _args(target, drafter, kv_cache_dtype="fp8").create_engine_config()
    target64, drafter64 = _head_dim_64(tmp_path, target, drafter)
    # a CPU with AVX-512, as vLLM sees it (whatever this one has): the
    # drafter's head size is what is refused
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: True)
    with pytest.raises(DDTreeConfigError, match=r"^kv_cache_dtype:.*drafter \(head size 48\)"):
        _args(target64, drafter, kv_cache_dtype="fp8").create_engine_config()
    # a CPU without AVX-512 or AMX, as vLLM sees it
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    with pytest.raises(DDTreeConfigError, match=r"^kv_cache_dtype:.*x86 with AVX-512 or AMX"):
        _args(target64, drafter64, kv_cache_dtype="fp8_e5m2").create_engine_config()


def test_fp8_kv_cache_on_cuda(tiny_pair, tmp_path, cuda_platform, monkeypatch):
    from vllm.platforms import current_platform

    # e4m3 (fp8, fp8_e4m3) is served: vLLM's Triton backend reads that format
    target, drafter = _head_dim_64(tmp_path, *tiny_pair)
    monkeypatch.setattr(current_platform, "has_device_capability", lambda cap: False)
    with pytest.raises(DDTreeConfigError, match=r"^kv_cache_dtype:.*compute capability 8.9"):
        _args(target, drafter, kv_cache_dtype="fp8").create_engine_config()
    monkeypatch.setattr(current_platform, "has_device_capability", lambda cap: cap <= 90)
    for kv_cache_dtype in ("fp8", "fp8_e4m3"):
        cfg = _args(target, drafter, kv_cache_dtype=kv_cache_dtype).create_engine_config()
        assert cfg.cache_config.cache_dtype == kv_cache_dtype
        assert cfg.attention_config.backend.name == "DDTREE"
    with pytest.raises(DDTreeConfigError, match=r"^kv_cache_dtype:.*'fp8_e5m2' on CUDA.*e4m3"
                                                r".*--kv-cache-dtype fp8"):
        _args(target, drafter, kv_cache_dtype="fp8_e5m2").create_engine_config()


def _hybrid_model_config(archs=("Qwen3_5ForCausalLM",), **text):
    import torch

    base = dict(layer_types=["linear_attention"] * 3 + ["full_attention"],
                linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=128,
                linear_value_head_dim=128, linear_conv_kernel_dim=4)
    return SimpleNamespace(architectures=list(archs), dtype=torch.bfloat16,
                           hf_text_config=SimpleNamespace(**dict(base, **text)))


def _hybrid_args(**kw):
    return SimpleNamespace(**dict(dict(enable_prefix_caching=None, mamba_cache_mode="none",
                                       mamba_cache_dtype="auto",
                                       mamba_ssm_cache_dtype="auto"), **kw))


def test_hybrid_target_checks(monkeypatch):
    from vllm_ddtree.patches.spec_config import check_hybrid_target, gdn_state_bytes

    # a GDN hybrid passes
    check_hybrid_target(_hybrid_args(enable_prefix_caching=False), _hybrid_model_config(), 16,
                        is_cpu=True)
    with pytest.raises(DDTreeConfigError, match=r"^enable_prefix_caching:.*align.*"
                                                r"--no-enable-prefix-caching"):
        check_hybrid_target(_hybrid_args(enable_prefix_caching=True), _hybrid_model_config(),
                            16, is_cpu=True)
    with pytest.raises(DDTreeConfigError, match=r"^mamba_cache_mode:"):
        check_hybrid_target(_hybrid_args(mamba_cache_mode="align"), _hybrid_model_config(),
                            16, is_cpu=True)
    with pytest.raises(DDTreeConfigError, match=r"^model:.*not Qwen Gated DeltaNet.*dflash"):
        check_hybrid_target(_hybrid_args(), _hybrid_model_config(("FalconH1ForCausalLM",)),
                            16, is_cpu=True)
    # on CUDA too (patches/gdn_tree_cuda.py), with the same prefix-caching refusal
    check_hybrid_target(_hybrid_args(enable_prefix_caching=False), _hybrid_model_config(), 16,
                        is_cpu=False)
    with pytest.raises(DDTreeConfigError, match=r"^enable_prefix_caching:"):
        check_hybrid_target(_hybrid_args(enable_prefix_caching=True), _hybrid_model_config(),
                            16, is_cpu=False)
    # Qwen3.6-27B's GDN shape: 48 layers, 16 K / 48 V heads of 128, conv 4; fp32 SSM.
    big = _hybrid_model_config(layer_types=["linear_attention"] * 48, linear_num_key_heads=16,
                               linear_num_value_heads=48)
    per_b = {b: gdn_state_bytes(big.hf_text_config, b, 2, 4) for b in (15, 64)}
    assert per_b[15] == 48 * 16 * ((2 * 16 * 128 + 48 * 128) * 18 * 2 + 48 * 128 * 128 * 4)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "8")
    with pytest.raises(DDTreeConfigError, match=r"^num_speculative_tokens: at tree budget 64 "
                                                r"one request's Gated DeltaNet states take "
                                                r"13\.13 GiB.*<= 42\b"):
        check_hybrid_target(_hybrid_args(mamba_ssm_cache_dtype="float32"), big, 64,
                            is_cpu=True)


def test_cuda_serves_the_tiny_hybrid(tiny_hybrid, cuda_platform):
    """The simulated-CUDA configuration builds the hybrid's DDTree engine config
    (the tree backend for its attention layers, prefix caching off)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    target, drafter = tiny_hybrid
    cfg = _args(target, drafter, dtype="bfloat16").create_engine_config()
    assert cfg.speculative_config.ddtree is not None
    assert cfg.attention_config.backend is AttentionBackendEnum["DDTREE"]
    assert cfg.cache_config.enable_prefix_caching is False


def test_cuda_gdn_layer_guard(monkeypatch):
    """On CUDA every GDN layer needs the three CUDA tree patches, and vLLM's
    fused chain kernel is turned off on them."""
    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as qga
    from vllm.platforms import current_platform

    from vllm_ddtree import runner
    from vllm_ddtree.core.round import DDTreeSeamError
    from vllm_ddtree.patches import gdn_tree_cuda

    layer = object.__new__(qga.QwenGatedDeltaNetAttention)
    layer.__dict__["enable_fused_gdn_spec_decode"] = True
    monkeypatch.setattr(runner, "get_layers_from_vllm_config",
                        lambda cfg, cls, names=None: {"model.layers.0.linear_attn": layer})
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    with pytest.raises(DDTreeSeamError, match=r"cuda-gdn-tree.*not installed"):
        runner.check_tree_capable_gdn_layers(None)
    for patch in gdn_tree_cuda.PATCHES:
        monkeypatch.setattr(patch, "when", lambda: True)
        patch.apply("0.32.0")
    try:
        assert gdn_tree_cuda.applied()
        assert runner.check_tree_capable_gdn_layers(None) == {"model.layers.0.linear_attn"}
        assert layer.enable_fused_gdn_spec_decode is False
    finally:
        for patch in gdn_tree_cuda.PATCHES:
            patch.revert()
    assert not gdn_tree_cuda.applied()


def test_hybrid_prefix_caching_is_off_by_default_and_refused_when_asked(tiny_hybrid):
    target, drafter = tiny_hybrid
    cfg = _args(target, drafter, dtype="bfloat16").create_engine_config()
    assert cfg.cache_config.enable_prefix_caching is False
    assert cfg.cache_config.mamba_cache_mode != "align"
    with pytest.raises(DDTreeConfigError, match=r"^enable_prefix_caching:.*align"):
        _args(target, drafter, dtype="bfloat16",
              enable_prefix_caching=True).create_engine_config()


def test_target_kv_cache_groups():
    """Each KV-cache group with target layers, and the target layers in it
    (compaction moves each group's layers by that group's slots)."""
    from vllm_ddtree.core.round import DDTreeSeamError
    from vllm_ddtree.runner import target_kv_cache_groups

    def cfg(*groups):
        return SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=g) for g in groups])

    target = frozenset({"l0", "l1", "l2"})
    assert target_kv_cache_groups(cfg(["d0"], ["l0", "l1", "l2"]), target) == {
        1: frozenset({"l0", "l1", "l2"})}
    assert target_kv_cache_groups(cfg(["l0", "l2"], ["l1"], ["d0"]), target) == {
        0: frozenset({"l0", "l2"}), 1: frozenset({"l1"})}
    with pytest.raises(DDTreeSeamError, match="none of the target's attention layers"):
        target_kv_cache_groups(cfg(["d0"]), target)


def test_gdn_state_memory_warns_when_it_limits_the_batch(monkeypatch):
    """A request holds 1 + budget blocks in each GDN group: a warning says
    how many requests the KV cache holds when that is below max_num_seqs."""
    from vllm_ddtree import runner

    seen = []
    monkeypatch.setattr(runner.logger, "warning", lambda msg, *a: seen.append(msg % a))
    monkeypatch.setattr(runner.logger, "info", lambda *a: None)

    def cfg(num_blocks):
        spec = SimpleNamespace(page_size_bytes=1 << 20)
        return SimpleNamespace(num_blocks=num_blocks, kv_cache_groups=[
            SimpleNamespace(layer_names=["g0", "g1"], kv_cache_spec=spec),
            SimpleNamespace(layer_names=["a0"], kv_cache_spec=spec),
            SimpleNamespace(layer_names=["d0"], kv_cache_spec=spec)])

    gdn = frozenset({"g0", "g1"})
    runner.log_gdn_state_memory(cfg(1560), gdn, 64, 128)  # 65 + 2 blocks a request
    assert len(seen) == 1 and "at most 23 requests" in seen[0] and "max_num_seqs=128" in seen[0]
    runner.log_gdn_state_memory(cfg(1560), gdn, 8, 128)  # 1560 // 11 = 141 >= 128
    assert len(seen) == 1


def test_trial_seconds_from_the_environment(monkeypatch):
    from vllm_ddtree import runner

    monkeypatch.delenv("VLLM_DDTREE_TRIAL_SECONDS", raising=False)
    assert runner._tuner_overrides() == {}
    monkeypatch.setenv("VLLM_DDTREE_TRIAL_SECONDS", "0.05")
    assert runner._tuner_overrides() == {"trial_seconds": 0.05}
    for bad in ("0", "-1", "fast"):
        monkeypatch.setenv("VLLM_DDTREE_TRIAL_SECONDS", bad)
        with pytest.raises(ValueError, match="VLLM_DDTREE_TRIAL_SECONDS must be"):
            runner._tuner_overrides()


# ---------------------------------------------------------------------------
# Runtime guards in a real engine (CPU)
# ---------------------------------------------------------------------------

GUARD_JOB = {"prompts": ["def add(a, b):\n"],
             "sampling": {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True},
             "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}}


@pytest.mark.engine
@pytest.mark.parametrize("breaker,message", [
    # The start-up guard names the layer and its backend.
    ("tests.seam_breakers:stock_cpu_attention",
     r"model\.layers\.0\.self_attn\.attn uses the CPU_ATTN backend \(CPUAttentionBackendImpl\)"),
    # With that guard gone too, the first tree step names the layers.
    ("tests.seam_breakers:stock_cpu_attention_unguarded",
     r"did not run the tree path .*kv_capture: model\.layers\.0\.self_attn\.attn"),
])
def test_stock_attention_on_the_target_is_refused(tiny_pair, tmp_path, breaker, message):
    target, drafter = tiny_pair
    job = dict(GUARD_JOB, model=target, setup=breaker,
               speculative_config={"method": "ddtree", "model": drafter,
                                   "num_speculative_tokens": 8, "ddtree_adaptive": False})
    with pytest.raises(RuntimeError, match=message):
        run_job(job, tmp_path, timeout=300)


def test_multimodal_targets_are_served_text_only():
    """Image and video inputs are refused per request by vLLM's own limits."""
    from vllm.config.multimodal import MultiModalConfig

    from vllm_ddtree.patches.spec_config import check_engine_args

    mm = MultiModalConfig()
    assert mm.get_limit_per_prompt("image") > 0
    model_config = SimpleNamespace(
        is_attention_free=False, is_hybrid=False, uses_alibi=False, multimodal_config=mm,
        model="tiny-vl", get_sliding_window=lambda: None,
        hf_text_config=SimpleNamespace(layer_types=None))
    parallel = SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1,
                               decode_context_parallel_size=1,
                               prefill_context_parallel_size=1)
    args = SimpleNamespace(kv_cache_dtype="auto", async_scheduling=False)
    check_engine_args(args, model_config, parallel, 16)
    assert mm.language_model_only
    assert mm.get_limit_per_prompt("image") == 0 and mm.get_limit_per_prompt("video") == 0
