"""Stage 01: source rows -> examples split by premise: CMV (premise, winner, loser) pairs balanced
for length, or review (paper, structured review) targets.

    python 01_build_pairs.py --config configs/smol/01_build_pairs.yaml --task cmv --data data/cmv/cmv_pairs.jsonl.gz
    python 01_build_pairs.py --config configs/smol/review/01_build_pairs.yaml   # --task review, --review_target

Writes train.jsonl, dev.jsonl, dev_later.jsonl, test.jsonl and metrics.json (n_input_rows, n_pairs per
split, dropped by reason, length_only_accuracy per split, split_by and each split's source periods).
Splits are by post (`split_by: post`; dev_later is then empty), or with `split_by: period` the source's
later period (CMV's `source_split: heldout` posts, whole) is held out: `later_dev_fraction` of its posts
form dev_later, where judges are chosen, the rest test, where they are reported; dev is drawn from the
earlier rest. Every input row is accounted for:
n_rows_used + sum(dropped) == n_input_rows (for CMV a row is one pair, so also
sum(n_pairs) + sum(dropped) == n_input_rows); a review row's reviews are counted in `input_units`.

Bad-input policy:
- A row that is not valid UTF-8, not valid JSON, not a JSON object, or whose fields are missing or of
  the wrong type (or whose op_id is blank) stops the stage with `error: FILE:LINE: ...` naming the
  file, line and field (fix the file), unless --skip_bad_rows true, which skips it and counts it
  under dropped["bad_row"].
- Rows that are well-formed but unusable (no premise, blank, deleted or identical replies, a duplicate
  pair) are always dropped and counted by reason. A duplicate is a pair with the same premise and the
  same replies as an earlier one, compared as normalised text (common/data.normalise_text: NFKC,
  invisible characters removed, white space collapsed, case folded), whatever its pair_id or post id;
  a row without pair_id gets the digest of its content as id, never its line number. A premise already
  seen under another post or paper id is dropped as duplicate_premise (it could land in two splits).
  A row whose pair_id an earlier row with other content holds is kept under `<pair_id>~2` (~3, ...)
  and counted in metrics.json's `renamed_ids`: an id clash is not a duplicate.
- A file damaged as a whole (a .jsonl.gz cut short or corrupt, a file that cannot be read) always
  stops the stage with `error: FILE:LINE: ...`, even with --skip_bad_rows: the rows after the damage
  cannot be counted. Files are read as gzip when their first bytes say so, whatever their name.
- Blank lines are skipped and not counted. An input file with no rows (empty, or only blank lines)
  stops the stage, naming the file; so does a run left with no train or test pairs (no DONE).
"""
from __future__ import annotations

import logging
import random
from collections import Counter
from pathlib import Path

from common.cli import cli
from common.config import PairsConfig
from common.data import balance_split, length_kinds, length_only_accuracy, split_by_group, split_by_period, write_jsonl
from common.runs import Run
from common.source_rows import SourceRows
from common.tasks import get_task
from common.tasks.protocol import options as task_options

log = logging.getLogger("pipeline")
SPLITS = ("train", "dev", "dev_later", "test")  # dev_later: split_by period only


def main(config: PairsConfig, overrides: dict) -> None:
    # 1. Seed, the task and its options (checked before anything is made), run directory, inputs
    #    recorded with their digests.
    random.seed(config.seed)
    task = get_task(config.task)
    options = task_options(task, config.task_options)
    run = Run("Pairs", config, overrides, inputs={**{f"data[{i}]": path for i, path in enumerate(config.data)},
                                                  **{f"pdf[{i}]": path for i, path in enumerate(config.pdf)}})
    run.manifest["task"] = task.NAME
    run.save_manifest()
    run.start_tracking()

    # 2. Source rows -> examples (CMV: one pair; review: one paper's target, or one per review), every
    #    row either used or counted under a drop reason, and every unit inside a row counted too.
    rows = read_rows(config, task, options, run)

    # 3. Split by premise (post, paper), then balance each split so reply length cannot pick the winner
    #    (lengths are measured on the scrubbed texts, the ones written). Rows without a loser (review)
    #    have nothing to balance.
    splits, moved = split_examples(config, rows.examples)
    kept = SPLITS if config.split_by == "period" else tuple(n for n in SPLITS if n != "dev_later")
    before = {"length_only_accuracy_before_balancing": {name: length_only_accuracy(splits[name]) for name in kept},
              "length_kinds_before_balancing": length_kinds(rows.examples)} if task.PAIRWISE else \
        {"length_only_accuracy_before_balancing": None, "length_kinds_before_balancing": None}
    strategy = config.length_balance if task.PAIRWISE else "none"
    for name in splits:
        splits[name], removed = balance_split(splits[name], strategy, config.max_length_ratio, config.seed)
        rows.drop_balanced(removed)

    # 4. Write the splits and the accounting: n_rows_used + sum(dropped) == n_input_rows.
    for name in kept:
        write_jsonl(run.dir / f"{name}.jsonl", splits[name])
    metrics = accounting(config, task, rows, {name: splits[name] for name in kept}, before, strategy, moved)
    assert rows.accounted(), f"row accounting is off: {rows.n_used} used, {dict(rows.dropped)}, {rows.n_rows} read"
    log.info("examples per split %s, dropped %s, length-only accuracy %s",
             metrics["n_pairs"], metrics["dropped"], metrics["length_only_accuracy"])

    # 5. A pairs run that a later stage cannot use is not finished: no DONE.
    empty = [name for name in ("train", "test") if not splits[name]]
    if empty:
        run.fail(metrics, f"no pairs in the {' and '.join(empty)} split(s) of {rows.n_rows} input rows of "
                          f"{', '.join(config.data)} (dropped: {metrics['dropped'] or 'none'}): check --data and "
                          f"the split and length settings")
    run.finish(metrics)


def read_rows(config: PairsConfig, task, options, run: Run) -> SourceRows:
    """Every --data file's rows, counted (common/source_rows.py); a file with no rows ends the run unfinished."""
    rows = SourceRows()
    for i, path in enumerate(config.data):
        rows_before = rows.n_rows
        run.manifest["inputs"][f"data[{i}]"]["sha256"] = rows.read_file(path, task, config, options)  # bytes read
        if rows.n_rows == rows_before:
            run.fail({"task": task.NAME, "n_input_rows": rows.n_rows, "dropped": dict(sorted(rows.dropped.items()))},
                     f"{path}: no rows (the file is empty or holds only blank lines): nothing to build pairs from")
    log.info("%d rows -> %d usable rows, %d examples", rows.n_rows, rows.n_used, len(rows.examples))
    return rows


def split_examples(config: PairsConfig, examples: list[dict]) -> tuple[dict, list[dict]]:
    """The splits by post (dev_later empty), or by period; and, by period, the rows of unknown (or another)
    period that went to test or dev_later with their post's later-period rows."""
    if config.split_by == "period":  # test: the later period's posts, to see whether a judge transfers
        splits = split_by_period(examples, config.dev_fraction, config.seed, config.later_dev_fraction)
        return splits, [p for p in splits["test"] + splits["dev_later"] if p.get("source_split") != "heldout"]
    return {"dev_later": [], **split_by_group(examples, {"train": 1 - config.dev_fraction - config.test_fraction,
                                                         "dev": config.dev_fraction,
                                                         "test": config.test_fraction}, config.seed)}, []


def accounting(config: PairsConfig, task, rows: SourceRows, splits: dict, before: dict, strategy: str,
               moved: list[dict]) -> dict:
    """metrics.json: the counts of every row, the splits as written, and the length shortcut before and after
    balancing."""
    metrics = {
        "task": task.NAME,
        "n_input_rows": rows.n_rows,
        "n_rows_used": rows.n_used,
        "n_pairs": {name: len(split) for name, split in splits.items()},  # examples (pairs, review targets) per split
        "n_groups": {name: len({p["group_id"] for p in split}) for name, split in splits.items()},
        "split_by": config.split_by,
        # the source's periods in each split, as kept (CMV: train, heldout = the later period, unknown)
        "source_split": {name: dict(sorted(Counter(str(p.get("source_split")) for p in split).items()))
                         for name, split in splits.items()},
        "dropped": dict(sorted(rows.dropped.items())),
        "renamed_ids": rows.seen.renamed,  # rows kept under a new id: an earlier row with other content had theirs
        "input_units": dict(sorted(rows.units.items())),  # review: every input review, used or not
        "length_only_accuracy": {name: length_only_accuracy(split) for name, split in splits.items()}
        if task.PAIRWISE else None,
        "length_only_accuracy_before_balancing": before["length_only_accuracy_before_balancing"],
        "length_balance": strategy,
        "length_kinds_before_balancing": before["length_kinds_before_balancing"],
        # pairs kept / (2 x min(winner longer, winner shorter)) over the usable pairs
        "kept_vs_balanced_max": _kept_share(splits, before["length_kinds_before_balancing"]) if task.PAIRWISE else None,
        "scrubbed": dict(sorted(rows.scrubbed.items())),  # kept-or-not texts changed, by rule (not drops)
    }
    if config.split_by == "period":  # counted before balancing, like the splits they were assigned to
        metrics["test_rows_of_other_periods_with_their_post"] = {
            "posts": len({p["group_id"] for p in moved}), "rows": len(moved)}
    if config.pdf:  # a PDF is named after its paper's id: one that names no paper kept was not read
        metrics["pdf_unused"] = sorted(p for p in config.pdf if Path(p).stem not in {e["group_id"] for e in rows.examples})
        if metrics["pdf_unused"]:
            log.warning("%d PDF(s) name no paper that was kept: %s", len(metrics["pdf_unused"]), metrics["pdf_unused"])
    return metrics


def _kept_share(splits: dict, kinds: dict) -> float | None:
    """None when one kind is absent (nothing to balance against): JSON has no NaN."""
    most = 2 * min(kinds["winner_longer"], kinds["winner_shorter"])
    return sum(map(len, splits.values())) / most if most else None


if __name__ == "__main__":
    cli(main, PairsConfig, __doc__)
