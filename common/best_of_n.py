"""Best-of-n: the baseline that practice against a judge must beat. Each premise gets n sampled
replies from a frozen model, and a scorer (the training judge unless `best_of_n_scorer` names
another) keeps its favourite; nothing is trained, so any gain of a trained policy over best-of-n is
what training added beyond picking.

A judge can prefer salad to prose, and picking its favourite of n would pick the salad. With a
fluency model, a candidate is eligible only when its mean token log-probability is at least the
source model's greedy reply's to that premise minus `best_of_n_fluency_margin` (nats a token): as
fluent as the model's own best guess, give or take. Where no candidate passes, the most fluent one
is kept (no premise goes without a reply), and replies.jsonl says which passed."""
from __future__ import annotations

import math


def fluency_gate(candidate_log_probs: list[list[float]], greedy_log_probs: list[float],
                 margin: float) -> list[list[bool]]:
    """Per premise, per candidate: does it pass (log-prob >= the greedy reply's - margin)? A greedy
    reply too short to score (nan) sets no bar; a candidate too short to score never passes."""
    return [[not math.isnan(lp) and (math.isnan(bar) or lp >= bar - margin) for lp in lps]
            for lps, bar in zip(candidate_log_probs, greedy_log_probs)]


def keep_best(prompts: list, candidates: list[list[str]], score, passed: list[list[bool]] | None = None,
              log_probs: list[list[float]] | None = None) -> tuple[list[str], list[list[float]]]:
    """For each prompt, the candidate `score(prompts, texts)` rates highest (the first on a tie) among
    those that `passed` the gate (all without one; the most fluent by `log_probs` where none did), and
    every candidate's score."""
    flat_prompts = [p for p, texts in zip(prompts, candidates) for _ in texts]
    flat = score(flat_prompts, [t for texts in candidates for t in texts])
    scores, start = [], 0
    for texts in candidates:
        scores.append(flat[start:start + len(texts)])
        start += len(texts)
    best = [texts[choose(s, passed[i] if passed is not None else None, log_probs[i] if log_probs else None)]
            for i, (texts, s) in enumerate(zip(candidates, scores))]
    return best, scores


def choose(scores: list[float], passed: list[bool] | None, log_probs: list[float] | None,
           among: range | None = None) -> int:
    """Which candidate `keep_best` keeps (of `among`, every one by default): the best scored of those that
    passed the gate (the first on a tie), else the most fluent."""
    among = among or range(len(scores))
    ok = [j for j in among if passed is None or passed[j]]
    if ok:
        return max(ok, key=scores.__getitem__)
    lps = [-math.inf if math.isnan(log_probs[j]) else log_probs[j] for j in among]
    return among[max(range(len(lps)), key=lps.__getitem__)]


def pick(config, manifest: dict, prompts: list, candidates: list[list[str]], log_probs: dict | None,
         candidate_log_probs: list[list[float]] | None) -> tuple[list[str], list[list[float]], list | None]:
    """Stage 05's model best_of_n: `best_of_n_scorer`'s favourite (the training judge by default) among the
    candidates that pass the fluency gate against their source model's greedy replies (`log_probs`, with a
    fluency model). Returns the picks, every candidate's score and which passed (None without a gate);
    the scorer and the gate go into `manifest["best_of_n"]`."""
    from common.config import ConfigError
    from common.scorers import ScorerError, load_scorer
    source = manifest["best_of_n"]["from"]
    try:
        scorer = load_scorer(config.best_of_n_scorer or f"run:{config.reward_run}", batch_size=config.batch_size,
                             packed=config.fast_paths)
    except ScorerError as err:
        raise ConfigError(f"field 'best_of_n_scorer': {err}", "best_of_n_scorer") from None
    passed = fluency_gate(candidate_log_probs, log_probs[source], config.best_of_n_fluency_margin) \
        if candidate_log_probs and source in log_probs else None
    manifest["best_of_n"].update(
        scorer=config.best_of_n_scorer or f"run:{config.reward_run}",
        fluency_gate=f"mean log-prob >= {source}'s greedy reply's - {config.best_of_n_fluency_margin:g}"
        if passed else "none (no fluency model, or no greedy reply of its source)",
        passed_share=sum(map(sum, passed)) / sum(map(len, passed)) if passed else None)
    best, scores = keep_best(prompts, candidates, scorer.score, passed, candidate_log_probs)
    return best, scores, passed
