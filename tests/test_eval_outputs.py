"""common/eval_outputs.py: how the report describes a run's decoding."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from common.eval_outputs import describe_decoding

SPREAD = "differ between two runs of one model"


def _config(temperature=0.0, replies_from=None):
    return SimpleNamespace(temperature=temperature, seed=42, repetition_penalty=1.2, no_repeat_ngram_size=0,
                           replies_from=replies_from)


@pytest.mark.parametrize("config, gpu, decoder, warned", [
    (_config(), "1 x NVIDIA H100 80GB HBM3", "static", True),  # greedy, static decoder, a GPU: not reproducible
    (_config(), None, "static", False),  # the CPU: the static decoder repeats itself
    (_config(), "1 x NVIDIA H100 80GB HBM3", "hf_generate", False),  # fast_paths false
    (_config(temperature=0.7), "1 x NVIDIA H100 80GB HBM3", "static", False),  # sampled: seeded, nothing claimed
    (_config(replies_from="runs/Eval"), "1 x NVIDIA H100 80GB HBM3", "static", False),  # nothing generated here
])
def test_greedy_replies_of_the_static_decoder_on_a_gpu_are_said_to_vary_between_runs(config, gpu, decoder, warned):
    said = describe_decoding(config, {"gpu": gpu, "backends": {"decoder": decoder}})
    assert said.startswith("greedy" if config.temperature == 0 and not config.replies_from else
                           ("sampled" if not config.replies_from else "read back")), said
    assert (SPREAD in said) == warned, said
