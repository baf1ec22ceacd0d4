"""How fluent a reply is: its mean token log-probability under a frozen language model.

A judge can prefer text that no reader would (word salad scored above real replies: docs/results.md).
A plain language model of another family than the policy cannot be fooled that way: salad, loops cut
mid-way and shuffled words all score far below real prose. Stage 04 uses it as a reward term (a penalty
below SFT's level, or a gate) and stage 05 as the fluency check of the verdict (perplexity against SFT's).

The reply is scored alone (no premise): a reply that copies its premise would otherwise look fluent
because the premise predicts it. `FluencyScorer` is a Scorer (common/scorers.py), kind `fluency:PATH`.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from common.scorers import register

LOGITS_BYTES = 1 << 30  # a forward's logits at most (counted at 4 bytes a value): 1 GiB


class FluencyScorer:
    """score(prompts, replies) -> each reply's mean log-probability per predicted token (higher is more
    fluent; a reply of fewer than two tokens gets nan). The model is frozen, in full precision on the
    CPU, bf16 on a GPU; replies are cut to `max_tokens`."""

    def __init__(self, model_path: str | Path, batch_size: int = 8, max_tokens: int = 256):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.path, self.batch_size, self.max_tokens = str(model_path), batch_size, max_tokens
        self.name = f"fluency_{Path(self.path).name}"
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        on_gpu = torch.cuda.is_available()
        self.model = AutoModelForCausalLM.from_pretrained(
            self.path, dtype=torch.bfloat16 if on_gpu else torch.float32).eval()
        self.model.to("cuda" if on_gpu else "cpu")
        self.model.requires_grad_(False)
        self.family = self.model.config.model_type

    @property
    def backends(self) -> dict:
        return {"fluency_model": self.path, "fluency_family": self.family}

    @torch.no_grad()
    def score(self, prompts, replies: list[str], **kwargs) -> list[float]:
        tok, device = self.tokenizer, next(self.model.parameters()).device
        # a begin-of-text token, where the model has one, so the reply's first token is predicted too
        start = [tok.bos_token_id] if tok.bos_token_id is not None else []
        encoded = [start + tok(r, add_special_tokens=False)["input_ids"][: self.max_tokens] for r in replies]
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        out = [math.nan] * len(replies)
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))  # little padding
        vocab = self.model.get_output_embeddings().weight.shape[0]
        begin = 0
        while begin < len(order):
            # as many replies a forward as batch_size, and as keep its logits within LOGITS_BYTES: 64 replies of
            # 256 tokens over Gemma's 262k-token vocabulary are 8.6 GiB of bf16 logits, which ran out of memory
            # beside other stages (sorted by length: the chunk's last reply is its longest)
            longest = len(encoded[order[min(begin + self.batch_size, len(order)) - 1]])
            step = max(1, min(self.batch_size, LOGITS_BYTES // (longest * vocab * 4)))
            rows = [i for i in order[begin:begin + step] if len(encoded[i]) >= 2]
            begin += step
            if not rows:
                continue
            width = max(len(encoded[i]) for i in rows)
            ids = torch.tensor([encoded[i] + [pad] * (width - len(encoded[i])) for i in rows], device=device)
            mask = torch.tensor([[1] * len(encoded[i]) + [0] * (width - len(encoded[i])) for i in rows], device=device)
            logits = self.model(input_ids=ids, attention_mask=mask).logits[:, :-1]
            # one row at a time in fp32: the batch's logits and their log-softmax in fp32 at once would be twice
            # the budget again
            token_lp = torch.stack([torch.log_softmax(row.float(), -1).gather(-1, targets[:, None])[:, 0]
                                    for row, targets in zip(logits, ids[:, 1:])])
            kept = mask[:, 1:].float()
            for i, value in zip(rows, ((token_lp * kept).sum(1) / kept.sum(1)).tolist()):
                out[i] = value
        return out


def perplexity(mean_log_probs: list[float]) -> float:
    """The perplexity of a set of replies: exp of minus their mean per-token log-probability (replies
    weighted alike; nan ones, too short to score, left out)."""
    kept = [v for v in mean_log_probs if not math.isnan(v)]
    return math.exp(-sum(kept) / len(kept)) if kept else math.nan


@register("fluency")
def _fluency(path: str, batch_size: int = 8, **_) -> FluencyScorer:
    return FluencyScorer(path, batch_size=batch_size)
