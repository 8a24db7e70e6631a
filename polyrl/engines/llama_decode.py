"""A lean decode path for Llama-family decoders (Llama, Mistral without sliding window, Qwen2).

At the batch sizes of RL groups on a CPU a decode step is bound by per-operation overhead, not by matmuls:
transformers' layer stack builds masks, dispatches through attention interfaces and cache objects, and keeps
q, k, v and gate, up as separate matmuls. This module runs the same computation with fewer, larger operations:

- q, k, v are one matmul and gate, up another, on fused copies of the weights (LoRA deltas merged in);
- in bfloat16 those copies are prepacked once (``bf16_matmul``: for polyrl's own AVX512-BF16 kernel, else in
  oneDNN's blocked layout), which at decode's row counts runs the matmuls well above ``F.linear`` on the plain
  layout;
- rotary embedding is applied to q and k together, once per layer, with cos/sin computed once per step;
- keys and values live in ``decode_kv.KVBuffers``, whole buffers kept close to their length, and decode
  attention is two batched matmuls over them (faster than SDPA at these shapes; see that module);
- grouped-query attention reads each key/value head once: the query heads that share it are that head's
  query rows, so nothing is repeated.

In float32 with the native kernels (a CPU without native bf16, or an engine that samples from the float32
policy) every small operation between the matmuls is a float32 kernel and the native ``linear`` does the
matmuls. With float32 weights it reads the policy's own [out, in] matrices (q, k, v and gate, up as lists, so
nothing is concatenated): no copy. With ``weight_dtype`` bf16 it reads a bf16 copy, widened to float32 in
registers: half the bytes per decode step, which bound the steps with few rows, at the bf16 path's rounding of
the weights (the head's largest logits recomputed in float32, as there). With ``weight_dtype`` int8 it reads
per-row quantised int8 copies (``engines/int8.py``; the head as with bf16): a quarter of the bytes.

It computes what the transformers model computes (same op order, same dtypes: bf16 residual stream, float32
RMS statistics, float32 output head); tests/test_llama_decode.py checks logits against it and tokens against the
reference engine.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from polyrl.engines import native
from polyrl.engines.bf16_matmul import (
    NativeBf16Weights,
    native_bf16_linear_available,
    pack,
    packed_linear,
    packing_available,
)
from polyrl.engines.decode_kv import KVBuffers, PromptSharedKV
from polyrl.engines.int8 import Int8Weights, quantise_int8, tensors_of
from polyrl.engines.rescored_head import rescore_top
from polyrl.models.device import native_bf16

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")


def _config(model: torch.nn.Module):
    return model.get_decoder().config if hasattr(model, "get_decoder") else model.config


def supports(model: torch.nn.Module) -> bool:
    """True when ``model`` (plain or with peft LoRA adapters) is a decoder this path computes exactly."""
    try:
        cfg = _config(model)
        layers = model.get_decoder().layers
    except AttributeError:
        return False
    if getattr(cfg, "model_type", None) not in SUPPORTED_TYPES or getattr(cfg, "hidden_act", None) != "silu":
        return False
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return False  # windowed attention is not implemented here
    if getattr(cfg, "mlp_bias", False) or getattr(cfg, "pretraining_tp", 1) != 1:
        return False
    att = layers[0].self_attn
    if not all(hasattr(att, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")) or hasattr(att, "q_norm"):
        return False  # Qwen3's per-head q/k norms are not implemented here
    # Llama's attention_bias puts a bias on o_proj too; only q/k/v biases (Qwen2) are applied here.
    return effective_weight(att.o_proj)[1] is None


def effective_weight(linear: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) a linear layer applies, with active, unmerged peft LoRA deltas added in float32."""
    base = getattr(linear, "base_layer", None)
    if base is None:
        return linear.weight.detach(), None if linear.bias is None else linear.bias.detach()
    weight = base.weight.detach()
    if not getattr(linear, "merged", False) and not getattr(linear, "disable_adapters", False):
        weight = weight.float()
        for name in linear.active_adapters:
            if name in linear.lora_A:
                weight = weight + linear.get_delta_weight(name).detach().float()
    return weight, None if base.bias is None else base.bias.detach()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm: statistics in float32, the scale applied in the input dtype. (torch's kernel computes in
    float32 for bf16 input and rounds once: bit-identical to normalising ``x.float()`` and casting back.)"""
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


Weights = torch.Tensor | list[torch.Tensor] | Int8Weights | NativeBf16Weights
"""A matmul's weight: one (fused, maybe prepacked) tensor, or for the native float32 ``linear`` the list of
[out, in] matrices whose outputs it concatenates, or int8 rows with their scales."""


@dataclass
class _Layer:
    in_norm: torch.Tensor
    qkv: Weights
    qkv_bias: torch.Tensor | None
    o: Weights
    post_norm: torch.Tensor
    gate_up: Weights
    down: Weights


def native_linear(x: torch.Tensor, weights: Weights, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` of float32 ``x`` [B, in] on float32, bf16 or int8 [out, in] weights (a list: outputs
    concatenated) with the native kernel, which reads each weight once per call."""
    if isinstance(weights, Int8Weights):
        return native.ops().linear(x, [weights.q], bias, weights.scale)
    return native.ops().linear(x, weights if isinstance(weights, list) else [weights], bias)


def computes_bf16() -> bool:
    """True when this CPU runs bf16 matmuls natively as the process sees it (oneDNN's instruction-set cap,
    ``ONEDNN_MAX_CPU_ISA``, included); elsewhere a bf16 copy of the weights is widened to float32 instead."""
    if platform.machine().lower() in ("x86_64", "amd64"):
        return packing_available()
    return native_bf16("cpu")


def float32_weights(policy: torch.nn.Module) -> bool:
    """True when the decoder's matrices of ``policy`` are float32 (the native float32 path reads them as is)."""
    layer = policy.get_decoder().layers[0]
    return all(effective_weight(m)[0].dtype == torch.float32
               for m in (layer.self_attn.q_proj, layer.mlp.down_proj, policy.get_output_embeddings()))


class LlamaDecoder:
    """Fused copies of a Llama-family policy's weights in ``dtype`` and the prefill / decode passes over them.

    ``head_weight`` is the float32 output head (shared with the caller); with tied embeddings it also serves
    input lookups, so no second embedding copy is kept. ``refresh(policy)`` copies updated weights in place.
    In float32 with the native kernels (``shares_weights``) the matrices are the policy's own tensors, read in
    place; ``refresh`` then only merges LoRA deltas again.
    """

    def __init__(
        self,
        policy: torch.nn.Module,
        head_weight: torch.Tensor,
        dtype: torch.dtype = torch.bfloat16,
        exact_top: int = 32,
        native_kernels: bool = True,
        weight_dtype: torch.dtype | None = None,
    ):
        cfg = _config(policy)
        # The C++ kernels (engines/native) replace the small operations of a decode step; their cache
        # (decode_kv.PromptSharedKV) keeps keys transposed, and each prompt once for its group. In bf16 its keys
        # are bf16 (the same values as float32 keys: rotary rounds them to bf16 first).
        self.native = native_kernels and dtype in (torch.bfloat16, torch.float32) and native.available()
        native_f32 = self.native and dtype == torch.float32
        # The matrices' dtype: ``dtype``, or bf16 widened to float32 by the native float32 ``linear``.
        self.weight_dtype = weight_dtype if weight_dtype is not None and native_f32 else dtype
        if weight_dtype == torch.int8 and self.weight_dtype != torch.int8:
            raise ValueError("int8 weights need the float32 decoder on the native kernels (engine.native_kernels "
                             "and a C++ compiler)")
        # Below float32 the head runs in ``weight_dtype`` too and the ``exact_top`` largest logits of each row are
        # recomputed in float32 (0: the whole head in float32; see ``_head``).
        self.exact_top = exact_top if self.weight_dtype != torch.float32 else 0
        self.shares_weights = native_f32 and self.weight_dtype == torch.float32 and float32_weights(policy)
        self.packed = dtype == torch.bfloat16 and packing_available()
        self.native_bf16 = self.packed and self.native and native_bf16_linear_available()
        self.linear = native_linear if native_f32 else packed_linear if self.packed else F.linear
        self.policy_storages = {p.untyped_storage().data_ptr() for p in policy.parameters()}  # for nbytes
        self.dtype = dtype
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.eps = cfg.rms_norm_eps
        self.qk_width = (self.heads + self.kv_heads) * self.head_dim
        self.head_weight = head_weight
        decoder = policy.get_decoder()
        self.rotary = decoder.rotary_emb
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin [1, n, d] (_rope_at)
        self.tied = policy.get_input_embeddings().weight is policy.get_output_embeddings().weight
        self.embed = None if self.tied else self._copy(policy.get_input_embeddings().weight)
        self.layers = [self._fuse(layer) for layer in decoder.layers]
        self._stack: tuple | None = None  # the layers as the native decode_stack takes them (_stack_weights)
        self.final_norm = decoder.norm.weight.detach().to(dtype).clone()
        self.head_low = self._matmul_weight(head_weight) if self.exact_top else None

    def _copy(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` in ``weight_dtype`` (float32 for int8: lookups read few rows): the policy's own tensor when
        weights are shared, else our own copy."""
        dtype = torch.float32 if self.weight_dtype == torch.int8 else self.weight_dtype
        return weight.detach() if self.shares_weights else weight.detach().to(dtype).clone()

    def _matmul_weight(self, weight: torch.Tensor) -> torch.Tensor | Int8Weights:
        """Our own copy of ``weight`` in ``weight_dtype`` (int8: quantised per row), prepacked when packing is on."""
        if self.weight_dtype == torch.int8:
            return quantise_int8(weight)
        weight = weight.to(self.weight_dtype, copy=True)
        return pack(weight, self.native_bf16) if self.packed else weight

    def _matmul_weights(self, *weights: torch.Tensor) -> Weights:
        """The matrices of one matmul whose outputs are concatenated: as they are (shared weights), or fused."""
        if self.shares_weights:
            return list(weights)
        return self._matmul_weight(torch.cat(weights) if len(weights) > 1 else weights[0])

    def _fuse(self, layer: torch.nn.Module) -> _Layer:
        att, mlp = layer.self_attn, layer.mlp
        (q, qb), (k, kb), (v, vb) = (effective_weight(m) for m in (att.q_proj, att.k_proj, att.v_proj))
        bias = None if qb is None else torch.cat([qb, kb, vb]).to(self.dtype)
        return _Layer(
            in_norm=layer.input_layernorm.weight.detach().to(self.dtype).clone(),
            qkv=self._matmul_weights(q, k, v),
            qkv_bias=bias,
            o=self._matmul_weights(effective_weight(att.o_proj)[0]),
            post_norm=layer.post_attention_layernorm.weight.detach().to(self.dtype).clone(),
            gate_up=self._matmul_weights(effective_weight(mlp.gate_proj)[0], effective_weight(mlp.up_proj)[0]),
            down=self._matmul_weights(effective_weight(mlp.down_proj)[0]),
        )

    @torch.no_grad()
    def refresh(self, policy: torch.nn.Module) -> None:
        """Take ``policy``'s current weights (LoRA merged), one layer at a time so memory peaks at one layer."""
        decoder = policy.get_decoder()
        self.policy_storages = {p.untyped_storage().data_ptr() for p in policy.parameters()}
        self._stack = None
        for i, layer in enumerate(decoder.layers):
            self.layers[i] = self._fuse(layer)
        self.final_norm.copy_(decoder.norm.weight)
        if self.exact_top:
            self.head_low = self._matmul_weight(self.head_weight)
        if self.embed is not None and not self.shares_weights:
            self.embed.copy_(policy.get_input_embeddings().weight)

    def release(self) -> None:
        """Drop the weight copies ``refresh`` rebuilds (the fused layers and the low-precision head) until it
        runs again; decoding in between is an error."""
        self.layers = [None] * len(self.layers)
        self.head_low = self._stack = None

    def nbytes(self) -> int:
        """Bytes of the weights this decoder holds beyond the caller's float32 head (shared weights, the
        policy's own tensors, are not counted)."""
        held = [t for layer in self.layers if layer is not None for t in vars(layer).values()]
        tensors = [w for t in (*held, self.final_norm, self.head_low, self.embed) for w in tensors_of(t)]
        if self.shares_weights:
            tensors = [t for t in tensors if t.untyped_storage().data_ptr() not in self.policy_storages]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        table = self.head_weight if self.tied else self.embed
        return F.embedding(ids, table).to(self.dtype)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """Float32 logits [B, V] of the final hidden states [B, H].

        A float32 head over a 49k vocabulary costs as much as the whole bf16 body at small batch, but bf16
        logits are rounded to 1/128 of their magnitude, too coarse for the tokens that carry the probability.
        So all logits are computed in ``dtype`` and the ``exact_top`` largest of each row are recomputed in
        float32: the sampled distribution and its recorded log-probs are exact where the mass is and off
        by the rounding only in the tail."""
        return self._logits(rms_norm(x, self.final_norm, self.eps))

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``_head`` after the final norm."""
        if self.head_low is None:
            if self.linear is native_linear:
                return native_linear(hidden, self.head_weight)
            return F.linear(hidden.float(), self.head_weight)
        low = self.linear(hidden, self.head_low)
        if self.dtype == torch.float32:  # bf16 or int8 weights widened: float32 logits to rescore
            return rescore_top(low, hidden, self.head_weight, self.exact_top)
        rescore = native.ops().rescore_head if self.native else rescore_top  # the same; native in two passes a row
        return rescore(low, hidden, self.head_weight, self.exact_top)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary(x, positions)  # the model's own rotary module: same frequencies and scaling

    def _rope_at(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, d] of one position per row: rows of a table of the rotary module's output over
        positions 0..n, built once (the module's handful of operations cost as much as a small kernel each step).
        With the default RoPE a position's angles depend on it alone; other RoPE types (dynamic scaling) call
        the module."""
        if getattr(self.rotary, "rope_type", "default") != "default":
            return self._rope(x, positions[:, None])
        need = int(positions.max()) + 1
        table = self._rope_table
        if table is None or table[0].shape[1] < need or table[0].dtype != x.dtype:
            n = max(need, 2 * table[0].shape[1] if table is not None else 512)
            table = self._rope_table = self._rope(x, torch.arange(n, device=x.device)[None])
        return table[0][0, positions][:, None], table[1][0, positions][:, None]

    def _mlp(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        """x + MLP(norm(x)) for 2-D x."""
        gate, up = self.linear(rms_norm(x, layer.post_norm, self.eps), layer.gate_up).chunk(2, dim=-1)
        return x + self.linear(F.silu(gate) * up, layer.down)

    @torch.no_grad()
    def prefill(
        self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, KVBuffers | PromptSharedKV]:
        """Run left-padded prompts ``[B, T]``; return float32 logits of the last position and the filled cache."""
        if self.layers and self.layers[0] is None:
            raise RuntimeError("the decoder's weights were released for an update: refresh() (engine.sync()) first")
        b, t = input_ids.shape
        x = self._embed(input_ids)
        cos, sin = self._rope(x, positions)
        cos, sin = cos[:, :, None], sin[:, :, None]
        causal = torch.ones((t, t), dtype=torch.bool).tril()
        # Padding queries attend to themselves only, so no softmax row is empty (an empty one would give NaN).
        allowed = (causal & mask.bool()[:, None, :]) | torch.eye(t, dtype=torch.bool)
        allowed = allowed[:, None]
        if self.native:  # each prompt stored once, shared by its group's rows
            kv = PromptSharedKV(len(self.layers), mask, self.kv_heads, self.head_dim, self.dtype)
        else:
            kv = KVBuffers(len(self.layers), b, self.kv_heads, t, self.head_dim, self.dtype)
        nh, d = self.heads, self.head_dim
        x = x.view(b * t, -1)  # matmuls see rows; attention sees [B, heads, T, d]
        for i, layer in enumerate(self.layers):
            qkv = self.linear(rms_norm(x, layer.in_norm, self.eps), layer.qkv, layer.qkv_bias).view(b, t, -1)
            qk = qkv[..., : self.qk_width].view(b, t, nh + self.kv_heads, d)
            qk = qk * cos + rotate_half(qk) * sin
            q, k = qk[:, :, :nh].transpose(1, 2), qk[:, :, nh:].transpose(1, 2)
            v = qkv[..., self.qk_width :].view(b, t, self.kv_heads, d).transpose(1, 2)
            kv.store_prompt(i, k, v)
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
            x = x + self.linear(att.transpose(1, 2).reshape(b * t, nh * d), layer.o)
            x = self._mlp(layer, x)
        if not self.native:
            kv.length = t
        return self._head(x.view(b, t, -1)[:, -1]), kv

    @torch.no_grad()
    def decode(
        self, tokens: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, kv: KVBuffers | PromptSharedKV
    ) -> torch.Tensor:
        """One token per row (``tokens`` [B], ``positions`` [B]; ``mask`` [B, >= length + 1] marks real keys:
        the prompts' padding, every generated position real); appends to ``kv`` and returns float32 logits
        [B, V]."""
        if self.native:
            return self._decode_native(tokens, positions, kv)
        b, t = tokens.shape[0], kv.length
        kv.reserve(t + 1)
        x = self._embed(tokens)
        cos, sin = self._rope_at(x, positions)  # [B, 1, d]: broadcast over the heads
        bias = kv.attention_bias(mask)
        nh, kvh, d = self.heads, self.kv_heads, self.head_dim
        scale = d**-0.5
        for i, layer in enumerate(self.layers):
            qkv = self.linear(rms_norm(x, layer.in_norm, self.eps), layer.qkv, layer.qkv_bias)
            qk = qkv[:, : self.qk_width].view(b, nh + kvh, d)
            qk = qk * cos + rotate_half(qk) * sin
            kv.write(i, qk[:, nh:], qkv[:, self.qk_width :].view(b, kvh, d))
            att = kv.attend(i, qk[:, :nh].view(b, kvh, nh // kvh, d), bias, scale)
            x = x + self.linear(att.reshape(b, nh * d), layer.o)
            x = self._mlp(layer, x)
        kv.length = t + 1
        return self._head(x)

    def _stack_weights(self) -> tuple:
        """The layers' norms and packed matmuls as the native ``decode_stack`` takes them, built once per
        ``refresh``."""
        if self._stack is None:
            ls = self.layers
            self._stack = (
                [a.in_norm for a in ls], [a.post_norm for a in ls], self.final_norm, [a.qkv.blocks for a in ls],
                [a.qkv_bias for a in ls] if ls[0].qkv_bias is not None else [], [a.o.blocks for a in ls],
                [a.gate_up.blocks for a in ls], [a.down.blocks for a in ls],
                [ls[0].qkv.outs, ls[0].o.outs, ls[0].gate_up.outs, ls[0].down.outs],
            )
        return self._stack

    def _decode_native(self, tokens: torch.Tensor, positions: torch.Tensor, kv: PromptSharedKV) -> torch.Tensor:
        """``decode`` with the C++ kernels: per layer four matmuls and four fused kernels (residual add with
        RMSNorm, rotary with the key/value write, attention over the shared prompt and the row's own
        positions, SiLU-and-multiply), the same roundings. The prompts' padding is in ``kv.prefix_bias``."""
        own, ops = kv.own, native.ops()
        t = own.length
        own.reserve(t + 1)
        x = self._embed(tokens).contiguous()  # the residual stream, updated in place by add_rms_norm
        cos, sin = self._rope_at(x, positions)
        nh, kvh, eps, scale = self.heads, self.kv_heads, self.eps, self.head_dim**-0.5
        if self.native_bf16:  # the same kernels in the same order, the layer loop in C++ (decode_stack.cpp)
            h = ops.decode_stack(x, *self._stack_weights(), cos, sin, own.keys, own.values, kv.prefix_keys,
                                 kv.prefix_values, kv.prefix_bias, kv.row_prompt, t, eps, scale, nh, kvh)
        else:
            h = ops.add_rms_norm(x, None, self.layers[0].in_norm, eps)
            for i, layer in enumerate(self.layers):
                qkv = self.linear(h, layer.qkv, layer.qkv_bias)
                ops.rope_write(qkv, cos, sin, own.keys[i], own.values[i], t, nh, kvh)
                att = ops.attention(qkv, kv.prefix_keys[i], kv.prefix_values[i], kv.prefix_bias, kv.row_prompt,
                                    own.keys[i], own.values[i], None, t + 1, scale, nh, kvh)
                h = ops.add_rms_norm(x, self.linear(att, layer.o), layer.post_norm, eps)
                up = ops.silu_mul(self.linear(h, layer.gate_up))
                after = self.layers[i + 1].in_norm if i + 1 < len(self.layers) else self.final_norm
                h = ops.add_rms_norm(x, self.linear(up, layer.down), after, eps)
        own.length = t + 1
        return self._logits(h)
