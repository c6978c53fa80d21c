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

Fix: the finalizer must not run a tensor op at all. Turning dispatch modes
off is not enough: the collection can land inside a fake mode's own
dispatch, where the mode is off the stack but torch's Python dispatcher
still routes ``.item()`` to its Python reference (``torch._refs.item``), which
recurses as above. So the replacement takes the tensor off the handler (a
handle is released at most once), reads the address straight from the
tensor's memory (``data_ptr``, a plain pointer read, no dispatch) and queues
the release; :func:`release_pending` runs the queued release ops at a point
where no tracing can be active: the model runner calls it after loading the
model, after the KV cache and compilation warm-up, and at the start of every
step (a no-op when nothing is queued).

Upstream status: present in vLLM 0.32.0 (``vllm/_custom_ops.py``). Drop this
patch when vLLM's handler keeps the address as a Python int, or releases it
without dispatching.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from typing import Any

from vllm_ddtree.patches.base import CPU_ONLY, Patch, on_cpu

_TARGET = "vllm._custom_ops:CPUDNNLGEMMHandler.__del__"

# (release op, handle address) of finalized handlers, released at a safe point
PENDING_HANDLES: list[tuple[Any, int]] = []


def release_handle(handler) -> bool:
    """Queue ``handler``'s native handle for release, once, without running
    any tensor op. Returns whether there was one to release."""
    handle = handler.__dict__.get("handler_tensor")
    if handle is None:
        return False
    handler.handler_tensor = None
    # the 0-dim int64 CPU tensor's value, read from its memory: no dispatch
    address = ctypes.c_int64.from_address(handle.data_ptr()).value
    PENDING_HANDLES.append((handler.dtor, address))
    return True


def release_pending() -> int:
    """Release every queued handle (call where no tracing is active).
    Returns how many were released."""
    done = 0
    while PENDING_HANDLES:
        dtor, address = PENDING_HANDLES.pop()
        dtor(address)
        done += 1
    return done


def _build(original):
    @functools.wraps(original)
    def __del__(self, _finalizing=sys.is_finalizing):
        if _finalizing():  # interpreter exit: module globals may be gone, the OS frees all
            return
        release_handle(self)

    return __del__


PATCH = Patch(
    name="cpu_gemm_handler_del",
    target=_TARGET,
    why="CPUDNNLGEMMHandler.__del__ calls handler_tensor.item(); when the garbage collector "
        "runs it under torch.compile's FakeTensorMode the call is refused, the oneDNN handle "
        "leaks, and the error path can recurse until a fatal stack overflow; read the address "
        "without a tensor op and release the handle at a safe point",
    upstream="not fixed in vLLM 0.32.0 (__del__ dispatches .item())",
    vllm_versions=CPU_ONLY,
    build=_build,
    when=on_cpu,
)
