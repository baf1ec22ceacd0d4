"""Stage 01 fed corrupt real lines ends in exactly one of two ways:

(a) it stops: exit code != 0, stderr's last line is `error: ...` naming the file (and `:LINE` where
    there is one), no traceback, and no run directory marked DONE;
(b) it finishes: exit 0, DONE, every non-blank input row accounted for in metrics.json
    (sum(n_pairs) + sum(dropped) == n_input_rows), split files as long as n_pairs, train and test
    not empty.

The cases below go through the real command line; the property-based test at the end drives the
same entry point (`cli(main, PairsConfig)`: parse_config, main, the one-line error) in-process,
because a subprocess per example would be ~20x slower.
"""
from __future__ import annotations

import gzip
import json
import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO, error_line, run_dir_of, run_in_process, run_stage
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from common.tasks import cmv

BUNDLED = REPO / "data" / "cmv" / "cmv_pairs.jsonl.gz"
N_ROWS = 80  # enough posts that every split keeps pairs after length balancing
SPLITS = ("train", "dev", "test")
STREAM_ERROR = "the gzip stream is cut short or corrupt"


# --- the two outcomes -------------------------------------------------------------------------------

@dataclass
class Outcome:
    kind: str                   # "error" or "done"
    error: str | None = None    # the last stderr line, for "error"
    metrics: dict | None = None  # metrics.json, for "done"
    run: Path | None = None


def _non_blank_lines(path: Path) -> int:
    """The rows a reader must account for: lines with something other than white space (gzip by magic)."""
    data = Path(path).read_bytes()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    return sum(bool(raw.decode("utf-8-sig" if i == 0 else "utf-8", errors="replace").strip())
               for i, raw in enumerate(data.split(b"\n")))


def assert_one_of_two_outcomes(proc, runs_dir, files) -> Outcome:
    """Stage 01's result is (a) a one-line error naming one of `files`, with no DONE anywhere, or (b) a
    finished run that accounts for every non-blank row of `files` and has usable splits."""
    runs_dir, files = Path(runs_dir), [Path(f) for f in files]
    stderr = proc.stderr or ""
    assert "Traceback" not in stderr, stderr[-5000:]
    run_dirs = sorted(p for p in runs_dir.iterdir() if p.is_dir()) if runs_dir.is_dir() else []
    if proc.returncode != 0:
        lines = stderr.strip().splitlines()
        assert lines, f"exit {proc.returncode} without an error line"
        last = lines[-1]
        assert last.startswith("error: "), stderr[-3000:]
        assert any(str(f) in last for f in files), f"the error names none of {files}: {last}"
        assert not [d for d in run_dirs if (d / "DONE").exists()], f"a failed stage left DONE in {run_dirs}"
        assert "run_dir: " not in (proc.stdout or "")
        for d in run_dirs:  # the failed run's log says why
            assert last in (d / "run.log").read_text(), d
        return Outcome("error", error=last)

    assert proc.returncode == 0
    run = run_dir_of(proc)
    assert (run / "DONE").is_file(), run
    assert [d.resolve() for d in run_dirs] == [run.resolve()]
    metrics = json.loads((run / "metrics.json").read_text())
    n_rows = sum(_non_blank_lines(f) for f in files)
    assert sum(metrics["n_pairs"].values()) + sum(metrics["dropped"].values()) == metrics["n_input_rows"] == n_rows, \
        (metrics["n_pairs"], metrics["dropped"], metrics["n_input_rows"], n_rows)
    ids, contents = set(), set()
    for split in SPLITS:
        pairs = [json.loads(line) for line in (run / f"{split}.jsonl").read_text().splitlines()]
        assert len(pairs) == metrics["n_pairs"][split], split
        for p in pairs:
            assert isinstance(p["chosen"], str) and p["chosen"] and p["rejected"] and p["chosen"] != p["rejected"]
            ids.add(p["id"])
            contents.add((p["group_id"], p["chosen"], p["rejected"]))
    total = sum(metrics["n_pairs"].values())
    assert len(ids) == len(contents) == total, "a pair id or a pair's content appears twice"
    assert metrics["n_pairs"]["train"] > 0 and metrics["n_pairs"]["test"] > 0, metrics["n_pairs"]
    return Outcome("done", metrics=metrics, run=run)


# --- real lines and the command line -------------------------------------------------------------------

def _real_lines(n: int = N_ROWS) -> list[bytes]:
    with gzip.open(BUNDLED, "rb") as f:
        return [next(f).rstrip(b"\n") for _ in range(n)]


def _rows(n: int = N_ROWS) -> list[dict]:
    return [json.loads(line) for line in _real_lines(n)]


def _line(row) -> bytes:
    try:
        return json.dumps(row, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: written as its JSON escape (valid JSON, not text)
        return json.dumps(row).encode("ascii")


def _write(path: Path, lines: list[bytes], compress: bool = False) -> Path:
    data = b"".join(line + b"\n" for line in lines)
    path.write_bytes(gzip.compress(data, mtime=0) if compress else data)
    return path


def _build(runs_dir: Path, *files, skip: bool = False):
    extra = ("--skip_bad_rows", "true") if skip else ()
    return run_stage("01_build_pairs.py", "--config", "configs/tiny/01_build_pairs.yaml", "--task", "cmv",
                     "--data", *files, "--runs_dir", runs_dir, *extra, check=False)


def _base_drops(rows: list[dict]) -> Counter:
    """What the untouched rows drop by themselves (before balancing), so a test can add its own."""
    return Counter(p for p in (cmv.to_pair(r, "x", 470) for r in rows) if isinstance(p, str))


# --- a bad row: stops the stage, or is skipped and counted with --skip_bad_rows ---------------------------

def _set(field, value):
    def change(row):
        row[field] = value
        return _line(row)
    return change


def _drop(field):
    def change(row):
        del row[field]
        return _line(row)
    return change


def _insert_bytes(bad: bytes):
    def change(row):
        line = _line(row)
        at = line.index(b'"positive_reply": "') + len(b'"positive_reply": "') + 5  # inside the reply's text
        return line[:at] + bad + line[at:]
    return change


BAD_ROWS = {  # name: (line changed (1-based), change, what the error says)
    "bad_json": (7, lambda row: _line(row)[:-5], "not valid JSON"),
    "missing_field": (3, _drop("positive_reply"), "field 'positive_reply' must be a string, got missing"),
    "wrong_type_field": (5, _set("negative_reply", ["a", "list"]), "field 'negative_reply' must be a string, got list"),
    "wrong_type_id": (11, _set("op_id", 12345), "field 'op_id' must be a string, got int"),
    "blank_op_id": (13, _set("op_id", "  "), "field 'op_id' must be a non-empty string"),
    "invalid_utf8": (9, _insert_bytes(b"\xff\xc3\x28"), "not valid UTF-8"),
    "lone_surrogate": (15, _set("positive_reply", "I see \ud800 your point"),
                       "field 'positive_reply' is not valid Unicode"),
    "null_line": (6, lambda row: b"null", "expected a JSON object"),
    "array_line": (17, lambda row: b"[1, 2]", "expected a JSON object"),
}


def _with_bad_rows(names) -> list[bytes]:
    lines, rows = _real_lines(), _rows()
    for name in names:
        lineno, change, _ = BAD_ROWS[name]
        lines[lineno - 1] = change(rows[lineno - 1])
    return lines


@pytest.mark.stage
@pytest.mark.parametrize("name", list(BAD_ROWS))
def test_a_bad_row_stops_the_stage_naming_file_and_line(tmp_path, name):
    lineno, _, message = BAD_ROWS[name]
    path = _write(tmp_path / "bad.jsonl", _with_bad_rows([name]))
    outcome = assert_one_of_two_outcomes(proc := _build(tmp_path / "runs", path), tmp_path / "runs", [path])
    assert outcome.kind == "error", proc.stdout[-2000:]
    assert outcome.error.startswith(f"error: {path}:{lineno}: {message}"), outcome.error


@pytest.mark.stage
def test_bad_rows_are_skipped_and_counted_with_skip_bad_rows(tmp_path):
    path = _write(tmp_path / "bad.jsonl.gz", _with_bad_rows(BAD_ROWS), compress=True)
    outcome = assert_one_of_two_outcomes(_build(tmp_path / "runs", path, skip=True), tmp_path / "runs", [path])
    assert outcome.kind == "done"
    assert outcome.metrics["n_input_rows"] == N_ROWS
    assert outcome.metrics["dropped"]["bad_row"] == len(BAD_ROWS)


# --- well-formed but unusable rows: always dropped and counted, by reason --------------------------------

@pytest.mark.stage
def test_unusable_rows_and_duplicates_are_dropped_by_reason(tmp_path):
    rows = _rows()
    for row in rows:  # rows without pair_id: the id must come from the content, not the line number
        del row["pair_id"]
    base = _base_drops(rows)
    rows[3]["positive_reply"] = "   \n  "                       # blank reply
    rows[4]["negative_reply"] = "[deleted]"
    rows[5]["positive_reply"] = "[removed]"
    rows[6]["op_title"], rows[6]["op_text"] = "", "   "         # blank premise
    rows[7]["pair_id"] = ""                                     # blank pair_id: the content id is used
    rows[8]["negative_reply"] = rows[8]["positive_reply"]       # identical replies
    lines = [_line(r) for r in rows]
    lines.append(lines[10])                                     # a duplicate line
    lines.append(_line({**rows[11], "pair_id": "another-id"}))  # the same pair under another pair_id
    lines.append(_line({**rows[12], "positive_reply": "  " + rows[12]["positive_reply"] + "\n"}))  # same once stripped
    lines[20:20] = [b"", b"   ", b"\t"]                         # blank lines: skipped, not rows
    path = _write(tmp_path / "unusable.jsonl", lines)
    outcome = assert_one_of_two_outcomes(_build(tmp_path / "runs", path), tmp_path / "runs", [path])
    assert outcome.kind == "done"
    dropped = outcome.metrics["dropped"]
    assert outcome.metrics["n_input_rows"] == N_ROWS + 3
    assert dropped["duplicate_pair"] == 3
    assert dropped["empty_or_deleted_reply"] == base["empty_or_deleted_reply"] + 3
    assert dropped["no_premise"] == base["no_premise"] + 1
    assert dropped["identical_replies"] == base["identical_replies"] + 1


def test_pair_id_is_a_content_digest_without_pair_id():
    row = _rows(1)[0]
    del row["pair_id"]
    first, again = cmv.to_pair(row, "a.jsonl:1", 470), cmv.to_pair(dict(row), "b.jsonl.gz:99", 470)
    assert first["id"] == again["id"] and re.fullmatch(r"[0-9a-f]{16}", first["id"])
    other = cmv.to_pair({**row, "negative_reply": row["negative_reply"] + " More."}, "a.jsonl:1", 470)
    assert other["id"] != first["id"]
    assert cmv.to_pair({**row, "pair_id": " "}, "a.jsonl:1", 470)["id"] == first["id"]  # blank pair_id
    assert cmv.to_pair({**row, "pair_id": "p-1"}, "a.jsonl:1", 470)["id"] == "p-1"


# --- a damaged or mislabelled file -----------------------------------------------------------------------

def _gzip_bytes(lines) -> bytes:
    return gzip.compress(b"".join(line + b"\n" for line in lines), mtime=0)


def _cut_in_half(tmp_path):
    data = _gzip_bytes(_real_lines())
    return [_write_bytes(tmp_path / "cut.jsonl.gz", data[:len(data) // 2])]


def _corrupt_middle(tmp_path):
    data = bytearray(_gzip_bytes(_real_lines()))
    for i in range(len(data) // 2, len(data) // 2 + 64):
        data[i] ^= 0x5A
    return [_write_bytes(tmp_path / "corrupt.jsonl.gz", bytes(data))]


def _trailing_garbage(tmp_path):
    return [_write_bytes(tmp_path / "tail.jsonl.gz", _gzip_bytes(_real_lines()) + b"not gzip at all\n")]


def _header_only(tmp_path):
    return [_write_bytes(tmp_path / "header.jsonl.gz", _gzip_bytes(_real_lines())[:6])]


def _write_bytes(path, data):
    path.write_bytes(data)
    return path


@pytest.mark.stage
@pytest.mark.parametrize("make", [_cut_in_half, _corrupt_middle, _trailing_garbage, _header_only])
@pytest.mark.parametrize("skip", [False, True])
def test_a_damaged_gzip_always_stops_the_stage(tmp_path, make, skip):
    files = make(tmp_path)
    proc = _build(tmp_path / "runs", *files, skip=skip)
    outcome = assert_one_of_two_outcomes(proc, tmp_path / "runs", files)
    assert outcome.kind == "error"
    assert re.match(rf"error: {re.escape(str(files[0]))}:\d+: ", outcome.error), outcome.error
    if skip or make is not _corrupt_middle:  # corrupt data may first decode to a bad row, which stops it too
        assert STREAM_ERROR in outcome.error and "--skip_bad_rows" in outcome.error, outcome.error


@pytest.mark.stage
@pytest.mark.parametrize("name, compress", [("gzip_named.jsonl", True), ("plain_named.jsonl.gz", False)])
def test_files_are_read_by_their_content_not_their_name(tmp_path, name, compress):
    path = _write(tmp_path / name, _real_lines(), compress=compress)
    outcome = assert_one_of_two_outcomes(_build(tmp_path / "runs", path), tmp_path / "runs", [path])
    assert outcome.kind == "done" and outcome.metrics["n_input_rows"] == N_ROWS


@pytest.mark.stage
@pytest.mark.parametrize("content", [b"", b"\n\n   \n\t\n"], ids=["empty", "blank_lines"])
def test_a_file_without_rows_stops_the_stage(tmp_path, content):
    path = _write_bytes(tmp_path / "empty.jsonl", content)
    outcome = assert_one_of_two_outcomes(_build(tmp_path / "runs", path), tmp_path / "runs", [path])
    assert outcome.kind == "error"
    assert outcome.error.startswith(f"error: {path}: no rows"), outcome.error
    (run,) = (tmp_path / "runs").iterdir()
    assert json.loads((run / "metrics.json").read_text())["n_input_rows"] == 0


@pytest.mark.stage
def test_an_empty_file_among_good_ones_is_named(tmp_path):
    good = _write(tmp_path / "good.jsonl.gz", _real_lines(), compress=True)
    empty = _write_bytes(tmp_path / "empty.jsonl", b"")
    outcome = assert_one_of_two_outcomes(_build(tmp_path / "runs", good, empty), tmp_path / "runs", [good, empty])
    assert outcome.kind == "error" and outcome.error.startswith(f"error: {empty}: no rows"), outcome.error


# --- property-based: random corruptions of real lines ----------------------------------------------------

def _run_in_process(*args) -> subprocess.CompletedProcess:
    """`python 01_build_pairs.py ARGS` in this process (conftest.run_in_process)."""
    return run_in_process("01_build_pairs.py", *args)


_N_PROPERTY_ROWS = 160  # with fewer, some random regroupings leave the test split without pairs after balancing
_CONFIG = "configs/tiny/01_build_pairs.yaml"
_FIELDS = ("pair_id", "op_id", "op_title", "op_text", "positive_reply", "negative_reply", "source_split")
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=5)
_INVALID_UTF8 = st.sampled_from([b"\xff", b"\x80", b"\xc3\x28", b"\xa0\xa1", b"\xe2\x28\xa1", b"\xed\xa0\x80",
                                 b"\xf0\x28\x8c\xbc", b"\xc0\xaf", b"\xfe\xfe\xff"])
_INDEX = st.integers(0, 10_000)  # taken modulo the length of whatever it indexes
_OPS = st.one_of(
    st.tuples(st.just("flip"), _INDEX, _INDEX, st.integers(1, 255)),
    st.tuples(st.just("truncate"), _INDEX, _INDEX),
    st.tuples(st.just("delete"), _INDEX, _INDEX, st.integers(1, 40)),
    st.tuples(st.just("field"), _INDEX, st.sampled_from(_FIELDS), _JSON),
    st.tuples(st.just("unset"), _INDEX, st.sampled_from(_FIELDS)),
    st.tuples(st.just("blank_field"), _INDEX, st.sampled_from(_FIELDS), st.sampled_from(["", "  ", "\n", "[deleted]"])),
    st.tuples(st.just("surrogate"), _INDEX, st.sampled_from(_FIELDS)),
    st.tuples(st.just("duplicate"), _INDEX, _INDEX, st.sampled_from(["same", "new_pair_id", "no_pair_id"])),
    st.tuples(st.just("invalid_utf8"), _INDEX, _INDEX, _INVALID_UTF8),
    st.tuples(st.just("blank_line"), _INDEX, st.sampled_from([b"", b"  ", b"\t", b"\r"])),
)


def _corrupt(lines: list[bytes], op: tuple) -> None:
    kind, i = op[0], op[1] % len(lines)
    line = lines[i]
    if kind == "flip" and line:
        at = op[2] % len(line)
        lines[i] = line[:at] + bytes([line[at] ^ op[3]]) + line[at + 1:]
    elif kind == "truncate":
        lines[i] = line[:op[2] % (len(line) + 1)]
    elif kind == "delete" and line:
        at = op[2] % len(line)
        lines[i] = line[:at] + line[at + op[3]:]
    elif kind == "invalid_utf8":
        at = op[2] % (len(line) + 1)
        lines[i] = line[:at] + op[3] + line[at:]
    elif kind == "blank_line":
        lines.insert(i, op[2])
    elif kind == "duplicate":
        copy = line
        if op[3] != "same":
            try:
                row = json.loads(line)
                if isinstance(row, dict):
                    row.pop("pair_id", None)
                    if op[3] == "new_pair_id":
                        row["pair_id"] = f"dup-{i}"
                    copy = _line(row)
            except ValueError:
                pass
        lines.insert(op[2] % (len(lines) + 1), copy)
    else:  # a change to one field of a row that still parses
        try:
            row = json.loads(line)
        except ValueError:
            return
        if not isinstance(row, dict):
            return
        if kind == "field":
            row[op[2]] = op[3]
        elif kind == "unset":
            row.pop(op[2], None)
        elif kind == "blank_field":
            row[op[2]] = op[3]
        elif kind == "surrogate":
            row[op[2]] = "before \udc80 after"
        lines[i] = _line(row)


@pytest.mark.stage
@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=st.lists(_OPS, min_size=1, max_size=4),
       strip_pair_ids=st.booleans(),
       container=st.sampled_from(["plain.jsonl", "gzip.jsonl.gz", "gzip_named.jsonl", "plain_named.jsonl.gz"]),
       cut=st.none() | st.floats(0.02, 0.98))
def test_random_corruptions_of_real_lines_end_in_one_of_two_outcomes(ops, strip_pair_ids, container, cut):
    lines = _real_lines(_N_PROPERTY_ROWS)
    if strip_pair_ids:
        lines = [_line({k: v for k, v in json.loads(line).items() if k != "pair_id"}) for line in lines]
    for op in ops:
        _corrupt(lines, op)
    compress = container.startswith("gzip")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        path = tmp / container
        text = b"".join(line + b"\n" for line in lines)
        n_file_lines = text.count(b"\n")  # a flipped byte may have become a newline
        data = gzip.compress(text, mtime=0) if compress else text
        if compress and cut is not None:
            data = data[:max(2, int(len(data) * cut))]  # a gzip cut short (its magic bytes kept)
        path.write_bytes(data)

        outcomes = {}
        for skip in (False, True):
            runs = tmp / f"runs_{skip}"
            extra = ("--skip_bad_rows", "true") if skip else ()
            proc = _run_in_process("--config", _CONFIG, "--task", "cmv", "--data", path, "--runs_dir", runs, *extra)
            outcomes[skip] = outcome = assert_one_of_two_outcomes(proc, runs, [path])
            if outcome.kind == "error" and "no rows" not in outcome.error:
                found = re.match(rf"error: {re.escape(str(path))}:(\d+): ", outcome.error)
                assert found, outcome.error  # the file and the line
                assert 1 <= int(found.group(1)) <= n_file_lines + 1, outcome.error

    strict, lenient = outcomes[False], outcomes[True]
    for mode, outcome in (("strict", strict), ("skip_bad_rows", lenient)):  # --hypothesis-show-statistics
        event(f"{mode}: " + (outcome.kind if outcome.kind == "done" else
                             re.sub(r"^error: \S+?(:\d+)?: ", "error: ", outcome.error).split(" (")[0][:60]))
    if compress and cut is not None:
        assert strict.kind == lenient.kind == "error" and STREAM_ERROR in lenient.error
    if strict.kind == "done":  # nothing bad: --skip_bad_rows changes nothing
        assert lenient.kind == "done" and "bad_row" not in strict.metrics["dropped"]
        assert lenient.metrics["n_pairs"] == strict.metrics["n_pairs"]
        assert lenient.metrics["dropped"] == strict.metrics["dropped"]
    if lenient.kind == "error":  # only damage to the file as a whole survives --skip_bad_rows
        assert STREAM_ERROR in lenient.error or "no rows" in lenient.error, lenient.error


@pytest.mark.stage
@pytest.mark.parametrize("gz, rows, line_kb", [(True, 20, 60), (False, 50, 30), (True, 400, 3)])
def test_a_file_over_the_size_bound_is_one_error_line(tmp_path, monkeypatch, gz, rows, line_kb):
    """A gzip bomb of rows, each under the line bound, stops at the file bound (here 1 MB)."""
    import gzip as gzip_

    from common import data
    monkeypatch.setattr(data, "MAX_FILE_BYTES", 2**20)
    path = tmp_path / ("bomb.jsonl.gz" if gz else "big.jsonl")
    with (gzip_.open(path, "wt") if gz else open(path, "w")) as f:
        for i in range(rows):
            f.write(json.dumps({"op_id": f"o{i}", "op_text": "x " * (line_kb * 512), "positive_reply": "a b",
                                "negative_reply": "c d"}) + "\n")
    limit_line = 2**20 // (line_kb * 1024 + 60) + 1
    with pytest.raises(data.DataError, match=rf"{path}:\d+: the file holds more than {2**20} bytes \(decompressed\)"):
        list(data.read_jsonl(path, skip_invalid=True))
    proc = run_in_process("01_build_pairs.py", "--config", "configs/tiny/01_build_pairs.yaml", "--data", path,
                          "--runs_dir", tmp_path / "runs", "--skip_bad_rows", "true")
    line = error_line(proc)
    assert f"{path}:" in line and "more than 1048576 bytes" in line and int(line.split(":")[2]) <= limit_line + 1, line


# --- rows of no known period and over-long lines ------------------------------------------------------

PAIRS_01 = "configs/tiny/01_build_pairs.yaml"


_error = error_line


def _cmv_rows(n: int) -> list[dict]:
    with gzip.open(REPO / "data" / "cmv" / "cmv_pairs.jsonl.gz", "rt", encoding="utf-8") as f:
        return [json.loads(next(f)) for _ in range(n)]


@pytest.mark.stage
@pytest.mark.parametrize("period", ["HeldOut", None, "later"])
def test_split_by_period_refuses_a_row_of_no_known_period(tmp_path, period):
    rows = _cmv_rows(120)
    for i, row in enumerate(rows):
        row["source_split"] = "heldout" if i % 4 == 0 else "train"
    rows[7]["source_split"] = period
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["--config", PAIRS_01, "--split_by", "period", "--data", path, "--runs_dir", tmp_path / "runs"]
    line = _error(run_in_process("01_build_pairs.py", *args))
    assert line == (f"error: {path}:8: field 'source_split' must be one of 'train', 'heldout', 'unknown' with "
                    f"split_by period, got {period!r}"), line
    proc = run_in_process("01_build_pairs.py", *args, "--skip_bad_rows", "true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((run_dir_of(proc) / "metrics.json").read_text())
    assert metrics["dropped"].get("bad_row") == 1, metrics["dropped"]


def _no_done(runs: Path) -> None:
    assert not list(runs.glob("*/DONE")), list(runs.glob("*/DONE"))


@pytest.mark.stage
def test_a_line_of_more_than_the_limit_is_one_error_line(tmp_path):
    from common.data import MAX_LINE_BYTES
    rows = _cmv_rows(3)
    path = tmp_path / "rows.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8", compresslevel=1) as f:
        f.write(json.dumps(rows[0]) + "\n")
        f.write(json.dumps({**rows[1], "op_text": "x" * MAX_LINE_BYTES}) + "\n")
        f.write(json.dumps(rows[2]) + "\n")
    assert path.stat().st_size < 2**20
    runs = tmp_path / "runs"
    for skip in ("false", "true"):
        line = _error(run_in_process("01_build_pairs.py", "--config", PAIRS_01, "--data", path, "--runs_dir", runs,
                                     "--skip_bad_rows", skip))
        assert line.startswith(f"error: {path}:2: the line is longer than {MAX_LINE_BYTES} bytes"), line
    _no_done(runs)
