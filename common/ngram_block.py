"""No n-gram twice in a reply: the rule both decoders apply (`no_repeat_ngram_size`).

Unlike transformers' NoRepeatNGramLogitsProcessor, the prompt's n-grams do not count: a review may
quote its paper.
"""
from __future__ import annotations

import torch
from transformers import LogitsProcessor


def repeat_bans(seq: torch.Tensor, written, n: int, vocab: int) -> torch.Tensor:
    """(B, vocab) True for each token that would complete an n-gram already in `seq[:, :written]`
    (the reply so far; `written` an int or a one-element tensor, so a CUDA graph can replay it)."""
    B, N = seq.shape
    if N < n:
        return torch.zeros(B, vocab, dtype=torch.bool, device=seq.device)
    grams = seq.unfold(1, n - 1, 1)[:, :N - n + 1]  # (B, N-n+1, n-1): the n-1 tokens from j, followed by seq[:, j+n-1]
    follow = seq[:, n - 1:]
    tail = (written - (n - 1) + torch.arange(n - 1, device=seq.device)).clamp(min=0)
    last = seq.gather(1, tail.expand(B, n - 1))  # the reply's last n-1 tokens
    starts = torch.arange(N - n + 1, device=seq.device)
    hit = (grams == last[:, None]).all(-1) & (starts + n - 1 < written)
    # scatter_add, not scatter: a token may follow several n-1-grams, hit or not
    return torch.zeros(B, vocab, device=seq.device).scatter_add_(1, follow, hit.float()) > 0


class ReplyNgramBlock(LogitsProcessor):
    """transformers' generate under the static decoder's rule: no n-gram twice in the reply (tokens
    after the `prompt_length` prompt columns)."""

    def __init__(self, n: int, prompt_length: int):
        self.n, self.prompt_length = n, prompt_length

    def __call__(self, input_ids, scores):
        reply = input_ids[:, self.prompt_length:]
        return scores.masked_fill(repeat_bans(reply, reply.shape[1], self.n, scores.shape[1]), float("-inf"))
