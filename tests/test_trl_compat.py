"""common/trl_compat.py: each private TRL / transformers name the pipeline relies on exists on the
installed versions, and a missing one stops a stage with one error naming the library and versions."""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import trl

from common import trl_compat
from common.config import ConfigError

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("private", trl_compat.NAMES, ids=lambda p: f"{p.owner.split('.')[-1]}.{p.name}")
def test_each_private_name_is_there(private):
    module = trl_compat.LIBRARIES[private.library][0]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{private.library} is not installed here (GPU machines only)")
    assert trl_compat.problem(private) is None


def test_tested_versions_are_the_pinned_ones():
    pins = dict(re.findall(r"^([\w-]+)==([\w.]+)", (REPO / "requirements.txt").read_text(), re.M))
    for library in ("trl", "transformers"):
        assert trl_compat.LIBRARIES[library][1] == pins[library]


def test_the_pinned_versions_pass():
    trl_compat.check()


def test_a_missing_name_is_one_error_naming_the_versions(monkeypatch):
    monkeypatch.delattr(trl.GRPOTrainer, "_tokenize_prompts")
    monkeypatch.setattr(trl_compat, "version", lambda name: "9.9.0" if name == "trl" else "5.24.0")
    with pytest.raises(trl_compat.CompatError) as err:
        trl_compat.check()
    message = str(err.value)
    assert message.startswith("trl 9.9.0 is installed and lacks what the pipeline relies on: "
                              "GRPOTrainer._tokenize_prompts is missing (used by static_decoder.grpo_rollout")
    assert "tested with trl 1.16.0 (requirements.txt)" in message
    assert "transformers" not in message.split("(used by")[0]  # only the library that lacks it is named


def test_a_changed_signature_and_an_instance_attribute_no_longer_set(monkeypatch):
    monkeypatch.setattr(trl.GRPOTrainer, "_tokenize_prompts", lambda self, texts: None)
    assert trl_compat.problem(next(p for p in trl_compat.NAMES if p.name == "_tokenize_prompts")) == \
        "GRPOTrainer._tokenize_prompts takes (self, texts), the pipeline relies on (self, prompts)"
    monkeypatch.setattr(trl.GRPOTrainer, "_prepare_inputs", lambda self, generation_batch: None)
    assert "GRPOTrainer._step is no longer set or read in GRPOTrainer._prepare_inputs" in \
        trl_compat.problem(next(p for p in trl_compat.NAMES if p.name == "_step"))


def test_the_stage_ends_with_one_error_line(monkeypatch):
    from common import cli
    monkeypatch.delattr(trl.GRPOTrainer, "_tokenize_prompts")
    with pytest.raises(ConfigError, match=r"^trl 1\.16\.0 is installed .*GRPOTrainer\._tokenize_prompts is missing"):
        cli.check_private_names()
    monkeypatch.setattr(sys, "argv", ["04_train_grpo.py"])
    with pytest.raises(SystemExit, match=r"^error: trl 1\.16\.0 is installed") as ended:
        cli.cli(lambda config, overrides: None, object)
    assert "\n" not in str(ended.value)


def test_libraries_a_stage_has_not_imported_are_not_checked(monkeypatch):
    monkeypatch.delattr(trl.GRPOTrainer, "_tokenize_prompts")
    monkeypatch.delitem(sys.modules, "trl")
    trl_compat.check()  # stage 01 imports neither TRL nor transformers


def test_accessors():
    from transformers import LlamaConfig, LlamaForCausalLM
    model = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, vocab_size=32))
    model.set_attn_implementation("eager")
    assert trl_compat.attn_implementation(model) == "eager"
