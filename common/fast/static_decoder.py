"""The static decoder: batched generation for Llama-shaped models (Llama, Qwen2) in few kernels a token.

`decode` runs the decoder layers itself over a preallocated KV cache, so that on a GPU each new
token is one CUDA graph replay. HF `generate` on a 4-bit model with LoRA is bound by Python
launching thousands of small kernels per token (its rate: docs/performance.md); a replayed graph has
no such cost, and the step it replays (`common/fast/decode_step.py`) launches few kernels. The LoRA
adapter is not merged: generation runs the very weights that training updates. Stage 05 and DPO's
rejected replies reach it through `common/generation.py`, GRPO through `grpo_rollout`; with
`fast_paths: false` neither does.
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from common.data import token_ids
from common.fast import nf4_dispatch
from common.fast.decode_step import DecodeStep, nf4_dequantizer
from common.model import eos_ids, unwrap_peft
from common.ngram_block import repeat_bans

log = logging.getLogger(__name__)
GRAPH_FAILURES: list[str] = []  # why a capture fell back to eager steps (manifests' decoder_fallbacks)


# Decoders whose layers are Llama's: RMSNorm, rotary GQA attention over every position, a gated MLP. Qwen2
# adds biases to q/k/v, which the fused step adds after its matmul; a sliding window it does not model.
FAST_DECODE_MODELS = ("llama", "qwen2")


def supports_fast_decode(model) -> bool:
    lm = unwrap_peft(model)
    return (getattr(lm.config, "model_type", None) in FAST_DECODE_MODELS and hasattr(lm, "lm_head")
            and not getattr(lm.config, "use_sliding_window", False))


def weights_backend(model, weights: str) -> str:
    """For the manifest: how the decode step reads the base weights: "bf16_copies", or "nf4_" + the kernel
    that dequantises them at every token, and the nf4_matmul table where one is in use (`nf4_dispatch`)."""
    if weights == "bf16":
        return "bf16_copies"
    table = nf4_dispatch.active()
    return "nf4_" + nf4_dequantizer(next(model.parameters()).device) + (
        f", nf4_matmul where {table.describe()}" if table else "")


def release_dense_base(model) -> None:
    """Free the bf16 copies of the base that `weights="bf16"` decoding made (a training stage needs the room)."""
    model.__dict__.pop("_dense_base", None)


def _prefill(lm, ids, positions, mask, store):
    """The decoder over prompt `ids` (B, T) through the model's own modules, attention by SDPA with
    `mask` (B, 1, T, T), each layer's K/V handed to `store(layer, k, v)`; returns last-position logits (B, V)."""
    # Llama's internals, here and below (head_dim, scaling, rotary_emb): common/trl_compat.py
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    core = lm.model
    h = core.embed_tokens(ids)
    cos, sin = core.rotary_emb(h, positions)
    B, T = ids.shape
    for i, layer in enumerate(core.layers):
        attn = layer.self_attn
        hd = attn.head_dim
        x = layer.input_layernorm(h)
        q = attn.q_proj(x).view(B, T, -1, hd).transpose(1, 2)
        k = attn.k_proj(x).view(B, T, -1, hd).transpose(1, 2)
        v = attn.v_proj(x).view(B, T, -1, hd).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        store(i, k, v)
        rep = q.shape[1] // k.shape[1]  # K/V expanded: SDPA's masked kernels refuse GQA (bench/RESULTS.md)
        o = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1),
                                           attn_mask=mask, scale=attn.scaling)
        h = h + attn.o_proj(o.transpose(1, 2).reshape(B, T, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return lm.lm_head(core.norm(h[:, -1:]))[:, -1].float()


@torch.no_grad()
def decode(model, prompt_ids: list[list[int]], max_new_tokens: int, eos: list[int], pad_id: int,
           temperature: float = 1.0, repetition_penalty: float = 1.0, cuda_graph: bool | None = None,
           prefill_tokens: int = 8192, weights: str = "nf4", no_repeat_ngram_size: int = 0,
           reproducible: bool = True) -> list[list[int]]:
    """New tokens for each prompt (sampled at `temperature`, greedy at 0), cut after the first end
    token. The model must be in eval mode (no LoRA dropout). The prompts run through the model's own
    modules; each later step is `DecodeStep`'s fused one (`weights`: its base weights, "nf4" or
    "bf16"). On CUDA that step is captured once as a graph and replayed; `cuda_graph=False` runs it
    eagerly. `reproducible` (`DecodeStep`): the same tokens on every run of a GPU, at some cost in speed; GRPO's
    sampled rollouts take SDPA's faster attention instead."""
    lm = unwrap_peft(model)
    core = lm.model
    device = core.embed_tokens.weight.device
    cuda_graph = device.type == "cuda" if cuda_graph is None else cuda_graph
    B, lens = len(prompt_ids), torch.tensor([len(p) for p in prompt_ids])
    P = int(lens.max())
    L = P + max_new_tokens
    attn0 = core.layers[0].self_attn
    n_kv = lm.config.num_key_value_heads
    dtype = core.embed_tokens.weight.dtype
    keys = torch.zeros(len(core.layers), B, n_kv, L, attn0.head_dim, dtype=dtype, device=device)
    values = torch.zeros_like(keys)

    # Prefill, left-padded, a few rows at a time (its activations, not the cache, would set the peak).
    ids = torch.full((B, P), pad_id, dtype=torch.long)
    for r, p in enumerate(prompt_ids):
        ids[r, P - len(p):] = torch.tensor(p)
    n_pad = P - lens
    ids, n_pad = ids.to(device), n_pad.to(device)
    arange = torch.arange(P, device=device)
    positions = (arange[None, :] - n_pad[:, None]).clamp(min=0)
    key_ok = arange[None, :] >= n_pad[:, None]  # (B, P)
    causal = arange[None, :] <= arange[:, None]
    # A pad query attends to itself only, so that no row of the mask is empty (NaN).
    mask = (causal[None] & key_ok[:, None, :]) | torch.eye(P, dtype=torch.bool, device=device)[None]
    logits = torch.empty(B, lm.lm_head.weight.shape[0], device=device)
    # A prompt repeated in the batch (GRPO: num_generations replies to each premise) runs once; its K/V
    # and logits go to every row that holds it.
    _, copy_of = torch.unique(ids, dim=0, return_inverse=True)
    first = torch.full((int(copy_of.max()) + 1,), B, device=device).scatter_reduce(
        0, copy_of, torch.arange(B, device=device), "amin")
    rows = max(1, prefill_tokens // P)
    for u0 in range(0, len(first), rows):
        run = first[u0:u0 + rows]
        to = ((copy_of >= u0) & (copy_of < u0 + len(run))).nonzero()[:, 0]
        src = copy_of[to] - u0

        def store(i, k, v, to=to, src=src):
            keys[i][to, :, :P] = k[src]
            values[i][to, :, :P] = v[src]
        logits[to] = _prefill(lm, ids[run], positions[run], mask[run, None], store)[src]

    # Decode state, all in fixed tensors so that one captured step can be replayed.
    fused_step = DecodeStep(model, weights, reproducible)
    bias = torch.full((B, 1, 1, L), float("-inf"), dtype=dtype, device=device)  # 0 where a slot may be attended
    bias[:, 0, 0, :P].masked_fill_(key_ok, 0.0)
    seen = prompt_tokens_seen(ids, key_ok, logits.shape[1]) if repetition_penalty != 1.0 else None
    eos_t = torch.tensor(eos, device=device)
    out = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=device)
    tok = _pick(logits, temperature, repetition_penalty, seen)
    out[:, 0] = tok
    done = (tok[:, None] == eos_t).any(-1)
    slot = torch.tensor([P], device=device)
    pos = lens.to(device)[:, None].clone()
    step_i = torch.tensor([1], device=device)

    def step():
        bias.index_fill_(-1, slot, 0.0)
        lg = fused_step(tok, pos, keys, values, slot, bias)
        if no_repeat_ngram_size:
            lg = lg.masked_fill(repeat_bans(out, step_i, no_repeat_ngram_size, lg.shape[1]), float("-inf"))
        nxt = _pick(lg, temperature, repetition_penalty, seen)
        nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
        out.index_copy_(1, step_i, nxt[:, None])
        done.logical_or_((nxt[:, None] == eos_t).any(-1))
        tok.copy_(nxt)
        slot.add_(1)
        pos.add_(1)
        step_i.add_(1)

    n_steps = max_new_tokens - 1
    graph = _capture(step, [bias, tok, done, out, slot, pos, step_i] + ([seen] if seen is not None else [])) \
        if cuda_graph and n_steps > 0 else None
    for i in range(n_steps):
        graph.replay() if graph is not None else step()
        if i % 32 == 31 and bool(done.all()):
            break
    del graph
    result = []
    for row in out.tolist():
        cut = next((j for j, t in enumerate(row) if t in eos), None)
        result.append(row if cut is None else row[:cut + 1])
    return result


def prompt_tokens_seen(ids, key_ok, vocab: int):
    """(B, vocab) bools: which tokens the repetition penalty counts as seen, those at the prompt's real
    positions (`key_ok`), padding not. Scattering `key_ok` itself would write True and False to one token where
    the pad id also sits in the prompt (SmolLM2 pads with its end of turn), and a GPU's scatter keeps either
    write: the end of turn then went unpenalised in padded rows, and their replies ended early. Counts add
    up in any order."""
    counts = torch.zeros(ids.shape[0], vocab, dtype=torch.int32, device=ids.device)
    return counts.scatter_add_(1, ids, key_ok.to(torch.int32)) > 0


def _pick(logits, temperature, repetition_penalty, seen):
    """Next token: greedy at temperature 0, else a sample (exponential race: argmax p_i / E_i,
    E_i ~ Exp(1), which draws i with probability p_i, with no host synchronisation)."""
    if seen is not None:
        penalised = torch.where(logits < 0, logits * repetition_penalty, logits / repetition_penalty)
        logits = torch.where(seen, penalised, logits)
    if temperature > 0:
        noise = torch.empty_like(logits).exponential_().log()
        nxt = (logits / temperature - noise).argmax(-1)
    else:
        nxt = logits.argmax(-1)
    if seen is not None:
        seen.scatter_(1, nxt[:, None], True)
    return nxt


@functools.lru_cache(maxsize=None)
def _warmup_stream(device: int):
    """One side stream a GPU for every capture's warm-up step: cuBLAS keeps a workspace (32 MiB on Hopper) for
    each stream it has run on, for the process's life, so a new stream at every decode grew memory by 32 MiB a
    GRPO step (bench/RESULTS.md)."""
    return torch.cuda.Stream(device)


def _capture(step, state):
    """Capture one decode step as a CUDA graph. The warm-up step (needed before capture) changes the
    state, so the state is restored after it; on any failure the caller runs the steps eagerly."""
    saved = [t.clone() for t in state]
    try:
        stream = _warmup_stream(torch.cuda.current_device())
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        for t, s in zip(state, saved):
            t.copy_(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        return graph
    except Exception as err:  # a model or kernel that cannot be captured: eager steps, still correct
        log.warning("CUDA graph capture failed (%s: %s); decoding eagerly", type(err).__name__, err)
        GRAPH_FAILURES.append(f"{type(err).__name__}: {err}"[:500])
        for t, s in zip(state, saved):
            t.copy_(s)
        return None


def grpo_rollout(max_new_tokens: int, temperature: float, batch_size: int = 64, weights: str = "nf4"):
    """A TRL `rollout_func` for GRPOTrainer: sampled completions from `decode` for the trainer's policy
    (the 4-bit base with its live LoRA adapter, in eval mode while sampling), `batch_size` sequences at
    a time. Its prompts are tokenised exactly as TRL does. weights "bf16": each decode step reads bf16
    copies of the base weights instead of dequantising the 4-bit ones (`DecodeStep`). Samples need not
    repeat across runs: the step's attention is SDPA's, faster than the reproducible one."""
    def rollout(prompts, trainer):
        tokenizer = trainer.processing_class
        if hasattr(trainer, "_tokenize_prompts"):  # private: common/trl_compat.py
            prompt_ids = trainer._tokenize_prompts(prompts)[0]
        else:
            prompt_ids = [token_ids(tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True))
                          for p in prompts]
        model = trainer.accelerator.unwrap_model(trainer.model)
        was_training = model.training
        model.eval()
        eos = list(getattr(trainer, "eos_token_ids", None) or eos_ids(model, tokenizer))  # TRL's: trl_compat
        completions = []
        for start in range(0, len(prompt_ids), batch_size):
            completions += decode(model, prompt_ids[start:start + batch_size], max_new_tokens, eos,
                                  tokenizer.pad_token_id, temperature=temperature, weights=weights,
                                  reproducible=False)
        model.train(was_training)
        return {"prompt_ids": [list(p) for p in prompt_ids], "completion_ids": completions, "logprobs": None}
    return rollout
