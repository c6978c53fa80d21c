"""The ``cpu-gdn-plain-decode`` and ``cpu-gdn-prefill-subset`` patches
(``patches/gdn_plain_decode.py``).

DDTree's plain steps send every row of a hybrid target down vLLM CPU's
``_spec_aware_nonspec`` (a speculative engine's wide conv buffer, no
speculative row). The patch runs their decode rows there on vLLM's C++ conv
update and their prefill rows on its C++ conv where vLLM packed the conv
weight for it. These checks run it and the
stock function (the torch update on the ``[:, :, :W - 1]`` view) on the same
fake layer and caches: the same outputs and recurrent states, the same first
``W - 1`` conv columns, the rest of the wide buffer untouched, and the stock
function for anything else. They need a CPU with vLLM's C++ conv kernels
(AVX-512 BF16 or Arm bf16); elsewhere the patch never takes its path.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

gdn_attention = pytest.importorskip("vllm.model_executor.layers.mamba.ops.cpu.gdn_attention")
import vllm._custom_ops as ops  # noqa: E402
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (  # noqa: E402
    QwenGatedDeltaNetAttention,
)

from vllm_ddtree.patches import gdn_plain_decode  # noqa: E402

H, HV, K, V, W, S = 1, 3, 128, 128, 4, 8
DIM = 2 * H * K + HV * V
STATE_LEN = W - 1 + S

_CPP_CONV = (hasattr(ops, "causal_conv1d_weight_pack")
             and (torch.cpu._is_avx512_bf16_supported() or gdn_attention.is_arm_bf16()))
pytestmark = pytest.mark.skipif(not _CPP_CONV, reason="no vLLM C++ conv kernels on this CPU")


@pytest.fixture(autouse=True)
def _no_amx(monkeypatch):
    # the stock function's own choice: the torch update (as on a CPU without AMX)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(gdn_attention, "is_arm_bf16", lambda: False)


class Layer(SimpleNamespace):
    rearrange_mixed_qkv = QwenGatedDeltaNetAttention.rearrange_mixed_qkv


def make_layer(seed=0):
    g = torch.Generator().manual_seed(seed)
    unpacked = (torch.randn(DIM, W, generator=g) * 0.5).bfloat16()
    conv = SimpleNamespace(weight=ops.causal_conv1d_weight_pack(unpacked),
                           bias=(torch.randn(DIM, generator=g) * 0.1).bfloat16(),
                           _cpu_unpacked_conv_weight=unpacked)
    return Layer(prefix="model.layers.0.linear_attn", conv1d=conv, activation="silu",
                 A_log=(torch.randn(HV, generator=g) * 0.5).float(),
                 dt_bias=torch.randn(HV, generator=g).bfloat16(),
                 key_dim=H * K, value_dim=HV * V, tp_size=1, head_k_dim=K, head_v_dim=V)


def caches(num_slots, seed=1):
    g = torch.Generator().manual_seed(seed)
    conv = torch.randn(num_slots, STATE_LEN, DIM, generator=g).bfloat16()  # SD storage
    ssm = torch.randn(num_slots, HV, K, V, generator=g) * 0.1
    return conv, ssm


def decode_metadata(block_table: torch.Tensor, num_prefills=0, dense=False):
    n = block_table.shape[0]
    rows = block_table[:, 0]
    return SimpleNamespace(
        num_prefills=num_prefills, num_decodes=n - num_prefills, num_decode_tokens=n - num_prefills,
        num_prefill_tokens=0, spec_sequence_masks=None, num_accepted_tokens=None,
        has_initial_state=None,
        # as vLLM's builder hands it over: column 0 of the state block table, a
        # strided view (the stock function refuses one row of it: the runner
        # hands it a dense copy, vllm_ddtree/runner.py)
        non_spec_state_indices_tensor=(rows.clone(memory_format=torch.contiguous_format)
                                       if dense else rows),
        non_spec_query_start_loc=torch.arange(n + 1, dtype=torch.int32))


def inputs(n, seed=2):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, DIM, generator=g).bfloat16(),
            torch.randn(n, HV, generator=g).bfloat16(),
            torch.randn(n, HV, generator=g).bfloat16())


def stock_function():
    fn = gdn_attention._spec_aware_nonspec
    return fn.__wrapped__ if getattr(fn, "ddtree_plain_decode", False) else fn


def run(fn, layer, md, x, b, a, conv, ssm):
    out = torch.zeros(x.shape[0], HV, V, dtype=torch.bfloat16)
    fn(layer, md, x, b, a, out, conv.transpose(1, 2), ssm, W)
    return out


class ConvCalls:
    """Records the calls of one of vLLM's C++ conv ops: the width of each
    call's input (its last dimension)."""

    def __init__(self, monkeypatch, op="causal_conv1d_update_cpu"):
        self.widths = []
        real = getattr(ops, op)

        def counted(*args, **kwargs):
            self.widths.append(kwargs["x"].shape[-1])
            return real(*args, **kwargs)

        monkeypatch.setattr(ops, op, counted)

    @property
    def count(self):
        return len(self.widths)


@pytest.mark.parametrize("n", [1, 5])
def test_plain_decode_equals_the_stock_function(monkeypatch, n):
    """Outputs, recurrent states and the first W - 1 conv columns as the
    stock function leaves them; the other columns of the wide buffer
    untouched; the C++ update ran (a single row included: its state index
    is a strided one-element view)."""
    layer = make_layer()
    slots = torch.randperm(4 * n * (S + 1))[: n * (S + 1)] + 1
    block_table = slots.view(n, S + 1).to(torch.int32)
    conv0, ssm0 = caches(int(slots.max()) + 1)
    x, b, a = inputs(n)
    stock = stock_function()
    patched = gdn_plain_decode._build(stock)
    calls = ConvCalls(monkeypatch)

    conv_s, ssm_s = conv0.clone(), ssm0.clone()
    ref = run(stock, layer, decode_metadata(block_table, dense=True), x, b, a, conv_s, ssm_s)
    assert calls.count == 0
    conv_p, ssm_p = conv0.clone(), ssm0.clone()
    out = run(patched, layer, decode_metadata(block_table), x, b, a, conv_p, ssm_p)
    assert calls.count == 1

    rows = block_table[:, 0].long()
    # (the two conv updates round their bf16 outputs differently, by an ulp at
    # most: a state from the wrong slot or column is off by ~0.1 everywhere)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(ssm_p, ssm_s, atol=1e-2, rtol=1e-2)
    assert torch.equal(conv_p[rows, : W - 1], conv_s[rows, : W - 1])
    # the C++ update rolled the window: the input is its newest column
    assert torch.equal(conv_p[rows, W - 2], x)
    assert torch.equal(conv_p[rows, W - 1:], conv0[rows, W - 1:])
    others = torch.ones(conv0.shape[0], dtype=torch.bool)
    others[rows] = False
    assert torch.equal(conv_p[others], conv0[others]) and torch.equal(ssm_p[others], ssm0[others])


def test_prefill_rows_equal_the_stock_function(monkeypatch):
    """A batch of two decode rows and three prefills (one continuing a
    chunked prefill, two from a zero state): outputs, recurrent states and the
    first W - 1 conv columns as the stock function leaves them, the rest of
    the wide buffer untouched, and the prefills convolved by vLLM's C++
    kernel."""
    layer = make_layer(3)
    lengths = [1, 1, 37, 5, 20]
    n, num_decodes = len(lengths), 2
    slots = torch.randperm(4 * n * (S + 1))[: n * (S + 1)] + 1
    block_table = slots.view(n, S + 1).to(torch.int32)
    conv0, ssm0 = caches(int(slots.max()) + 1, seed=4)
    total = sum(lengths)
    x, b, a = inputs(total, seed=5)
    qsl = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)

    def metadata():
        md = decode_metadata(block_table, dense=True)
        md.num_decodes, md.num_decode_tokens = num_decodes, num_decodes
        md.num_prefills, md.num_prefill_tokens = n - num_decodes, total - num_decodes
        md.non_spec_query_start_loc = qsl
        md.has_initial_state = torch.tensor([True, True, True, False, False])
        return md

    fwd_calls = ConvCalls(monkeypatch, "causal_conv1d_fwd_cpu").widths
    stock = stock_function()
    conv_s, ssm_s = conv0.clone(), ssm0.clone()
    ref = run(stock, layer, metadata(), x, b, a, conv_s, ssm_s)
    assert fwd_calls == []  # the stock function: the torch conv
    conv_p, ssm_p = conv0.clone(), ssm0.clone()
    out = run(gdn_plain_decode._build(stock), layer, metadata(), x, b, a, conv_p, ssm_p)
    assert fwd_calls == [total - num_decodes]

    rows = block_table[:, 0].long()
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(ssm_p, ssm_s, atol=2e-2, rtol=2e-2)
    assert torch.equal(conv_p[rows, : W - 1], conv_s[rows, : W - 1])
    assert torch.equal(conv_p[rows, W - 1:], conv0[rows, W - 1:])
    # each prefill's window is its last W - 1 inputs
    for i in range(num_decodes, n):
        assert torch.equal(conv_p[rows[i], : W - 1], x[qsl[i + 1] - (W - 1): qsl[i + 1]])
    # a continued prefill started from its state, the others from zeros
    fresh = ssm0.clone()
    fresh[rows[3:]] = 0
    conv_z, ssm_z = conv0.clone(), fresh
    zero_all = metadata()
    zero_all.has_initial_state = torch.zeros(n, dtype=torch.bool)
    out_z = run(gdn_plain_decode._build(stock), layer, zero_all, x, b, a, conv_z, ssm_z)
    assert torch.equal(out_z[qsl[3]:], out[qsl[3]:])
    assert not torch.allclose(out_z[qsl[2]: qsl[3]].float(), out[qsl[2]: qsl[3]].float(),
                              atol=2e-2)
    others = torch.ones(conv0.shape[0], dtype=torch.bool)
    others[rows] = False
    assert torch.equal(conv_p[others], conv0[others]) and torch.equal(ssm_p[others], ssm0[others])


def test_anything_else_runs_the_stock_function(monkeypatch):
    """A layer whose conv weight vLLM did not pack, or an AMX CPU (where the
    stock function takes the C++ kernels itself), goes to the stock
    function."""
    seen = []

    def original(*args):
        seen.append(args[1])

    patched = gdn_plain_decode._build(original)
    block_table = torch.arange(1, 2 * (S + 1) + 1, dtype=torch.int32).view(2, S + 1)
    conv, ssm = caches(2 * (S + 1) + 1)
    x, b, a = inputs(2)
    unpacked = make_layer()
    unpacked.conv1d._cpu_unpacked_conv_weight = None
    md = decode_metadata(block_table)
    run(patched, unpacked, md, x, b, a, conv, ssm)
    assert seen == [md]
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    with_prefill = decode_metadata(block_table, num_prefills=1)
    run(patched, make_layer(), with_prefill, x, b, a, conv, ssm)
    assert seen == [md, with_prefill]


def test_prefill_beside_speculative_rows_equals_the_stock_function(monkeypatch):
    """``cpu-gdn-prefill-subset``: the prefill rows of a verification step
    (two from a zero state, one continuing a chunked prefill) through the C++
    conv give the stock function's outputs, states and first W - 1 conv
    columns, the rest of the buffer untouched."""
    layer = make_layer(6)
    lengths = [23, 4, 41]
    n = len(lengths)
    slots = (torch.randperm(6 * n)[:n] + 1).to(torch.int32)
    conv0, ssm0 = caches(6 * n + 1, seed=7)
    total = sum(lengths)
    x, b, a = inputs(total, seed=8)
    md = SimpleNamespace(prefill_state_indices=slots,
                         prefill_query_start_loc=torch.tensor([0] + lengths).cumsum(0)
                         .to(torch.int32),
                         has_initial_state=torch.tensor([False, True, False]))
    fwd_calls = ConvCalls(monkeypatch, "causal_conv1d_fwd_cpu").widths
    fn = gdn_attention._spec_aware_nonspec_subset
    stock = fn.__wrapped__ if getattr(fn, "ddtree_prefill_subset", False) else fn
    conv_s, ssm_s = conv0.clone(), ssm0.clone()
    ref = stock(layer, md, x, b, a, conv_s.transpose(1, 2), ssm_s, W)
    assert fwd_calls == []
    conv_p, ssm_p = conv0.clone(), ssm0.clone()
    out = gdn_plain_decode._build_subset(stock)(layer, md, x, b, a, conv_p.transpose(1, 2),
                                                ssm_p, W)
    assert fwd_calls == [total]
    rows = slots.long()
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(ssm_p, ssm_s, atol=2e-2, rtol=2e-2)
    assert torch.equal(conv_p[rows, : W - 1], conv_s[rows, : W - 1])
    assert torch.equal(conv_p[rows, W - 1:], conv0[rows, W - 1:])
    others = torch.ones(conv0.shape[0], dtype=torch.bool)
    others[rows] = False
    assert torch.equal(conv_p[others], conv0[others]) and torch.equal(ssm_p[others], ssm0[others])
