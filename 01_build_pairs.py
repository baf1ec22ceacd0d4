"""Stage 01: source rows -> (premise, winner, loser) pairs, split by premise, balanced for length.

    python 01_build_pairs.py --config configs/smol/01_build_pairs.yaml --task cmv --data data/cmv/cmv_pairs.jsonl.gz

Writes train.jsonl, dev.jsonl, test.jsonl and metrics.json (n_input_rows, n_pairs per split,
dropped by reason, length_only_accuracy per split). Every input row is accounted for:
sum(n_pairs) + sum(dropped) == n_input_rows.

Bad-input policy:
- A row that is not valid UTF-8, not valid JSON, not a JSON object, or whose fields are missing or of
  the wrong type stops the stage with `error: FILE:LINE: ...` naming the file, line and field (fix
  the file), unless --skip_bad_rows true, which skips it and counts it under dropped["bad_row"].
- Rows that are well-formed but unusable (no premise, blank, deleted or identical replies, a duplicate
  pair) are always dropped and counted by reason. A duplicate is a pair with the same post and the
  same replies as an earlier one, whatever its pair_id (or a repeated pair_id); a row without pair_id
  gets the digest of its content as id, never its line number.
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

from common.cli import cli
from common.config import PairsConfig
from common.data import (DataError, balance_split, length_kinds, length_only_accuracy, read_jsonl, split_by_group,
                         write_jsonl)
from common.runs import Run
from common.tasks import get_task

log = logging.getLogger("pipeline")
SPLITS = ("train", "dev", "test")


def main(config: PairsConfig, overrides: dict) -> None:
    # 1. Seed, run directory, inputs recorded with their digests.
    random.seed(config.seed)
    task = get_task(config.task)
    run = Run("Pairs", config, overrides, inputs={f"data[{i}]": path for i, path in enumerate(config.data)})
    run.manifest["task"] = task.NAME
    run.save_manifest()
    run.start_tracking()

    # 2. Rows -> pairs, every row either kept or counted under a drop reason.
    n_rows, dropped, scrubbed, pairs, seen_ids, seen_content = 0, Counter(), Counter(), [], set(), set()
    for path in config.data:
        rows_before = n_rows
        for where, row in read_jsonl(path, skip_invalid=config.skip_bad_rows):  # stream damage always raises
            n_rows += 1
            if row is None and config.skip_bad_rows:  # not UTF-8 or not JSON (or a bare null), skipped
                dropped["bad_row"] += 1
                continue
            try:
                pair = task.to_pair(row, where, config.premise_words, config.scrub_giveaways)
            except DataError:
                if not config.skip_bad_rows:
                    raise
                dropped["bad_row"] += 1
                continue
            if isinstance(pair, str):
                dropped[pair] += 1
                continue
            content = (pair["group_id"], pair["chosen"], pair["rejected"])
            if pair["id"] in seen_ids or content in seen_content:  # same pair_id, or same post and replies
                dropped["duplicate_pair"] += 1
            else:
                seen_ids.add(pair["id"])
                seen_content.add(content)
                scrubbed.update(pair["scrubbed"])  # texts whose give-aways were removed, by rule
                pairs.append(pair)
        if n_rows == rows_before:
            run.fail({"task": task.NAME, "n_input_rows": n_rows, "dropped": dict(sorted(dropped.items()))},
                     f"{path}: no rows (the file is empty or holds only blank lines): nothing to build pairs from")
    log.info("%d rows -> %d usable pairs", n_rows, len(pairs))

    # 3. Split by premise (group), then balance each split so reply length cannot pick the winner
    #    (lengths are measured on the scrubbed texts, the ones written).
    splits = split_by_group(pairs, {"train": 1 - config.dev_fraction - config.test_fraction,
                                    "dev": config.dev_fraction, "test": config.test_fraction}, config.seed)
    length_before = {name: length_only_accuracy(rows) for name, rows in splits.items()}
    kinds_before = length_kinds(pairs)
    for name in SPLITS:
        splits[name], removed = balance_split(splits[name], config.length_balance, config.max_length_ratio, config.seed)
        dropped.update(removed)

    # 4. Write the splits and the accounting.
    for name in SPLITS:
        write_jsonl(run.dir / f"{name}.jsonl", splits[name])
    metrics = {
        "task": task.NAME,
        "n_input_rows": n_rows,
        "n_pairs": {name: len(splits[name]) for name in SPLITS},
        "n_groups": {name: len({p["group_id"] for p in splits[name]}) for name in SPLITS},
        "dropped": dict(sorted(dropped.items())),
        "length_only_accuracy": {name: length_only_accuracy(splits[name]) for name in SPLITS},
        "length_only_accuracy_before_balancing": length_before,
        "length_balance": config.length_balance,
        "length_kinds_before_balancing": kinds_before,
        # pairs kept / (2 x min(winner longer, winner shorter)) over the usable pairs
        "kept_vs_balanced_max": _kept_share(splits, kinds_before),
        "scrubbed": dict(sorted(scrubbed.items())),  # kept-or-not texts changed, by rule (not drops)
    }
    accounted = sum(metrics["n_pairs"].values()) + sum(dropped.values())
    assert accounted == n_rows, f"row accounting is off: {accounted} accounted for, {n_rows} read"
    log.info("pairs per split %s, dropped %s, length-only accuracy %s",
             metrics["n_pairs"], metrics["dropped"], metrics["length_only_accuracy"])
    # 5. A pairs run that a later stage cannot use is not finished: no DONE.
    empty = [name for name in ("train", "test") if not splits[name]]
    if empty:
        run.fail(metrics, f"no pairs in the {' and '.join(empty)} split(s) of {n_rows} input rows "
                          f"(dropped: {metrics['dropped'] or 'none'}): check --data and the split and length settings")
    run.finish(metrics)


def _kept_share(splits: dict, kinds: dict) -> float | None:
    """None when one kind is absent (nothing to balance against): JSON has no NaN."""
    most = 2 * min(kinds["winner_longer"], kinds["winner_shorter"])
    return sum(map(len, splits.values())) / most if most else None


if __name__ == "__main__":
    cli(main, PairsConfig, __doc__)
