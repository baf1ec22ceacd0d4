"""Tasks: each module knows how to read its source rows, build prompts and targets, and its extra
metrics. Stages look a task up by name here and never branch on it.

A task module has:
- `NAME`; `PAIRWISE` (rows carry a winner and a loser: stage 01 balances them for length; without a
  loser, stage 04_train_dpo generates the rejected reply); `READING` (how stage 05 reads a long input)
- `rows_from(row, where, config)`: stage 01, one source row -> its examples, or a drop reason;
  malformed rows raise DataError naming FILE:LINE and the field
- `check_config(config)`: any stage on the task's runs, before its run directory exists: a setting
  the task cannot work with raises ConfigError naming the field
- `input_units(row)`: stage 01, counts of what a row holds besides itself (review: its reviews)
- `sft_examples(row, tokenizer, config)`: stage 02, prompt/completion examples within max_length
- `references(row)`: stage 05, the real replies a generated one is compared with
- `display(row)` and `NOUNS`: stage 05, the text a premise is shown by, and what its report calls a
  premise and a real reply (review: a paper, a real review)
- `PROBES`: stage 03's shortcut probes of a judge (common/audit.py; empty where no judge trains)
- `evaluate(premises, replies, results, pairs_run, readouts, seed)`: stage 05, the task's own metrics
- `train_judge(config, run)` (optional): stage 03 for a task whose judge is no pairwise reward model
  (review: a rating model, common/rating_model.py); returns the run's metrics
- `READOUT_SCALE`: a rating scale read from the model where a reply writes none (review: 1-6), or
  None; with it `readout_turn(reply)` (the assistant's turn the rating is read after) and
  `reading_windows(row, tokenizer, max_prompt_tokens, overlap)` (stage 05, reading all_windows)
"""
from common.tasks import cmv, review

TASKS = {cmv.NAME: cmv, review.NAME: review}


def get_task(name: str):
    if name not in TASKS:
        raise ValueError(f"unknown task '{name}' (known: {', '.join(sorted(TASKS))})")
    return TASKS[name]
