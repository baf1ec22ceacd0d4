"""Best-of-n: the baseline that practice against a judge must beat. Each premise gets n sampled
replies from a frozen model, and the training judge keeps its favourite; nothing is trained, so any
gain of a trained policy over best-of-n is what training added beyond picking."""
from __future__ import annotations


def keep_best(prompts: list, candidates: list[list[str]], score) -> tuple[list[str], list[list[float]]]:
    """For each prompt, the candidate `score(prompts, texts)` rates highest (the first on a tie), and
    every candidate's score."""
    flat_prompts = [p for p, texts in zip(prompts, candidates) for _ in texts]
    flat = score(flat_prompts, [t for texts in candidates for t in texts])
    scores, start = [], 0
    for texts in candidates:
        scores.append(flat[start:start + len(texts)])
        start += len(texts)
    best = [texts[max(range(len(texts)), key=s.__getitem__)] for texts, s in zip(candidates, scores)]
    return best, scores
