"""Release vLLM CPU's oneDNN GEMM handles without tensor dispatch.

Target: ``vllm._custom_ops:CPUDNNLGEMMHandler.__del__``.

Why: on CPU, every unquantized linear layer (and ``create_onednn_scaled_mm``
for int8) owns a ``CPUDNNLGEMMHandler``: a native oneDNN matmul handle (the
primitive cache and the packed weights) whose address is kept in a 0-dim int64
tensor, ``handler_tensor``. Its ``__del__`` reads the address with
``handler_tensor.item()`` and passes it to ``release_dnnl_matmul_handler``.

``.item()`` is a dispatched tensor op (``aten._local_scalar_dense``), so what
it does depends on the dispatch modes active in the thread at that moment. A
finalizer does not choose that moment: handles owned by modules in reference
cycles are freed by the cyclic garbage collector whenever an allocation
triggers it. A DFlash drafter's own ``embed_tokens`` and ``lm_head`` are such
garbage: each got a handle at load, then vLLM replaced both by the target's
shared layers. torch.compile allocates heavily while it traces the model under
a ``FakeTensorMode``, so the collection often lands there (in a cold-cache
compiled start of the bundled DFlash pair both handles were finalized under
``FakeTensorMode``; in a warm one, outside it). The fake mode receives
``.item()`` on a real tensor and refuses it (``Please convert all Tensors to
FakeTensors first ...``), the exception escapes ``__del__`` (printed as
``Exception ignored in ... CPUDNNLGEMMHandler.__del__``, once per handle) and
the handle is never released: its oneDNN primitives and packed weights leak.
Building that error message formats the same real tensor through ``__repr__``,
which calls ``.item()`` again; the fatal form seen intermittently with an
80M-parameter target (``Fatal Python error: _Py_CheckRecursiveCall: Cannot
recover from stack overflow``, a stack of ``__repr__`` -> ``item``) is that
path re-entering dispatch. Both start at the one dispatched ``.item()`` in the
finalizer.

Fix: the finalizer must not depend on ambient dispatch state. The replacement
takes the tensor off the handler first (so a handle is released at most once),
then reads the address and calls the release op with Python dispatch modes and
``__torch_function__`` handling disabled for those two calls, so they run the
plain CPU kernels whatever mode is active. Outside any mode this is exactly
vLLM's release; under a fake or tracing mode the handle is now released
instead of leaked.

Upstream status: present in vLLM 0.32.0 (``vllm/_custom_ops.py``). Drop this
patch when vLLM's handler keeps the address as a Python int, or releases it
without dispatching.
"""

from __future__ import annotations

import functools

import torch

from vllm_ddtree.patches.base import CPU_ONLY, Patch, on_cpu

_TARGET = "vllm._custom_ops:CPUDNNLGEMMHandler.__del__"


def release_handle(handler) -> bool:
    """Release ``handler``'s native handle once, without tensor dispatch.
    Returns whether there was one to release."""
    handle = handler.__dict__.get("handler_tensor")
    if handle is None:
        return False
    handler.handler_tensor = None
    with torch._C._DisableTorchDispatch(), torch._C.DisableTorchFunction():
        handler.dtor(handle.item())
    return True


def _build(original):
    @functools.wraps(original)
    def __del__(self):
        release_handle(self)

    return __del__


PATCH = Patch(
    name="cpu_gemm_handler_del",
    target=_TARGET,
    why="CPUDNNLGEMMHandler.__del__ calls handler_tensor.item(); when the garbage collector "
        "runs it under torch.compile's FakeTensorMode the call is refused, the oneDNN handle "
        "leaks, and the error path can recurse until a fatal stack overflow; release without "
        "tensor dispatch",
    upstream="not fixed in vLLM 0.32.0 (__del__ dispatches .item())",
    vllm_versions=CPU_ONLY,
    build=_build,
    when=on_cpu,
)
