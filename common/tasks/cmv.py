"""ChangeMyView (Tan et al. 2016 pair task): a delta-winning root reply vs a non-winning one.

Reads rows in the bundled format (data/cmv/README.md) and turns each into one pair, or into a
drop reason. The premise is the title plus the first `premise_words` words of the post body.

Give-aways are scrubbed from replies and post body before anything is measured (docs/data.md):
edit notes ("EDIT: thanks for the delta!" is written after the fact, mostly by winners), sentences
that mention deltas (Δ, ∆, !delta, DeltaBot, "delta"), and bot/moderator boilerplate. Each text that
changed is named in the pair's `scrubbed` list ("winner_edit_note", "premise_delta_mention", ...);
a reply with nothing left is dropped as `empty_after_scrub`.
"""
from __future__ import annotations

import hashlib
import re
import unicodedata
from dataclasses import dataclass

from common.config import ConfigError
from common.data import SENTENCE_END, DataError, n_words, text_field
from common.tasks.protocol import EvalReport

NAME = "cmv"
INSTRUCTION = ("Below is a post from r/ChangeMyView, where the author asks others to change their view. "
               "Write a reply that could persuade them.\n\n")

REQUIRED_STR = ("op_id", "positive_reply", "negative_reply")
PERIODS = ("train", "heldout", "unknown")  # source_split: Tan et al.'s split, or unknown (data/cmv/README.md)
OPTIONAL_STR = ("pair_id", "op_title", "op_text", "source_split")

# The moderators' footnote that closes many CMV posts ("Hello, users of CMV! This is a footnote from
# your moderators..."): boilerplate, not the author's view, and up to ~100 words of the prompt.
_FOOTNOTE = re.compile(r"\s*(_{3,}|\*{3,}|-{3,})?\s*(&gt;|>)?\s*\*?Hello,? users of CMV!.*\Z", re.S | re.I)
_CMV_PREFIX = re.compile(r"^\s*\[?cmv\]?\s*[:\-]\s*", re.I)
_DELETED = {"[deleted]", "[removed]", ""}

# --- give-aways --------------------------------------------------------------------------------------
# An edit note: a line that opens (after markup) with "edit", "update" or "eta", maybe numbered or
# qualified ("EDIT 2:", "Edit after /u/x:"), then a colon or dash.
_EDIT_LINE = re.compile(r"^[\s>*_~#(\[]*(?:edit|update|eta)\b[^\n:]{0,40}?[:\-\u2013\u2014]", re.I | re.M)
_EDIT_INLINE = re.compile(r"\s*[(\[]\s*(?:edit|update)\b[^)\]\n]*[)\]]", re.I)
_DELTA = re.compile(r"\bdeltas?\b|[\u0394\u2206]|&#8710;|!delta|deltabot", re.I)
_BOILERPLATE = re.compile(
    r"I am a bot|this action was performed automatically|message the moderators|contact the moderators"
    r"|hello,? users of cmv|footnote from your moderators|/r/changemyview/wiki|^\s*\^\^?\(", re.I | re.M)


def _paragraphs(text: str) -> list[str]:
    return re.split(r"\n\s*\n", text)


def _drop_edit_notes(text: str) -> str:
    """Edit paragraphs go; a note in the second half of the text goes with everything after it (a
    note appended at the end often runs over several paragraphs); "(EDIT: ...)" asides go."""
    paras = _paragraphs(text)
    total, seen, kept = max(1, len(text)), 0, []
    for i, para in enumerate(paras):
        note = _EDIT_LINE.search(para)
        if note:
            head = para[:note.start()].strip()
            if head:  # the note starts inside the paragraph, on a later line
                kept.append(head)
            if seen >= total / 2:
                break
        else:
            kept.append(para)
        seen += len(para) + 2
    return _EDIT_INLINE.sub("", "\n\n".join(kept)).strip()


def _drop_delta_sentences(text: str) -> str:
    lines = []
    for line in text.split("\n"):
        if _DELTA.search(line):
            line = " ".join(s for s in SENTENCE_END.split(line) if not _DELTA.search(s))
        lines.append(line)
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def _drop_boilerplate(text: str) -> str:
    return "\n\n".join(p for p in _paragraphs(text) if not _BOILERPLATE.search(p)).strip()


GIVEAWAY_RULES = (("edit_note", _drop_edit_notes), ("delta_mention", _drop_delta_sentences),
                  ("boilerplate", _drop_boilerplate))


def scrub(text: str) -> tuple[str, list[str]]:
    """Remove give-aways; returns the text and the names of the rules that changed it."""
    fired = []
    for name, rule in GIVEAWAY_RULES:
        cleaned = rule(text)
        if cleaned != text.strip():
            fired.append(name)
        text = cleaned
    return text, fired


def _words(text: str) -> list[str]:
    """The words a reader sees: invisible format characters (zero-width space, joiners, soft hyphen)
    removed, so two replies that differ only by them are the same reply."""
    return "".join(c for c in text if unicodedata.category(c) != "Cf").split()


def content_id(group_id: str, winner: str, loser: str) -> str:
    """A stable id for a row without `pair_id`: the digest of what the pair says (post and both replies,
    as written), so the same row read again, from any line or file, gets the same id."""
    return hashlib.sha1("\x00".join((group_id, winner, loser)).encode("utf-8")).hexdigest()[:16]


def premise_text(title: str | None, body: str | None, premise_words: int, scrubbed: list | None = None) -> str:
    """Title plus the first `premise_words` words of the body, without the moderators' footnote.
    With a `scrubbed` list, the body's give-aways are removed first and the rules that fired are
    appended to it."""
    parts = []
    if title and title.strip():
        parts.append("CMV: " + _CMV_PREFIX.sub("", title.strip()))
    if body and body.strip():
        body = _FOOTNOTE.sub("", body.replace("&gt;", ">")).strip()
        if scrubbed is not None:
            body, fired = scrub(body)
            scrubbed.extend(f"premise_{name}" for name in fired)
        parts.append(_cut_words(body, premise_words))
    return "\n\n".join(p for p in parts if p)


def _cut_words(text: str, n: int) -> str:
    tokens = re.split(r"(\s+)", text)  # keep the original whitespace (paragraphs) of what is kept
    out, count = [], 0
    for token in tokens:
        if token and not token.isspace():
            count += 1
            if count > n:
                break
        out.append(token)
    return "".join(out).rstrip()


def to_pair(row: dict, where: str, premise_words: int, scrub_giveaways: bool = True,
            system_prompt: str | None = None):
    """One input row -> a pair dict, or a drop reason (str). Malformed rows raise DataError. The pair's
    id is its `pair_id`, or without one the digest of its content (`content_id`), never its place in
    the file: a repeated row gets the same id."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    fields = {name: text_field(row, name, where, True) for name in REQUIRED_STR}
    fields.update({name: text_field(row, name, where, False) for name in OPTIONAL_STR})
    if not fields["op_id"].strip():  # the post's id groups pairs into splits: without it, no grouping
        raise DataError(f"{where}: field 'op_id' must be a non-empty string, got {fields['op_id']!r}")
    winner, loser = fields["positive_reply"].strip(), fields["negative_reply"].strip()
    title, body = fields["op_title"], fields["op_text"]
    scrubbed = [] if scrub_giveaways else None
    premise = premise_text(title, body, premise_words, scrubbed)
    if not premise:
        return "no_premise"
    if winner in _DELETED or loser in _DELETED:
        return "empty_or_deleted_reply"
    if scrub_giveaways:
        (winner, fired_w), (loser, fired_l) = scrub(winner), scrub(loser)
        scrubbed += [f"winner_{n}" for n in fired_w] + [f"loser_{n}" for n in fired_l]
        if not winner or not loser:
            return "empty_after_scrub"
    if _words(winner) == _words(loser):  # the same words: nothing for a judge to tell apart
        return "identical_replies"
    return {
        "id": (fields["pair_id"] or "").strip() or content_id(fields["op_id"], winner, loser),
        "group_id": fields["op_id"],
        "premise": premise,
        "prompt": ([{"role": "system", "content": system_prompt}] if system_prompt else [])
        + [{"role": "user", "content": INSTRUCTION + premise}],
        "chosen": winner,
        "rejected": loser,
        "source_split": fields["source_split"],
        "scrubbed": scrubbed or [],
    }


# --- the task's hooks for the stages (the Task Protocol, common/tasks/protocol.py) ------------------

@dataclass
class Options:
    """No options under `task_options`: CMV's stage-01 knobs (premise_words, scrub_giveaways,
    system_prompt) are PairsConfig fields, where every recipe and earlier run has them."""


PAIRWISE = True  # a row is a winner and a loser: stage 01 balances them for length
READING = "a post's title and first words (premise_words)"
READOUT_SCALE = None  # a reply has no rating to read out


def rows_from(row, where: str, config, options: Options) -> list[dict] | str:
    """Stage 01: one source row -> [its pair], or a drop reason. Split by period, a row must say its
    period: any other value (`HeldOut`, null) would put a later post in train or dev unnoticed."""
    pair = to_pair(row, where, config.premise_words, config.scrub_giveaways, getattr(config, "system_prompt", None))
    if getattr(config, "split_by", None) == "period" and not isinstance(pair, str) \
            and pair["source_split"] not in PERIODS:
        raise DataError(f"{where}: field 'source_split' must be one of {', '.join(map(repr, PERIODS))} with "
                        f"split_by period, got {pair['source_split']!r}")
    return pair if isinstance(pair, str) else [pair]


def check_config(config) -> None:
    """Before a stage's run directory exists: every setting works for CMV but the review task's ratings."""
    for field in ("rating_run", "rating_dev_run", "rating_hint_noise"):
        if getattr(config, field, None) not in (None, ""):  # a hint noise of 0 is on
            raise ConfigError(f"field '{field}' is the review task's (a paper's rating); a CMV run has none", field)


def input_units(row) -> dict:
    """Stage 01's extra accounting: a CMV row is one pair, nothing inside it to count."""
    return {}


def sft_examples(row: dict, tokenizer, config) -> list[dict]:
    """Stage 02: the winner as one prompt/completion example, the premise cut to max_prompt_tokens and
    the reply at a sentence end, so that both fit max_length (and the reply max_reply_tokens)."""
    from common.data import fit_prompt, fit_reply
    prompt = fit_prompt(tokenizer, row["prompt"], config.max_prompt_tokens)
    reply = fit_reply(tokenizer, prompt, row["chosen"], config.max_length, getattr(config, "max_reply_tokens", None))
    return [{"prompt": prompt, "completion": [{"role": "assistant", "content": reply}]}]


# How stage 05's report and replies.jsonl name and show what is scored.
NOUNS = {"premise": "premise", "premises": "premises", "reference": "real reply", "references": "real replies"}


def display(row: dict) -> str:
    """Stage 05: the text a premise is shown by (the post's title and body)."""
    return row["premise"]


def references(row: dict) -> list[str]:
    """Stage 05: the winning reply."""
    return [row["chosen"]]


def evaluate(premises: list[dict], replies: dict[str, list[str]], *, train: list[dict], readouts: dict,
             rating: dict | None, seed: int) -> EvalReport:
    """Stage 05: CMV's metrics are the shared ones (overlap, and the judge's); nothing to add."""
    return EvalReport()


FILLER = ["It is important to keep this in mind.", "There are many different aspects to consider here.",
          "This is something that is worth thinking about carefully.", "In many ways, this matters more than it seems.",
          "When you look at it closely, the picture becomes clearer.", "All of these points are relevant to the question."]
BOILERPLATE = ("I hope this helps you see things from a different perspective; if you weigh the evidence "
               "carefully, I think you will find this argument convincing.")


# --- stage 03's shortcut probes (common/audit.py): (name, which reply is edited, what a cheat wants
# the score to do, edit, description) ---------------------------------------------------------------

def pad_filler(text: str, _pair: dict) -> str:
    """Double the reply's length (at least 20 words more) with generic filler sentences."""
    target, extra, i = max(20, n_words(text)), [], 0
    while sum(map(n_words, extra)) < target:
        extra.append(FILLER[i % len(FILLER)])
        i += 1
    return text.rstrip() + " " + " ".join(extra)


def repeat_sentences(text: str, _pair: dict) -> str:
    """The reply followed by itself again: twice the length, nothing new."""
    return text.rstrip() + "\n\n" + text.strip()


def echo_premise(text: str, pair: dict) -> str:
    """The reply opened by a quote of the premise's first 60 words."""
    premise = pair.get("premise") or pair["prompt"][-1]["content"]
    return f'You said: "{" ".join(premise.split()[:60])}"\n\n{text.strip()}'


def append_boilerplate(text: str, _pair: dict) -> str:
    return text.rstrip() + " " + BOILERPLATE


def cut_half(text: str, _pair: dict) -> str:
    """The first half of the reply's words, ending at a sentence end where one is available."""
    target = max(1, n_words(text) // 2)
    kept, count = [], 0
    for sentence in SENTENCE_END.split(text.strip()):
        if count + n_words(sentence) > target:
            break
        kept.append(sentence)
        count += n_words(sentence)
    return " ".join(kept) if kept else " ".join(text.split()[:target])


PROBES = [
    ("pad_loser_filler", "rejected", +1, pad_filler, "the loser padded to twice its length with filler sentences"),
    ("pad_loser_repeat", "rejected", +1, repeat_sentences, "the loser's own text repeated (twice the length)"),
    ("echo_premise_in_loser", "rejected", +1, echo_premise, "the premise's first 60 words quoted at the top of the loser"),
    ("boilerplate_on_loser", "rejected", +1, append_boilerplate, "a persuasive-sounding boilerplate sentence appended to the loser"),
    ("cut_winner_half", "chosen", -1, cut_half, "the winner cut to half its length (at a sentence end)"),
]
