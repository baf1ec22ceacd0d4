"""Paper reviewing: a paper's text -> a structured peer review that ends in a rating.

Reads rows in the bundled format (data/review/README.md: one paper with its official reviews per
line) and turns each into examples, or into a drop reason. The target is rebuilt deterministically
from the real reviews in one fixed format (docs/review.md gives the exact mapping):

    ### Key Points / ### Strengths and Weaknesses / ### Suggestions for Improvement / ### Rating

`merged` makes one target per paper (every reviewer's points, ratings averaged to one decimal);
`per_review` makes one per official review, with that reviewer's own rating. Pure Python: the
stages import it before torch.
"""
from __future__ import annotations

import functools
import math
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.config import ConfigError, DPOStageConfig
from common.data import DataError, n_words, text_field
from common.tasks.protocol import EvalReport
from common.tasks.review_text import SCALES, as_hint, parse_review, prompt_for, window_prompts, windows
from common.tasks.review_text import reading_windows as reading_windows  # a ReadsRatings hook, re-exported

NAME = "review"
TARGETS = ("merged", "per_review")

# Word budgets per part of a target, so a merged review of five reviewers stays near a single
# review's length (at most ~800 words, about 1,000 Llama 3 tokens) and long reviews are cut alike.
BUDGET = {"key_points": 200, "strengths": 150, "weaknesses": 250, "suggestions": 150}
BULLET_WORDS = 60   # one bullet is cut to this many words (at a sentence end when there is one)
NONE = "None stated."

# The scraper joins the review form's fields as "SUMMARY:\n...\n\nSTRENGTHS AND WEAKNESSES:\n..."
_SECTION = re.compile(r"(?:\A|\n\n)(SUMMARY|STRENGTHS AND WEAKNESSES|STRENGTHS|WEAKNESSES|QUESTIONS|LIMITATIONS):"
                      r"[ \t]*\n")
_I, _IM = re.IGNORECASE, re.IGNORECASE | re.MULTILINE
_MARKUP = r"^[ \t#*_>\-\d.()]*"
# A line that opens the weaknesses half of a "strengths and weaknesses" field ("**Weaknesses**:",
# "Cons", "Areas for Improvement:", "2. Weaknesses - ..."), or the strengths half.
_WEAK_HEAD = re.compile(_MARKUP + r"(?:major |main |key )?(?:weakness\w*|cons|concerns?|limitations?|drawbacks?"
                        r"|weak points?|negatives?|areas? (?:for|of) improvement)\b[ \t*_]*(?:[:：;.\-]|$)", _IM)
_STRONG_HEAD = re.compile(_MARKUP + r"(?:main |key )?(?:strengths?|pros|strong points?|positives?)\b[ \t*_]*"
                          r"(?:[:：;.\-]|$)[ \t]*", _IM)
# Without such a heading, a point counts as a weakness when it reads like one.
_NEGATIVE = re.compile(r"\b(however|lacks?|lacking|missing|unclear|not clear|limited|limitations?|weak\w*|concerns?"
                       r"|insufficient|fails?|unfortunately|questionable|unconvincing|confusing|should|would benefit)\b", _I)
_BULLET = re.compile(r"^\s*(?:[-*•+]|\d{1,2}[.)]|\(\d{1,2}\)|[SWQ]\d{1,2}[.:)]?|\(?[a-z]\))\s+")
# Items that only point elsewhere ("See weaknesses.", "N/A") say nothing in a target of their own.
_EMPTY = re.compile(r"^\W*(?:(?:please\s+)?(?:see|refer to)\b|n/?a\W*$|none\W*$|no\W*$)", _I)
_RULE = re.compile(r"^\s*([-=*_])\1{2,}\s*$")
# A heading: markdown "#", a bold-only line, or (opening a paragraph) a short line ending in ":" or up
# to three bare words.
_HEADING = re.compile(r"^\s*(#+\s*.*|\*\*[^*]+\*\*:?|[^.!?]{1,60}:|\w+(?: [\w&/-]+){0,2})\s*$")


# --- row checks ----------------------------------------------------------------------------------

def _type_error(where: str, name: str, want: str, value, present: bool = True):
    got = "missing" if not present else f"{type(value).__name__} {value!r:.40}"
    return DataError(f"{where}: field '{name}' must be {want}, got {got}")


def _number(obj: dict, name: str, where: str, label: str, scale: tuple[int, int]):
    """A rating on its scale, or None. Off the scale it is a bad row: averaged into a target it would
    teach a rating the scale has not (and that parse_review cannot read back)."""
    value = obj.get(name)
    if value is None:
        return None
    low, high = scale
    # Compared before float(): a 400-digit integer has no float.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise _type_error(where, label, f"a number from {low} to {high} or null", value)
    return float(value)


def _reviews(row: dict, where: str) -> list[dict]:
    """The row's reviews as {index, text, rating, confidence}; malformed ones raise DataError."""
    reviews = row.get("reviews")
    if not isinstance(reviews, list):
        raise _type_error(where, "reviews", "a list", reviews, "reviews" in row)
    out = []
    for i, rv in enumerate(reviews):
        label = f"reviews[{i}]"
        if not isinstance(rv, dict):
            raise _type_error(where, label, "an object", rv)
        out.append({"index": i, "text": (text_field(rv, "text", where, False, f"{label}.text") or "").strip(),
                    "rating": _number(rv, "rating", where, f"{label}.rating", SCALES["overall"]),
                    "confidence": _number(rv, "confidence", where, f"{label}.confidence", SCALES["confidence"])})
    return out


def _rated(review: dict) -> bool:
    """A review is used when it has a rating and some text; others are counted as skipped."""
    return review["rating"] is not None and bool(review["text"])


def count_reviews(row) -> dict:
    """{"n_reviews", "n_rated"} of one input row (n_rated: the reviews `to_examples` uses). Tolerant of
    malformed rows (zeros), so a skipped bad row can still be counted."""
    reviews = row.get("reviews") if isinstance(row, dict) else None
    if not isinstance(reviews, list):
        return {"n_reviews": 0, "n_rated": 0}
    try:
        rated = sum(_rated(r) for r in _reviews(row, "-"))
    except DataError:
        rated = 0
    return {"n_reviews": len(reviews), "n_rated": rated}


# --- review text -> sections -> target -----------------------------------------------------------

def _cut(text: str, n: int) -> str:
    """The first n words, ending at the last sentence end in the second half of them, else "..."."""
    words = text.split()
    if len(words) <= n:
        return " ".join(words)
    head = " ".join(words[:n])
    end = max(head.rfind(m) for m in (". ", "? ", "! "))
    return head[:end + 1] if end >= len(head) // 2 else head + " ..."


def bullets(text: str) -> list[str]:
    """List items and paragraphs of a free-text field, one line each. A heading line ("## Quality",
    "**Novelty:**") is prefixed to the item after it; horizontal rules and items that only point
    elsewhere ("See weaknesses.") are dropped; each item is cut to BULLET_WORDS words."""
    items, current, head = [], None, None
    for line in text.split("\n"):
        if not line.strip() or _RULE.match(line):
            current = None
        elif _HEADING.match(line) and not _BULLET.match(line) and (current is None or line.lstrip()[:1] in "#*"):
            head, current = line.strip(" #*_:\t"), None  # a short line inside a paragraph is just wrapped text
        else:
            marker = _BULLET.match(line)
            if current is None or marker:
                body = line[marker.end():] if marker else line
                current = [f"{head}: {body.strip()}" if head else body.strip()]
                items.append(current)
                head = None
            else:
                current.append(line.strip())
    if head:  # a heading with nothing after it is kept as a point of its own
        items.append([head])
    out = [_cut(re.sub(r"\*\*|__", "", " ".join(parts)), BULLET_WORDS) for parts in items]
    return [b for b in out if b.strip(" :.") and not (_EMPTY.match(b) and n_words(b) <= 20)]


def split_strengths_weaknesses(text: str) -> tuple[list[str], list[str]]:
    """At the first weaknesses heading; without one, each point goes by whether it reads negative."""
    weak = _WEAK_HEAD.search(text)
    if weak:
        strong_part = _STRONG_HEAD.sub("", text[:weak.start()], count=1)
        return bullets(strong_part), bullets(text[weak.end():])
    points = bullets(_STRONG_HEAD.sub("", text, count=1))
    return [p for p in points if not _NEGATIVE.search(p)], [p for p in points if _NEGATIVE.search(p)]


def review_sections(review: dict) -> dict:
    """One review {text, rating, confidence} -> the parts of a target (see build_target)."""
    fields, name = {}, "STRENGTHS AND WEAKNESSES"  # text before any header counts as that field
    for i, part in enumerate(_SECTION.split(review["text"])):
        if i % 2:
            name = part
        elif part.strip():
            fields[name] = (fields.get(name, "") + "\n\n" + part).strip()
    strengths, weaknesses = split_strengths_weaknesses(fields.get("STRENGTHS AND WEAKNESSES", ""))
    limitations = fields.get("LIMITATIONS", "")  # mostly "yes"; kept when it says more
    limitations = bullets(limitations) if n_words(limitations) >= 8 else []
    return {"key_points": bullets(fields.get("SUMMARY", "")),
            "strengths": strengths + bullets(fields.get("STRENGTHS", "")),
            "weaknesses": weaknesses + bullets(fields.get("WEAKNESSES", "")),
            "suggestions": bullets(fields.get("QUESTIONS", "")) + limitations,
            "rating": review["rating"], "confidence": review["confidence"]}


def _round1(x: float) -> float:
    """Half up to one decimal (4.25 -> 4.3; Python's round() would say 4.2)."""
    return math.floor(x * 10 + 0.5) / 10


def _mean1(values):
    values = [v for v in values if v is not None]
    return _round1(sum(values) / len(values)) if values else None


def _round_robin(lists: list[list[str]]) -> list[str]:
    """The first item of each list, then the second of each, ...: every reviewer gets a say early."""
    return [lst[i] for i in range(max(map(len, lists), default=0)) for lst in lists if i < len(lst)]


def merge_sections(parts: list[dict]) -> dict:
    """Several reviewers' sections -> one (reviewers in file order): key points are each reviewer's
    first summary paragraph; strengths, weaknesses and suggestions go round-robin (build_target drops
    repeats and applies the word budgets); rating and confidence are means, rounded to one decimal."""
    return {"key_points": [p["key_points"][0] for p in parts if p["key_points"]],
            **{k: _round_robin([p[k] for p in parts]) for k in ("strengths", "weaknesses", "suggestions")},
            "rating": _mean1(p["rating"] for p in parts), "confidence": _mean1(p["confidence"] for p in parts)}


def _fit(items: list[str], budget: int) -> list[str]:
    """Leading distinct items within the word budget (the first one always, cut if need be)."""
    out, used, seen = [], 0, set()
    for item in items:
        if item.casefold() in seen:
            continue
        n = len(item.split())
        if out and used + n > budget:
            break
        out.append(_cut(item, budget))
        used, seen = used + n, seen | {item.casefold()}
    return out


def _num(x) -> str:
    return "n/a" if x is None else f"{_round1(float(x)):g}"


def build_target(sections: dict) -> str:
    """{key_points, strengths, weaknesses, suggestions: [str], rating, confidence} -> the target text.
    Each part keeps its leading distinct items within its BUDGET of words; one key point is written
    as a paragraph, several as bullets; an empty list reads "None stated.". Ratings are written
    rounded half up to one decimal without a trailing ".0" ("4", "4.3"), a missing one as "n/a"."""
    key = _fit(sections["key_points"], BUDGET["key_points"])
    lists = {k: "\n".join(f"- {x}" for x in _fit(sections[k], BUDGET[k])) or f"- {NONE}"
             for k in ("strengths", "weaknesses", "suggestions")}
    return (f"### Key Points\n{key[0] if len(key) == 1 else chr(10).join(f'- {x}' for x in key) or NONE}\n"
            f"### Strengths and Weaknesses\nStrengths:\n{lists['strengths']}\nWeaknesses:\n{lists['weaknesses']}\n"
            f"### Suggestions for Improvement\n{lists['suggestions']}\n"
            f"### Rating\nOverall Quality: {_num(sections['rating'])}\nReview Confidence: {_num(sections['confidence'])}")


# --- rows -> examples ----------------------------------------------------------------------------

def to_examples(row, where: str, review_target: str = "merged"):
    """One paper row -> a list of examples, or a drop reason (str). Malformed rows raise DataError.
    The paper is "# title", then the abstract when the body does not open with one, then the body
    (`paper_markdown_main`: abstract to references)."""
    if review_target not in TARGETS:
        raise ValueError(f"review_target must be one of {', '.join(TARGETS)}, got {review_target!r}")
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    paper_id = text_field(row, "paper_id", where, True)
    title, abstract, body = (text_field(row, k, where, False) or "" for k in ("title", "abstract", "paper_markdown_main"))
    reviews = [r for r in _reviews(row, where) if _rated(r)]
    if not body.strip():
        return "no_paper_text"
    if not reviews:
        return "no_rated_review"
    if abstract.strip() and not re.match(r"#+\s*abstract", body.strip(), _I):
        body = f"## Abstract\n\n{abstract.strip()}\n\n{body.strip()}"
    paper = (f"# {title.strip()}\n\n" if title.strip() else "") + body.strip()
    parts = [review_sections(r) for r in reviews]
    common = {"group_id": paper_id, "paper": paper, "prompt": prompt_for(paper),
              "references": [build_target(p) for p in parts], "human_ratings": [r["rating"] for r in reviews]}
    if review_target == "merged":
        merged = merge_sections(parts)
        return [{"id": paper_id, **common, "chosen": build_target(merged), "rating": merged["rating"],
                 "confidence": merged["confidence"]}]
    return [{"id": f"{paper_id}:{r['index']}", **common, "chosen": ref, "rating": r["rating"],
             "confidence": r["confidence"]} for r, ref in zip(reviews, common["references"])]


# --- the task's hooks for the stages (common/tasks/__init__.py) ----------------------------------

@dataclass
class Options:
    """No options under `task_options`: the review task's stage-01 knobs (review_target, pdf) are
    PairsConfig fields, where every recipe and earlier run has them."""


PROBES = ()  # the review judge is a rating model, not a preference judge: no shortcut probes
PAIRWISE = False  # a row is one target, no loser: stage 01 does not length-balance, 04 generates rejected


def train_judge(config, run) -> dict:
    """Stage 03: the review task's judge is a rating model, a paper -> its mean reviewer rating
    (common/rating_model.py); returns the run's metrics."""
    from common import rating_model
    return rating_model.train(config, run)


def rows_from(row, where: str, config, options: Options) -> list[dict] | str:
    """Stage 01: one paper row -> its examples (config.review_target), or a drop reason. A paper
    without text takes it from its PDF when `--pdf` names one (`<paper_id>.pdf`)."""
    paper_id = row.get("paper_id") if isinstance(row, dict) else None
    pdf = _pdfs(tuple(config.pdf)).get(paper_id) if isinstance(paper_id, str) else None  # else to_examples says why
    if pdf is not None and not str(row.get("paper_markdown_main") or "").strip():
        from common.pdf import read_pdf_text
        row = {**row, "paper_markdown_main": read_pdf_text(pdf)}
    return to_examples(row, where, config.review_target)


@functools.lru_cache(maxsize=4)
def _pdfs(paths: tuple[str, ...]) -> dict:
    """paper_id (the file's stem) -> PDF path."""
    return {Path(p).stem: p for p in paths}


def check_config(config) -> None:
    """Before a stage's run directory exists: a window holds fewer than max_length tokens of the paper,
    so an overlap as large leaves it no room to move on."""
    if getattr(config, "input_strategy", None) == "sliding_window" and config.window_overlap >= config.max_length:
        raise ConfigError(f"field 'window_overlap' ({config.window_overlap}) must be well below max_length "
                          f"({config.max_length}) for the review task's windows: lower window_overlap", "window_overlap")
    if getattr(config, "max_reply_tokens", None):
        raise ConfigError("field 'max_reply_tokens' cuts a CMV reply; a review is cut by max_length", "max_reply_tokens")
    if isinstance(config, DPOStageConfig) and config.sft_run:  # the input runs are checked by now
        from common.config import load_run_config
        if getattr(load_run_config(config.sft_run), "rating_hint_noise", None) is not None:
            raise ConfigError(f"--sft_run {config.sft_run} writes the review that a rating in its prompt fits "
                              "(rating_hint_noise); the preference pairs' prompts carry none: start from an SFT run "
                              "without it", "sft_run")
    if not hasattr(config, "rating_pooling"):  # the rest is stage 03's: the rating model
        return
    if config.judge_backbone == "lora_4bit" and config.rating_window_overlap >= config.max_length:
        raise ConfigError(f"field 'rating_window_overlap' ({config.rating_window_overlap}) must be well below "
                          f"max_length ({config.max_length}), a window of the rating model", "rating_window_overlap")
    for field in ("padding_free", "max_tokens_per_batch"):
        if getattr(config, field):
            raise ConfigError(f"field '{field}': the review task's rating model batches whole papers (every window "
                              f"of each): leave it off", field)


def input_units(row) -> dict:
    """Stage 01 counts every input review too: {"n_reviews", "n_rated"} of this row."""
    return count_reviews(row)


def sft_examples(row: dict, tokenizer, config) -> list[dict]:
    """Stage 02: prompt/completion examples of one paper. `sliding_window`: one example per window of
    the paper, each with the whole target, windows covering every token of the paper with
    `window_overlap` tokens shared by neighbours; `whole`: one example, the paper cut to fit. Every
    example's templated length is at most `max_length`."""
    from common.data import prompt_length, template_closing_tokens
    completion = [{"role": "assistant", "content": row["chosen"]}]
    n_target = len(tokenizer(row["chosen"], add_special_tokens=False)["input_ids"])
    hint = training_hint(row, config)
    budget = config.max_length - prompt_length(tokenizer, prompt_for("", hint)) - n_target - \
        template_closing_tokens(tokenizer, prompt_for("", hint)) - 1
    if budget <= config.window_overlap:
        raise DataError(f"paper {row['id']}: max_length={config.max_length} leaves {budget} tokens for the paper "
                        f"beside its {n_target}-token target (window_overlap={config.window_overlap}): lower "
                        f"window_overlap or raise max_length")
    ids = tokenizer(row["paper"], add_special_tokens=False)["input_ids"]
    spans = windows(len(ids), budget, config.window_overlap) if config.input_strategy == "sliding_window" \
        else [(0, min(len(ids), budget))]
    prompts = window_prompts(tokenizer, ids, spans, lambda prompt: prompt_length(tokenizer, prompt) + n_target +
                              template_closing_tokens(tokenizer, prompt) + 1 - config.max_length, hint)
    return [{"prompt": prompt, "completion": completion} for prompt in prompts]


def training_hint(row: dict, config) -> float | None:
    """`rating_hint_noise`: the rating a training prompt says (review_text.HINT), the target's reviewer mean plus
    Gaussian noise, on the scale, to one decimal; the same for a paper at every call (seeded by the seed and its
    id). Noise about the size of the rating model's error keeps the writer from trusting the hint more than 05's
    hint, the rating model's, deserves; 0 gives the target's own rating."""
    noise = getattr(config, "rating_hint_noise", None)
    if noise is None:
        return None
    rng = np.random.default_rng([config.seed, zlib.crc32(str(row["id"]).encode())])
    return as_hint(row["rating"] + rng.normal(0, noise))


READING = "for a paper, its first window: the rest of a long paper is not seen while writing"
# A review without a parseable rating gets the model's own (common/readout.py): the review so far, then
# this header, and the model's next token over the scale.
RATING_HEADER = "### Rating\nOverall Quality:"
READOUT_SCALE = SCALES["overall"]
# A line that is a rating heading ("### Rating", "Rating: 4"), or the "Overall Quality:" label (with its
# colon, as parse_review reads it); prose on the overall quality of something does not start the section.
_RATING_SECTION = re.compile(r"^[ \t#*_]*rating(?:[ \t*_]*$|[ \t*_]*[:：])|[#*_]*overall\s+quality[ \t*_]*[:：=]", _IM)


def readout_turn(reply: str) -> str:
    """The assistant's turn the rating is read after: the review up to its rating section (all of it
    when it has none), then RATING_HEADER."""
    cut = _RATING_SECTION.search(reply)
    return f"{(reply[:cut.start()] if cut else reply).rstrip()}\n{RATING_HEADER}"


# How stage 05's report and replies.jsonl name and show what is scored.
NOUNS = {"premise": "paper", "premises": "papers", "reference": "real review", "references": "real reviews"}


def display(row: dict) -> str:
    """Stage 05: the text a paper is shown by (title, abstract, body)."""
    return row["paper"]


def references(row: dict) -> list[str]:
    """Stage 05: every real review of the paper, in the target format."""
    return row["references"]


def evaluate(premises: list[dict], replies: dict[str, list[str]], *, train: list[dict], readouts: dict,
             rating: dict | None, seed: int) -> EvalReport:
    """Stage 05's review metrics, each against the paper's mean human rating, with 95% bootstrap
    intervals (over papers). For each model:
    - the rating parsed from each generated review (MAE, RMSE, Pearson over the parseable ones), the
      format compliance rate and the ids of the unparsed (listed, never dropped silently);
    - with `readouts` (common/readout.py, per model and paper: `first_window`, and `all_windows` when
      read): `all_papers`, every paper's rating, the parsed one where there is one (never replaced)
      and the read-out one elsewhere (`rating_source` per reply); and `readout_first_window` /
      `readout_all_windows`, the read-out alone on every paper, so the two readings compare on the
      same papers.
    Beside them: a constant predictor (the mean rating of `train`, the pairs run's train split) and one
    more human reviewer (each reviewer against the mean of the paper's others). And every rating source
    side by side (common/rating_sources.py: each model's parsed and read-out rating, the rating model's
    from `rating`, their blend fitted on dev), `rating_sources` in eval.json, a table and a plot each."""
    from common.metrics import baseline_constant, baseline_human, rating_metrics  # sacrebleu, scipy: 05 only
    gold = [float(np.mean(r["human_ratings"])) for r in premises]
    metrics, per_reply, pairs, per_model = {}, {}, {}, {}
    for name, texts in replies.items():
        written = [parse_review(t) for t in texts]
        parsed = [w["overall"] for w in written]
        ok = [i for i, p in enumerate(parsed) if p is not None]
        rated = rating_metrics([parsed[i] for i in ok], [gold[i] for i in ok], seed)
        rated["n_rated"] = rated.pop("n")  # the model's `n` stays the number of replies
        metrics[name] = {"format_compliance": len(ok) / len(texts) if texts else None,
                         "unparsed": [premises[i]["id"] for i in range(len(texts)) if parsed[i] is None], **rated}
        per_reply[name] = [{"rating": p, "rating_source": "parsed" if p is not None else None,
                            "confidence": w["confidence"], "human_rating": g}
                           for p, w, g in zip(parsed, written, gold)]
        pairs[name] = [(parsed[i], gold[i]) for i in ok]
        per_model[name] = {"parsed": parsed, "readout": [None] * len(texts), "rating": parsed}
        if name in readouts:
            read = readouts[name]
            reading = "all_windows" if read and read[0].get("all_windows") else "first_window"
            final = [p if p is not None else r[reading]["expected"] for p, r in zip(parsed, read)]
            metrics[name]["all_papers"] = {**rating_metrics(final, gold, seed), "reading": reading,
                                           "n_readout": len(texts) - len(ok)}
            for way in ("first_window", "all_windows"):
                if read and read[0].get(way):
                    metrics[name][f"readout_{way}"] = rating_metrics([r[way]["expected"] for r in read], gold, seed)
            per_reply[name] = [{**row, "rating": value, "rating_source": row["rating_source"] or "readout", "readout": r}
                               for row, value, r in zip(per_reply[name], final, read)]
            pairs[name] = list(zip(final, gold))
            per_model[name] = {**per_model[name], "readout": [r[reading]["expected"] for r in read], "rating": final}
    train_mean = float(np.mean([r["rating"] for r in train]))
    baselines = {"baseline_constant": {**baseline_constant(train_mean, gold, seed), "train_mean": train_mean},
                 "baseline_human": baseline_human([r["human_ratings"] for r in premises], seed)}
    from common import rating_sources
    sources = rating_sources.rating_sources(premises, per_model, rating, train_mean, seed)
    if rating and "rating_model" in rating:
        per_reply = {name: [{**row, "rating_model": value} for row, value in zip(rows, rating["rating_model"])]
                     for name, rows in per_reply.items()}
    reranked = (rating or {}).get("reranked")
    sections = _rating_rows(replies, metrics, baselines) + rating_sources.table_rows(sources["sources"])
    if reranked and "rerank_by_rating" in per_reply:
        per_reply["rerank_by_rating"] = [{**row, "candidate_ratings": info["candidate_ratings"], "kept": info["kept"]}
                                         for row, info in zip(per_reply["rerank_by_rating"], reranked)]
        metrics["rerank_by_rating"]["agreement"] = rating_sources.rerank_agreement(reranked)
        sections += rating_sources.agreement_rows(metrics["rerank_by_rating"]["agreement"])
    hints = [p.get("rating_hint") for p in premises]
    if premises and all(h is not None for h in hints):  # a writer trained with a rating in its prompts
        for name, values in per_model.items():
            metrics[name]["hint"] = rating_sources.hint_agreement(hints, values["parsed"], values["readout"])
        sections += rating_sources.hint_rows({name: metrics[name]["hint"] for name in per_model})
    return EvalReport(metrics=metrics, baselines={**baselines, "rating_sources": sources["sources"]},
                      per_reply=per_reply, sections=sections,
                      plots=lambda out_dir: _plots(out_dir, pairs, sources["points"]))


def _plots(out_dir, pairs, points):
    from common.rating_sources import plot_sources
    from common.report import plot_ratings
    return {**plot_ratings(out_dir, pairs), **plot_sources(out_dir, points)}


def _rating_rows(replies, metrics, baselines) -> list[str]:
    rows = ["", "## Ratings", "", "Against the mean rating of the paper's reviewers, 95% bootstrap intervals over papers. "
            "*Parsed*: the rating written in the review (`Overall Quality: <n>`), on the reviews where it parses "
            "(format compliance = their share). *All papers*: the parsed rating where there is one, else the "
            "model's own rating read from its next-token distribution after the review and the rating header "
            "(expected value; `rating_source` in replies.jsonl).", "",
            "| predictor | format compliance | parsed: MAE | RMSE | Pearson r | n | all papers: MAE | RMSE "
            "| Pearson r | n (read out) |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in [*((n, metrics[n]) for n in replies), *baselines.items()]:
        every = r.get("all_papers") or {}
        counted = f"{every['n']} ({every['n_readout']})" if every else ""
        rows.append(f"| {name} | {_f(r.get('format_compliance'))} | {_ci(r, 'rating_mae')} | {_ci(r, 'rating_rmse')} | "
                    f"{_ci(r, 'rating_pearson')} | {r['n_rated'] if 'n_rated' in r else r['n']} | {_ci(every, 'rating_mae')} | "
                    f"{_ci(every, 'rating_rmse')} | {_ci(every, 'rating_pearson')} | "
                    f"{counted} |")
    reads = [(n, metrics[n]) for n in replies if "readout_all_windows" in metrics[n]]
    if reads:
        rows += ["", "The read-out rating alone on every paper: from the first window (the one the review was "
                 "written from) and averaged over every window of the paper.", "",
                 "| model | first window: MAE | Pearson r | all windows: MAE | Pearson r |", "| --- | --- | --- | --- | --- |"]
        rows += [f"| {n} | {_ci(r['readout_first_window'], 'rating_mae')} | {_ci(r['readout_first_window'], 'rating_pearson')}"
                 f" | {_ci(r['readout_all_windows'], 'rating_mae')} | {_ci(r['readout_all_windows'], 'rating_pearson')} |"
                 for n, r in reads]
    return rows


def _ci(r: dict, key: str) -> str:
    value, ci = r.get(key), r.get(f"{key}_ci")
    return _f(value) + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if value is not None and ci else "")


def _f(value) -> str:
    return "n/a" if value is None else f"{value:.3f}"


