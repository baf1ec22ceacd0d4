"""The review's text (common/tasks/review_text.py): the rating read back from a review, and windows that
cover every token of a long paper."""
from __future__ import annotations

import itertools
import math

import pytest

from common.tasks.review_text import parse_review, windows


@pytest.mark.parametrize("text, overall, confidence", [
    ("### Rating\nOverall Quality: 4\nReview Confidence: 3", 4.0, 3.0),
    ("**Overall Quality:**   4.5 \n\n  **Review Confidence**: 2", 4.5, 2.0),
    ("overall quality 2\nReview Confidence: 5\nOverall Quality: 5", 5.0, 5.0),  # the last one counts
    ("Overall Quality: 7\nReview Confidence: 0", None, None),  # off the 1-6 / 1-5 scales
    ("I would accept this paper.", None, None),
    ("", None, None),
])
def test_parse_review(text, overall, confidence):
    assert parse_review(text) == {"overall": overall, "confidence": confidence}


def test_the_rating_parser_reads_the_rating_not_prose_or_another_scale():
    rated = "### Rating\nOverall Quality: 4\nReview Confidence: 3\n"
    assert parse_review(rated + "Note: the overall quality 1 of the writing could improve.") == \
        {"overall": 4.0, "confidence": 3.0}
    assert parse_review("Overall Quality: 5 out of 10\nReview Confidence: 3 out of 5") == \
        {"overall": None, "confidence": 3.0}


@pytest.mark.parametrize("text, overall", [("Overall Quality: 1e1", None), ("Overall Quality: 4x", None),
                                           ("Overall Quality: 4.5.", 4.5), ("Overall Quality: 4.", 4.0),
                                           ("Overall Quality: 3\nlater: Overall Quality: n/a", None),
                                           ("Overall Quality: 5/6", 5.0)])
def test_a_rating_is_the_whole_number_after_the_label(text, overall):
    assert parse_review(text)["overall"] == overall


@pytest.mark.parametrize("n, window, overlap", [
    (0, 8, 2), (1, 8, 2), (7, 8, 2), (8, 8, 2), (9, 8, 2), (14, 8, 2), (15, 8, 2), (100, 8, 0), (100, 8, 7),
    (5, 1, 0), (25_000, 8_192, 512), (25_000, 8_000, 1_000), (20_480, 20_480, 1_024), (3, 2, 1)])
def test_windows_cover_every_token_within_the_limit(n, window, overlap):
    spans = windows(n, window, overlap)
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
        windows(10, window, overlap)
