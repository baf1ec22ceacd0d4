"""What a task is to the stages: the `Task` Protocol (a task module meets it), `EvalReport` (what its
stage-05 `evaluate` returns) and `options` (its `Options` from the pairs run's `task_options`).

A task is a module, registered by name in common/tasks/__init__.py. Stages call only these hooks and
never branch on the task's name; tests/test_tasks.py checks that every registered task meets them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol, Sequence, runtime_checkable

from common.config import ConfigError


def _no_plots(out_dir: Path) -> dict[str, Path]:
    return {}


@dataclass(frozen=True)
class EvalReport:
    """A task's own stage-05 results, beside the shared ones (overlap, reply shape, judges)."""
    metrics: dict[str, dict] = field(default_factory=dict)  # model -> its task metrics, added to its eval.json entry
    baselines: dict[str, dict] = field(default_factory=dict)  # eval.json entries beside the models (review: a constant)
    per_reply: dict[str, list[dict]] = field(default_factory=dict)  # model -> one dict a premise, into replies.jsonl
    sections: list[str] = field(default_factory=list)  # report.md lines, after the shared table
    plots: Callable[[Path], dict[str, Path]] = _no_plots  # writes its plots into the run directory: {title: path}


@runtime_checkable
class Task(Protocol):
    """The hooks of a task module (module-level names; `Options` a dataclass)."""
    NAME: str  # its registry name, recorded in every run's manifest
    PAIRWISE: bool  # rows carry a winner and a loser: 01 balances them for length; without one, 04_train_dpo generates it
    READING: str  # how 05 reads a long input, in the report's words
    NOUNS: dict[str, str]  # what 05's report calls a premise and a real reply: premise(s), reference(s)
    PROBES: Sequence  # stage 03's shortcut probes of a judge (common/audit.py); empty where no judge trains
    READOUT_SCALE: tuple[int, int] | None  # a rating read from the model where a reply writes none (ReadsRatings)
    Options: type  # a dataclass of the task's knobs, built from `task_options` (options())

    def rows_from(self, row, where: str, config, options) -> list[dict] | str:
        """Stage 01: one source row -> its examples (`id`, `group_id`, `prompt` as chat messages, `chosen`,
        and `rejected` when PAIRWISE), or a drop reason; a malformed row raises DataError naming `where`
        (FILE:LINE) and the field."""

    def check_config(self, config) -> None:
        """Any stage on the task's runs, before its run directory exists: ConfigError naming a field the
        task cannot work with."""

    def input_units(self, row) -> dict[str, int]:
        """Stage 01: counts of what a row holds besides itself (review: its reviews); {} for none."""

    def sft_examples(self, row: dict, tokenizer, config) -> list[dict]:
        """Stage 02: prompt/completion examples of one row, within config.max_length."""

    def references(self, row: dict) -> list[str]:
        """Stage 05: the real replies a generated one is compared with."""

    def display(self, row: dict) -> str:
        """Stage 05: the text a premise is shown by."""

    def evaluate(self, premises: list[dict], replies: dict[str, list[str]], *, train: list[dict],
                 readouts: dict, rating: dict | None, seed: int) -> EvalReport:
        """Stage 05: the task's own metrics of every model's replies. `train`: the pairs run's train split;
        `readouts`: model -> ratings read out (ReadsRatings tasks, else {}); `rating`: the rating sources of
        common/rating_sources.py, or None. Reads its arguments only: it writes into none of them."""


@runtime_checkable
class ReadsRatings(Protocol):
    """A task with a READOUT_SCALE also has these (common/readout.py)."""

    def readout_turn(self, reply: str) -> str:
        """The assistant's turn the rating is read after."""

    def reading_windows(self, row: dict, tokenizer, max_prompt_tokens: int, overlap: int) -> list[list[dict]]:
        """Stage 05, reading all_windows: the input as prompts of at most max_prompt_tokens tokens."""


@runtime_checkable
class TrainsJudge(Protocol):
    """Optional: stage 03 for a task whose judge is no pairwise reward model (review: a rating model)."""

    def train_judge(self, config, run) -> dict:
        """Trains the judge into the run directory; returns the run's metrics."""


def options(task, given: dict):
    """The task's `Options` from the `task_options` mapping: an unknown key, a wrong type or a value out of
    bounds is a ConfigError naming `task_options.<field>` and the task."""
    known = [f.name for f in dataclasses.fields(task.Options)]
    for key in given:
        if key not in known:
            raise ConfigError(f"field 'task_options.{key}': the {task.NAME} task has no such option (its options: "
                              f"{', '.join(known) or 'none'})", "task_options")
    try:
        return task.Options(**given)
    except ConfigError as err:  # config.validate names the field alone
        raise ConfigError(str(err).replace(f"field '{err.field}'", f"field 'task_options.{err.field}'", 1) +
                          f" (the {task.NAME} task)", "task_options") from None
