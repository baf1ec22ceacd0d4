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

import hashlib
import logging
import random
from collections import Counter
from pathlib import Path

from common.cli import cli
from common.config import PairsConfig
from common.data import (
    DataError,
    SeenRows,
    balance_split,
    length_kinds,
    length_only_accuracy,
    read_jsonl,
    split_by_group,
    split_by_period,
    write_jsonl,
)
from common.runs import Run
from common.tasks import get_task

log = logging.getLogger("pipeline")
SPLITS = ("train", "dev", "dev_later", "test")  # dev_later: split_by period only


def main(config: PairsConfig, overrides: dict) -> None:
    # 1. Seed, run directory, inputs recorded with their digests.
    random.seed(config.seed)
    task = get_task(config.task)
    run = Run("Pairs", config, overrides, inputs={**{f"data[{i}]": path for i, path in enumerate(config.data)},
                                                  **{f"pdf[{i}]": path for i, path in enumerate(config.pdf)}})
    run.manifest["task"] = task.NAME
    run.save_manifest()
    run.start_tracking()

    # 2. Source rows -> examples (CMV: one pair; review: one paper's target, or one per review), every
    #    row either used or counted under a drop reason, and every unit inside a row counted too.
    n_rows, n_used, dropped, scrubbed, units = 0, 0, Counter(), Counter(), Counter()
    examples, seen = [], SeenRows()
    for i, path in enumerate(config.data):
        rows_before, digest = n_rows, hashlib.sha256()
        for where, row in read_jsonl(path, skip_invalid=config.skip_bad_rows, digest=digest):  # damage always raises
            n_rows += 1
            if row is None and config.skip_bad_rows:  # not UTF-8 or not JSON (or a bare null), skipped
                dropped["bad_row"] += 1
                continue
            try:
                made = task.rows_from(row, where, config)
            except DataError:
                if not config.skip_bad_rows:
                    raise
                dropped["bad_row"] += 1
                continue
            reason = made if isinstance(made, str) else None
            reason = reason or seen.repeat(made)  # an earlier row's pair, or its premise under another id
            units.update({f"{k}{'' if reason is None else '_in_dropped_rows'}": v for k, v in task.input_units(row).items()})
            if reason is not None:
                dropped[reason] += 1
                continue
            n_used += 1
            seen.add(made)
            for e in made:
                scrubbed.update(e.get("scrubbed", []))  # texts whose give-aways were removed, by rule
                examples.append(e)
        run.manifest["inputs"][f"data[{i}]"]["sha256"] = digest.hexdigest()  # of the bytes read, not a re-read
        if n_rows == rows_before:
            run.fail({"task": task.NAME, "n_input_rows": n_rows, "dropped": dict(sorted(dropped.items()))},
                     f"{path}: no rows (the file is empty or holds only blank lines): nothing to build pairs from")
    log.info("%d rows -> %d usable rows, %d examples", n_rows, n_used, len(examples))

    # 3. Split by premise (post, paper), then balance each split so reply length cannot pick the winner
    #    (lengths are measured on the scrubbed texts, the ones written). Rows without a loser (review)
    #    have nothing to balance.
    strategy = config.length_balance if task.PAIRWISE else "none"
    if config.split_by == "period":  # test: the later period's posts, to see whether a judge transfers
        splits = split_by_period(examples, config.dev_fraction, config.seed, config.later_dev_fraction)
    else:
        splits = {"dev_later": [], **split_by_group(examples, {"train": 1 - config.dev_fraction - config.test_fraction,
                                                               "dev": config.dev_fraction,
                                                               "test": config.test_fraction}, config.seed)}
    # Rows of unknown (or another) period that went to test with their post's later-period rows.
    moved = [p for p in splits["test"] + splits["dev_later"] if p.get("source_split") != "heldout"] \
        if config.split_by == "period" else []
    kept = SPLITS if config.split_by == "period" else tuple(n for n in SPLITS if n != "dev_later")
    length_before = {name: length_only_accuracy(splits[name]) for name in kept} if task.PAIRWISE else None
    kinds_before = length_kinds(examples) if task.PAIRWISE else None
    for name in splits:
        splits[name], removed = balance_split(splits[name], strategy, config.max_length_ratio, config.seed)
        dropped.update(removed)
        n_used -= sum(removed.values())  # a CMV row is one pair: a pair balanced away is its row dropped

    # 4. Write the splits and the accounting: n_rows_used + sum(dropped) == n_input_rows.
    for name in kept:
        write_jsonl(run.dir / f"{name}.jsonl", splits[name])
    metrics = {
        "task": task.NAME,
        "n_input_rows": n_rows,
        "n_rows_used": n_used,
        "n_pairs": {name: len(splits[name]) for name in kept},  # examples (pairs, review targets) per split
        "n_groups": {name: len({p["group_id"] for p in splits[name]}) for name in kept},
        "split_by": config.split_by,
        # the source's periods in each split, as kept (CMV: train, heldout = the later period, unknown)
        "source_split": {name: dict(sorted(Counter(str(p.get("source_split")) for p in splits[name]).items()))
                         for name in kept},
        "dropped": dict(sorted(dropped.items())),
        "renamed_ids": seen.renamed,  # rows kept under a new id: an earlier row with other content had theirs
        "input_units": dict(sorted(units.items())),  # review: every input review, used or not
        "length_only_accuracy": {name: length_only_accuracy(splits[name]) for name in kept} if task.PAIRWISE else None,
        "length_only_accuracy_before_balancing": length_before,
        "length_balance": strategy,
        "length_kinds_before_balancing": kinds_before,
        # pairs kept / (2 x min(winner longer, winner shorter)) over the usable pairs
        "kept_vs_balanced_max": _kept_share(splits, kinds_before) if task.PAIRWISE else None,
        "scrubbed": dict(sorted(scrubbed.items())),  # kept-or-not texts changed, by rule (not drops)
    }
    if config.split_by == "period":  # counted before balancing, like the splits they were assigned to
        metrics["test_rows_of_other_periods_with_their_post"] = {
            "posts": len({p["group_id"] for p in moved}), "rows": len(moved)}
    if config.pdf:  # a PDF is named after its paper's id: one that names no paper kept was not read
        metrics["pdf_unused"] = sorted(p for p in config.pdf if Path(p).stem not in {e["group_id"] for e in examples})
        if metrics["pdf_unused"]:
            log.warning("%d PDF(s) name no paper that was kept: %s", len(metrics["pdf_unused"]), metrics["pdf_unused"])
    accounted = n_used + sum(dropped.values())
    assert accounted == n_rows, f"row accounting is off: {accounted} accounted for, {n_rows} read"
    log.info("examples per split %s, dropped %s, length-only accuracy %s",
             metrics["n_pairs"], metrics["dropped"], metrics["length_only_accuracy"])

    # 5. A pairs run that a later stage cannot use is not finished: no DONE.
    empty = [name for name in ("train", "test") if not splits[name]]
    if empty:
        run.fail(metrics, f"no pairs in the {' and '.join(empty)} split(s) of {n_rows} input rows of "
                          f"{', '.join(config.data)} (dropped: {metrics['dropped'] or 'none'}): check --data and "
                          f"the split and length settings")
    run.finish(metrics)


def _kept_share(splits: dict, kinds: dict) -> float | None:
    """None when one kind is absent (nothing to balance against): JSON has no NaN."""
    most = 2 * min(kinds["winner_longer"], kinds["winner_shorter"])
    return sum(map(len, splits.values())) / most if most else None


if __name__ == "__main__":
    cli(main, PairsConfig, __doc__)
