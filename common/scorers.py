"""The Scorer seam: anything that turns (prompt, reply) pairs into one number each.

A learned judge (a stage-03 run), a cross-fit of judges, an ensemble, a fluency scorer and a plain
Python function all meet one Protocol, so stage 04 can practise against any weighted sum of them (TRL's
`reward_funcs` + `reward_weights`) and stage 05 can score with any of them. A new reward is one
function plus a line of YAML:

    # mypkg/rewards.py
    def shorter_is_better(prompts, replies, **kwargs):
        return [-len(r.split()) / 100 for r in replies]

    # configs/<recipe>/04_train_grpo.yaml
    reward_funcs: [judge, "mypkg.rewards:shorter_is_better"]
    reward_weights: [1.0, 0.1]

A spec names a scorer: `run:PATH` (a stage-03 run), `pkg.mod:fn` (a function or a Scorer factory),
or `KIND:ARG` for any kind in the registry (`register`). `load_scorer(spec)` builds it.
"""
from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path
from typing import Callable, Protocol, runtime_checkable


@runtime_checkable
class Scorer(Protocol):
    """One number per (prompt, reply), in input order. `prompts` are chat messages (a list of
    {"role", "content"} dicts each), `replies` plain strings."""
    name: str

    def score(self, prompts: list[list[dict]], replies: list[str]) -> list[float]: ...

    @property
    def backends(self) -> dict:
        """How it scores, for the manifest (e.g. {"judge_scoring": "packed"}); {} when nothing to say."""
        ...


class ScorerError(ValueError):
    """A spec that names no scorer, or a scorer that does not meet the Protocol."""


class FunctionScorer:
    """A plain function `fn(prompts, replies, **kwargs) -> list[float]` as a Scorer (TRL's reward
    functions take `(prompts, completions, **kwargs)`: the same call)."""

    def __init__(self, fn: Callable, name: str | None = None):
        self.fn, self.name = fn, name or getattr(fn, "__name__", type(fn).__name__)

    def score(self, prompts, replies, **kwargs) -> list[float]:
        scores = self.fn(prompts, replies, **kwargs)
        if len(scores) != len(replies):
            raise ScorerError(f"reward function {self.name} returned {len(scores)} scores for {len(replies)} replies")
        return [float(s) for s in scores]

    @property
    def backends(self) -> dict:
        return {"scoring": "function"}


# kind -> factory(arg: str, **context) -> Scorer. `context` carries what a stage knows (batch_size,
# packed, premises, ...); a factory takes what it needs and ignores the rest.
SCORERS: dict[str, Callable[..., Scorer]] = {}


def register(kind: str):
    """Decorator: `@register("fluency")` makes `fluency:ARG` a spec."""
    def add(factory):
        SCORERS[kind] = factory
        return factory
    return add


# A stage-03 run's judge_backbone -> the Scorer class that loads such a run (`from_run`), by name: the
# modules that implement the seam depend on it, not the other way round.
JUDGE_RUNS = {"features": "common.feature_judge:FeatureScorer", "ensemble": "common.ensemble:EnsembleScorer",
              "model": "common.rewards:RewardScorer"}  # "model": lora_4bit, encoder and every other backbone
# What may wrap any judge run once built, as its run says (`wrap(judge, path, config)`): the topic gate.
JUDGE_RUN_WRAPPERS = ("common.topic_gate:TopicGated",)


def _named(target: str):
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


@register("run")
def _judge_run(path: str, batch_size: int = 8, packed: bool = True, **_) -> Scorer:
    """A stage-03 run's judge, built by its config's judge_backbone: a model (lora_4bit, encoder), the
    feature judge (features) or an ensemble of judge runs (ensemble); gated when the run has a topic gate."""
    from common.config import RewardStageConfig, load_run_config
    config = load_run_config(path)
    backbone = config.judge_backbone if isinstance(config, RewardStageConfig) else None
    judge = _named(JUDGE_RUNS.get(backbone, JUDGE_RUNS["model"])).from_run(path, batch_size=batch_size, packed=packed)
    for wrapper in JUDGE_RUN_WRAPPERS:
        judge = _named(wrapper).wrap(judge, path, config)
    return judge


# Modules whose scorers register themselves when imported: imported on the first load_scorer.
BUILTIN_MODULES = ("common.fluency", "common.reward_terms", "common.judges")

DOTTED = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def load_scorer(spec: str, **context) -> Scorer:
    """The Scorer a spec names: `KIND:ARG` for a registered kind, `pkg.mod:fn` for a function (wrapped in
    FunctionScorer) or a factory returning a Scorer, or a bare existing folder (a stage-03 run)."""
    for module in BUILTIN_MODULES:
        importlib.import_module(module)
    kind, _, arg = spec.partition(":")
    if kind in SCORERS and arg:
        scorer = SCORERS[kind](arg, **context)
    elif DOTTED.match(spec):
        module, _, attr = spec.partition(":")
        try:
            target = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as err:
            raise ScorerError(f"scorer {spec!r}: cannot import {attr} from {module} ({err})") from None
        scorer = target if isinstance(target, Scorer) else _from_callable(target, spec)
    elif Path(spec).is_dir():
        scorer = SCORERS["run"](spec, **context)
    else:
        raise ScorerError(f"scorer {spec!r}: not a known kind ({', '.join(sorted(SCORERS))}), a 'pkg.module:function' "
                          f"path or a run directory")
    if not isinstance(scorer, Scorer):
        raise ScorerError(f"scorer {spec!r}: {type(scorer).__name__} has no name, score() and backends")
    return scorer


def _from_callable(target, spec: str) -> Scorer:
    """A class or factory taking no arguments that builds a Scorer, or a reward function."""
    if inspect.isclass(target):
        return target()
    return FunctionScorer(target, name=spec.rpartition(":")[2])
