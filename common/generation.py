"""Batched generation of replies from chat prompts (evaluation)."""
from __future__ import annotations

import torch


@torch.no_grad()
def generate_replies(model, tokenizer, prompts: list[list[dict]], max_new_tokens: int, batch_size: int,
                     repetition_penalty: float = 1.0) -> list[str]:
    """Greedy replies (reproducible), left-padded batches, special tokens stripped."""
    tokenizer.padding_side = "left"
    model.eval()
    device = next(model.parameters()).device
    replies = []
    for start in range(0, len(prompts), batch_size):
        texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False)
                 for p in prompts[start:start + batch_size]]
        # The template already holds the BOS token: add no second one.
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                             repetition_penalty=repetition_penalty, pad_token_id=tokenizer.pad_token_id)
        new = out[:, batch["input_ids"].shape[1]:]
        replies.extend(t.strip() for t in tokenizer.batch_decode(new, skip_special_tokens=True))
    return replies
