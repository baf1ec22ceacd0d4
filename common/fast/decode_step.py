"""One decode step of a Llama-shaped decoder (Llama, Qwen2) with LoRA in few kernels: what `static_decoder.decode` replays.

A decode step (one new token for each of B sequences) through the model's modules launches about
70 kernels a layer: peft runs each LoRA linear as five, a 4-bit weight adds three to dequantise,
and HF's attention a dozen more. Here each decoder layer runs its linear layers that read one input
(q/k/v, then gate/up) as one matmul over their stacked base weights, one matmul over their stacked
LoRA A and one addmm that adds every LoRA B product with its scaling (a block-diagonal B). The
residual adds ride in the o and down matmuls, q and k are rotated together, and the attention runs over
the cache with an additive mask kept across layers (two grouped matmuls, reproducible on a GPU; SDPA's for
GRPO's sampled rollouts, faster there): about 24 kernels a layer. On an
H200 the step is then bound by what its kernels do (dequantising, the matmuls, attention), not by
launching them (docs/performance.md).

The LoRA adapter is not merged: `DecodeStep` copies its live weights (in the compute dtype, as
training's bf16 autocast runs them) each time a decode starts. Base weights, `weights`:
- "nf4": each 4-bit weight is dequantised into one scratch buffer on every step, as bitsandbytes
  does, but with the absmax of double quantisation decoded once and kept on the model (the base is
  frozen; 4 bytes per 64 weights). On a GPU with Triton a Triton kernel dequantises
  (common/fast/nf4_dequantize.py), else bitsandbytes' own: `nf4_dequantizer` says which. Where
  `nf4_dispatch`'s table (off by default) names an `nf4_matmul` configuration for every weight of a group
  at the step's row count, that split-K kernel reads the packed weights directly instead.
- "bf16": stacked bf16 copies kept on the model (`_dense_base`, 2 bytes a weight), made at the first
  decode: no dequantising per token, for GPUs with room.
A base that is not 4-bit (a full-precision test model) is stacked at each decode.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers.activations import ACT2FN  # internal, as are Llama's head_dim, scaling, rotary_emb: trl_compat

from common.fast import nf4_dequantize, nf4_dispatch
from common.fast.nf4_matmul import nf4_matmul
from common.fast.nf4_matmul import runs_on as nf4_matmul_runs_on

# The decode attention (one query a sequence, GQA, a padding mask) by SDPA with every backend allowed,
# whatever training turned off (cuDNN: `cudnn_attention`): faster than two grouped matmuls or
# cuDNN alone (timed by bench/profile_decode.py; docs/performance.md). On a GPU torch picks cuDNN's kernel, whose
# result differs between calls on the same inputs (bench/decode_determinism.py): `reproducible` steps use
# `grouped_attention` instead.
DECODE_ATTENTION = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                    SDPBackend.MATH]


def grouped_attention(q, keys, values, bias, scale: float):
    """The decode attention as two matmuls: queries (B, nq, hd) against the cache (B, nkv, L, hd), query head
    j reading K/V head j // (nq // nkv), the softmax in fp32, `bias` (B, 1, 1, L) added. No SDPA kernel, so
    a GPU gives the same output every call (cuBLAS's matmuls of fixed shapes are deterministic)."""
    B, nq, hd = q.shape
    nkv = keys.shape[1]
    scores = torch.matmul(q.view(B, nkv, nq // nkv, hd), keys.transpose(-1, -2))  # (B, nkv, nq / nkv, L)
    probs = scores.float().mul_(scale).add_(bias).softmax(-1).to(q.dtype)
    return torch.matmul(probs, values).reshape(B, nq * hd)


def _lora_parts(module) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """(A, B, scaling) of each active, unmerged LoRA adapter of a peft layer; none for a plain linear."""
    if not hasattr(module, "lora_A") or module.disable_adapters or module.merged:
        return []
    parts = []
    for name in module.active_adapters:
        if name not in module.lora_A:
            continue
        if module.use_dora.get(name) or module.lora_B[name].bias is not None:
            raise NotImplementedError("decode: DoRA and LoRA bias are not supported by the fused step")
        parts.append((module.lora_A[name].weight, module.lora_B[name].weight, module.scaling[name]))
    return parts


def _is_4bit(linear) -> bool:
    return hasattr(getattr(linear, "weight", None), "quant_state")


def _absmax(model, name, linear) -> torch.Tensor:
    """The fp32 absmax of a 4-bit weight, double quantisation decoded once and kept."""
    from bitsandbytes.functional import dequantize_blockwise
    cache = model.__dict__.setdefault("_nf4_absmax", {})
    if name not in cache:
        qs = linear.weight.quant_state
        cache[name] = (dequantize_blockwise(qs.absmax, qs.state2) + qs.offset) if qs.nested else qs.absmax.float()
    return cache[name]


def nf4_dequantizer(device) -> str:
    """Which kernel dequantises 4-bit weights on `device` for the nf4 step: "triton" on a GPU with Triton,
    else "bitsandbytes"."""
    return "triton" if torch.device(device).type == "cuda" and nf4_dequantize.available() else "bitsandbytes"


def _dequantize_into(out, linear, absmax, kernel: str) -> None:
    qs = linear.weight.quant_state
    args = (linear.weight.data, absmax, qs.blocksize, qs.quant_type, qs.shape, qs.dtype)
    if kernel == "triton" and qs.quant_type == "nf4":
        nf4_dequantize.nf4_dequantize(linear.weight.data, absmax, qs.code, out, qs.blocksize)
    elif out.is_cuda:
        torch.ops.bitsandbytes.dequantize_4bit.out(*args, out=out)
    else:  # bitsandbytes 0.50 registers the out= form for CUDA only
        out.copy_(torch.ops.bitsandbytes.dequantize_4bit(*args))


class _Group:
    """Linear layers that read one input: y = x W^T (+ residual) + (x A^T) B_blk^T, three kernels."""

    def __init__(self, model, names, modules, weights, dtype, scratch):
        bases = [getattr(m, "base_layer", m) for m in modules]
        self.sizes = [b.out_features for b in bases]
        self.in_features = bases[0].in_features
        rows = sum(self.sizes)
        self.bias = None  # Qwen2's q/k/v carry one (frozen, unquantised): stacked once, added after the matmul
        if any(b.bias is not None for b in bases):
            self.bias = torch.cat([b.bias.to(dtype) if b.bias is not None else
                                   torch.zeros(b.out_features, dtype=dtype, device=b.weight.device) for b in bases])
        self.nf4 = weights == "nf4" and all(_is_4bit(b) for b in bases)
        if self.nf4:  # dequantised into `scratch` at each step, by the kernel chosen once here
            self.bases = [(b, _absmax(model, n, b)) for n, b in zip(names, bases)]
            self.dequantizer = nf4_dequantizer(scratch.device)
            self.plans = {}  # rows -> nf4_dispatch's plan
            self.weight = scratch[:rows * self.in_features].view(rows, self.in_features)
        elif all(_is_4bit(b) for b in bases):  # bf16 copies, made once: the base is frozen
            from bitsandbytes.functional import dequantize_4bit
            cache = model.__dict__.setdefault("_dense_base", {})
            key = ",".join(names)
            if key not in cache:
                cache[key] = torch.cat([dequantize_4bit(b.weight.data, b.weight.quant_state) for b in bases]).to(dtype)
            self.weight = cache[key]
        else:
            self.weight = torch.cat([b.weight for b in bases]).to(dtype)
        # The live LoRA weights, copied now: A stacked, B block-diagonal with each scaling folded in.
        parts = [_lora_parts(m) for m in modules]
        ranks = sum(a.shape[0] for p in parts for a, _, _ in p)
        self.lora_a = self.lora_b = None
        if ranks:
            self.lora_a = torch.cat([a for p in parts for a, _, _ in p]).to(dtype)
            self.lora_b = torch.zeros(rows, ranks, dtype=dtype, device=self.lora_a.device)
            r0 = o0 = 0
            for size, p in zip(self.sizes, parts):
                for a, b, scale in p:
                    self.lora_b[o0:o0 + size, r0:r0 + a.shape[0]] = b * scale
                    r0 += a.shape[0]
                o0 += size

    def _plans(self, M):
        """An nf4_matmul Config for each base weight at M rows if `nf4_dispatch`'s table has one for all of
        them, else None (dequantise, then one matmul)."""
        table = nf4_dispatch.active()
        if table is None or not nf4_matmul_runs_on(self.weight.device):
            return None
        if M not in self.plans:
            plans = [table.plan(size, self.in_features, M) for size in self.sizes]
            nf4 = all(b.weight.quant_state.quant_type == "nf4" for b, _ in self.bases)
            self.plans[M] = plans if nf4 and all(plans) else None
        return self.plans[M]

    def __call__(self, x, residual=None):
        plans = self._plans(x.shape[0]) if self.nf4 else None
        if plans:  # each packed weight read once by nf4_matmul, no bf16 buffer
            y = torch.empty(x.shape[0], sum(self.sizes), dtype=x.dtype, device=x.device)
            o0 = 0
            for (linear, absmax), size, launch in zip(self.bases, self.sizes, plans):
                qs = linear.weight.quant_state
                nf4_matmul(x, linear.weight.data, absmax, qs.code, size, self.in_features, qs.blocksize, launch,
                           out=y[:, o0:o0 + size], residual=None if residual is None else residual[:, o0:o0 + size])
                o0 += size
        else:
            if self.nf4:
                o0 = 0
                for (linear, absmax), size in zip(self.bases, self.sizes):
                    _dequantize_into(self.weight[o0:o0 + size], linear, absmax, self.dequantizer)
                    o0 += size
            y = F.linear(x, self.weight) if residual is None else torch.addmm(residual, x, self.weight.t())
        if self.bias is not None:
            y = y + self.bias
        if self.lora_a is not None:
            y = torch.addmm(y, F.linear(x, self.lora_a), self.lora_b.t())
        return y


class DecodeStep:
    """The fused decode step of one decode call: `logits = step(tok, pos, keys, values, slot, bias)`."""

    def __init__(self, model, weights: str = "nf4", reproducible: bool = True):
        from common.model import unwrap_peft
        self.reproducible = reproducible  # grouped_attention, else SDPA's (faster on a GPU, not reproducible)
        self.lm = lm = unwrap_peft(model)
        core = lm.model
        dtype = core.embed_tokens.weight.dtype
        names = {id(m): n for n, m in model.named_modules()}
        groups = [[(a.q_proj, a.k_proj, a.v_proj), (a.o_proj,), (m.gate_proj, m.up_proj), (m.down_proj,)]
                  for a, m in ((layer.self_attn, layer.mlp) for layer in core.layers)]
        # "nf4": one scratch buffer, as large as the largest stacked group, takes every dequantised weight.
        bases = [[getattr(m, "base_layer", m) for m in g] for g in groups[0]]
        widest = max(sum(b.weight.numel() * 2 for b in g if _is_4bit(b)) for g in bases)  # two weights a byte
        device = core.embed_tokens.weight.device
        scratch = torch.empty(widest if weights == "nf4" else 0, dtype=dtype, device=device)
        self.layers = [(layer, *(_Group(model, [names[id(m)] for m in g], g, weights, dtype, scratch) for g in gs))
                       for layer, gs in zip(core.layers, groups)]
        attn = core.layers[0].self_attn
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        self.n_heads, self.n_kv = lm.config.num_attention_heads, lm.config.num_key_value_heads
        self.act = ACT2FN[lm.config.hidden_act]

    def __call__(self, tok, pos, keys, values, slot, bias):
        """Logits (B, V) for tokens `tok` (B,) at positions `pos` (B, 1): K/V written at cache `slot`;
        `bias` (B, 1, 1, L), in the compute dtype, is 0 where a cache position may be attended and -inf
        elsewhere."""
        core, half = self.lm.model, self.head_dim // 2
        h = core.embed_tokens(tok)
        cos, sin = (t[:, 0, None, :] for t in core.rotary_emb(h[:, None], pos))  # (B, 1, hd)
        # rotate_half(x) * sin == roll(x, half) * sin with its first half negated
        sin = torch.cat([-sin[..., :half], sin[..., half:]], -1)
        with sdpa_kernel(DECODE_ATTENTION):
            return self._layers(h, cos, sin, keys, values, slot, bias)

    def _layers(self, h, cos, sin, keys, values, slot, bias):
        core, hd, nq, nkv = self.lm.model, self.head_dim, self.n_heads, self.n_kv
        B, half = h.shape[0], self.head_dim // 2
        for i, (layer, qkv, o_proj, gate_up, down) in enumerate(self.layers):
            y = qkv(layer.input_layernorm(h))
            qk = y[:, :(nq + nkv) * hd].view(B, nq + nkv, hd)
            qk = torch.addcmul(qk * cos, qk.roll(half, -1), sin)
            keys[i].index_copy_(2, slot, qk[:, nq:, None])  # (B, nkv, 1, hd) into (B, nkv, L, hd)
            values[i].index_copy_(2, slot, y[:, (nq + nkv) * hd:].view(B, nkv, 1, hd))
            if self.reproducible:
                attn = grouped_attention(qk[:, :nq], keys[i], values[i], bias, self.scaling)
            else:
                attn = F.scaled_dot_product_attention(qk[:, :nq, None], keys[i], values[i], attn_mask=bias,
                                                      scale=self.scaling, enable_gqa=True).reshape(B, nq * hd)
            h = o_proj(attn, residual=h)
            y = gate_up(layer.post_attention_layernorm(h))
            gate, up = y[:, :y.shape[1] // 2], y[:, y.shape[1] // 2:]
            h = down(self.act(gate) * up, residual=h)
        return self.lm.lm_head(core.norm(h)).float()
