"""Corruptions of a real reply: text a judge must never prefer to the reply it was made from.

A GRPO policy trained against a judge that had only ever compared real replies wrote word salad, and
judges of the same recipe preferred that salad to SFT's replies (docs/results.md). Each kind below
keeps what a shallow judge may read (the reply's words, its length, its topic) and destroys what
makes it a reply:

- `shuffle`: the reply's words in a random order (same words, same length).
- `salad`: words drawn at random from the reply's own vocabulary, as many as it has.
- `repeat`: one sentence of the reply repeated to the reply's length (a one-sentence reply: its
  first third of words).
- `premise_copy`: the premise copied back as the reply, cut to the reply's length.
- `other_post`: a real reply to another post (fluent, but not an answer to this one).
- `cut`: the reply cut near half-way, mid-sentence: never at a sentence end.

Each is a pure function of (reply, premise, replies to other posts, seed): its random choices come
from a generator seeded by the seed, the kind and the reply, so a corruption is the same in every
process and every run. Stage 03 trains on (real reply over its corruption) pairs (`--corruptions`)
and every judge's audit measures how often the judge prefers the real reply (`corruption_audit`).
"""
from __future__ import annotations

import random
from typing import Callable, Sequence

import numpy as np

from common.data import SENTENCE_END
from common.metrics import bootstrap_ci, wins

KINDS = ("shuffle", "salad", "repeat", "premise_copy", "other_post", "cut")
TARGET = 0.98  # the share of real-over-corruption verdicts a judge should reach for every kind
SENTENCE_MARKS = ".!?"
OTHER_CANDIDATES = 4  # replies of other posts drawn per reply, one of which other_post takes


def _rng(kind: str, reply: str, seed: int) -> random.Random:
    # A string seed is hashed (SHA-512) by `random`, not by Python's per-process hash: the same in every process.
    return random.Random(f"{seed}\0{kind}\0{reply}")


def shuffle(reply: str, premise: str, others: Sequence[str], rng: random.Random) -> str:
    words = reply.split()
    shuffled = list(words)
    for _ in range(10):  # a short reply can come back in its own order
        rng.shuffle(shuffled)
        if shuffled != words:
            break
    return " ".join(shuffled)


def salad(reply: str, premise: str, others: Sequence[str], rng: random.Random) -> str:
    words = reply.split()
    vocabulary = sorted(set(words))
    return " ".join(rng.choice(vocabulary) for _ in words) if vocabulary else ""


def repeat(reply: str, premise: str, others: Sequence[str], rng: random.Random) -> str:
    n = len(reply.split())
    sentences = [s.split() for s in SENTENCE_END.split(reply.strip()) if s.strip()]
    shorter = [s for s in sentences if len(s) < n]
    unit = rng.choice(shorter) if shorter else reply.split()[: max(1, n // 3)]
    if not unit:
        return ""
    return " ".join((unit * (n // len(unit) + 1))[:n])


def premise_copy(reply: str, premise: str, others: Sequence[str], rng: random.Random) -> str:
    return " ".join(premise.split()[: len(reply.split())])


def other_post(reply: str, premise: str, others: Sequence[str], rng: random.Random) -> str:
    candidates = [o for o in others if o.strip() and o != reply]
    if not candidates:
        raise ValueError("other_post needs a reply to another post (`others`)")
    return rng.choice(candidates)


def cut(reply: str, premise: str, others: Sequence[str], rng: random.Random) -> str:
    """The first words up to about half, ending on a word that does not end a sentence (a word that
    does is left out, or, when every word near half does, its mark is dropped)."""
    words = reply.split()
    if len(words) < 2:
        return ""
    half = max(1, len(words) // 2)
    for end in sorted(range(1, len(words)), key=lambda k: (abs(k - half), k)):
        if not words[end - 1].endswith(tuple(SENTENCE_MARKS)):
            return " ".join(words[:end])
    return " ".join(words[:half]).rstrip(SENTENCE_MARKS + "\"')")


CORRUPT: dict[str, Callable] = {"shuffle": shuffle, "salad": salad, "repeat": repeat, "premise_copy": premise_copy,
                                "other_post": other_post, "cut": cut}


def corrupt(kind: str, reply: str, premise: str = "", others: Sequence[str] = (), seed: int = 0) -> str:
    """The `kind` corruption of `reply` (to `premise`; `others`: replies to other posts, for other_post)."""
    if kind not in CORRUPT:
        raise ValueError(f"unknown corruption {kind!r} (known: {', '.join(KINDS)})")
    return CORRUPT[kind](reply, premise, others, _rng(kind, reply, seed))


# --- (real reply, its corruption) pairs --------------------------------------------------------------

def premise_of(row: dict) -> str:
    """A pair's premise text: the post (its `premise`), else the last user turn of its prompt."""
    return row.get("premise") or [m["content"] for m in row["prompt"] if m["role"] == "user"][-1]


def _others(rows: list[dict], index: int, rng: random.Random) -> list[str]:
    """A few replies of posts other than rows[index]'s, drawn from `rows` (no scan of every row)."""
    group, out = rows[index]["group_id"], []
    for _ in range(8 * OTHER_CANDIDATES):
        row = rows[rng.randrange(len(rows))]
        if row["group_id"] != group:
            out.append(row[rng.choice(("chosen", "rejected"))])
            if len(out) == OTHER_CANDIDATES:
                break
    return out


def corrupted(rows: list[dict], kind: str, seed: int, keys: Sequence[str] = ("chosen", "rejected"),
              visible: Callable | None = None, share: float | None = None) -> tuple[list[dict], int]:
    """(real reply over its `kind` corruption) pairs from the pairs `rows`: for each row, each of `keys`
    (the winner and the loser are both real replies) gives a pair whose `chosen` is that reply and whose
    `rejected` is its corruption, marked `negative: kind` (`real`: which reply, `row`: its row's index). With `share`, round(share x len(rows)) pairs,
    each from a row and one of its replies drawn at random (seeded). `visible(prompt, reply)` is the part
    of a reply the judge reads (its token budget cuts long replies): the corruption is made of that, so
    that a cut or a copy differs from the reply where the judge looks. Returns (pairs, skipped): a
    corruption that is empty or equal to its reply (a one-word reply shuffled) is skipped and counted."""
    rng = random.Random(f"{seed}\0{kind}\0pairs")
    picks = [(i, key) for i in range(len(rows)) for key in keys]
    if share is not None:
        picks = sorted(rng.sample(picks, min(len(picks), round(share * len(rows)))))
    pairs, skipped = [], 0
    for i, key in picks:
        row = rows[i]
        reply = row[key]
        seen = visible(row["prompt"], reply) if visible else reply
        others = _others(rows, i, random.Random(f"{seed}\0{row['id']}\0{key}")) if kind == "other_post" else ()
        if kind == "other_post" and not others:
            skipped += 1
            continue
        bad = corrupt(kind, seen, premise_of(row), others, seed)
        if not bad.strip() or bad.split() == seen.split():
            skipped += 1
            continue
        pairs.append({"id": f"{row['id']}:{kind}:{key}", "group_id": row["group_id"], "premise": row.get("premise"),
                      "prompt": row["prompt"], "chosen": reply, "rejected": bad, "negative": kind, "real": key, "row": i})
    return pairs, skipped


def corruption_pairs(rows: list[dict], kinds: Sequence[str], seed: int, share: float,
                     visible: Callable | None = None) -> tuple[list[dict], dict]:
    """Stage 03's --corruptions: every kind's pairs from the train `rows` (`share` of len(rows) a kind),
    and {"corruption_pairs": {kind: n}, "corruption_pairs_skipped": {kind: n}}."""
    pairs, counts, skipped = [], {}, {}
    for kind in kinds:
        made, skipped[kind] = corrupted(rows, kind, seed, visible=visible, share=share)
        counts[kind] = len(made)
        pairs += made
    return pairs, {"corruption_pairs": counts, "corruption_pairs_skipped": skipped}


# --- the gibberish audit ------------------------------------------------------------------------------

def corruption_audit(scorer, splits: dict[str, list[dict]], kinds: Sequence[str] = KINDS, seed: int = 0,
                     visible: Callable | None = None, n_boot: int = 1000) -> dict:
    """How often a judge prefers a real reply to its corruption: for every kind, on the pairs of each
    split in `splits` ({name: pair rows}), the winner and the loser each against its corruption; the
    share of those verdicts that go to the real reply (ties half), with a 95% bootstrap interval, per
    split and over all splits; `min_over_kinds` (the weakest kind's share) and whether it reaches
    TARGET. `scorer`: any Scorer (common/scorers.py) or a function (prompts, replies) -> scores;
    `visible` defaults to the scorer's `visible_reply` when it has one."""
    score = scorer.score if hasattr(scorer, "score") else scorer
    visible = visible or getattr(scorer, "visible_reply", None)
    splits = {name: rows for name, rows in splits.items() if rows}
    out = {"splits": {name: len(rows) for name, rows in splits.items()}, "target": TARGET, "kinds": {}}
    real_scores = {name: score([r["prompt"] for r in rows] * 2, [r["chosen"] for r in rows] + [r["rejected"] for r in rows])
                   for name, rows in splits.items()}
    for kind in kinds:
        entry, pooled = {"by_split": {}}, []
        for name, rows in splits.items():
            pairs, skipped = corrupted(rows, kind, seed, visible=visible)
            real = real_scores[name]  # every winner's score, then every loser's
            bad = score([p["prompt"] for p in pairs], [p["rejected"] for p in pairs]) if pairs else []
            won = wins([real[p["row"] + (len(rows) if p["real"] == "rejected" else 0)] for p in pairs], bad)
            pooled.append(won)
            entry["by_split"][name] = {"n": len(pairs), "skipped": skipped, **_share(won, n_boot, seed)}
        won = np.concatenate(pooled) if pooled else np.zeros(0)
        out["kinds"][kind] = {**_share(won, n_boot, seed), "n": int(len(won)), **entry}
    shares = {kind: v["share"] for kind, v in out["kinds"].items() if v["share"] is not None}
    weakest = min(shares, key=shares.get) if shares else None
    out.update(min_over_kinds=shares.get(weakest), weakest_kind=weakest,
               passes=bool(shares) and len(shares) == len(kinds) and min(shares.values()) >= TARGET)
    return out


def _share(won: np.ndarray, n_boot: int, seed: int) -> dict:
    if not len(won):
        return {"share": None, "share_ci95": [None, None]}
    return {"share": float(won.mean()), "share_ci95": bootstrap_ci(won, n_boot, seed)}


def summary(result: dict) -> dict:
    """The audit in metrics.json: each kind's share, the weakest, and whether it reaches the target."""
    return {"share": {kind: v["share"] for kind, v in result["kinds"].items()},
            "min_over_kinds": result["min_over_kinds"], "weakest_kind": result["weakest_kind"],
            "target": result["target"], "passes": result["passes"], "splits": result["splits"]}


def verdict_line(result: dict) -> str:
    """One sentence for the audit's verdict."""
    if result["min_over_kinds"] is None:
        return "Gibberish audit: no pairs to corrupt."
    shares = ", ".join(f"{k} {v['share']:.1%}" for k, v in result["kinds"].items() if v["share"] is not None)
    return (f"Gibberish audit on {'+'.join(result['splits'])}: the judge prefers the real reply to its corruption "
            f"in {shares}; weakest {result['weakest_kind']} {result['min_over_kinds']:.1%} "
            f"({'meets' if result['passes'] else 'BELOW'} the {TARGET:.0%} target).")
