"""A frozen model's replies: stage 05's, and DPO's rejected ones.

Llama-shaped models (Llama, Qwen2) decode with the static decoder (common/fast/static_decoder.py), the others and
`fast_paths: false` with transformers' generate; `decoder_for` says which, and the stages record it.
"""
from __future__ import annotations

import contextlib
import time

import torch
from transformers import LogitsProcessorList

from common import fast
from common.data import token_ids
from common.model import eos_ids
from common.ngram_block import ReplyNgramBlock


def generate_replies(model, tokenizer, prompts: list[list[dict]], max_new_tokens: int, batch_size: int,
                     **decoding) -> list[str]:
    """Replies of a frozen model (`replies_and_cuts`, without the cut flags)."""
    return replies_and_cuts(model, tokenizer, prompts, max_new_tokens, batch_size, **decoding)[0]


@torch.no_grad()
def replies_and_cuts(model, tokenizer, prompts: list[list[dict]], max_new_tokens: int, batch_size: int,
                     repetition_penalty: float = 1.0, no_repeat_ngram_size: int = 0, temperature: float = 0.0,
                     weights: str = "nf4", seed: int | None = None, static: bool = True) -> tuple[list[str], list[bool]]:
    """Replies of a frozen model: greedy at temperature 0, else sampled from `seed` (either decoder writes the
    same replies on every run, on a GPU too: docs/performance.md); left-padded batches, special tokens stripped; and for each, whether `max_new_tokens` stopped it before
    the model wrote an end token (the decoder's own tokens say so: a text rule such as "ends without a full
    stop" would miss a reply cut after a sentence, or a review's closing "Rating: 6"). `weights` "bf16": the
    static decoder reads bf16 copies of the 4-bit base, made once and freed at the end, instead of
    dequantising every weight at every token. `no_repeat_ngram_size` n > 0: no n-gram appears twice in a
    reply (the prompt's do not count: a review may quote its paper). The decoder that runs is
    `decoder_for(model, static)`."""
    tokenizer.padding_side = "left"
    eos = eos_ids(model, tokenizer)
    model.eval()
    if seed is not None:
        torch.manual_seed(seed)
    if decoder_for(model, static) == "static":
        ids = [token_ids(tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True)) for p in prompts]
        new = []
        for start in range(0, len(ids), batch_size):
            new += fast.decode(model, ids[start:start + batch_size], max_new_tokens, eos,
                               tokenizer.pad_token_id, temperature=temperature, repetition_penalty=repetition_penalty,
                               no_repeat_ngram_size=no_repeat_ngram_size, weights=weights)
        fast.release_dense_base(model)
        return [t.strip() for t in tokenizer.batch_decode(new, skip_special_tokens=True)], _cut(new, eos)
    device = next(model.parameters()).device
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
        dict(do_sample=False)
    replies, cut = [], []
    for start in range(0, len(prompts), batch_size):
        texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False)
                 for p in prompts[start:start + batch_size]]
        # The template already holds the BOS token: add no second one.
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        blocks = [ReplyNgramBlock(no_repeat_ngram_size, batch["input_ids"].shape[1])] if no_repeat_ngram_size else []
        out = model.generate(**batch, max_new_tokens=max_new_tokens, repetition_penalty=repetition_penalty,
                             logits_processor=LogitsProcessorList(blocks), pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=eos, **sampling)
        new = out[:, batch["input_ids"].shape[1]:]
        replies.extend(t.strip() for t in tokenizer.batch_decode(new, skip_special_tokens=True))
        cut += _cut(new.tolist(), eos)
    return replies, cut


def _cut(rows: list[list[int]], eos: list[int]) -> list[bool]:
    """Which decoded rows hold no end token: stopped by the token cap (both decoders keep a row's end token,
    then pad it with the pad token, or stop the row there)."""
    ends = set(eos)
    return [not ends.intersection(row) for row in rows]


def decoder_for(model, static: bool = True) -> str:
    """"static" (`decode`: Llama-shaped models, unless `static` is false) or "hf_generate"
    (transformers' generate: the other models, and fast_paths false)."""
    return "static" if static and fast.supports_fast_decode(model) else "hf_generate"


def decoder_backends(model, static: bool, weights: str, reproducible: bool = True) -> dict:
    """For the manifest: the decoder that runs, and how the static one reads the base weights and attends
    (two grouped matmuls when `reproducible`: equal on a GPU from run to run, where SDPA's cuDNN kernel is not;
    SDPA for GRPO's sampled rollouts, `fast.decode(..., reproducible=False)`)."""
    decoder = decoder_for(model, static)
    attention = "grouped_matmuls" if reproducible else "sdpa"
    return {"decoder": decoder, **({"decoder_weights": fast.weights_backend(model, weights),
                                    "decoder_attention": attention} if decoder == "static" else {})}


@contextlib.contextmanager
def adapter_on(model, name: str):
    """The model as `name`: "base" with every adapter disabled, else that adapter active."""
    if name == "base":
        with model.disable_adapter():
            yield model
    else:
        model.set_adapter(name)
        yield model


def replies_of(model, tokenizer, prompts: list[list[dict]], config, n: int = 1,
               temperature: float | None = None) -> tuple[list[str], list[bool], dict]:
    """Stage 05: the active model's replies with the config's decoding (`n` a prompt, in prompt order, at
    `temperature` when given), whether each was cut at max_new_tokens, and their speed (generation_speed)."""
    started = time.perf_counter()
    decoding = {**config.decoding(), **({"temperature": temperature} if temperature is not None else {})}
    replies, cut = replies_and_cuts(model, tokenizer, [p for p in prompts for _ in range(n)], config.max_new_tokens,
                                    config.batch_size, **decoding)
    return replies, cut, generation_speed(tokenizer, replies, time.perf_counter() - started)


def generation_speed(tokenizer, texts: list[str], seconds: float) -> dict:
    """Wall time of one model's generation and its new tokens a second (the replies re-tokenised)."""
    n = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts)
    return {"seconds": round(seconds, 2), "new_tokens": n, "new_tokens_per_s": round(n / max(seconds, 1e-9), 1)}


def in_groups(flat: list, n: int) -> list[list]:
    """n items a prompt, in prompt order -> one list a prompt."""
    return [flat[i:i + n] for i in range(0, len(flat), n)]
