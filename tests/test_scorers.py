"""The Scorer seam (common/scorers.py): specs, plain functions, run directories, bad specs."""
import pytest

from common.scorers import FunctionScorer, Scorer, ScorerError, load_scorer, register


def words(prompts, replies, **kwargs):
    return [len(r.split()) for r in replies]


def test_dotted_function_is_a_scorer():
    scorer = load_scorer("tests.test_scorers:words")
    assert isinstance(scorer, Scorer) and scorer.name == "words"
    assert scorer.score([[{"role": "user", "content": "p"}]] * 2, ["one two", "one"]) == [2.0, 1.0]


def test_function_returning_wrong_count_is_refused():
    scorer = FunctionScorer(lambda prompts, replies: [1.0])
    with pytest.raises(ScorerError, match="returned 1 scores for 2 replies"):
        scorer.score([[]] * 2, ["a", "b"])


def test_registered_kind_gets_its_argument_and_context():
    seen = {}

    @register("constant_for_test")
    def constant(arg, batch_size=1, **_):
        seen.update(arg=arg, batch_size=batch_size)
        return FunctionScorer(lambda p, r: [float(arg)] * len(r), name="constant")

    assert load_scorer("constant_for_test:3", batch_size=7).score([[]], ["x"]) == [3.0]
    assert seen == {"arg": "3", "batch_size": 7}


@pytest.mark.parametrize("spec", ["nope", "no_such_module_xyz:fn", "tests.test_scorers:missing", "/no/such/run"])
def test_bad_spec_is_one_error(spec):
    with pytest.raises(ScorerError, match="scorer"):
        load_scorer(spec)


def test_object_without_the_protocol_is_refused():
    with pytest.raises(ScorerError, match="has no name, score"):
        load_scorer("tests.test_scorers:NotAScorer")


class NotAScorer:
    pass
