"""vLLM CPU's oneDNN GEMM handles are released, once, also when the garbage
collector finalizes them under torch.compile's FakeTensorMode
(patches/cpu_gemm_handler_del.py): the finalizer runs no tensor op, and
queues the release for the model runner's next safe point
(``release_pending``)."""

from __future__ import annotations

import gc
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from vllm_ddtree.patches import cpu_gemm_handler_del as patch_mod

pytestmark = pytest.mark.skipif(not patch_mod.on_cpu(), reason="a patch of vLLM's CPU build")


@pytest.fixture(scope="module", autouse=True)
def registered():
    from vllm import _custom_ops as ops

    from vllm_ddtree import plugin

    if not ops._supports_onednn:
        pytest.skip("this vLLM CPU build has no oneDNN GEMM handles")
    plugin.register()
    assert patch_mod.PATCH.applied


@pytest.fixture
def unraisable(monkeypatch):
    """Exceptions escaping finalizers (what Python prints as 'Exception ignored in')."""
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u))
    return seen


def _handler():
    """A real handle, made the way vLLM makes one for a linear layer's weight,
    with its release op recorded (and still called)."""
    from vllm import _custom_ops as ops

    weight = torch.randn(64, 32)  # [out, in], as nn.Linear stores it
    h = ops.create_onednn_mm(weight.t(), 32)
    address = int(h.handler_tensor.item())
    released = []
    real = h.dtor

    def dtor(ptr):
        released.append(ptr)
        real(ptr)

    h.dtor = dtor
    return h, address, released


def test_the_handle_is_released_when_collected_normally(unraisable, capfd):
    patch_mod.release_pending()  # handles other tests dropped
    h, address, released = _handler()
    del h
    assert released == [] and patch_mod.release_pending() == 1
    assert released == [address]
    h, address, released = _handler()
    h.me = h  # a reference cycle: only the cyclic collector frees it
    del h
    gc.collect()
    patch_mod.release_pending()
    assert released == [address]
    assert not unraisable and "Exception ignored" not in capfd.readouterr().err


def test_the_handle_is_released_when_collected_under_fake_mode(unraisable, capfd):
    h, address, released = _handler()
    with FakeTensorMode():
        del h
        assert released == []  # no op runs inside the mode
    patch_mod.release_pending()
    assert released == [address]
    assert not unraisable


def test_no_tensor_op_runs_in_the_finalizer(monkeypatch):
    """The engine's fatal case: the collection lands inside a fake mode's own
    dispatch, where torch's Python dispatcher sends ``.item()`` to
    ``torch._refs.item`` (which recursed through ``__repr__`` until the stack
    overflowed). The finalizer must not call it, nor any op."""
    import torch._refs

    def no_item(*args, **kwargs):
        raise AssertionError("the finalizer dispatched .item()")

    h, address, released = _handler()
    monkeypatch.setattr(torch.Tensor, "item", no_item)
    monkeypatch.setattr(torch._refs, "item", no_item)
    del h
    monkeypatch.undo()
    assert patch_mod.release_pending() == 1 and released == [address]


def test_the_collector_running_during_fake_tracing_releases_it(monkeypatch, capfd):
    """The engine's case: a handle in a reference cycle, the cyclic collector
    triggered while a FakeTensorMode traces; nothing is printed."""
    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)  # prints, as in vLLM
    h, address, released = _handler()
    h.me = h
    del h
    with FakeTensorMode():
        x = torch.empty(8, 8)
        gc.collect()
        (x @ x).sum()
    patch_mod.release_pending()
    err = capfd.readouterr().err
    assert "Exception ignored" not in err and "FakeTensor" not in err, err[:200] + err[-400:]
    assert released == [address]


def test_a_handle_is_released_at_most_once(unraisable):
    h, address, released = _handler()
    type(h).__del__(h)
    patch_mod.release_pending()
    assert released == [address] and h.handler_tensor is None
    del h
    gc.collect()
    patch_mod.release_pending()
    assert released == [address]
    assert not unraisable


def test_stock_del_leaks_the_handle_under_fake_mode():
    """Why the patch exists: vLLM's own finalizer dispatches ``.item()``, which
    the fake mode refuses, so the release op never runs. If this fails, vLLM's
    finalizer no longer dispatches and the patch can be dropped."""
    from vllm import _custom_ops as ops

    stock = patch_mod.PATCH._original or ops.CPUDNNLGEMMHandler.__del__
    h, address, released = _handler()
    with FakeTensorMode():
        with pytest.raises(Exception, match="Please convert all Tensors to FakeTensors"):
            stock(h)
    assert released == []
    del h  # the patched finalizer queues it
    patch_mod.release_pending()
    assert released == [address]
