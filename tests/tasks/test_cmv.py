"""The ChangeMyView task's rows (common/tasks/cmv.py): what makes two replies one."""
from common.tasks import cmv


def test_replies_that_differ_only_in_white_space_are_identical():
    row = {"op_id": "t1", "op_title": "CMV: a view", "op_text": "Some body text.",
           "positive_reply": "You are  wrong,\nbecause of this.", "negative_reply": "You are wrong, because of  this."}
    assert cmv.to_pair(row, "x:1", 470) == "identical_replies"


def test_replies_that_differ_only_by_invisible_characters_are_identical():
    row = {"op_id": "t1", "op_title": "CMV: a view", "op_text": "Some body text.",
           "positive_reply": "You are wrong,\u200b because of this.", "negative_reply": "You are wrong, because\u2060 of this."}
    assert cmv.to_pair(row, "x:1", 470) == "identical_replies"
