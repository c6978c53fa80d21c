"""fp8 KV-cache codes: the kinds DDTree reads, their exact decode, argument checks.

vLLM 0.32's ``--kv-cache-dtype fp8`` / ``fp8_e4m3`` / ``fp8_e5m2`` store one
byte per K or V element (the cache tensor is ``uint8``, ``STR_DTYPE_TO_TORCH_DTYPE``
in ``vllm/utils/torch_utils.py``) and one scale per tensor and layer
(``layer._k_scale_float`` / ``_v_scale_float``): the stored code ``c`` of an
element ``x`` decodes to ``x ~= decode(c) * scale``.

Decode (``kv_quant`` names the kind; no vLLM import here):

* ``"e4m3"`` (``fp8`` and ``fp8_e4m3``): sign, 4 exponent bits with bias 7, 3
  mantissa bits; exponent 0 holds the subnormals ``m * 2**-9``. There is no
  infinity and no NaN: the two codes that ``float8_e4m3fn`` reads as NaN
  (0x7F, 0xFF) decode to +-480, which is what vLLM's CPU attention op reads
  (it widens the code into a half-precision number and multiplies by 2**8).
  vLLM's CPU cache write never stores them (it clamps at 448, code 0x7E).
* ``"e5m2"`` (``fp8_e5m2``): the high byte of an IEEE half (sign, 5 exponent
  bits with bias 15, 2 mantissa bits), infinities and NaNs included.

Both decodes are exact in fp32 (and in fp16 and bf16: every code's value is
representable there), so the tree kernels decode to fp32, attend, and apply
the per-tensor scales outside the dot products as vLLM's CPU op does: the
logits are ``(q . decode(k)) * (softmax_scale * k_scale)`` and the output
``(sum_k p_k decode(v_k)) * v_scale``. Mathematically that is attention over
``decode(k) * k_scale`` and ``decode(v) * v_scale``; the fp32 rounding differs
from multiplying every element first only in the last bits.
"""

from __future__ import annotations

import math
import numbers

import torch

__all__ = ["FP8_KINDS", "KV_CACHE_DTYPE_KINDS", "check_kv_quant", "decode_table",
           "dequantize", "kv_quant_of"]

FP8_KINDS = ("e4m3", "e5m2")
# vLLM's --kv-cache-dtype values with one fp8 code per element and per-tensor scales.
KV_CACHE_DTYPE_KINDS = {"fp8": "e4m3", "fp8_e4m3": "e4m3", "fp8_e5m2": "e5m2"}
UNQUANTIZED_KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "half", "float", "float32")

_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def kv_quant_of(kv_cache_dtype: str) -> str | None:
    """The fp8 kind of a vLLM ``kv_cache_dtype`` value; None for an
    unquantized cache. Other quantized formats raise ``ValueError``."""
    if kv_cache_dtype in UNQUANTIZED_KV_CACHE_DTYPES:
        return None
    kind = KV_CACHE_DTYPE_KINDS.get(kv_cache_dtype)
    if kind is None:
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype!r}: the tree kernels read unquantized caches "
            f"and the per-tensor fp8 formats {sorted(KV_CACHE_DTYPE_KINDS)} only")
    return kind


def _decode_values(kind: str) -> list[float]:
    values = []
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        if kind == "e4m3":
            exp, man = (code >> 3) & 0xF, code & 0x7
            mag = math.ldexp(man, -9) if exp == 0 else math.ldexp(8 + man, exp - 10)
        else:
            exp, man = (code >> 2) & 0x1F, code & 0x3
            if exp == 0x1F:
                mag = math.inf if man == 0 else math.nan
            else:
                mag = math.ldexp(man, -16) if exp == 0 else math.ldexp(4 + man, exp - 17)
        values.append(sign * mag)
    return values


def decode_table(kind: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 ``[256]``: the value of every code of ``kind`` (module docstring)."""
    _check_kind(kind)
    key = (kind, torch.device(device))
    table = _TABLES.get(key)
    if table is None:
        table = _TABLES[key] = torch.tensor(_decode_values(kind), dtype=torch.float32,
                                            device=device)
    return table


def dequantize(codes: torch.Tensor, kind: str) -> torch.Tensor:
    """float32 values of a ``uint8`` tensor of fp8 codes (unscaled)."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"dequantize: codes must be uint8 fp8 codes, got {codes.dtype}")
    return decode_table(kind, codes.device)[codes.long()]


def _check_kind(kind) -> None:
    if kind not in FP8_KINDS:
        raise ValueError(f"kv_quant must be one of {FP8_KINDS} (the cache's fp8 format: "
                         f"'e4m3' for --kv-cache-dtype fp8/fp8_e4m3, 'e5m2' for fp8_e5m2) "
                         f"or None for an unquantized cache; got {kind!r}")


def check_kv_quant(kv_quant: str | None, k_scale, v_scale, cache_dtype: torch.dtype) -> None:
    """Raise unless ``kv_quant``, the scales and the cache dtype agree: a
    ``uint8`` cache needs ``kv_quant`` ("e4m3" or "e5m2") and positive finite
    scales; an unquantized cache takes neither (scales stay 1.0)."""
    if kv_quant is None:
        if cache_dtype == torch.uint8:
            raise ValueError("kv_quant: the KV cache is uint8 (fp8 codes); pass "
                             "kv_quant='e4m3' or 'e5m2' and the layer's k_scale/v_scale")
        if k_scale != 1.0 or v_scale != 1.0:
            raise ValueError(f"k_scale/v_scale ({k_scale}, {v_scale}) apply to a quantized "
                             f"KV cache only; pass kv_quant with them, or leave them at 1.0")
        return
    _check_kind(kv_quant)
    if cache_dtype != torch.uint8:
        raise ValueError(f"kv_quant={kv_quant!r}: the KV cache must hold the fp8 codes as "
                         f"uint8 (vLLM's fp8 cache dtype), got {cache_dtype}")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if isinstance(s, bool) or not isinstance(s, numbers.Real) \
                or not (math.isfinite(s) and s > 0):
            raise ValueError(f"{name}: expected a positive finite float (the layer's "
                             f"_{name}_float), got {s!r}")
