"""The reward-hacking watch of stage 04: what every batch of GRPO replies looks like, and a guard
that stops the run when reply length drifts (how a length-biased judge gets gamed).

For every batch, the mean reply length (words), distinct-2 over the batch and the overlap with the
premise (share of the reply's word 3-grams found in it) are zero-weight reward functions
(common/reward_terms.py): TRL logs their means (rewards/watch_<stat>/mean, in the trainer's log
history and W&B) and they move no advantage. `WatchCallback` reads those logs and keeps the length
guard; its reference length (the mean of the run's first batches) is kept in the run directory, so a
resumed or requeued run keeps the same reference.
"""
from __future__ import annotations

import json
import logging
import re
from collections import Counter
from pathlib import Path

from transformers import TrainerCallback

from common.data import write_json

log = logging.getLogger("pipeline")


def _words(text: str) -> list[str]:
    return re.findall(r"\w+(?:'\w+)?", text.lower())


def _ngrams(words: list[str], n: int) -> list[tuple]:
    return [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]


def distinct_n(texts: list[str], n: int = 2) -> float:
    """Distinct-n over a set of texts: unique word n-grams / all word n-grams (0 when there are none).
    Falls when the replies of a batch repeat themselves or each other."""
    grams = [g for t in texts for g in _ngrams(_words(t), n)]
    return len(set(grams)) / len(grams) if grams else 0.0


def premise_overlap(premise: str, reply: str, n: int = 3) -> float:
    """Share of the reply's word n-grams that also occur in the premise (0 for a reply shorter than
    n words). Rises when the reply echoes the premise back."""
    grams = _ngrams(_words(reply), n)
    if not grams:
        return 0.0
    source = set(_ngrams(_words(premise), n))
    return sum(g in source for g in grams) / len(grams)


def looped(text: str, min_words: int = 5, times: int = 3, run_words: int = 8) -> bool:
    """A reply that loops: one line or sentence of at least `min_words` words said `times` times or more, or
    one run of `run_words` words said `times` times (a list whose items differ in their last word, with no
    full stop between them: "6) A desire to avoid offending people who might think this is stupid 7) ...")."""
    parts = [p.strip().lower() for p in re.split(r"\n|(?<=[.!?])\s", text) if len(p.split()) >= min_words]
    if parts and Counter(parts).most_common(1)[0][1] >= times:
        return True
    words = re.findall(r"\w+", text.lower())
    runs = Counter(tuple(words[i:i + run_words]) for i in range(len(words) - run_words + 1))
    return bool(runs) and runs.most_common(1)[0][1] >= times


# What an assistant model says when it declines instead of arguing. Each pattern is matched, case-blind,
# in the reply's first 200 characters (where a refusal is made; a debate reply quoting "as an AI" later
# is no refusal), with straight or curly apostrophes.
REFUSAL_PATTERNS = (
    r"\bI(?:'m| am) sorry,? but I (?:can(?:'t|not)|won't|am unable|'m unable|am not able)",
    r"\bI (?:can(?:'t|not)|won't) (?:assist|help(?!\s+but)|comply|provide|engage|fulfil|fulfill|do that|write)",
    r"\bI(?:'m| am) (?:unable|not able) to (?:assist|help(?!\s+but)|comply|provide|engage|fulfil|fulfill)",
    r"\bas an AI\b",
    r"\bas a language model\b",
    r"\bI(?:'m| am) not comfortable\b",
)
_REFUSAL = re.compile("|".join(f"(?:{p})" for p in REFUSAL_PATTERNS), re.IGNORECASE)


def refused(text: str, head: int = 200) -> bool:
    """A reply that refuses: one of REFUSAL_PATTERNS in its first `head` characters."""
    return bool(_REFUSAL.search(text[:head].replace("\u2019", "'")))


# What a reply says when it tells the poster they are right. A policy practised against a judge learned to open
# almost every reply so ("I agree with your points. Your reasoning is sound."): 87 of 100 replies against 15 of
# SFT's and 6 of 100 real replies (docs/results.md, the SmolLM2 practice of 2026-12-06). Matched case-blind anywhere
# in the reply; "I'm not sure I agree" and "I don't agree" are no concession.
CONCESSION_PATTERNS = (
    r"(?<!not sure )(?<!not sure if )(?<!n't )\bI (?:completely |totally |fully |absolutely |definitely |do )?agree\b",
    r"\byou(?:'re| are) (?:absolutely |completely |totally |quite )?(?:right|correct)\b",
    r"\b(?:valid|good|great|fair|excellent|strong) (?:point|argument|concern)s?\b",
    r"\b(?:reasoning|argument|logic|points?|critique|concern) (?:is|are) (?:sound|valid|spot on|well[- ]taken)\b",
    r"\bspot on\b",
)
_CONCESSION = re.compile("|".join(f"(?:{p})" for p in CONCESSION_PATTERNS), re.IGNORECASE)


def conceded(text: str) -> bool:
    """A reply that tells the poster they are right: one of CONCESSION_PATTERNS anywhere in it."""
    return bool(_CONCESSION.search(text.replace("\u2019", "'")))


def reply_shape(premises: list[str], replies: list[str]) -> dict:
    """What stage 05 reports of one model's replies besides the judges' verdicts: the share that loop,
    the share of reply 3-grams copied from the premise (mean over replies), distinct-2 over all, the
    share that refuse (`refused`) and the share that concede (`conceded`)."""
    n = max(1, len(replies))
    return {"looped_share": sum(map(looped, replies)) / n,
            "premise_copy_share": sum(premise_overlap(p, r) for p, r in zip(premises, replies)) / n,
            "distinct_2": distinct_n(replies, 2),
            "refusal_share": sum(map(refused, replies)) / n,
            "conceded_share": sum(map(conceded, replies)) / n}


def off_topic_shares(premises: list[str], references: list[list[str]], replies: dict[str, list[str]]) -> dict:
    """Each model's share of replies less related to their premise than nine real replies in ten are: the tf-idf
    cosine of reply and premise (common.features.Topic, fitted on these premises and their real replies) under
    its floor, the 10% quantile of the real replies' own. The real replies' share is about 0.10 by construction;
    a reply written for another premise, or to no premise, falls under it."""
    from common.features import Topic
    topic = Topic.fit([p for p, refs in zip(premises, references) for _ in refs], [r for refs in references for r in refs])
    return {name: float((topic.cosines(premises, texts) < topic.floor).sum()) / max(1, len(texts))
            for name, texts in replies.items()}


WATCH_LOG = "rewards/watch_{}/mean"  # TRL's log column of the watch's zero-weight reward functions


class WatchCallback(TrainerCallback):
    """The length guard, reading TRL's logs (common/reward_terms.py logs the watch's statistics as
    zero-weight reward functions). It trips when the mean reply length leaves
    [reference / max_length_ratio, reference * max_length_ratio] for `patience` logged steps in a row,
    reference = the mean of the run's first `reference_batches` logged steps (kept in `state_path`, so a
    resumed run keeps it), and stops training there (`control.should_training_stop`). max_length_ratio
    None disables the guard; the statistics are logged all the same."""

    def __init__(self, max_length_ratio: float | None = None, patience: int = 1, reference_batches: int = 1,
                 state_path: Path | None = None):
        if max_length_ratio is not None and max_length_ratio <= 1:
            raise ValueError(f"max_length_ratio must be > 1 (or None to disable the guard), got {max_length_ratio}")
        self.max_length_ratio = max_length_ratio
        self.patience, self.reference_batches = max(1, patience), max(1, reference_batches)
        self.state_path = Path(state_path) if state_path else None
        self.history: list[dict] = []
        self.reference: float | None = None
        self._firsts: list[float] = []
        self.tripped: str | None = None
        self._breaches, self._writes = 0, True
        if self.state_path and self.state_path.is_file():  # a resumed run: the reference of its first batches
            self.reference = json.loads(self.state_path.read_text())["reference_words"]

    def on_log(self, args, state, control, logs=None, **kwargs):
        words = (logs or {}).get(WATCH_LOG.format("reply_words"))
        if words is None:
            return control
        step = state.global_step if state is not None else len(self.history) + 1
        self.history.append({"step": step, "reply_words": words})
        # TRL's logged means are gathered over the processes of a launch: each one trips alike, one writes
        self._writes = state is None or state.is_world_process_zero
        self._check(words, step)
        if self.tripped:
            control.should_training_stop = True
        return control

    def _check(self, words: float, step: int) -> None:
        if self.max_length_ratio is None or self.tripped:
            return
        if self.reference is None:
            self._firsts.append(words)
            if len(self._firsts) == self.reference_batches:
                self.reference = sum(self._firsts) / len(self._firsts)
                if self.state_path and self._writes:
                    write_json(self.state_path, {"reference_words": self.reference, "batches": self.reference_batches,
                                                 "step": step})
            return
        low, high = self.reference / self.max_length_ratio, self.reference * self.max_length_ratio
        if low <= words <= high:
            self._breaches = 0
            return
        self._breaches += 1
        if self._breaches >= self.patience:
            self.tripped = (
                f"reward-hacking guard: mean reply length {words:.1f} words at step {step} is outside "
                f"[{low:.1f}, {high:.1f}] (the run's first {self.reference_batches} batch(es) averaged "
                f"{self.reference:.1f} words; max_length_ratio={self.max_length_ratio}) for {self._breaches} "
                f"batch(es) in a row: the policy is drifting in length, which is how a length-biased judge "
                f"gets gamed. Training stopped; see metrics.json per_step and judge_audit.json of the reward run.")
            log.error(self.tripped)


def watch_per_step(log_history: list[dict], terms: list[str] = ()) -> list[dict]:
    """Stage 04's per-step record from the trainer's log: the reward, reply length, the watch, and each
    reward term's mean (`reward/<name>`, TRL's rewards/<name>/mean)."""
    return [{"step": h["step"], "reward_mean": h.get("reward"),
             "reply_length_mean": h.get("completions/mean_length"),  # tokens, as TRL counts them
             "reply_words_mean": h.get(WATCH_LOG.format("reply_words")),
             "distinct_2": h.get(WATCH_LOG.format("distinct_2")),
             "premise_overlap": h.get(WATCH_LOG.format("premise_overlap")),
             "conceded_share": h.get(WATCH_LOG.format("conceded")),
             **{f"reward/{name}": h.get(f"rewards/{name}/mean") for name in terms}}
            for h in log_history if "reward" in h]
