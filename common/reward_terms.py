"""GRPO's reward as declared terms: each a Scorer (common/scorers.py) turned into one of TRL's reward
functions, summed by TRL with `reward_weights` (stage 04's `reward_funcs` + `reward_weights`).

A policy trained against one learned judge can find text the judge loves and no reader would (word
salad, docs/results.md). The terms that guard against it:

- `judge`: the --reward_run's raw score (the default, alone: the reward as it always was).
- `par`: Preference As Reward (Fu et al. 2025, "Reward shaping to mitigate reward hacking in RLHF"):
  sigmoid(r(reply) - r(reference reply)), r the judge, the reference the starting policy's reply to the
  same premise, sampled as the rollouts are (greedy replies loop and read as more fluent than any sample:
  a gate measured against them shut every rollout out, docs/results.md). Bounded in (0, 1), flat once a reply clearly beats the reference, so a judge's
  runaway scores stop paying.
- `fluency`: the reply's mean token log-prob under a frozen LM of another family
  (`common.fluency.FluencyScorer`), as a penalty below the reference replies' mean (`min(0, lp - ref)`,
  times its weight) or as a gate (`fluency_mode: gate`).
- any scorer spec: `run:PATH`, `fluency:PATH`, `pkg.module:function`.

The gate and TRL's weighted sum: TRL adds `weight * term` over the terms, so a gate cannot multiply them.
The gate is instead the LAST reward function, and for a reply under the threshold it returns what takes
the weighted sum of the other terms (read from their outputs for this very batch) to
`fluency_gate_reward`, and 0 for a fluent reply. Every other term still logs its honest mean; the gate's
own column shows how much it took away.

The reward-hacking watch rides along as zero-weight reward functions (reply words, distinct-2,
premise overlap, the share that concede: TRL logs each one's mean as rewards/watch_<stat>/mean);
common/watch.py's `WatchCallback` reads those logs and keeps the length guard.
"""
from __future__ import annotations

import json
import logging
import math

from common.data import n_words, read_jsonl, write_jsonl
from common.runs import RunError
from common.scorers import ScorerError, load_scorer, register
from common.watch import conceded, distinct_n, premise_overlap

log = logging.getLogger("pipeline")

REFERENCE_REPLIES = "reference_replies.jsonl"


def reply_text(completion) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else completion


def premise_text(prompt) -> str:
    return prompt[-1]["content"] if isinstance(prompt, list) else prompt


class Term:
    """A Scorer as a TRL reward function: called (prompts, completions, **kwargs), named by `__name__`
    (TRL's log column rewards/<name>/mean). Keeps its last batch's scores for the gate."""

    def __init__(self, scorer, name: str | None = None):
        self.scorer, self.__name__ = scorer, name or scorer.name
        self.last: tuple[list[str], list[float]] | None = None

    def __call__(self, prompts, completions, **kwargs) -> list[float]:
        replies = [reply_text(c) for c in completions]
        scores = [float(s) for s in self.scorer.score(prompts, replies)]
        if len(scores) != len(replies):
            raise ScorerError(f"reward term {self.__name__} gave {len(scores)} scores for {len(replies)} replies")
        self.last = (replies, scores)
        return scores


# --- the watch's statistics: zero-weight reward functions, so TRL logs their means -------------------

def watch_reply_words(prompts, completions, **_) -> list[float]:
    return [float(n_words(reply_text(c))) for c in completions]


def watch_distinct_2(prompts, completions, **_) -> list[float]:
    """Distinct-2 is a property of the batch: every reply carries the batch's value, so the mean is it."""
    return [distinct_n([reply_text(c) for c in completions], 2)] * len(completions)


def watch_premise_overlap(prompts, completions, **_) -> list[float]:
    return [premise_overlap(premise_text(p), reply_text(c)) for p, c in zip(prompts, completions)]


def watch_conceded(prompts, completions, **_) -> list[float]:
    """1 for a reply that tells the poster they are right (common/watch.py `conceded`): its mean is the batch's share."""
    return [float(conceded(reply_text(c))) for c in completions]


WATCH = (watch_reply_words, watch_distinct_2, watch_premise_overlap, watch_conceded)


# --- PAR -----------------------------------------------------------------------------------------

def par(scores: list[float], reference_scores: list[float]) -> list[float]:
    """sigmoid(score - reference score), each in (0, 1) (written so no exp overflows)."""
    out = []
    for s, r in zip(scores, reference_scores, strict=True):
        d = s - r
        out.append(1 / (1 + math.exp(-d)) if d >= 0 else math.exp(d) / (1 + math.exp(d)))
    return out


class ParScorer:
    """PAR's Scorer: the judge's score of a reply against its score of the reference reply to the same
    prompt (scored once per prompt, the judge being frozen)."""

    def __init__(self, judge, references: dict[str, str]):
        self.judge, self.references, self.name = judge, references, "par"
        self._reference_scores: dict[str, float] = {}

    @property
    def backends(self) -> dict:
        return {"par_judge": self.judge.name, **self.judge.backends}

    def score(self, prompts, replies: list[str]) -> list[float]:
        keys = [json.dumps(p) for p in prompts]
        todo = {k: p for k, p in zip(keys, prompts) if k not in self._reference_scores}
        missing = [k for k in todo if k not in self.references]
        if missing:
            raise ScorerError(f"par: no reference reply for {len(missing)} prompt(s), e.g. {missing[0][:80]}")
        if todo:
            values = self.judge.score(list(todo.values()), [self.references[k] for k in todo])
            self._reference_scores.update(zip(todo, values))
        return par(self.judge.score(prompts, replies), [self._reference_scores[k] for k in keys])


@register("par")
def _par_of_run(path: str, references: dict[str, str] | None = None, batch_size: int = 8, packed: bool = True,
                **_) -> ParScorer:
    """`par:PATH`: PAR against another stage-03 run's judge (stage 04 passes the reference replies)."""
    if references is None:
        raise ScorerError(f"par:{path} needs the reference replies (a stage 04 reward term)")
    from common.judges import load_judge  # any judge run: 4-bit, encoder, features, ensemble
    return ParScorer(load_judge(path, batch_size=batch_size, packed=packed), references)


# --- fluency -------------------------------------------------------------------------------------

class FluencyPenalty:
    """min(0, lp - reference_lp): no reward for fluency above the starting policy's mean, a cost below it.
    A reply too short to score (nan) costs nothing."""

    def __init__(self, fluency, reference_lp: float):
        self.fluency, self.reference_lp, self.name = fluency, reference_lp, "fluency"

    @property
    def backends(self) -> dict:
        return self.fluency.backends

    def score(self, prompts, replies):
        return [0.0 if math.isnan(lp) else min(0.0, lp - self.reference_lp) for lp in self.fluency.score(prompts, replies)]


class FluencyGate:
    """The gate as TRL's last reward function (see the module's docstring): for a reply whose mean token
    log-prob is under `threshold`, the value that makes the weighted sum of every term `gate_reward`;
    0 otherwise. `terms` are the other weighted (Term, weight) pairs, called before it in the batch."""
    __name__ = "fluency_gate"

    def __init__(self, fluency, threshold: float, terms: list[tuple[Term, float]], weight: float,
                 gate_reward: float = 0.0):
        self.scorer, self.threshold, self.terms, self.weight = fluency, threshold, terms, weight
        self.gate_reward = gate_reward

    def __call__(self, prompts, completions, **kwargs) -> list[float]:
        replies = [reply_text(c) for c in completions]
        lps = self.scorer.score(prompts, replies)
        others = [0.0] * len(replies)
        for term, weight in self.terms:
            scores = term.last[1] if term.last and term.last[0] == replies else term(prompts, completions)
            others = [o + weight * s for o, s in zip(others, scores)]
        return [(self.gate_reward - o) / self.weight if not math.isnan(lp) and lp < self.threshold else 0.0
                for lp, o in zip(lps, others)]


def gate_value(reward_sum: float, lp: float, threshold: float, gate_reward: float = 0.0) -> float:
    """The whole reward a reply gets under the gate: `gate_reward` under the threshold, else its sum."""
    return gate_reward if not math.isnan(lp) and lp < threshold else reward_sum


# --- the reference replies (PAR's and the fluency term's) -------------------------------------------

def reference_replies(config, run, policy, tokenizer, prompts: list[list[dict]]) -> dict[str, str]:
    """The starting policy's reply to each train premise, sampled at the rollouts' temperature from the run's
    seed (the distribution the rollouts come from, so that PAR and the fluency gate compare like with like),
    written once to the run directory
    (reference_replies.jsonl, an artifact; its sha256 in the manifest). A resumed run reads them back and
    refuses a file that changed or answers other premises."""
    from common import provenance
    path = run.dir / REFERENCE_REPLIES
    recorded = run.manifest.get("reference_replies_sha256")
    if recorded and not path.is_file():
        raise RunError(f"{path} is gone: the run wrote it (reference_replies_sha256 in the manifest) and PAR and the "
                       f"fluency term measure against it; start a new run")
    if recorded:
        if provenance.sha256_file(path) != recorded:
            raise RunError(f"{path} changed since the run wrote it (sha256 differs from the manifest's "
                           f"reference_replies_sha256): PAR and the fluency term would measure against other "
                           f"replies; start a new run")
        rows = [row for _, row in read_jsonl(path)]
        if [r["prompt"] for r in rows] != prompts:
            raise RunError(f"{path} answers other premises than this run practises on; start a new run")
        log.info("reference replies: %d read back from %s", len(rows), path)
        return {json.dumps(r["prompt"]): r["reply"] for r in rows}
    from common.generation import generate_replies
    replies = generate_replies(policy, tokenizer, prompts, config.max_completion_length, config.rollout_batch_size,
                               temperature=config.temperature, seed=config.seed, weights=config.rollout_weights,
                               static=config.fast_paths and config.rollout_backend == "static")
    policy.train()
    if getattr(run, "is_main", True):  # every process of a launch generates the same greedy replies; one writes
        write_jsonl(path, [{"prompt": p, "reply": r} for p, r in zip(prompts, replies)])
        run.manifest["reference_replies_sha256"] = provenance.sha256_file(path)
        run.save_manifest()
    log.info("reference replies: the starting policy's reply to %d premises (temperature %g) -> %s", len(replies),
             config.temperature, path)
    return {json.dumps(p): r for p, r in zip(prompts, replies)}


# --- the whole reward --------------------------------------------------------------------------------

def build(config, run, policy, tokenizer, prompts: list[list[dict]]) -> tuple[list, list[float], object]:
    """Stage 04's reward functions and weights from `reward_funcs` / `reward_weights`: the declared terms
    in order (a fluency gate moved last), then the watch's statistics at weight 0; and the training judge.
    Records each term in the manifest's `reward_terms`."""
    from common.judges import load_judge  # any judge run: 4-bit, encoder, features, ensemble
    from common.model import resolve_model_path
    specs = list(config.reward_funcs)
    judge = load_judge(config.reward_run, batch_size=config.reward_batch_size, packed=config.fast_paths)
    judge.name = "judge"
    needs_reference = any(s in ("par", "fluency") or s.startswith("par:") for s in specs)
    references = reference_replies(config, run, policy, tokenizer, prompts) if needs_reference else {}
    terms: list[tuple[Term, float]] = []
    gate = None
    record = {}
    for spec, weight in zip(specs, config.reward_weights):
        if spec == "judge":
            scorer = judge
        elif spec == "par":
            scorer = ParScorer(judge, references)
        elif spec == "fluency":
            from common.fluency import FluencyScorer
            fluency = FluencyScorer(resolve_model_path(config.fluency_model_name_or_path),
                                    batch_size=config.reward_batch_size, max_tokens=config.max_completion_length)
            lps = [v for v in fluency.score(prompts, list(references.values())) if not math.isnan(v)]
            reference_lp = sum(lps) / len(lps) if lps else 0.0
            record["fluency_reference_lp"] = reference_lp
            if config.fluency_mode == "gate":
                threshold = config.fluency_threshold if config.fluency_threshold is not None else reference_lp - 1.0
                record["fluency_threshold"] = threshold
                gate = (fluency, threshold, weight)
                continue
            scorer = FluencyPenalty(fluency, reference_lp)
        else:
            try:
                scorer = load_scorer(spec, batch_size=config.reward_batch_size, packed=config.fast_paths,
                                     references=references)
            except (ScorerError, OSError, ValueError) as err:
                raise RunError(f"field 'reward_funcs': {err}") from None
        name = _unique(scorer.name, {t.__name__ for t, _ in terms})
        terms.append((Term(scorer, name), weight))
        record[name] = {"spec": spec, "weight": weight, **scorer.backends}
    funcs, weights = [t for t, _ in terms], [w for _, w in terms]
    if gate is not None:
        fluency, threshold, weight = gate
        funcs.append(FluencyGate(fluency, threshold, terms, weight, config.fluency_gate_reward))
        weights.append(weight)
        record["fluency_gate"] = {"spec": "fluency", "weight": weight, "threshold": threshold, **fluency.backends}
    run.manifest["reward_terms"] = record
    return funcs + list(WATCH), weights + [0.0] * len(WATCH), judge


def _unique(name: str, taken: set[str]) -> str:
    out, i = name, 2
    while out in taken or out.startswith("watch_"):
        out, i = f"{name}_{i}", i + 1
    return out


def term_names(funcs) -> list[str]:
    """The weighted terms' log names (the watch's statistics left out)."""
    return [f.__name__ for f in funcs if f not in WATCH]


def learned_judges(funcs) -> list:
    """The learned judges (RewardScorer: `packed` and `model`) behind the reward functions, each once: the
    fast paths switch their attention and kernels."""
    out = []
    for f in funcs:
        scorer = getattr(f, "scorer", f)
        scorer = getattr(scorer, "judge", scorer)
        if hasattr(scorer, "packed") and hasattr(scorer, "model") and all(scorer is not o for o in out):
            out.append(scorer)
    return out
