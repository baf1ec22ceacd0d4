"""The review task without a model: the target format round-trips on the real rows, a PDF the test
writes is read back, malformed rows name FILE:LINE and the field, and every paper and review of the
bundled file is accounted for."""
from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import re
import subprocess
from pathlib import Path

import pytest
from conftest import REPO, error_line, run_dir_of, run_in_process
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from common.data import DataError, read_jsonl
from common.pdf import read_pdf_text
from common.tasks import review, review_text

BUNDLED = Path(__file__).resolve().parents[2] / "data" / "review" / "neurips2025_papers_reviews.jsonl.gz"
FORMAT = re.compile(r"### Key Points\n(?:.+\n)+### Strengths and Weaknesses\nStrengths:\n(?:- .+\n)+Weaknesses:\n"
                    r"(?:- .+\n)+### Suggestions for Improvement\n(?:- .+\n)+### Rating\n"
                    r"Overall Quality: (\d+(?:\.\d)?)\nReview Confidence: (\d+(?:\.\d)?|n/a)\Z")


@pytest.fixture(scope="module")
def rows():
    return list(read_jsonl(BUNDLED))


@pytest.fixture(scope="module")
def examples(rows):
    return {target: [ex for where, row in rows for ex in review.to_examples(row, where, target)]
            for target in review.TARGETS}


# --- targets ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("target", review.TARGETS)
def test_targets_round_trip_on_the_bundled_rows(examples, target):
    for ex in examples[target]:
        assert FORMAT.match(ex["chosen"]), ex["chosen"]
        assert review_text.parse_review(ex["chosen"]) == {"overall": ex["rating"], "confidence": ex["confidence"]}
        assert [review_text.parse_review(ref)["overall"] for ref in ex["references"]] == ex["human_ratings"]
        assert ex["prompt"] == [{"role": "user", "content": review_text.INSTRUCTION + ex["paper"]}]
        assert ex["group_id"] in ex["id"] and len(ex["chosen"].split()) <= 900


def test_a_hint_sits_before_the_paper_and_is_not_read_as_a_rating():
    plain = review_text.prompt_for("# A paper\n\nIts body.")[0]["content"]
    hinted = review_text.prompt_for("# A paper\n\nIts body.", 4.3)[0]["content"]
    assert plain == review_text.INSTRUCTION + "# A paper\n\nIts body."
    head, paper = hinted.split("The paper:\n\n")
    assert paper == "# A paper\n\nIts body." and head.endswith("puts its Overall Quality at 4.3.\n\n")
    assert head.startswith(review_text.INSTRUCTION[:-len("The paper:\n\n")])
    assert "Overall Quality:" not in review_text.HINT  # no rating label: a quoted hint is never a parsed rating


def test_merged_rating_is_the_reviewers_mean_to_one_decimal(examples):
    for ex in examples["merged"]:
        mean = sum(ex["human_ratings"]) / len(ex["human_ratings"])
        assert abs(ex["rating"] - mean) <= 0.05 + 1e-9 and ex["rating"] == round(ex["rating"], 1)
    sections = [{"key_points": ["k"], "strengths": [], "weaknesses": [], "suggestions": [], "rating": r,
                 "confidence": c} for r, c in ((4, 3), (4, 4), (5, 4), (4, None))]
    merged = review.merge_sections(sections)
    assert (merged["rating"], merged["confidence"]) == (4.3, 3.7)  # 4.25 rounds half up; 11/3
    assert review_text.parse_review(review.build_target(merged)) == {"overall": 4.3, "confidence": 3.7}


def test_target_is_built_from_the_review_fields():
    text = ("SUMMARY:\nThe paper adds a cache.\n\nSTRENGTHS AND WEAKNESSES:\n**Strengths**\n- Fast.\n- Simple.\n\n"
            "**Weaknesses**:\n1. No ablation.\n2. Small data.\n\nQUESTIONS:\nWhy 4 layers?\n\nLIMITATIONS:\nyes")
    target = review.build_target(review.review_sections({"text": text, "rating": 3.0, "confidence": 4.0}))
    assert target == ("### Key Points\nThe paper adds a cache.\n### Strengths and Weaknesses\nStrengths:\n- Fast.\n"
                      "- Simple.\nWeaknesses:\n- No ablation.\n- Small data.\n### Suggestions for Improvement\n"
                      "- Why 4 layers?\n### Rating\nOverall Quality: 3\nReview Confidence: 4")


# --- PDFs ------------------------------------------------------------------------------------------

def _pdf(lines: list[str]) -> bytes:
    """A one-page PDF with `lines` of Helvetica text, its xref offsets counted as it is written."""
    stream = "BT /F1 12 Tf 72 720 Td " + " ".join(f"({line}) Tj 0 -16 Td" for line in lines) + " ET"
    objects = ["<< /Type /Catalog /Pages 2 0 R >>", "<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
               ("<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
                "/Resources << /Font << /F1 5 0 R >> >> >>"),
               f"<< /Length {len(stream)} >>\nstream\n{stream}\nendstream",
               "<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    out, offsets = b"%PDF-1.4\n", []
    for i, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += f"{i} 0 obj\n{body}\nendobj\n".encode()
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    out += b"".join(f"{offset:010d} 00000 n \n".encode() for offset in offsets)
    return out + f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()


def test_pdf_text_is_read_back(tmp_path):
    path = tmp_path / "paper.pdf"
    path.write_bytes(_pdf(["Attention Is Not All You Need", "We study caches."]))
    assert read_pdf_text(path) == "Attention Is Not All You Need\nWe study caches."


def test_pdf_refusals(tmp_path):
    from pypdf import PdfWriter
    (tmp_path / "notes.pdf").write_text("just text")
    (tmp_path / "broken.pdf").write_bytes(b"%PDF-1.4\nnothing else")
    blank = PdfWriter()
    blank.add_blank_page(612, 792)
    blank.write(tmp_path / "scan.pdf")
    locked = PdfWriter(clone_from=_write(tmp_path / "plain.pdf", _pdf(["secret"])))
    locked.encrypt("pw", algorithm="RC4-128")
    locked.write(tmp_path / "locked.pdf")
    for name, message in [("notes.pdf", "not a PDF"), ("broken.pdf", "unreadable PDF"),
                          ("scan.pdf", "no extractable text"), ("locked.pdf", "encrypted PDF"),
                          ("missing.pdf", "no such file")]:
        with pytest.raises(DataError, match=rf"^{re.escape(str(tmp_path / name))}: {message}") as err:
            read_pdf_text(tmp_path / name)
        assert "\n" not in str(err.value)


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


# --- bad rows and accounting -----------------------------------------------------------------------

def _good_row() -> dict:
    return {"paper_id": "p1", "title": "T", "abstract": "A.", "paper_markdown_main": "## Abstract\n\nA.\n\n## 1 Intro",
            "reviews": [{"text": "SUMMARY:\nS.", "rating": 4, "confidence": 3},
                        {"text": "SUMMARY:\nS2.", "rating": 5, "confidence": None}]}


@pytest.mark.parametrize("change, field", [
    (lambda r: r.pop("paper_id"), "paper_id"),
    (lambda r: r.update(paper_id=7), "paper_id"),
    (lambda r: r.update(title=["T"]), "title"),
    (lambda r: r.update(paper_markdown_main=3.5), "paper_markdown_main"),
    (lambda r: r.update(reviews="none"), "reviews"),
    (lambda r: r.pop("reviews"), "reviews"),
    (lambda r: r["reviews"].append("great paper"), "reviews[2]"),
    (lambda r: r["reviews"][1].update(rating="4"), "reviews[1].rating"),
    (lambda r: r["reviews"][1].update(rating=True), "reviews[1].rating"),
    (lambda r: r["reviews"][0].update(confidence=[3]), "reviews[0].confidence"),
    (lambda r: r["reviews"][0].update(text=12), "reviews[0].text"),
])
def test_malformed_rows_name_file_line_and_field(tmp_path, change, field):
    bad = _good_row()
    change(bad)
    path = tmp_path / "papers.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write(json.dumps(_good_row()) + "\n" + json.dumps(bad) + "\n")
    (_, good), (where, row) = read_jsonl(path)
    assert len(review.to_examples(good, "x", "merged")) == 1
    for target in review.TARGETS:
        with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:2: field '{re.escape(field)}' must be"):
            review.to_examples(row, where, target)
    with pytest.raises(DataError, match=r"^f:9: expected a JSON object"):
        review.to_examples(["a list"], "f:9", "merged")


def _account(rows, target) -> dict:
    """What a stage reports: examples and drops per paper, reviews used and skipped by reason."""
    papers, reviews = {"kept": 0}, {"used": 0}
    n_examples, ids = 0, set()
    for where, row in rows:
        out, counts = review.to_examples(row, where, target), review.count_reviews(row)
        if isinstance(out, str):
            papers[out] = papers.get(out, 0) + 1
            reviews[out] = reviews.get(out, 0) + counts["n_reviews"]
            continue
        papers["kept"] += 1
        reviews["used"] += counts["n_rated"]
        reviews["unrated"] = reviews.get("unrated", 0) + counts["n_reviews"] - counts["n_rated"]
        n_examples += len(out)
        ids.update(ex["id"] for ex in out)
    assert len(ids) == n_examples  # ids are unique
    return {"papers": papers, "reviews": reviews, "n_examples": n_examples}


def test_every_paper_and_review_of_the_bundled_file_is_accounted_for(rows):
    assert len(rows) == 400 and sum(review.count_reviews(row)["n_reviews"] for _, row in rows) == 1612
    merged, per_review = _account(rows, "merged"), _account(rows, "per_review")
    assert merged == {"papers": {"kept": 400}, "reviews": {"used": 1612, "unrated": 0}, "n_examples": 400}
    assert per_review == {**merged, "n_examples": 1612}


@pytest.mark.parametrize("target", review.TARGETS)
def test_unusable_papers_and_reviews_are_counted(target):
    no_text, unrated, partly = _good_row(), _good_row(), _good_row()
    no_text["paper_markdown_main"] = "  "
    for rv in unrated["reviews"]:
        rv["rating"] = None
    partly["reviews"] += [{"text": "", "rating": 4}, {"text": "SUMMARY:\nS3.", "rating": None}]
    got = _account([("a:1", no_text), ("a:2", unrated), ("a:3", partly)], target)
    assert got["papers"] == {"kept": 1, "no_paper_text": 1, "no_rated_review": 1}
    assert got["reviews"] == {"used": 2, "unrated": 2, "no_paper_text": 2, "no_rated_review": 2}
    assert sum(got["papers"].values()) == 3 and sum(got["reviews"].values()) == 8
    assert got["n_examples"] == (1 if target == "merged" else 2)
    assert review.count_reviews(None) == {"n_reviews": 0, "n_rated": 0}


# --- the rating and the read-out ---------------------------------------------------------------------

def test_the_read_out_cuts_a_review_at_its_rating_section_not_at_prose():
    body = "### Key Points\nThe overall quality of the writing is high.\nRating the novelty is hard.\n"
    assert review.readout_turn(body + "### Rating\nOverall Quality: 4") == body.rstrip() + "\n" + review.RATING_HEADER
    assert review.readout_turn(body + "**Overall Quality:** 4") == body.rstrip() + "\n" + review.RATING_HEADER
    assert review.readout_turn(body) == body.rstrip() + "\n" + review.RATING_HEADER
    assert review.readout_turn(body + "Rating: 4") == body.rstrip() + "\n" + review.RATING_HEADER


# --- review rows through stage 01 -------------------------------------------------------------------

REVIEWS = REPO / "data" / "review" / "neurips2025_papers_reviews.jsonl.gz"
REVIEW_01 = "configs/tiny/review/01_build_pairs.yaml"
N_PAPERS = 8  # one dev and one test paper, six to train on


def _run(script: str, *args) -> subprocess.CompletedProcess:
    return run_in_process(script, *args)


_error = error_line


def _no_done(runs: Path) -> None:
    """A row is read after the run directory exists: the stopped run is left without DONE."""
    assert not list(runs.glob("*/DONE")), list(runs.glob("*/DONE"))


def _done(proc) -> tuple[Path, dict]:
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    run = run_dir_of(proc)
    assert (run / "DONE").is_file()
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["n_rows_used"] + sum(metrics["dropped"].values()) == metrics["n_input_rows"], metrics
    return run, metrics


def _papers(n: int = N_PAPERS) -> list[dict]:
    """The first bundled papers with their text cut short (the tests need rows, not long papers)."""
    with gzip.open(REVIEWS, "rt", encoding="utf-8") as f:
        rows = [json.loads(next(f)) for _ in range(n)]
    for row in rows:
        row["paper_markdown_main"] = row["paper_markdown_main"][:1500]
        row.pop("paper_markdown_after_references", None)
    return rows


def _write_rows(path: Path, rows) -> Path:
    # json.dumps escapes a lone surrogate (valid JSON, not text), as a scraper's output may hold it
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _build_review(tmp_path: Path, rows, *extra, name: str = "papers.jsonl"):
    path = _write_rows(tmp_path / name, rows)
    return path, _run("01_build_pairs.py", "--config", REVIEW_01, "--data", path,
                      "--runs_dir", tmp_path / "runs", *extra)


def _splits(run: Path) -> dict[str, list[dict]]:
    return {s: [json.loads(line) for line in (run / f"{s}.jsonl").read_text().splitlines()]
            for s in ("train", "dev", "test")}


@pytest.mark.stage
@pytest.mark.parametrize("rating", [99, 0, 1.7e307])
def test_a_rating_off_the_scale_is_a_bad_row(tmp_path, rating):
    rows = _papers()
    rows[2]["reviews"][1]["rating"] = rating
    path, proc = _build_review(tmp_path, rows)
    assert _error(proc).startswith(
        f"error: {path}:3: field 'reviews[1].rating' must be a number from 1 to 6 or null"), proc.stderr
    _no_done(tmp_path / "runs")
    run, metrics = _done(_build_review(tmp_path, rows, "--skip_bad_rows", "true", name="again.jsonl")[1])
    assert metrics["dropped"] == {"bad_row": 1}
    for row in sum(_splits(run).values(), []):  # every target's rating reads back, on the scale
        assert review_text.parse_review(row["chosen"])["overall"] == row["rating"]


@pytest.mark.stage
def test_the_same_paper_under_another_id_is_a_duplicate(tmp_path):
    rows = _papers()
    rows.append({**rows[3], "paper_id": rows[3]["paper_id"] + "_copy"})
    _, proc = _build_review(tmp_path, rows, "--seed", 45, "--dev_fraction", 0.25, "--test_fraction", 0.25)
    run, metrics = _done(proc)
    assert metrics["dropped"] == {"duplicate_pair": 1}
    papers = {split: {r["paper"] for r in found} for split, found in _splits(run).items()}
    assert not (papers["train"] & papers["dev"] or papers["train"] & papers["test"] or papers["dev"] & papers["test"])
    # the same paper with other reviews under another id is the same premise too
    rows[-1]["reviews"] = rows[-1]["reviews"][:1]
    run, metrics = _done(_build_review(tmp_path, rows, name="other.jsonl")[1])
    assert metrics["dropped"] == {"duplicate_premise": 1}


@pytest.mark.stage
@pytest.mark.parametrize("rating", [1e308, 10**400])
def test_a_huge_rating_is_one_error_line_or_a_counted_bad_row(tmp_path, rating):
    rows = _papers()
    rows[4]["reviews"][0]["rating"] = rating
    path, proc = _build_review(tmp_path, rows)
    assert _error(proc).startswith(f"error: {path}:5: field 'reviews[0].rating'")
    _no_done(tmp_path / "runs")
    _, metrics = _done(_build_review(tmp_path, rows, "--skip_bad_rows", "true", name="again.jsonl")[1])
    assert metrics["dropped"] == {"bad_row": 1}


@pytest.mark.stage
@pytest.mark.parametrize("field", ["title", "paper_markdown_main", "paper_id"])
def test_a_lone_surrogate_in_a_review_row_is_a_bad_row(tmp_path, field):
    rows = _papers()
    rows[1][field] = "before \ud800 after"
    path, proc = _build_review(tmp_path, rows)
    assert _error(proc).startswith(f"error: {path}:2: field '{field}' is not valid Unicode")
    _no_done(tmp_path / "runs")
    _, metrics = _done(_build_review(tmp_path, rows, "--skip_bad_rows", "true", name="again.jsonl")[1])
    assert metrics["dropped"] == {"bad_row": 1}


def _pdf_file(path: Path, content: bytes = b"") -> Path:
    """A one-page PDF whose text is 'Hello paper', then `content` in its content stream."""
    stream = b"BT /F1 12 Tf 10 50 Td (Hello paper) Tj ET " + content
    objs = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 200 100] /Contents 4 0 R "
            b"/Resources << /Font << /F1 5 0 R >> >> >>",
            b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream",
            b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    out, offsets = b"%PDF-1.4\n", []
    for i, body in enumerate(objs, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % i + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objs) + 1) + b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objs) + 1, xref)
    path.write_bytes(out)
    return path


@pytest.mark.stage
def test_a_pdf_of_deeply_nested_arrays_is_one_error_line(tmp_path):
    rows = _papers()
    rows[2]["paper_markdown_main"] = ""
    pdf = _pdf_file(tmp_path / f"{rows[2]['paper_id']}.pdf", b"[" * 5000 + b"]" * 5000 + b" TJ")
    _, proc = _build_review(tmp_path, rows, "--pdf", pdf)
    assert f"{pdf}: unreadable PDF" in _error(proc)
    _, metrics = _done(_build_review(tmp_path, rows, "--pdf", pdf, "--skip_bad_rows", "true", name="again.jsonl")[1])
    assert metrics["dropped"] == {"bad_row": 1}


@pytest.mark.stage
def test_pdfs_are_recorded_and_one_that_names_no_paper_is_counted(tmp_path):
    rows = _papers()
    rows[2]["paper_markdown_main"] = ""
    own, stray = _pdf_file(tmp_path / f"{rows[2]['paper_id']}.pdf"), _pdf_file(tmp_path / "no_such_paper.pdf")
    (tmp_path / "copy").mkdir()
    twice = _pdf_file(tmp_path / "copy" / own.name)
    _, proc = _build_review(tmp_path, rows, "--pdf", own, twice)
    assert _error(proc, tmp_path / "runs") == \
        f"error: command line: field 'pdf': two files are named {own.stem}.pdf; each paper takes one PDF"
    run, metrics = _done(_build_review(tmp_path, rows, "--pdf", own, stray, name="again.jsonl")[1])
    assert metrics["pdf_unused"] == [str(stray)]
    assert any(r["paper"].endswith("Hello paper") for r in sum(_splits(run).values(), []))
    inputs = json.loads((run / "manifest.json").read_text())["inputs"]
    assert inputs["pdf[0]"]["sha256"] == hashlib.sha256(own.read_bytes()).hexdigest()


@pytest.mark.stage
def test_a_window_overlap_of_max_length_is_refused_before_a_run_exists(tmp_path, tiny_model):
    pairs, _ = _done(_build_review(tmp_path, _papers())[1])
    line = _error(_run("02_train_sft.py", "--config", "configs/tiny/review/02_train_sft.yaml", "--pairs_run", pairs,
                       "--window_overlap", 4096, "--runs_dir", tmp_path / "sft"), tmp_path / "sft")
    assert line == ("error: field 'window_overlap' (4096) must be well below max_length (4096) for the review "
                    "task's windows: lower window_overlap"), line


@pytest.mark.stage
def test_eval_of_an_empty_split_is_one_error_line(tmp_path, tiny_model):
    _, proc = _build_review(tmp_path, _papers(2), "--dev_fraction", 0, "--test_fraction", 0.5)
    pairs, metrics = _done(proc)
    assert metrics["n_pairs"]["dev"] == 0
    line = _error(_run("05_eval.py", "--config", "configs/tiny/review/05_eval.yaml", "--pairs_run", pairs,
                       "--split", "dev", "--runs_dir", tmp_path / "runs"))
    assert line == f"error: {pairs}: its dev split holds no premises to score", line


# --- property-based: hostile review rows -----------------------------------------------------------

_HOSTILE_NUMBER = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.integers(-10**6, 10**6),
    st.integers(10**18, 10**400), st.sampled_from([0, 7, 1.7e307, 1e308, -1e308, 3.5, 6, 1]))
_HOSTILE_TEXT = st.one_of(st.text(max_size=20), st.just("a \ud800 b"), st.just("\udfff"),
                          st.text(alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), max_size=3))
_NESTING = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=5),
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                        max_leaves=6)
_ROW_FIELDS = ("paper_id", "title", "abstract", "paper_markdown_main", "reviews")
_REVIEW_FIELDS = ("rating", "confidence", "text")
_ROW_OPS = st.one_of(
    st.tuples(st.just("rating"), st.integers(0, 7), st.sampled_from(("rating", "confidence")), _HOSTILE_NUMBER),
    st.tuples(st.just("text"), st.integers(0, 7), st.sampled_from(("paper_id", "title", "abstract",
                                                                   "paper_markdown_main")), _HOSTILE_TEXT),
    st.tuples(st.just("review_text"), st.integers(0, 7), _HOSTILE_TEXT),
    st.tuples(st.just("nest_row"), st.integers(0, 7), st.sampled_from(_ROW_FIELDS), _NESTING),
    st.tuples(st.just("nest_review"), st.integers(0, 7), st.sampled_from(_REVIEW_FIELDS), _NESTING),
    st.tuples(st.just("whole_row"), st.integers(0, 7), _NESTING),
)


def _apply(rows: list, op: tuple) -> None:
    kind, i = op[0], op[1]
    row = rows[i]
    if not isinstance(row, dict):
        return
    reviews = row.get("reviews") if isinstance(row.get("reviews"), list) else []
    first = reviews[0] if reviews and isinstance(reviews[0], dict) else None
    if kind in ("rating", "nest_review") and first is not None:
        first[op[2]] = op[3]
    elif kind == "review_text" and first is not None:
        first["text"] = op[2]
    elif kind in ("text", "nest_row"):
        row[op[2]] = op[3]
    elif kind == "whole_row":
        rows[i] = op[2]


@pytest.fixture(scope="module")
def papers():
    return _papers()


@pytest.mark.stage
@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=st.lists(_ROW_OPS, min_size=1, max_size=3), skip=st.booleans())
def test_hostile_review_rows_end_in_a_documented_outcome(papers, ops, skip):
    rows = json.loads(json.dumps(papers))
    for op in ops:
        _apply(rows, op)
    with contextlib.ExitStack() as stack:
        import tempfile
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        path, proc = _build_review(tmp, rows, "--skip_bad_rows", str(skip).lower())
        if proc.returncode:  # one located line, no DONE anywhere
            line = _error(proc)
            event("error: " + line.split(": ", 2)[-1][:40])
            assert line.startswith(f"error: {path}:") or "split(s)" in line, line
            _no_done(tmp / "runs")
            return
        run, metrics = _done(proc)
        event(f"done, dropped {sorted(metrics['dropped'])}")
        assert metrics["n_input_rows"] == len(rows)
        for row in sum(_splits(run).values(), []):  # a target's rating is on the scale and reads back
            assert review_text.parse_review(row["chosen"])["overall"] == row["rating"]
            assert 1 <= row["rating"] <= 6 and all(1 <= r <= 6 for r in row["human_ratings"])
