"""Stage 03's --hard_negatives: a policy's own replies as losers against the real winners of the same
posts, so that a judge's second round learns the tricks the policy found against its first.

The replies come from a finished stage-05 Eval run (its replies.jsonl: one row a premise, one entry a
model, e.g. `base`, `sft`, a GRPO run's name). `RUN:MODEL` takes one model's replies; a bare `RUN`
takes those of every model in `hard_negative_models`. A reply is matched to its post by the premise's
id, else by the premise's text (as replies.jsonl shows it), in the judge's pairs run. Its post must be
one the judge trains on: a reply to a post of any other split (dev, dev_later, test: where the judge
is measured) or of a cross-fit's left-out fold is refused, the whole run with it, and so is a reply to
a post the pairs run does not hold (05's --eval_data): there is no real winner to pair it with.
"""
from __future__ import annotations

from pathlib import Path

from common.data import read_jsonl
from common.runs import RunError

SPLITS = ("train", "dev", "dev_later", "test")
NEGATIVE = "hard_negative"


def parse(spec: str, default_models: list[str]) -> tuple[str, list[str]]:
    """`RUN:MODEL` -> (RUN, [MODEL]); `RUN` -> (RUN, default_models). A run path that itself holds a ':'
    is read as a bare run when it exists as a folder."""
    run, sep, model = spec.rpartition(":")
    if not sep or Path(spec).is_dir():
        return spec, list(default_models)
    return run, [model]


def hard_negative_pairs(specs: list[str], default_models: list[str], pairs_run: str, train_splits: list[str],
                        left_out_posts: set[str], display) -> tuple[list[dict], dict]:
    """(winner over the policy's reply) pairs from every spec, and {"RUN:MODEL": pairs}. `train_splits`:
    the splits the judge trains on; `left_out_posts`: a cross-fit's left-out fold (held out too);
    `display(row)`: the task's premise text as replies.jsonl shows it. RunError naming the run and the
    count when a reply answers a held-out post, or a post the pairs run does not hold."""
    where, winners = _index(pairs_run, train_splits, display)
    pairs, counts = [], {}
    for spec in specs:
        run, models = parse(spec, default_models)
        rows = [row for _, row in read_jsonl(Path(run) / "replies.jsonl")]
        known = sorted({k for row in rows[:1] for k, v in row.items() if isinstance(v, dict) and "reply" in v})
        for model in models:
            if model not in known:
                raise RunError(f"--hard_negatives {run}: no model {model!r} in its replies.jsonl (it has: "
                               f"{', '.join(known) or 'none'})")
        held, unknown = [], []
        for row in rows:
            split, group = where.get(("id", row.get("id"))) or where.get(("text", row.get("premise"))) or (None, None)
            if split is None:
                unknown.append(row.get("id"))
            elif split not in train_splits or group in left_out_posts:
                held.append((split if group not in left_out_posts else "the left-out fold", group))
        if held:
            splits = sorted({s for s, _ in held})
            raise RunError(f"--hard_negatives {run}: {len(held)} of its {len(rows)} premises are posts of the judge's "
                           f"held-out splits ({', '.join(splits)}; e.g. post {held[0][1]}): a judge must not train on "
                           f"the posts it is measured on; give an Eval run of the judge's training posts "
                           f"(05_eval.py --split {train_splits[0]})")
        if unknown:
            raise RunError(f"--hard_negatives {run}: {len(unknown)} of its {len(rows)} premises are not posts of the "
                           f"pairs run {pairs_run} (e.g. premise {unknown[0]}): their replies have no real winner to "
                           f"lose to")
        for model in models:
            made = []
            for row in rows:
                _, group = where.get(("id", row.get("id"))) or where[("text", row.get("premise"))]
                reply = row[model]["reply"]
                for j, winner in enumerate(winners[group]):
                    made.append({"id": f"{row['id']}:{Path(run).name}:{model}:{j}", "group_id": group,
                                 "premise": winner.get("premise"), "prompt": winner["prompt"],
                                 "chosen": winner["chosen"], "rejected": reply, "negative": NEGATIVE})
            counts[f"{Path(run).name}:{model}"] = len(made)
            pairs += made
    return pairs, counts


def _index(pairs_run: str, train_splits: list[str], display) -> tuple[dict, dict]:
    """Where each premise of the pairs run is ({("id", id) or ("text", premise): (split, post)}), and
    the distinct winners of each training post ({post: [winner rows]})."""
    where, winners = {}, {}
    for split in SPLITS:
        path = Path(pairs_run) / f"{split}.jsonl"
        if not path.is_file():
            continue
        for _, row in read_jsonl(path):
            where.setdefault(("id", row["id"]), (split, row["group_id"]))
            where.setdefault(("text", display(row)[:2000]), (split, row["group_id"]))
            if split in train_splits:
                same = winners.setdefault(row["group_id"], [])
                if all(w["chosen"] != row["chosen"] for w in same):
                    same.append(row)
    return where, winners
