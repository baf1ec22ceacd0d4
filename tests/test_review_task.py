"""The review task without a model: the target format round-trips on the real rows, windows
cover every token, rating metrics and baselines match numbers worked out by hand, a PDF the test
writes is read back, malformed rows name FILE:LINE and the field, and every paper and review of the
bundled file is accounted for."""
from __future__ import annotations

import gzip
import itertools
import json
import math
import re
from pathlib import Path

import pytest

from common.data import DataError, read_jsonl
from common.pdf import read_pdf_text
from common.tasks import review

BUNDLED = Path(__file__).resolve().parent.parent / "data" / "review" / "neurips2025_papers_reviews.jsonl.gz"
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
        assert review.parse_review(ex["chosen"]) == {"overall": ex["rating"], "confidence": ex["confidence"]}
        assert [review.parse_review(ref)["overall"] for ref in ex["references"]] == ex["human_ratings"]
        assert ex["prompt"] == [{"role": "user", "content": review.INSTRUCTION + ex["paper"]}]
        assert ex["group_id"] in ex["id"] and len(ex["chosen"].split()) <= 900


def test_merged_rating_is_the_reviewers_mean_to_one_decimal(examples):
    for ex in examples["merged"]:
        mean = sum(ex["human_ratings"]) / len(ex["human_ratings"])
        assert abs(ex["rating"] - mean) <= 0.05 + 1e-9 and ex["rating"] == round(ex["rating"], 1)
    sections = [{"key_points": ["k"], "strengths": [], "weaknesses": [], "suggestions": [], "rating": r,
                 "confidence": c} for r, c in ((4, 3), (4, 4), (5, 4), (4, None))]
    merged = review.merge_sections(sections)
    assert (merged["rating"], merged["confidence"]) == (4.3, 3.7)  # 4.25 rounds half up; 11/3
    assert review.parse_review(review.build_target(merged)) == {"overall": 4.3, "confidence": 3.7}


def test_target_is_built_from_the_review_fields():
    text = ("SUMMARY:\nThe paper adds a cache.\n\nSTRENGTHS AND WEAKNESSES:\n**Strengths**\n- Fast.\n- Simple.\n\n"
            "**Weaknesses**:\n1. No ablation.\n2. Small data.\n\nQUESTIONS:\nWhy 4 layers?\n\nLIMITATIONS:\nyes")
    target = review.build_target(review.review_sections({"text": text, "rating": 3.0, "confidence": 4.0}))
    assert target == ("### Key Points\nThe paper adds a cache.\n### Strengths and Weaknesses\nStrengths:\n- Fast.\n"
                      "- Simple.\nWeaknesses:\n- No ablation.\n- Small data.\n### Suggestions for Improvement\n"
                      "- Why 4 layers?\n### Rating\nOverall Quality: 3\nReview Confidence: 4")


@pytest.mark.parametrize("text, overall, confidence", [
    ("### Rating\nOverall Quality: 4\nReview Confidence: 3", 4.0, 3.0),
    ("**Overall Quality:**   4.5 \n\n  **Review Confidence**: 2", 4.5, 2.0),
    ("overall quality 2\nReview Confidence: 5\nOverall Quality: 5", 5.0, 5.0),  # the last one counts
    ("Overall Quality: 7\nReview Confidence: 0", None, None),  # off the 1-6 / 1-5 scales
    ("I would accept this paper.", None, None),
    ("", None, None),
])
def test_parse_review(text, overall, confidence):
    assert review.parse_review(text) == {"overall": overall, "confidence": confidence}


# --- windows ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("n, window, overlap", [
    (0, 8, 2), (1, 8, 2), (7, 8, 2), (8, 8, 2), (9, 8, 2), (14, 8, 2), (15, 8, 2), (100, 8, 0), (100, 8, 7),
    (5, 1, 0), (25_000, 8_192, 512), (25_000, 8_000, 1_000), (20_480, 20_480, 1_024), (3, 2, 1)])
def test_windows_cover_every_token_within_the_limit(n, window, overlap):
    spans = review.windows(n, window, overlap)
    covered = set()
    for start, end in spans:
        assert 0 <= start < end <= n and end - start <= window
        covered.update(range(start, end))
    assert covered == set(range(n))
    if n:
        assert spans[0][0] == 0 and spans[-1][1] == n
        assert all(end - start == min(window, n) for start, end in spans)  # the last is moved back, not short
    for (s1, e1), (s2, _) in itertools.pairwise(spans):
        assert s2 > s1 and e1 - s2 >= overlap  # neighbours share at least `overlap` tokens ...
    for (_, e1), (s2, _) in itertools.pairwise(spans[:-1]):
        assert e1 - s2 == overlap  # ... and exactly `overlap` except with the last
    assert len(spans) == (0 if n == 0 else max(1, math.ceil((n - overlap) / (window - overlap))))


@pytest.mark.parametrize("window, overlap", [(0, 0), (4, 4), (4, 5), (4, -1)])
def test_windows_refuse_bad_settings(window, overlap):
    with pytest.raises(ValueError):
        review.windows(10, window, overlap)


# --- rating metrics --------------------------------------------------------------------------------

def test_rating_metrics_and_baselines_by_hand():
    # errors -0.5, 0, 1: MAE 1.5/3; RMSE sqrt(1.25/3); deviations (0, -1, 1) and (2/3, -5/6, 1/6):
    # covariance sum 1, squares 2 and 7/6, so r = 1 / sqrt(2 * 7/6) = sqrt(3/7)
    # Spearman: ranks (2, 1, 3) and (3, 1, 2), deviations (0, -1, 1) and (1, -1, 0): rho = 1 / 2
    got = review.rating_metrics([4, 3, 5], [4.5, 3.0, 4.0])
    assert got == pytest.approx({"rating_mae": 0.5, "rating_rmse": 0.6454972, "rating_pearson": 0.6546537,
                                 "rating_spearman": 0.5, "n": 3})
    # always 4.0: errors 0.5, 1, 0; a constant prediction has no correlation
    got = review.baseline_constant(4.0, [4.5, 3.0, 4.0])
    assert got.pop("rating_pearson") is None and got.pop("rating_spearman") is None
    assert got == pytest.approx({"rating_mae": 0.5, "rating_rmse": 0.6454972, "n": 3})
    # paper 1: 4 vs 2, 2 vs 4; paper 2: 3 vs 4.5, 4 vs 4, 5 vs 3.5; paper 3 (one reviewer) left out.
    # errors 2, 2, 1.5, 0, 1.5: MAE 7/5; RMSE sqrt(12.5/5); deviations from 3.6 (0.4, -1.6, -0.6, 0.4, 1.4)
    # and (-1.6, 0.4, 0.9, 0.4, -0.1): covariance sum -1.8, squares 5.2 and 3.7, r = -1.8 / sqrt(19.24).
    # Spearman: ranks (3.5, 1, 2, 3.5, 5) and (1, 3.5, 5, 3.5, 2), deviations from 3 give a covariance
    # sum of -5.75 and squares 9.5 and 9.5: rho = -5.75 / 9.5
    got = review.baseline_human([[4, 2], [3, 4, 5], [6]])
    assert got == pytest.approx({"rating_mae": 1.4, "rating_rmse": 1.5811388, "rating_pearson": -0.4103646,
                                 "rating_spearman": -5.75 / 9.5, "n": 5, "n_papers": 2})


def test_rating_metrics_edge_cases():
    assert review.rating_metrics([], []) == {"rating_mae": None, "rating_rmse": None, "rating_pearson": None,
                                             "rating_spearman": None, "n": 0}
    assert review.rating_metrics([4], [3])["rating_pearson"] is None
    assert review.rating_metrics([4.2, 4.2, 4.2], [1, 2, 3])["rating_pearson"] is None
    with pytest.raises(ValueError):
        review.rating_metrics([1, 2], [1])


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
