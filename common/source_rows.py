"""Stage 01's row accounting: every source row read is used or counted under a drop reason, and every
unit inside a row (review: its reviews) is counted too, so that n_rows_used + sum(dropped) ==
n_input_rows holds (01_build_pairs.py asserts it)."""
from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field

from common.data import DataError, SeenRows, read_jsonl


@dataclass
class SourceRows:
    """The examples built so far and the counts behind them."""
    examples: list[dict] = field(default_factory=list)
    n_rows: int = 0  # rows read (blank lines are not rows)
    n_used: int = 0  # rows whose examples were kept
    dropped: Counter = field(default_factory=Counter)  # reason -> rows
    scrubbed: Counter = field(default_factory=Counter)  # give-away rule -> texts it changed (kept or not)
    units: Counter = field(default_factory=Counter)  # task.input_units, `_in_dropped_rows` for a dropped row's
    seen: SeenRows = field(default_factory=SeenRows)  # earlier rows' pairs and premises, and renamed ids

    def read_file(self, path: str, task, config, options) -> str:
        """Every row of one file into the counts; returns the sha256 of the bytes read. A damaged file
        always raises; a bad row raises unless config.skip_bad_rows."""
        digest = hashlib.sha256()
        for where, row in read_jsonl(path, skip_invalid=config.skip_bad_rows, digest=digest):
            self.n_rows += 1
            if row is None and config.skip_bad_rows:  # not UTF-8 or not JSON (or a bare null), skipped
                self.dropped["bad_row"] += 1
                continue
            try:
                made = task.rows_from(row, where, config, options)
            except DataError:
                if not config.skip_bad_rows:
                    raise
                self.dropped["bad_row"] += 1
                continue
            self._count(row, made, task)
        return digest.hexdigest()

    def _count(self, row, made: list[dict] | str, task) -> None:
        reason = made if isinstance(made, str) else None
        reason = reason or self.seen.repeat(made)  # an earlier row's pair, or its premise under another id
        suffix = "" if reason is None else "_in_dropped_rows"
        self.units.update({f"{k}{suffix}": v for k, v in task.input_units(row).items()})
        if reason is not None:
            self.dropped[reason] += 1
            return
        self.n_used += 1
        self.seen.add(made)
        for example in made:
            self.scrubbed.update(example.get("scrubbed", []))  # texts whose give-aways were removed, by rule
            self.examples.append(example)

    def drop_balanced(self, removed: Counter) -> None:
        """Pairs removed by length balancing: a CMV row is one pair, so a pair balanced away is its row dropped."""
        self.dropped.update(removed)
        self.n_used -= sum(removed.values())

    def accounted(self) -> bool:
        return self.n_used + sum(self.dropped.values()) == self.n_rows
