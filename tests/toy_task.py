"""A toy task, the worked example of docs/architecture.md ("Adding a task"): echo a text's first words.

A source row is {"id": str, "text": str}; its example asks for the text's first `n_words` words (the
task's one option, `task_options: {n_words: N}`), and those words are the target. Its own metric is
the share of replies that say exactly those words. tests/test_tasks.py registers it and runs it
01 -> 02 -> 05 on the tiny model.
"""
from __future__ import annotations

from dataclasses import dataclass

from common.config import arg, validate
from common.data import fit_prompt, fit_reply, text_field
from common.tasks.protocol import EvalReport

NAME = "echo"
PAIRWISE = False  # one target a row, no loser
READING = "the whole text (it fits)"
NOUNS = {"premise": "text", "premises": "texts", "reference": "first words", "references": "first words"}
PROBES = ()  # no judge of its own to probe
READOUT_SCALE = None  # nothing to read out


@dataclass
class Options:
    """The echo task's knobs, under `task_options` in stage 01's config."""
    n_words: int = arg(6, "words of the text a reply repeats", ge=1)

    def __post_init__(self):
        validate(self)


def rows_from(row, where: str, config, options: Options) -> list[dict] | str:
    """Stage 01: one row -> its example, or a drop reason; a malformed row raises DataError."""
    row_id, text = text_field(row, "id", where, True), text_field(row, "text", where, True)
    if not text.strip():
        return "no_premise"
    target = " ".join(text.split()[: options.n_words])
    return [{"id": row_id, "group_id": row_id, "premise": text, "chosen": target,
             "prompt": [{"role": "user", "content": f"Repeat the first {options.n_words} words of: {text}"}]}]


def check_config(config) -> None:
    """Every setting works for the echo task."""


def input_units(row) -> dict[str, int]:
    return {}


def sft_examples(row: dict, tokenizer, config) -> list[dict]:
    prompt = fit_prompt(tokenizer, row["prompt"], config.max_prompt_tokens)
    return [{"prompt": prompt, "completion": [{"role": "assistant",
                                               "content": fit_reply(tokenizer, prompt, row["chosen"], config.max_length)}]}]


def references(row: dict) -> list[str]:
    return [row["chosen"]]


def display(row: dict) -> str:
    return row["premise"]


def evaluate(premises: list[dict], replies: dict[str, list[str]], *, train: list[dict], readouts: dict,
             rating: dict | None, seed: int) -> EvalReport:
    """Stage 05: each model's share of replies that are exactly the text's first words."""
    exact = {name: [r.strip() == p["chosen"] for r, p in zip(texts, premises)] for name, texts in replies.items()}
    return EvalReport(
        metrics={name: {"exact_match": sum(hits) / len(hits)} for name, hits in exact.items()},
        per_reply={name: [{"exact": hit} for hit in hits] for name, hits in exact.items()},
        sections=["", "## Echo", "", "| model | exact match |", "| --- | --- |",
                  *(f"| {name} | {sum(hits) / len(hits):.2f} |" for name, hits in exact.items())])
