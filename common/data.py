"""Reading and writing data files, splitting by group, length balancing, fitting token budgets."""
from __future__ import annotations

import contextlib
import functools
import gzip
import hashlib
import json
import math
import random
import re
import unicodedata
import zlib
from bisect import bisect_left
from collections import Counter
from pathlib import Path

SENTENCE_END = re.compile(r"(?<=[.!?])\s+")  # splits text into sentences, keeping their marks


class DataError(ValueError):
    """Malformed input: the message names the file, the line and the field."""


def write_json(path: Path, data) -> None:
    """Atomically: a reader never sees half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(_finite(data), indent=2, sort_keys=False, allow_nan=False) + "\n")
    tmp.replace(path)


def _finite(data):
    """JSON has no NaN or Infinity (strict readers refuse the file): a non-finite number is written as null."""
    if isinstance(data, float) and not math.isfinite(data):
        return None
    if isinstance(data, dict):
        return {k: _finite(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_finite(v) for v in data]
    return data


def read_json(path: Path):
    return json.loads(Path(path).read_text())


def read_manifest(run_dir) -> dict:
    """A run directory's manifest.json; DataError naming it when it is not a readable JSON object."""
    path = Path(run_dir) / "manifest.json"
    try:
        manifest = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as err:
        raise DataError(f"{path}: not a readable manifest ({(str(err).splitlines() or [type(err).__name__])[0][:80]}); "
                        f"the run directory is damaged") from None
    if not isinstance(manifest, dict):
        raise DataError(f"{path}: not a readable manifest (a JSON {type(manifest).__name__}, not an object); "
                        f"the run directory is damaged")
    return manifest


def text_field(row: dict, name: str, where: str, required: bool, label: str | None = None) -> str | None:
    """Field `name` of a source row as text (None when absent and not `required`); anything else is a
    DataError naming `where` and the field (`label`, for a field nested in the row)."""
    value = row.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, str):
        got = "missing" if name not in row else f"{type(value).__name__} {value!r:.40}"
        raise DataError(f"{where}: field '{label or name}' must be a string, got {got}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:  # a lone surrogate escape such as \ud800: valid JSON, not text
        raise DataError(f"{where}: field '{label or name}' is not valid Unicode (unpaired surrogate "
                        f"{value[err.start]!r} at character {err.start + 1})") from None
    return value


GZIP_MAGIC = b"\x1f\x8b"
# The longest line a data file may hold: a paper with its reviews is well under 1 MiB (the bundled
# NeurIPS file's longest is 0.3 MiB), and a line is read into memory whole (a small .gz can expand to
# one line of gigabytes).
MAX_LINE_BYTES = 16 * 2**20
# The most a data file may hold once decompressed: the bundled review file is 48 MiB. A small .gz can
# expand to gigabytes of rows, each under the line bound, that would take the stage hours to read.
MAX_FILE_BYTES = 2**30


class _Hashing:
    """A raw file that hashes every byte read from it: the digest is of the bytes parsed, not of a
    second read of a file that may have changed in between."""

    def __init__(self, raw, digest):
        self.raw, self.digest = raw, digest

    def read(self, n=-1):
        data = self.raw.read(n)
        self.digest.update(data)
        return data

    def readline(self, n=-1):
        data = self.raw.readline(n)
        self.digest.update(data)
        return data

    def close(self):
        if self.raw.closed:
            return
        while chunk := self.raw.read(2**20):  # bytes after the last row (a gzip trailer) are part of the file
            self.digest.update(chunk)
        self.raw.close()

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.close()


def _open_by_content(path: Path, digest=None):
    """A binary stream of the file's lines: gzip when it starts with the gzip magic bytes, whatever
    its name says (a gzip named .jsonl is read; a plain file named .gz is read as it is). With a
    `digest` (a hashlib object), every byte of the file goes into it as it is read."""
    raw = open(path, "rb")
    magic = raw.read(2)
    raw.seek(0)
    if digest is not None:
        raw = _Hashing(raw, digest)
    return gzip.GzipFile(fileobj=raw, mode="rb") if magic == GZIP_MAGIC else raw, raw


def _stream_error(path: Path, lineno: int, err: BaseException) -> DataError:
    """The file is damaged as a whole, not one row of it: the rows after the damage cannot be counted."""
    damaged = isinstance(err, (EOFError, zlib.error, gzip.BadGzipFile))
    what = "the gzip stream is cut short or corrupt" if damaged else "the file cannot be read"
    detail = (str(err).splitlines() or [type(err).__name__])[0]
    where = f"{path}:{lineno}" if lineno else str(path)
    return DataError(f"{where}: {what} ({detail}); the rows from there on cannot be counted, so this "
                     f"stops the stage even with --skip_bad_rows: repair or re-create the file")


def read_jsonl(path: str | Path, skip_invalid: bool = False, digest=None):
    """Yield (where, row) for each non-blank line; `where` is "file:line" for error messages.

    The file is read in binary, as gzip when its first bytes say so (not its name), and each line is
    decoded here. A line that is not valid UTF-8 or not valid JSON raises DataError naming the file and
    line, or yields (where, None) with skip_invalid. A damaged stream (a gzip cut short, a bad CRC, a
    file that cannot be read), a line over MAX_LINE_BYTES or a file over MAX_FILE_BYTES (decompressed)
    always raises DataError, skip_invalid or not. With `digest` (a hashlib object), the file's bytes
    go into it as they are read: when the generator is done, it holds the sha256 of what was parsed."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    lineno, total = 0, 0
    try:
        stream, source = _open_by_content(path, digest)
    except OSError as err:
        raise _stream_error(path, 0, err) from None
    with contextlib.closing(source), stream:
        while True:
            try:
                raw = stream.readline(MAX_LINE_BYTES + 1)
            except (EOFError, zlib.error, OSError) as err:  # gzip.BadGzipFile is an OSError
                raise _stream_error(path, lineno + 1, err) from None
            if not raw:
                return
            lineno += 1
            total += len(raw)
            if total > MAX_FILE_BYTES:
                raise DataError(f"{path}:{lineno}: the file holds more than {MAX_FILE_BYTES} bytes (decompressed) by "
                                f"this line; no data file of the task's format is that large, so this stops the stage: "
                                f"split the file, or check that it is the one meant")
            if len(raw) > MAX_LINE_BYTES:  # the rest of the line is never read into memory
                raise DataError(f"{path}:{lineno}: the line is longer than {MAX_LINE_BYTES} bytes; no row of "
                                f"the task's format is that long, so this stops the stage: repair the file")
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = _parse_line(raw, first=lineno == 1)
            except DataError as err:
                if skip_invalid:
                    yield where, None
                    continue
                raise DataError(f"{where}: {err}") from None
            if row is not _BLANK:
                yield where, row


_BLANK = object()  # a line of nothing but (Unicode) white space: skipped, not a row


def _parse_line(raw: bytes, first: bool):
    """One line's bytes -> its JSON value (or _BLANK); DataError, without the place, when the line is not
    UTF-8 or not JSON."""
    try:
        text = raw.decode("utf-8-sig" if first else "utf-8")  # a byte-order mark may open the file
    except UnicodeDecodeError as err:
        raise DataError(f"not valid UTF-8 ({err.reason}: byte {raw[err.start]:#04x} at byte {err.start + 1} "
                        f"of the line)") from None
    if not text.strip():
        return _BLANK
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(f"not valid JSON ({err.msg} at column {err.colno})") from None
    except (ValueError, RecursionError) as err:  # e.g. an integer of more digits than Python converts
        raise DataError(f"not valid JSON ({(str(err).splitlines() or [type(err).__name__])[0]})") from None


def write_jsonl(path: Path, rows) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def load_split(pairs_run: str | Path, split: str) -> list[dict]:
    return [row for _, row in read_jsonl(Path(pairs_run) / f"{split}.jsonl")]


def train_and_dev(pairs_run: str | Path, max_train: int | None, max_dev: int | None,
                  train_split: str = "train", dev_split: str = "dev") -> tuple[list, list]:
    """A training stage's data: the split it trains on (never empty) and the held-out split it is
    measured on, each cut to its maximum."""
    train = load_split(pairs_run, train_split)[:max_train]
    if not train:
        raise DataError(f"{pairs_run}: no {train_split} pairs to train on")
    return train, load_split(pairs_run, dev_split)[:max_dev]


# Characters a reader does not see: zero-width space, joiners, word joiner, byte-order mark, soft hyphen.
_INVISIBLE = dict.fromkeys(map(ord, "\u200b\u200c\u200d\u2060\ufeff\u00ad"))


def normalise_text(text: str) -> str:
    """A text as a reader compares it: Unicode NFKC (composed accents, NBSP as a space, full-width
    forms), invisible characters removed, white space collapsed (CRLF, doubled spaces, a blank line
    written as newline-space-newline), case folded. Two copies of one post that differ only in these
    are the same post to every overlap and duplicate check."""
    return " ".join(unicodedata.normalize("NFKC", text).translate(_INVISIBLE).casefold().split())


def premise_digest(row: dict) -> str:
    """The identity of a row's premise by its normalised text (its prompt), whatever post or paper id it
    carries and however its white space, accents or case are written."""
    return hashlib.sha256(json.dumps([[m["role"], normalise_text(m["content"])] for m in row["prompt"]]).encode()
                          ).hexdigest()


def raw_premise_digest(row: dict) -> str:
    """The digest of a premise as written (judges made before premises were normalised recorded these)."""
    return hashlib.sha256(json.dumps(row["prompt"]).encode()).hexdigest()


SHINGLE_WORDS = 5  # near duplicates: word 5-grams of the normalised text ...
NEAR_DUPLICATE_JACCARD = 0.8  # ... shared at this Jaccard similarity or more ...
NEAR_DUPLICATE_MIN_WORDS = 20  # ... by texts of this many words (shorter ones: compared whole)


def shingles(text: str, n: int = SHINGLE_WORDS) -> set[int]:
    """The word n-grams of a normalised text, hashed (a text shorter than n words: itself)."""
    words = normalise_text(text).split()
    return {hash(tuple(words[i:i + n])) for i in range(max(1, len(words) - n + 1))}


class NearDuplicates:
    """Texts indexed by their word shingles: `find(text)` names an indexed text whose shingles' Jaccard
    similarity with it is NEAR_DUPLICATE_JACCARD or more (a post with a sentence edited, a word added,
    a footnote dropped), or None. Texts under NEAR_DUPLICATE_MIN_WORDS words (a title alone) are left
    to the exact comparison: two short titles share most of their few shingles by chance."""

    def __init__(self, threshold: float = NEAR_DUPLICATE_JACCARD):
        self.threshold, self.sizes, self.index = threshold, {}, {}

    def add(self, key: str, text: str) -> None:
        if len(text.split()) < NEAR_DUPLICATE_MIN_WORDS:
            return
        found = shingles(text)
        self.sizes[key] = len(found)
        for s in found:
            self.index.setdefault(s, set()).add(key)

    def find(self, text: str) -> str | None:
        if len(text.split()) < NEAR_DUPLICATE_MIN_WORDS:
            return None
        found = shingles(text)
        shared = Counter(key for s in found for key in self.index.get(s, ()))
        for key, n in shared.most_common():
            if n / (len(found) + self.sizes[key] - n) >= self.threshold:
                return key
        return None


class SeenRows:
    """The examples kept so far, to drop repeats (stage 01, and 05's --eval_data): a row with the same
    (normalised) premise and replies as an earlier one is a `duplicate_pair`; one whose premise text was
    kept under another post or paper id is a `duplicate_premise` (it could land in two splits, or be
    scored twice). A row whose id an earlier row with other content holds is kept under a new id
    (`<id>~2`, ...), counted in `renamed`: an id clash is not a duplicate."""

    def __init__(self):
        self.ids: set[str] = set()
        self.contents: set[tuple] = set()
        self.premises: dict[str, str] = {}
        self.renamed = 0

    def repeat(self, examples: list[dict]) -> str | None:
        if any(self._content(e) in self.contents for e in examples):
            return "duplicate_pair"
        if any(self.premises.get(premise_digest(e), e["group_id"]) != e["group_id"] for e in examples):
            return "duplicate_premise"
        return None

    def add(self, examples: list[dict]) -> None:
        clash = any(e["id"] in self.ids for e in examples)
        self.renamed += clash
        for e in examples:
            if clash:
                n = 2
                while f"{e['id']}~{n}" in self.ids:
                    n += 1
                e["id"] = f"{e['id']}~{n}"
            self.ids.add(e["id"])
            self.contents.add(self._content(e))
            self.premises.setdefault(premise_digest(e), e["group_id"])

    @staticmethod
    def _content(example: dict) -> tuple:
        return (premise_digest(example), normalise_text(example["chosen"]),
                normalise_text(example.get("rejected") or ""))


def one_per_group(rows: list[dict]) -> list[dict]:
    """The first row of each group (premise): a post with several pairs is prompted once."""
    seen, out = set(), []
    for row in rows:
        if row["group_id"] not in seen:
            seen.add(row["group_id"])
            out.append(row)
    return out


def split_by_group(pairs: list[dict], fractions: dict[str, float], seed: int) -> dict[str, list[dict]]:
    """Assign whole groups (original posts, papers) to splits, so no premise is in two splits.
    Every split but the first gets at least one group when there are enough groups."""
    groups = sorted({p["group_id"] for p in pairs})
    random.Random(seed).shuffle(groups)
    names = list(fractions)
    counts = {name: round(fractions[name] * len(groups)) for name in names[1:]}
    if len(groups) >= len(names):
        counts = {name: max(1, n) for name, n in counts.items()}
    assignment, start = {}, 0
    for name in names[1:]:
        for g in groups[start:start + counts[name]]:
            assignment[g] = name
        start += counts[name]
    for g in groups[start:]:
        assignment[g] = names[0]
    out = {name: [] for name in names}
    for p in pairs:
        out[assignment[p["group_id"]]].append(p)
    return out


def split_by_period(pairs: list[dict], dev_fraction: float, seed: int,
                    later_dev_fraction: float = 0.0) -> dict[str, list[dict]]:
    """The source's later period as the held-out splits: every post (group) with a row whose source_split
    is `heldout` is a later post with all its rows, since a post has one date and its rows of unknown
    period share it. `later_dev_fraction` of the later posts, drawn by post, form dev_later (where a
    judge is chosen), the rest test (where it is reported), so that no choice is made on test. Dev is
    drawn by post from the earlier rest, as split_by_group does."""
    later = {p["group_id"] for p in pairs if p.get("source_split") == "heldout"}
    rest = split_by_group([p for p in pairs if p["group_id"] not in later],
                          {"train": 1 - dev_fraction, "dev": dev_fraction}, seed)
    held = [p for p in pairs if p["group_id"] in later]
    held = split_by_group(held, {"test": 1 - later_dev_fraction, "dev_later": later_dev_fraction}, seed) \
        if later_dev_fraction else {"test": held, "dev_later": []}
    return {**rest, "dev_later": held["dev_later"], "test": held["test"]}


def fold_of(group_id: str, folds: int) -> int:
    """The cross-fitting fold (0..folds-1) of a post, from a hash of its id. Not a seeded shuffle: the
    k judges of one cross-fit are k separate stage-03 runs, and each must cut the same folds whatever
    its seed, max_train_examples or the order of the split's file, or a premise could end up trained
    on by every judge. By post, so a post's pairs stay in one fold, as split_by_group keeps them in one split."""
    return int.from_bytes(hashlib.sha256(str(group_id).encode()).digest()[:8], "big") % folds


def cross_fit(rows: list[dict], folds: int, fold: int) -> tuple[list[dict], list[dict]]:
    """(the rows of every other fold, the rows of `fold`), each in file order."""
    kept = [r for r in rows if fold_of(r["group_id"], folds) != fold]
    return kept, [r for r in rows if fold_of(r["group_id"], folds) == fold]


def n_words(text: str) -> int:
    return len(text.split())


def length_only_accuracy(pairs: list[dict]) -> float | None:
    """Share of pairs a length-only judge gets right: the winner is the longer reply (ties: half)."""
    if not pairs:
        return None
    score = sum(1.0 if n_words(p["chosen"]) > n_words(p["rejected"]) else
                0.5 if n_words(p["chosen"]) == n_words(p["rejected"]) else 0.0 for p in pairs)
    return score / len(pairs)


def balance_by_length(pairs: list[dict], seed: int) -> tuple[list[dict], list[dict]]:
    """Keep every pair of the rarer kind (winner longer, or winner shorter) and, for each, the pair of
    the other kind whose length ratio is closest. The winner is then the longer reply in exactly half
    of the kept pairs, and the size of the length gap carries no signal either: its distribution is
    the same for both kinds. Ties in length are kept (they tell a length judge nothing).
    Returns (kept, dropped)."""
    def log_ratio(p):
        return abs(math.log((n_words(p["chosen"]) + 1) / (n_words(p["rejected"]) + 1)))

    longer = [p for p in pairs if n_words(p["chosen"]) > n_words(p["rejected"])]
    shorter = [p for p in pairs if n_words(p["chosen"]) < n_words(p["rejected"])]
    ties = [p for p in pairs if n_words(p["chosen"]) == n_words(p["rejected"])]
    minority, majority = sorted((longer, shorter), key=len)
    rng = random.Random(seed)
    rng.shuffle(majority)  # equal ratios are then broken at random, not by file order
    pool = sorted(majority, key=log_ratio)
    keys = [log_ratio(p) for p in pool]
    matched = []
    for p in sorted(minority, key=log_ratio):
        r = log_ratio(p)
        i = bisect_left(keys, r)
        best = min((j for j in (i - 1, i) if 0 <= j < len(pool)), key=lambda j: abs(keys[j] - r))
        matched.append(pool.pop(best))
        keys.pop(best)
    kept_ids = {id(p) for p in minority + matched + ties}
    kept = [p for p in pairs if id(p) in kept_ids]  # input order, for reproducible files
    dropped = [p for p in pairs if id(p) not in kept_ids]
    return kept, dropped


def length_kinds(pairs: list[dict]) -> dict:
    """How many pairs have the winner longer, shorter, or as long as the loser (in words)."""
    counts = {"winner_longer": 0, "winner_shorter": 0, "tie": 0}
    for p in pairs:
        c, r = n_words(p["chosen"]), n_words(p["rejected"])
        counts["winner_longer" if c > r else "winner_shorter" if c < r else "tie"] += 1
    return counts


def within_length_band(pair: dict, max_length_ratio: float) -> bool:
    """True when the longer reply has at most `max_length_ratio` times the words of the shorter."""
    a, b = sorted((n_words(pair["chosen"]) + 1, n_words(pair["rejected"]) + 1))
    return b / a <= max_length_ratio


def balance_split(pairs: list[dict], strategy: str, max_length_ratio: float | None, seed: int):
    """One split through the length strategy: the optional ratio band, then the balancing.
    Returns (kept, {drop reason: count})."""
    dropped = {}
    if max_length_ratio is not None:
        band = [p for p in pairs if within_length_band(p, max_length_ratio)]
        dropped["length_ratio_band"] = len(pairs) - len(band)
        pairs = band
    if strategy == "match_ratio":
        pairs, removed = balance_by_length(pairs, seed)
        dropped["length_balance"] = len(removed)
    return pairs, dropped


# --- token budgets -------------------------------------------------------------------------------

def token_ids(encoded) -> list[int]:
    """The ids of what a tokenizer or `apply_chat_template(tokenize=True)` returned (a list or a BatchEncoding)."""
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def _template_overheads(tokenizer, prompt_messages):
    """Tokens the chat template adds around the user content and after the reply."""
    return _overheads_for_roles(tokenizer, tuple(m["role"] for m in prompt_messages))


@functools.lru_cache(maxsize=64)
def _overheads_for_roles(tokenizer, roles: tuple[str, ...]) -> tuple[int, int]:
    # The same for every prompt with these roles: rendered once per tokenizer, not once per reply.
    empty = [{"role": role, "content": ""} for role in roles]
    prompt_ids = token_ids(tokenizer.apply_chat_template(empty, add_generation_prompt=True, tokenize=True))
    full_ids = token_ids(tokenizer.apply_chat_template(empty + [{"role": "assistant", "content": "x"}], tokenize=True))
    return len(prompt_ids), len(full_ids) - len(prompt_ids) - 1


def truncate_tokens(tokenizer, text: str, n: int, sentence_boundary: bool = False) -> str:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= n:
        return text
    cut = tokenizer.decode(ids[:max(n, 0)], skip_special_tokens=True)
    if sentence_boundary:
        # End on a finished sentence when one ends in the last third: a cleaner training target.
        ends = [cut.rfind(mark) for mark in (". ", "? ", "! ", "\n")]
        end = max(ends)
        if end >= len(cut) * 2 // 3:
            cut = cut[:end + 1]
    return cut.rstrip()


def fit_prompt(tokenizer, prompt_messages: list[dict], max_prompt_tokens: int) -> list[dict]:
    """Cut the last (user) message so the templated prompt fits `max_prompt_tokens`."""
    overhead, _ = _template_overheads(tokenizer, prompt_messages)
    *head, last = prompt_messages
    budget = max_prompt_tokens - overhead - sum(
        len(tokenizer(m["content"], add_special_tokens=False)["input_ids"]) for m in head)
    return head + [{**last, "content": truncate_tokens(tokenizer, last["content"], budget)}]


def prompt_length(tokenizer, prompt_messages: list[dict]) -> int:
    return len(token_ids(tokenizer.apply_chat_template(prompt_messages, add_generation_prompt=True, tokenize=True)))


def template_closing_tokens(tokenizer, prompt_messages: list[dict]) -> int:
    """Tokens the chat template adds after a reply (end of turn)."""
    return _template_overheads(tokenizer, prompt_messages)[1]


def fit_reply(tokenizer, prompt_messages: list[dict], reply: str, max_length: int,
              max_reply_tokens: int | None = None) -> str:
    """Cut the reply (at a sentence end where possible) so prompt + reply fit `max_length`, and the reply
    `max_reply_tokens` when given."""
    closing = template_closing_tokens(tokenizer, prompt_messages)
    budget = max_length - prompt_length(tokenizer, prompt_messages) - closing - 1
    return truncate_tokens(tokenizer, reply, min(budget, max_reply_tokens or budget), sentence_boundary=True)
