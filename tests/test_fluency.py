"""The fluency scorer (common/fluency.py): a real language model tells prose from word salad."""
import math
import random

import pytest
import torch
from conftest import tf32

from common.fluency import FluencyScorer, perplexity
from common.scorers import Scorer, load_scorer

REPLY = ("I think you are underestimating how much public transport depends on density. In a city where most "
         "people live far from the centre, a bus line cannot run often enough to be useful, so people keep their "
         "cars. That is why the cities you mention built housing near the stations first.")


def salad(text: str, seed: int = 0) -> str:
    words = text.split()
    random.Random(seed).shuffle(words)
    return " ".join(words)


def test_salad_and_loops_score_below_the_reply(smol_model):
    scorer = load_scorer(f"fluency:{smol_model}", batch_size=2)
    assert isinstance(scorer, Scorer) and scorer.family == "llama"
    real, shuffled, short = scorer.score([[]] * 3, [REPLY, salad(REPLY), ""])
    assert real > shuffled + 1.0  # nats a token: shuffling costs far more than noise
    assert math.isnan(short)  # nothing to predict


@pytest.mark.slow
def test_scores_do_not_depend_on_the_batch(smol_model):
    """A reply's score alone equals its score in a padded batch: to float32 rounding (1e-4 nats) in float32,
    the scorer's dtype on the CPU, and on a GPU with its model cast to float32 and TF32 off. On a GPU the
    scorer runs bf16, which keeps 8 significant bits: another batch shape takes other kernels, whose logits
    may round a unit apart, so there the two scores need only agree to two bf16 roundings (2 * 2^-8 of the
    score; on an H100 they were 8.9e-4 nats apart on a score of -7.36, 1.2e-4 of it)."""
    replies = [REPLY, salad(REPLY, 1), REPLY[:80], "Yes."]
    batched, single = FluencyScorer(smol_model, batch_size=4), FluencyScorer(smol_model, batch_size=1)

    def together_and_alone():
        return zip(batched.score([[]] * 4, replies), [single.score([[]], [r])[0] for r in replies])

    if torch.cuda.is_available():
        for a, b in together_and_alone():
            assert abs(a - b) < 2 * 2 ** -8 * abs(b), (a, b)
        for scorer in (batched, single):
            scorer.model.float()
        with tf32(False):  # a trainer may have turned it on
            pairs = list(together_and_alone())
    else:
        assert next(batched.model.parameters()).dtype == torch.float32
        pairs = list(together_and_alone())
    for a, b in pairs:
        assert abs(a - b) < 1e-4, (a, b)


def test_a_forward_keeps_its_logits_within_the_budget_and_the_scores_do_not_change(tiny_model, monkeypatch):
    """A large vocabulary (Gemma's 262k tokens) makes a batch's logits gigabytes: the scorer takes fewer replies
    a forward where they would pass `LOGITS_BYTES`, with the same scores."""
    from common import fluency
    replies = [REPLY, salad(REPLY, 1), REPLY[:80], "Yes.", REPLY[:200]]
    scorer = FluencyScorer(tiny_model, batch_size=4)
    widths, forward = [], scorer.model.forward
    monkeypatch.setattr(scorer.model, "forward", lambda **kw: widths.append(kw["input_ids"].shape) or forward(**kw))
    whole = scorer.score([[]] * 5, replies)
    assert [w[0] for w in widths] == [4, 1]  # batch_size 4, then the last reply
    vocab = scorer.model.get_output_embeddings().weight.shape[0]
    monkeypatch.setattr(fluency, "LOGITS_BYTES", 2 * 40 * vocab * 4)  # two rows of 40 tokens
    widths.clear()
    cut = scorer.score([[]] * 5, replies)
    assert all(rows * width * vocab * 4 <= fluency.LOGITS_BYTES or rows == 1 for rows, width in widths), widths
    assert len(widths) > 2
    assert all(abs(a - b) < 1e-4 for a, b in zip(whole, cut)), (whole, cut)


def test_perplexity_of_fixed_log_probs():
    assert perplexity([-1.0, -3.0]) == math.exp(2.0)
    assert perplexity([math.nan, -2.0]) == math.exp(2.0)
    assert math.isnan(perplexity([]))


def test_best_of_n_candidates_already_scored_are_not_scored_again(tiny_model, monkeypatch):
    """05's fluency_scores: the greedy reply among the candidates (best_of_n_with_greedy) and a repeated sample
    keep the score they have, so the greedy reply meets its own bar exactly; only the new texts are scored."""
    from types import SimpleNamespace

    from common import eval_scoring
    real = FluencyScorer(tiny_model, batch_size=2)
    asked = []

    class Counting:
        backends = real.backends

        def score(self, prompts, replies):
            asked.extend(replies)
            return real.score(prompts, replies)

    monkeypatch.setattr(eval_scoring, "load_scorer", lambda *a, **k: Counting())
    config = SimpleNamespace(fluency_model_name_or_path=str(tiny_model), batch_size=2, model_name_or_path=str(tiny_model))
    greedy = [REPLY, "Density decides it."]
    candidates = [[REPLY, salad(REPLY), salad(REPLY)], ["Density decides it.", "Buses need riders."]]
    log_probs, groups = eval_scoring.fluency_scores(config, SimpleNamespace(manifest={}), [[]] * 2, {"sft": greedy},
                                                    candidates, ["a human reply", "another one"])
    assert asked == [*greedy, "a human reply", "another one", salad(REPLY), "Buses need riders."]
    assert [g[0] for g in groups] == log_probs["sft"] and groups[0][1] == groups[0][2]
    assert groups[1][1] == pytest.approx(real.score([[]], ["Buses need riders."])[0])
