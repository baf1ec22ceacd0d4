"""ChangeMyView (Tan et al. 2016 pair task): a delta-winning root reply vs a non-winning one.

Reads rows in the bundled format (data/cmv/README.md) and turns each into one pair, or into a
drop reason. The premise is the title plus the first `premise_words` words of the post body.
"""
from __future__ import annotations

import re

from common.data import DataError

NAME = "cmv"
INSTRUCTION = ("Below is a post from r/ChangeMyView, where the author asks others to change their view. "
               "Write a reply that could persuade them.\n\n")

REQUIRED_STR = ("op_id", "positive_reply", "negative_reply")
OPTIONAL_STR = ("pair_id", "op_title", "op_text", "source_split")

# The moderators' footnote that closes many CMV posts ("Hello, users of CMV! This is a footnote from
# your moderators..."): boilerplate, not the author's view, and up to ~100 words of the prompt.
_FOOTNOTE = re.compile(r"\s*(_{3,}|\*{3,}|-{3,})?\s*(&gt;|>)?\s*\*?Hello,? users of CMV!.*\Z", re.S | re.I)
_CMV_PREFIX = re.compile(r"^\s*\[?cmv\]?\s*[:\-]\s*", re.I)
_DELETED = {"[deleted]", "[removed]", ""}


def _field(row: dict, name: str, where: str, required: bool):
    value = row.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, str):
        got = "missing" if name not in row else f"{type(value).__name__} {value!r:.40}"
        raise DataError(f"{where}: field '{name}' must be a string, got {got}")
    return value


def premise_text(title: str | None, body: str | None, premise_words: int) -> str:
    """Title plus the first `premise_words` words of the body, without the moderators' footnote."""
    parts = []
    if title and title.strip():
        parts.append("CMV: " + _CMV_PREFIX.sub("", title.strip()))
    if body and body.strip():
        parts.append(_cut_words(_FOOTNOTE.sub("", body.replace("&gt;", ">")).strip(), premise_words))
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


def to_pair(row: dict, where: str, premise_words: int):
    """One input row -> a pair dict, or a drop reason (str). Malformed rows raise DataError."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    fields = {name: _field(row, name, where, True) for name in REQUIRED_STR}
    fields.update({name: _field(row, name, where, False) for name in OPTIONAL_STR})
    winner, loser = fields["positive_reply"].strip(), fields["negative_reply"].strip()
    title, body = fields["op_title"], fields["op_text"]
    premise = premise_text(title, body, premise_words)
    if not premise:
        return "no_premise"
    if winner in _DELETED or loser in _DELETED:
        return "empty_or_deleted_reply"
    if winner == loser:
        return "identical_replies"
    return {
        "id": fields["pair_id"] or f"{fields['op_id']}:{where}",
        "group_id": fields["op_id"],
        "premise": premise,
        "prompt": [{"role": "user", "content": INSTRUCTION + premise}],
        "chosen": winner,
        "rejected": loser,
        "source_split": fields["source_split"],
    }
