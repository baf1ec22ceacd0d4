"""Run directories are never shared or overwritten; configs are strict; the base lock names fields."""
from __future__ import annotations

import datetime
import json
import multiprocessing
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO, error_line, run_in_process

from common.cli import parse_config
from common.config import ConfigError, EvalConfig, ModelArgs, PairsConfig, RunArgs, TrainArgs
from common.runs import Run, RunError, create_run_dir, run_dir_name


@dataclass
class DemoConfig(RunArgs, ModelArgs, TrainArgs):
    pairs_run: str | None = None
    data: list[str] | None = None
    weights: list[float] | None = None


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


@pytest.mark.slow
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


def test_a_list_of_numbers_takes_its_words_as_numbers():
    config, _ = parse_config(DemoConfig, ["--weights", "1", "0.5", "--data", "1", "null"])
    assert config.weights == [1.0, 0.5] and config.data == ["1", "null"]  # a list of strings keeps its words
    with pytest.raises(ConfigError, match="'weights' expects"):
        parse_config(DemoConfig, ["--weights", "one", "0.5"])


def _finished_run(path, base, stage="SFT"):
    path.mkdir()
    (path / "manifest.json").write_text(json.dumps({"run_name": path.name, "stage": stage, "base": base,
                                                    "artifacts": {}}))
    (path / "DONE").write_text("")
    return path


def test_base_lock_names_the_differing_field_before_a_directory_is_made(tmp_path):
    config, _ = parse_config(DemoConfig, ["--runs_dir", str(tmp_path / "runs")])
    mine = {"model": "m", "lora_r": 64, "config_sha256": "a"}
    same = _finished_run(tmp_path / "same", mine)
    pairs = _finished_run(tmp_path / "pairs", None, "Pairs")  # pairs runs carry no base
    run = Run("SFT", config, {}, inputs={"pairs_run": pairs, "sft_run": same}, argv=["test"], base=mine)
    assert run.manifest["base"] == mine
    other = _finished_run(tmp_path / "other", {**mine, "config_sha256": "b"})
    before = sorted((tmp_path / "runs").iterdir())
    with pytest.raises(RunError, match="field 'config_sha256'"):
        Run("SFT", config, {}, inputs={"sft_run": other}, argv=["test"], base=mine)
    assert sorted((tmp_path / "runs").iterdir()) == before


def test_inputs_are_checked_before_a_directory_is_made(tmp_path):
    config, _ = parse_config(DemoConfig, ["--runs_dir", str(tmp_path / "runs")])
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    with pytest.raises(RunError, match="no DONE marker"):
        Run("SFT", config, {}, inputs={"pairs_run": unfinished}, argv=["test"])
    with pytest.raises(RunError, match="--pairs_run is required"):
        Run("SFT", config, {}, inputs={"pairs_run": None}, argv=["test"])
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_every_recipe_parses_strictly():
    """Every YAML under configs/ (but accelerate's) is a valid config of the stage its name starts with."""
    from pathlib import Path

    from common.config import (
        DPOStageConfig,
        EvalConfig,
        GRPOStageConfig,
        PairsConfig,
        RewardStageConfig,
        SFTStageConfig,
    )
    stages = {"01": (PairsConfig, []), "02": (SFTStageConfig, ["--pairs_run", "p"]),
              "03": (RewardStageConfig, ["--pairs_run", "p"]), "04_train_dpo": (DPOStageConfig, ["--sft_run", "s"]),
              "04_train_grpo": (GRPOStageConfig, ["--sft_run", "s", "--reward_run", "r"]),
              "05": (EvalConfig, ["--pairs_run", "p"])}
    configs = Path(__file__).resolve().parent.parent / "configs"
    recipes = sorted(p for p in configs.rglob("*.yaml") if "accelerate" not in p.parts)
    assert len(recipes) > 30
    for path in recipes:
        cls, required = next(v for k, v in stages.items() if path.name.startswith(k))
        config, _ = parse_config(cls, ["--config", str(path), *required])
        assert isinstance(config, cls), path


def test_every_judge_candidate_of_the_chains_parses_strictly():
    """Each line of a chain's candidates file (`NAME stage-03 arguments`, scripts/judges_later_posts.sh) is a
    valid stage-03 config: a typo would otherwise surface on the GPU machine, mid-chain."""
    import shlex
    from pathlib import Path

    from common.config import RewardStageConfig
    files = sorted((Path(__file__).resolve().parent.parent / "configs").rglob("judges_*candidates.txt"))
    assert files
    for path in files:
        lines = [line for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
        assert lines, path
        for line in lines:
            name, *args = shlex.split(line)
            config, _ = parse_config(RewardStageConfig, [*args, "--pairs_run", "p"])
            assert isinstance(config, RewardStageConfig), (path, name)


def test_a_library_too_old_is_one_error_line_at_start_up(monkeypatch):
    import importlib.metadata

    from common import cli
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "5.17.0" if name == "transformers" else real(name))
    with pytest.raises(ConfigError, match=r"transformers 5\.17\.0 is installed; the stages need transformers >= 5\.19"):
        cli.check_versions()
    monkeypatch.setattr(importlib.metadata, "version", real)
    cli.check_versions()  # the pinned versions pass


# --- renamed fields: `shared_prompt` meant three things ----------------------------------------------

@pytest.mark.parametrize("recipe,new", [("04_train_dpo", "pair_in_one_sequence"),
                                        ("04_train_grpo", "group_in_one_sequence")])
def test_a_config_with_an_old_field_name_is_told_the_new_one(tmp_path, recipe, new):
    from common.config import DPOStageConfig, GRPOStageConfig
    cls = DPOStageConfig if recipe == "04_train_dpo" else GRPOStageConfig
    path = tmp_path / "old.yaml"
    path.write_text((REPO / "configs" / "llama3-8b" / f"{recipe}.yaml").read_text().replace(f"{new}:", "shared_prompt:"))
    with pytest.raises(ConfigError, match=f"{path}: unknown field 'shared_prompt' \\(renamed: use '{new}'\\)"):
        parse_config(cls, ["--config", str(path)])
    with pytest.raises(ConfigError, match="unknown field '--shared_prompt_attention' \\(renamed: use 'one_sequence_attention'\\)"):
        parse_config(cls, ["--config", str(REPO / "configs" / "llama3-8b" / f"{recipe}.yaml"),
                           "--shared_prompt_attention", "sdpa"])


def test_an_earlier_runs_config_is_read_under_the_new_names(tmp_path):
    from common.config import load_run_config
    run = tmp_path / "Dec01_Reward_Run1"
    run.mkdir()
    (run / "manifest.json").write_text(json.dumps({"stage": "Reward"}))
    (run / "config.yaml").write_text("pairs_run: p\nmodel_name_or_path: m\npadding_free: true\nshared_prompt: false\n")
    config = load_run_config(run)
    assert config.padding_free and config.prompt_once_per_pair is False


# --- lineage by content ------------------------------------------------------------------------------

def _pairs_run(path, rows: str):
    """A finished pairs run holding `rows` as its test split, its artifacts recorded."""
    from common.provenance import artifact_digests
    path.mkdir()
    (path / "test.jsonl").write_text(rows)
    (path / "manifest.json").write_text(json.dumps({"run_name": path.name, "stage": "Pairs", "task": "cmv",
                                                    "artifacts": artifact_digests(path)}))
    (path / "DONE").write_text("")
    return path


def _child(tmp_path, stage, name, inputs):
    """A finished run of `stage` made by Run itself from `inputs` (no base: none is loaded)."""
    config, _ = parse_config(DemoConfig, ["--runs_dir", str(tmp_path / "runs"), "--run_name", name])
    run = Run(stage, config, {}, inputs=inputs, argv=["test"])
    run.finish({})
    return run.dir


@pytest.mark.parametrize("rebuilt", ['{"a": 2}\n', '{"a": 1}\n\n', '{"b": 1}\n'])
def test_a_pairs_run_rebuilt_at_the_same_path_is_another_lineage(tmp_path, rebuilt):
    import shutil
    pairs = _pairs_run(tmp_path / "P", '{"a": 1}\n')
    sft = _child(tmp_path, "SFT", "S", {"pairs_run": pairs})
    assert json.loads((sft / "manifest.json").read_text())["pairs_run_sha256"]
    policy = _child(tmp_path, "GRPO", "G", {"sft_run": sft})  # inherits the pairs run: recorded by content too
    shutil.rmtree(pairs)
    _pairs_run(pairs, rebuilt)  # another seed or other data, the same path
    config, _ = parse_config(DemoConfig, ["--runs_dir", str(tmp_path / "runs")])
    with pytest.raises(RunError, match="different contents of one pairs run path.*--sft_run"):
        Run("Eval", config, {}, inputs={"pairs_run": pairs, "sft_run": sft}, argv=["test"])
    with pytest.raises(RunError, match=f"pairs run {pairs} is not the one the input runs were trained on"):
        Run("DPO", config, {}, inputs={"sft_run": sft}, argv=["test"])  # the pairs run inherited, not given
    with pytest.raises(RunError, match="different contents"):
        Run("Eval", config, {}, inputs={"pairs_run": pairs, "policy_runs[0]": policy}, argv=["test"])
    # A run made on the rebuilt pairs run is accepted with it.
    fresh = _child(tmp_path, "SFT", "S2", {"pairs_run": pairs})
    Run("Eval", config, {}, inputs={"pairs_run": pairs, "sft_run": fresh}, argv=["test"])


# --- bounds that stop a traceback or an allocation before it happens --------------------------------

@pytest.mark.parametrize("seed", ["-1", str(2**32), str(2**40), "-99999"])
@pytest.mark.parametrize("recipe", ["01_build_pairs", "02_train_sft", "03_train_reward", "04_train_grpo", "04_train_dpo",
                                    "05_eval"])
def test_a_seed_numpy_cannot_take_is_refused_by_every_stage(recipe, seed):
    from common.config import STAGE_CONFIGS
    cls = STAGE_CONFIGS[_STAGES[recipe]]
    inputs = {"01": [], "02": ["--pairs_run", "p"], "03": ["--pairs_run", "p"], "04": ["--sft_run", "s", "--reward_run",
              "r"] if "grpo" in recipe else ["--sft_run", "s"], "05": ["--pairs_run", "p"]}[recipe[:2]]
    with pytest.raises(ConfigError, match="field 'seed'"):
        parse_config(cls, ["--config", f"configs/tiny/{recipe}.yaml", *inputs, "--seed", seed])
    config, _ = parse_config(cls, ["--config", f"configs/tiny/{recipe}.yaml", *inputs, "--seed", str(2**32 - 1)])
    assert config.seed == 2**32 - 1


_STAGES = {"01_build_pairs": "Pairs", "02_train_sft": "SFT", "03_train_reward": "Reward", "04_train_grpo": "GRPO",
           "04_train_dpo": "DPO", "05_eval": "Eval"}


@pytest.mark.stage
@pytest.mark.parametrize("n", [65, 10**9, 2**62])
def test_best_of_n_is_bounded_before_anything_is_allocated(tmp_path, n):
    from conftest import error_line, run_in_process
    proc = run_in_process("05_eval.py", "--config", "configs/tiny/05_eval.yaml", "--pairs_run", "p", "--reward_run", "r",
                          "--best_of_n", str(n), "--runs_dir", tmp_path / "runs")
    assert "field 'best_of_n'" in error_line(proc, tmp_path / "runs")


# --- messages that name what is wrong -----------------------------------------------------------------

@pytest.mark.parametrize("field", ["sft_run", "pairs_run", "policy_runs[0]"])
def test_a_file_given_as_a_run_is_named_a_file(tmp_path, field):
    config, _ = parse_config(DemoConfig, ["--runs_dir", str(tmp_path / "runs")])
    given = tmp_path / "manifest.json"
    given.write_text("{}")
    with pytest.raises(RunError, match=f"input {given} is a file, not a run directory"):
        Run("Eval", config, {}, inputs={field: given}, argv=["test"])


@pytest.mark.parametrize("where", ["command line", "yaml"])
@pytest.mark.parametrize("value", ["0.1", "0.2", "0.0"])
def test_test_fraction_with_split_by_period_is_refused_even_at_its_default(tmp_path, where, value):
    from common.config import PairsConfig
    if where == "yaml":
        path = tmp_path / "p.yaml"
        path.write_text(f"task: cmv\ndata: [d.jsonl]\nsplit_by: period\ntest_fraction: {value}\n")
        argv = ["--config", str(path)]
    else:
        argv = ["--config", "configs/smol/01_build_pairs.yaml", "--test_fraction", value]
    with pytest.raises(ConfigError, match="field 'test_fraction' is not used with split_by period"):
        parse_config(PairsConfig, argv)
    config, _ = parse_config(PairsConfig, ["--config", "configs/smol/01_build_pairs.yaml"])  # left out: fine
    assert config.split_by == "period"


@pytest.mark.parametrize("writes", [1, 10_000])
def test_a_full_disk_names_the_run_directory_when_the_error_names_no_file(tmp_path, monkeypatch, writes, capsys):
    from common.cli import cli

    def main(config, overrides):
        run = Run("SFT", config, overrides, argv=["test"])
        with open("/dev/full", "w") as f:  # a write that fails as on a full disk: no file name in the error
            for _ in range(writes):
                f.write("x" * 100)
        run.finish({})
    monkeypatch.setattr("sys.argv", ["stage", "--runs_dir", str(tmp_path / "runs"), "--run_name", "full"])
    with pytest.raises(SystemExit) as exit_:
        cli(main, DemoConfig)
    import logging
    for handler in logging.getLogger().handlers[:]:
        if isinstance(handler, logging.FileHandler):
            logging.getLogger().removeHandler(handler)
            handler.close()
    assert str(exit_.value.code).startswith(f"error: writing in {tmp_path / 'runs' / 'full'}: No space left on device")


@pytest.mark.parametrize("judges, ok", [(["--crossfit_judge_runs", "a", "b"], True), (["--judge_runs", "j"], True),
                                        (["--reward_run", "r"], True), ([], False)])
def test_replies_from_takes_any_judge_a_cross_fit_included(judges, ok):
    from common.config import EvalConfig
    argv = ["--config", "configs/tiny/05_eval.yaml", "--replies_from", "runs/E", *judges]
    if ok:
        assert parse_config(EvalConfig, argv)[0].replies_from == "runs/E"
    else:
        with pytest.raises(ConfigError, match="replies_from: give the judges"):
            parse_config(EvalConfig, argv)


# --- the command line -------------------------------------------------------------------------------

PAIRS_01 = "configs/tiny/01_build_pairs.yaml"


_error = error_line


def test_an_inline_value_keeps_its_dashes():
    config, overrides = parse_config(PairsConfig, ["--config", PAIRS_01, "--runs-dir=/x/my-runs",
                                                   "--data=cmv-v2.jsonl"])
    assert config.runs_dir == "/x/my-runs" and config.data == ["cmv-v2.jsonl"]
    assert overrides == {"runs_dir": "/x/my-runs", "data": ["cmv-v2.jsonl"]}


@pytest.mark.parametrize("argv", [["--seed", "1", "--seed", "2"], ["--seed=1", "--seed", "2"],
                                  ["--runs_dir", "a", "--runs-dir", "b"]])
def test_a_field_given_twice_on_the_command_line_is_refused(argv):
    key = argv[-2].lstrip("-").replace("-", "_")
    with pytest.raises(ConfigError, match=f"command line: --{key} is given twice"):
        parse_config(PairsConfig, ["--config", PAIRS_01, *argv])


@pytest.mark.stage
@pytest.mark.parametrize("field, value", [("run_name", "Run1\nrun_dir: /etc"), ("run_name", "a\tb"),
                                          ("runs_dir", "runs\nrun_dir: /etc")])
def test_control_characters_in_a_run_name_are_refused(tmp_path, field, value):
    runs = tmp_path / "runs"
    args = ["--runs_dir", runs, "--run_name", value] if field == "run_name" else ["--runs_dir", f"{runs}/{value}"]
    line = _error(run_in_process("01_build_pairs.py", "--config", PAIRS_01, *args), runs)
    assert line.startswith(f"error: command line: field '{field}' must not hold control characters"), line


@pytest.mark.parametrize("second", ["X", "./X", "X/"])
def test_one_policy_run_given_twice_is_refused(second):
    with pytest.raises(ConfigError, match="field 'policy_runs': X is given twice; give each run once"):
        parse_config(EvalConfig, ["--config", "configs/tiny/05_eval.yaml", "--pairs_run", "p",
                                  "--policy_runs", "X", second])


# --- bounds and a full disk -------------------------------------------------------------------------

def _no_done(runs: Path) -> None:
    assert not list(runs.glob("*/DONE")), list(runs.glob("*/DONE"))


@pytest.mark.stage
def test_a_config_over_the_size_limit_is_refused_before_a_run_exists(tmp_path):
    from common.config import MAX_CONFIG_BYTES
    config = tmp_path / "big.yaml"
    config.write_text("task: cmv\ndata:\n" + "- data/cmv/cmv_pairs.jsonl.gz\n" * (MAX_CONFIG_BYTES // 30 + 1))
    runs = tmp_path / "runs"
    line = _error(run_in_process("01_build_pairs.py", "--config", config, "--runs_dir", runs), runs)
    assert line == f"error: {config}: {config.stat().st_size} bytes; a config is at most 1024 KiB", line


@pytest.mark.stage
def test_a_full_disk_is_one_error_line_and_no_done(tmp_path):
    import errno
    from unittest import mock

    def full(path, rows):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))
    runs = tmp_path / "runs"
    with mock.patch("common.data.write_jsonl", full):
        line = _error(run_in_process("01_build_pairs.py", "--config", PAIRS_01, "--runs_dir", runs))
    (run,) = runs.iterdir()
    assert line == (f"error: {run / 'train.jsonl'}: No space left on device (errno 28); the run is left "
                    f"unfinished, without DONE: free space, then run the stage again"), line
    _no_done(runs)


@pytest.mark.stage
def test_a_config_with_a_field_under_its_old_and_new_name_is_refused(tmp_path):
    from common.config import load_run_config
    run = tmp_path / "Dec01_DPO_Run1"
    run.mkdir()
    (run / "manifest.json").write_text(json.dumps({"stage": "DPO"}))
    (run / "config.yaml").write_text("sft_run: s\nshared_prompt: false\npair_in_one_sequence: true\n")
    message = (f"{run / 'config.yaml'}: fields 'shared_prompt' and 'pair_in_one_sequence' are one field "
               f"('shared_prompt' was renamed 'pair_in_one_sequence'); give it once")
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_run_config(run)
    line = _error(run_in_process("04_train_dpo.py", "--resume", run))
    assert line == f"error: {message}", line
