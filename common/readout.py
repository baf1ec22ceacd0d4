"""A rating read from the model itself, for a review whose text gives none.

A small or undertrained model can run out of tokens, or loop, before it writes `Overall Quality:`.
Its rating is still in the model: the review so far, followed by the rating header, as the
assistant's turn, and the model's next-token distribution over the scale's values (1 ... 6). The
read-out is that distribution renormalised over the scale: its expected value and its most likely
value, and `scale_mass`, the probability the model put on the scale's tokens at all before
renormalising (near 1 for a model that learned the format).
"""
from __future__ import annotations

import torch

from common.data import token_ids
from common.model import unwrap_peft


def value_tokens(tokenizer, text: str, values: list[int]) -> tuple[list[int], list[int]]:
    """(the tokens of `text` up to the value, the token that starts each value) when `text + " " + value`
    is tokenised: the two agree on the first part whatever the tokenizer does with the space."""
    encoded = [tokenizer(f"{text} {v}", add_special_tokens=False)["input_ids"] for v in values]
    n = 0
    while all(len(ids) > n for ids in encoded) and len({ids[n] for ids in encoded}) == 1:
        n += 1
    starts = [ids[n] if len(ids) > n else None for ids in encoded]
    if None in starts or len(set(starts)) != len(starts):
        raise ValueError(f"the tokenizer gives no distinct first token to each of the values {values}")
    return encoded[0][:n], starts


@torch.no_grad()
def read_scale(model, tokenizer, prompts: list[list[dict]], turns: list[str], scale: tuple[int, int],
               max_tokens_per_batch: int = 16384) -> list[dict]:
    """For each chat prompt and the assistant's turn so far (ending in the rating header): the model's
    {expected, most_likely, scale_mass, probs} over the integer values of `scale`. The active adapter
    reads (switch it off with `model.disable_adapter()` for the base)."""
    values = list(range(scale[0], scale[1] + 1))
    if not prompts:
        return []
    rows, starts, encoded = [], [], {}  # encoded: each distinct turn once (all_windows reads one per window)
    for prompt, turn in zip(prompts, turns):
        head = token_ids(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True))
        if turn not in encoded:
            encoded[turn] = value_tokens(tokenizer, turn, values)
        ids, first = encoded[turn]
        rows.append(head + ids)
        starts.append(first)
    lm = unwrap_peft(model)
    device = lm.model.embed_tokens.weight.device
    was_training = model.training
    model.eval()
    out = [None] * len(rows)
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    batch: list[int] = []
    for i in order + [None]:  # length-sorted batches under a token budget; None flushes the last
        if i is not None and (not batch or len(rows[i]) * (len(batch) + 1) <= max_tokens_per_batch):
            batch.append(i)
            continue
        width = max(len(rows[j]) for j in batch)
        # Right padding: a real token never attends to the pads after it, and positions need no shift.
        ids = torch.full((len(batch), width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, j in enumerate(batch):
            ids[r, :len(rows[j])] = torch.tensor(rows[j])
            mask[r, :len(rows[j])] = 1
        hidden = lm.model(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
        last = hidden[torch.arange(len(batch)), mask.sum(1).to(device) - 1]
        logits = lm.lm_head(last).float()
        for r, j in enumerate(batch):
            out[j] = _summary(logits[r], starts[j], values)
        batch = [i] if i is not None else []
    model.train(was_training)
    return out


def _summary(logits: torch.Tensor, starts: list[int], values: list[int]) -> dict:
    full = torch.softmax(logits, -1)[starts]
    probs = full / full.sum()
    return {"expected": float((probs * torch.tensor(values, dtype=probs.dtype, device=probs.device)).sum()),
            "most_likely": values[int(probs.argmax())], "scale_mass": float(full.sum()),
            "probs": [round(float(p), 6) for p in probs]}


def rating_readouts(model, tokenizer, task, prompts: list[list[dict]], replies: list[str],
                    windows: list[list[list[dict]]] | None = None) -> list[dict]:
    """Stage 05: per paper, the rating read after its review on the prompt it was written from
    (`first_window`), and with `windows` (every window of each paper) the same read on each window,
    averaged (`all_windows`: the mean expected value, and each window's)."""
    turns = [task.readout_turn(reply) for reply in replies]
    out = [{"first_window": read} for read in read_scale(model, tokenizer, prompts, turns, task.READOUT_SCALE)]
    if windows:
        owner = [i for i, ws in enumerate(windows) for _ in ws]
        reads = read_scale(model, tokenizer, [w for ws in windows for w in ws], [turns[i] for i in owner],
                           task.READOUT_SCALE)
        per_paper = [[] for _ in out]
        for read, i in zip(reads, owner):
            per_paper[i].append(read["expected"])
        for read, each in zip(out, per_paper):
            read["all_windows"] = {"expected": sum(each) / len(each), "n_windows": len(each), "per_window": each}
    return out
