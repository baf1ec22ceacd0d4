"""The review's text, shared by the review task (common/tasks/review.py) and the rating model and rating
sources built on it (common/rating_model.py, common/rating_sources.py): the prompt a paper is read in, the
windows of a long paper, and the rating read back from a review. Pure Python: the stages import it before
torch.
"""
from __future__ import annotations

import re

from common.data import DataError

SCALES = {"overall": (1, 6), "confidence": (1, 5)}  # NeurIPS 2025: rating 1-6, confidence 1-5
_I = re.IGNORECASE


INSTRUCTION = (
    "You are reviewing a paper submitted to a machine-learning conference. Read it and write a peer "
    "review in exactly this format:\n\n"
    "### Key Points\n<what the paper does and claims>\n"
    "### Strengths and Weaknesses\nStrengths:\n- <strength>\nWeaknesses:\n- <weakness>\n"
    "### Suggestions for Improvement\n- <question or suggestion>\n"
    "### Rating\nOverall Quality: <1-6>\nReview Confidence: <1-5>\n\n"
    "Overall Quality: 6 strong accept, 5 accept, 4 borderline accept, 3 borderline reject, 2 reject, "
    "1 strong reject. Review Confidence: 5 certain, 4 confident, 3 fairly confident, 2 willing to "
    "defend but unsure, 1 educated guess.\n\nThe paper:\n\n")
# Conditioning (docs/review.md, "The written rating agreeing with the judgement"): a writer trained with this
# line learns to write the review its rating fits; at eval the number is the rating model's. It comes before
# the paper, so that cutting a long paper to its first window never cuts it.
HINT = "A rating model that read this paper puts its Overall Quality at {:.1f}.\n\n"
_PAPER_HEADER = "The paper:\n\n"


# A rating is the label, a colon (or "="), the number, and maybe its scale ("5/6", "5 out of 6"): a
# mention in prose ("the overall quality 1 of the writing") is not one, nor a number on another scale.
# The number must end where it ends: "1e1" or "4x" is no rating (not 1 or 4). The last label decides,
# so a label without a readable number gives no rating.
_RATING = {key: re.compile(label + r"\s*[:：=]\s*(?:(-?\d+(?:\.\d+)?)(?!\w|\.\d)"
                          r"(?:\s*(?:/|out\s+of)\s*(\d+(?:\.\d+)?))?)?", _I)
           for key, label in (("overall", r"overall\s+quality"), ("confidence", r"review\s+confidence"))}


def parse_review(text: str) -> dict:
    """{"overall", "confidence"}: the number after the last "Overall Quality:" / "Review Confidence:"
    (markdown emphasis ignored); None when absent, off the scale (1-6, 1-5) or given on another
    ("5 out of 10")."""
    text = re.sub(r"[*_`]", "", text or "")
    out = {}
    for key, pattern in _RATING.items():
        low, high = SCALES[key]
        found = pattern.findall(text)
        value, scale = (float(found[-1][0]), found[-1][1]) if found and found[-1][0] else (None, "")
        out[key] = value if value is not None and low <= value <= high and scale in ("", str(high)) else None
    return out


def as_hint(rating: float) -> float:
    """A rating as a prompt says it (HINT): on the scale, to one decimal."""
    low, high = SCALES["overall"]
    return round(min(max(float(rating), low), high), 1)


def prompt_for(paper: str, hint: float | None = None) -> list[dict]:
    """The user turn a paper is reviewed from; `hint`: a rating the review is to fit (HINT), or none."""
    head = INSTRUCTION if hint is None else INSTRUCTION[:-len(_PAPER_HEADER)] + HINT.format(hint) + _PAPER_HEADER
    return [{"role": "user", "content": head + paper}]


def window_prompts(tokenizer, ids: list[int], spans, excess_of, hint: float | None = None) -> list[list[dict]]:
    """One prompt per span of the paper's tokens, each within budget (`excess_of(prompt) <= 0`).
    Decoding and re-encoding a window can merge tokens differently: a window is shrunk until it fits,
    on the side its neighbour covers (the last window keeps the paper's end)."""
    prompts = []
    for start, end in spans:
        while True:
            prompt = prompt_for(tokenizer.decode(ids[start:end]), hint)
            excess = excess_of(prompt)
            if excess <= 0 or end - start <= 1:
                break
            if end == len(ids):
                start += excess
            else:
                end -= excess
        prompts.append(prompt)
    return prompts


def reading_windows(row: dict, tokenizer, max_prompt_tokens: int, overlap: int) -> list[list[dict]]:
    """Stage 05, reading all_windows (and the rating model): the paper as prompts of at most
    `max_prompt_tokens` templated tokens, windows covering every token with `overlap` tokens shared by
    neighbours; each with the row's `rating_hint` where it has one (a conditioned writer's eval)."""
    from common.data import prompt_length
    hint = row.get("rating_hint")
    budget = max_prompt_tokens - prompt_length(tokenizer, prompt_for("", hint))
    if budget <= overlap:
        raise DataError(f"max_prompt_tokens={max_prompt_tokens} leaves {budget} tokens of paper a window, not more "
                        f"than window_overlap={overlap}: lower window_overlap or raise max_prompt_tokens")
    ids = tokenizer(row["paper"], add_special_tokens=False)["input_ids"]
    return window_prompts(tokenizer, ids, windows(len(ids), budget, overlap),
                           lambda prompt: prompt_length(tokenizer, prompt) - max_prompt_tokens, hint)


def windows(n_tokens: int, window_tokens: int, overlap: int) -> list[tuple[int, int]]:
    """Half-open spans [start, end) of at most `window_tokens` tokens that cover 0..n_tokens-1. Each
    starts `window_tokens - overlap` after the one before, so neighbours share exactly `overlap`
    tokens; the last is moved back to end at n_tokens (full length, sharing more with the one before).
    A text of at most `window_tokens` tokens is one span; an empty one none."""
    if window_tokens < 1 or not 0 <= overlap < window_tokens:
        raise ValueError(f"need window_tokens >= 1 and 0 <= overlap < window_tokens, got {window_tokens}, {overlap}")
    spans, start = [], 0
    while n_tokens > 0:
        if start + window_tokens >= n_tokens:
            spans.append((max(0, n_tokens - window_tokens), n_tokens))
            break
        spans.append((start, start + window_tokens))
        start += window_tokens - overlap
    return spans
