"""Run directories are never shared or overwritten; configs are strict; the base lock names fields."""
from __future__ import annotations

import datetime
import multiprocessing
from dataclasses import dataclass

import pytest

from common.config import ConfigError, ModelArgs, RunArgs, TrainArgs, parse_config
from common.runs import Run, RunError, create_run_dir, run_dir_name


@dataclass
class DemoConfig(RunArgs, ModelArgs, TrainArgs):
    pairs_run: str | None = None
    data: list[str] | None = None


def test_run_dir_name_format():
    assert run_dir_name("SFT", 2, datetime.date(2026, 11, 30)) == "Nov30_SFT_Run2"
    assert run_dir_name("Eval", 1, datetime.date(2026, 3, 5)) == "Mar05_Eval_Run1"


def test_second_run_never_reuses_a_directory(tmp_path):
    first = create_run_dir(tmp_path, "SFT")
    second = create_run_dir(tmp_path, "SFT")
    assert first != second and first.name.endswith("_Run1") and second.name.endswith("_Run2")
    assert create_run_dir(tmp_path, "Reward").name.endswith("_Run1")  # numbered per stage


def test_explicit_existing_run_name_is_refused(tmp_path):
    create_run_dir(tmp_path, "SFT", "Nov30_SFT_Run7")
    with pytest.raises(RunError, match="already exists"):
        create_run_dir(tmp_path, "SFT", "Nov30_SFT_Run7")


def _make(path):
    return create_run_dir(path, "GRPO").name


def test_concurrent_runs_get_distinct_directories(tmp_path):
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        names = pool.map(_make, [tmp_path] * 8)
    assert len(set(names)) == 8


def test_unknown_yaml_key_is_an_error_naming_it(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lora_r: 8\nlearning_rat: 0.1\n")
    with pytest.raises(ConfigError, match="unknown field 'learning_rat'"):
        parse_config(DemoConfig, ["--config", str(path)])


def test_unknown_command_line_field_is_an_error_naming_it():
    with pytest.raises(ConfigError, match="unknown field '--lora_rank'"):
        parse_config(DemoConfig, ["--lora_rank", "8"])


def test_overrides_are_typed_and_returned(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lora_r: 8\nlearning_rate: 1.0e-4\n")
    config, overrides = parse_config(DemoConfig, ["--config", str(path), "--lora_r", "16", "--run_name", "x1",
                                                  "--data", "a.jsonl", "b.jsonl.gz"])
    assert config.lora_r == 16 and config.learning_rate == 1e-4 and config.run_name == "x1"
    assert config.data == ["a.jsonl", "b.jsonl.gz"]
    assert overrides == {"lora_r": 16, "run_name": "x1", "data": ["a.jsonl", "b.jsonl.gz"]}
    with pytest.raises(ConfigError, match="'lora_r' expects"):
        parse_config(DemoConfig, ["--lora_r", "big"])


def test_base_lock_names_the_differing_field(tmp_path):
    config, _ = parse_config(DemoConfig, ["--runs_dir", str(tmp_path)])
    run = Run("SFT", config, {}, argv=["test"])
    mine = {"model": "m", "lora_r": 64, "config_sha256": "a"}
    run.lock_base(mine, {"pairs_run": {"run_name": "p", "base": None}})  # pairs runs carry no base
    with pytest.raises(RunError, match="field 'config_sha256'"):
        run.lock_base(mine, {"sft_run": {"run_name": "s", "base": {**mine, "config_sha256": "b"}}})
