"""polyrl's own bf16 decode matmul (engines/native/bf16_linear.cpp) against ``F.linear``, and the decoder's choice
of packing. The kernel sums in float32 as oneDNN does, two inputs at a time, so it agrees with ``F.linear`` to
the last bit except where oneDNN splits the sum differently (one bf16 step, on a small fraction of entries)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from test_native_kernels import assert_bf16_close, randn

from polyrl.engines import bf16_matmul, native

if os.environ.get("POLYRL_NATIVE") == "0":
    pytest.skip("native kernels switched off (POLYRL_NATIVE=0)", allow_module_level=True)


@pytest.fixture(scope="module")
def ops():
    assert native.available(), "the native kernels did not build (see the warning logged above)"
    if not native.ops().bf16_linear_available():
        pytest.skip("the native kernels were built for a CPU without AVX512-BF16: the kernel cannot run here")
    return native.ops()


@pytest.mark.parametrize(
    "rows,outs,ins",
    # SmolLM2's decode shapes at 16 rows; rows in every tile size (16, 8, 4, 2, 1) and their mixes; outputs
    # that end inside a block; odd input widths (a zero-padded last pair)
    [(16, 960, 576), (16, 576, 1536), (64, 48, 64), (31, 40, 33), (7, 17, 5), (1, 16, 2), (300, 49, 130)],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_linear_matches_f_linear(ops, rows, outs, ins, with_bias):
    weight, bias = randn(outs, ins, seed=1), randn(outs, seed=2) if with_bias else None
    x = randn(rows, ins, seed=3)
    packed = bf16_matmul.pack(weight, native_kernel=True)
    assert isinstance(packed, bf16_matmul.NativeBf16Weights)
    got = bf16_matmul.packed_linear(x, packed, bias)
    assert_bf16_close(got, F.linear(x, weight, bias))
    # Against float32 sums of the same products: within one bf16 rounding of the exact value.
    exact = x.float() @ weight.float().T + (bias.float() if with_bias else 0)
    assert ((got.float() - exact).abs() <= exact.abs() * 2**-8 + exact.abs().max() * 2**-16).all()


def test_bf16_linear_reads_strided_rows_and_ignores_the_thread_count(ops):
    weight, x_wide = randn(96, 576, seed=4), randn(16, 600, seed=5)
    x = x_wide[:, :576]  # rows 600 apart: the kernel reads them in place
    packed = bf16_matmul.pack(weight, native_kernel=True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = bf16_matmul.packed_linear(x, packed)
        torch.set_num_threads(2)
        two = bf16_matmul.packed_linear(x, packed)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # every output is one thread's fixed-order sum
    assert torch.equal(one, bf16_matmul.packed_linear(x.contiguous(), packed))


def test_bf16_pack_layout(ops):
    weight = randn(20, 7, seed=6)
    blocks = ops.bf16_pack(weight)
    assert blocks.shape == (2, 4, 16, 2)
    for out in range(20):
        for i in range(7):
            assert blocks[out // 16, i // 2, out % 16, i % 2] == weight[out, i]
    assert (blocks[1, :, 4:] == 0).all() and (blocks[:, 3, :, 1] == 0).all()  # padding


def test_bf16_linear_refuses_mismatched_inputs(ops):
    packed = ops.bf16_pack(randn(32, 64, seed=7))
    with pytest.raises(RuntimeError, match="x has 62 inputs, the packed weight 64"):
        ops.bf16_linear(randn(4, 62), packed, 32, None)
    with pytest.raises(RuntimeError, match="outs does not match"):
        ops.bf16_linear(randn(4, 64), packed, 48, None)


def test_the_decoder_packs_for_the_native_kernel_where_it_runs():
    from test_llama_decode import qwen2_with_bias

    from polyrl.engines.llama_decode import LlamaDecoder

    if not bf16_matmul.packing_available():
        pytest.skip("no bf16 packing on this CPU: the decoder runs F.linear")
    model = qwen2_with_bias()  # q, k, v biases: the kernel's bias path
    head = model.get_output_embeddings().weight.detach().float()
    decoder = LlamaDecoder(model, head, torch.bfloat16)
    native_kernel = bf16_matmul.native_bf16_linear_available()
    assert decoder.native_bf16 == native_kernel
    assert isinstance(decoder.layers[0].qkv, bf16_matmul.NativeBf16Weights) == native_kernel
    onednn = LlamaDecoder(model, head, torch.bfloat16, native_kernels=False)
    assert not onednn.native_bf16 and isinstance(onednn.layers[0].gate_up, torch.Tensor)
    hidden, inner = model.config.hidden_size, model.config.intermediate_size
    for name, width, bias in [("qkv", hidden, "qkv_bias"), ("o", hidden, None), ("gate_up", hidden, None),
                              ("down", inner, None)]:
        x = randn(5, width, seed=8)
        b = getattr(decoder.layers[0], bias) if bias else None
        got = decoder.linear(x, getattr(decoder.layers[0], name), b)
        assert_bf16_close(got, onednn.linear(x, getattr(onednn.layers[0], name), b))


@pytest.mark.parametrize("bias", [False, True])
def test_the_native_layer_stack_equals_the_python_layer_loop(ops, monkeypatch, bias):
    """``decode_stack`` runs the Python loop's kernels in its order: the same logits to the bit, through buffer
    growth and rows that leave (q/k/v biases with ``bias``)."""
    from test_llama_decode import qwen2_with_bias
    from test_native_kernels import small_llama

    from polyrl.engines import decode_kv, llama_decode
    from polyrl.engines.llama_decode import LlamaDecoder

    monkeypatch.setattr(decode_kv, "KV_CHUNK", 4)  # growth during the run
    # On an AMX CPU the decoder takes oneDNN's matmul; the kernel (checked by ``ops``) still runs there.
    monkeypatch.setattr(llama_decode, "native_bf16_linear_available", lambda: True)
    model = qwen2_with_bias() if bias else small_llama(64)
    head = model.get_output_embeddings().weight.detach().float()
    prompts = torch.randint(3, 300, (2, 6), generator=torch.Generator().manual_seed(1))
    cont = torch.randint(3, 300, (4, 10), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(prompts)
    mask[0, :2] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    full_mask = torch.cat([mask.repeat_interleave(2, 0), torch.ones_like(cont)], 1)
    outputs = []
    for stack in (True, False):
        dec = LlamaDecoder(model, head, torch.bfloat16)
        assert dec.native_bf16
        dec.native_bf16 = stack  # off: the Python loop, on the same packed weights and kernels
        _, kv = dec.prefill(prompts, mask, positions)
        kv.batch_repeat_interleave(2)
        rows, steps = torch.arange(4), []
        start = positions[:, -1].repeat_interleave(2) + 1
        for j in range(cont.shape[1]):
            if j == 6:
                rows = torch.tensor([0, 3])
                kv.batch_select_indices(rows)
            steps.append(dec.decode(cont[rows, j], full_mask[rows], start[rows] + j, kv))
        outputs.append(steps)
    for a, b in zip(*outputs, strict=True):
        assert torch.equal(a, b)
