"""A run directory never lies, third probe: command-line values, run locks, resumed runs, bounded
inputs and the readers of replies and reviews. Each case fails the way the README promises: one
`error: ...` line naming the file, line or field, or a DONE run whose records are true."""
from __future__ import annotations

import gzip
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, error_line, run_dir_of, run_in_process

from common.cli import parse_config
from common.config import ConfigError, EvalConfig, PairsConfig
from common.tasks import cmv, review

PAIRS_01 = "configs/tiny/01_build_pairs.yaml"


_error = error_line


# --- the command line -------------------------------------------------------------------------------

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


@pytest.mark.parametrize("field, value", [("run_name", "Run1\nrun_dir: /etc"), ("run_name", "a\tb"),
                                          ("runs_dir", "runs\nrun_dir: /etc")])
def test_control_characters_in_a_run_name_are_refused(tmp_path, field, value):
    runs = tmp_path / "runs"
    args = ["--runs_dir", runs, "--run_name", value] if field == "run_name" else ["--runs_dir", f"{runs}/{value}"]
    line = _error(run_in_process("01_build_pairs.py", "--config", PAIRS_01, *args), runs)
    assert line.startswith(f"error: command line: field '{field}' must not hold control characters"), line


# --- the demo scripts' `stage` ----------------------------------------------------------------------

def _demo(tmp_path: Path, body: str, **env) -> subprocess.CompletedProcess:
    """A script that sources scripts/demo_lib.sh and runs `body`, with a fake stage interpreter that
    prints its arguments and a run_dir line; the script's stdout and stderr go to one file."""
    fake = tmp_path / "python"
    fake.write_text('#!/usr/bin/env bash\necho "stage of $1 args: ${*:2}"\necho "run_dir: /r/$1"\n')
    fake.chmod(0o755)
    script = tmp_path / "chain.sh"
    script.write_text(f'source "{REPO}/scripts/demo_lib.sh"\n{body}\n')
    log = tmp_path / "run.log"
    with open(log, "w") as out:
        proc = subprocess.run(["bash", str(script)], stdout=out, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "PY": str(fake), "RUNS_DIR": str(tmp_path / "runs"), **env})
    return subprocess.CompletedProcess(proc.args, proc.returncode, log.read_text(), "")


def test_a_chain_logged_to_a_file_keeps_every_stage(tmp_path):
    proc = _demo(tmp_path, 'a=$(stage one.py --x 1)\nb=$(stage two.py --y 2)\necho "chain: $a $b"')
    assert proc.returncode == 0, proc.stdout
    lines = proc.stdout.splitlines()
    for expected in (f"stage of one.py args: --x 1 --runs_dir {tmp_path / 'runs'}", "run_dir: /r/one.py",
                     f"stage of two.py args: --y 2 --runs_dir {tmp_path / 'runs'}", "run_dir: /r/two.py",
                     "chain: /r/one.py /r/two.py"):
        assert expected in lines, proc.stdout


def test_stage_keeps_a_callers_own_runs_dir(tmp_path):
    proc = _demo(tmp_path, 'stage one.py --runs_dir /mine >/dev/null\nstage two.py --runs_dir=/theirs >/dev/null')
    assert proc.returncode == 0, proc.stdout
    assert "stage of one.py args: --runs_dir /mine" in proc.stdout.splitlines(), proc.stdout
    assert "stage of two.py args: --runs_dir=/theirs" in proc.stdout.splitlines(), proc.stdout


def test_fast_paths_false_says_which_asked_for_value_it_replaced(tmp_path):
    from common.config import SFTStageConfig
    from common.runs import Run
    config, overrides = parse_config(SFTStageConfig, [
        "--config", "configs/tiny/02_train_sft.yaml", "--pairs_run", "p", "--runs_dir", str(tmp_path),
        "--fast_paths", "false", "--mlp_chunk_tokens", "64", "--liger_kernel", "false"])
    assert config.mlp_chunk_tokens == 0
    run = Run("SFT", config, overrides)
    logging.getLogger().removeHandler(run._handler)
    run._handler.close()
    warned = [line for line in (run.dir / "run.log").read_text().splitlines() if "is not used" in line]
    assert len(warned) == 1 and warned[0].endswith("--mlp_chunk_tokens 64 is not used: --fast_paths false sets "
                                                   "it to 0"), warned


# --- what the tasks read ----------------------------------------------------------------------------

def _cmv_rows(n: int) -> list[dict]:
    with gzip.open(REPO / "data" / "cmv" / "cmv_pairs.jsonl.gz", "rt", encoding="utf-8") as f:
        return [json.loads(next(f)) for _ in range(n)]


@pytest.mark.parametrize("period", ["HeldOut", None, "later"])
def test_split_by_period_refuses_a_row_of_no_known_period(tmp_path, period):
    rows = _cmv_rows(120)
    for i, row in enumerate(rows):
        row["source_split"] = "heldout" if i % 4 == 0 else "train"
    rows[7]["source_split"] = period
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["--config", PAIRS_01, "--split_by", "period", "--data", path, "--runs_dir", tmp_path / "runs"]
    line = _error(run_in_process("01_build_pairs.py", *args))
    assert line == (f"error: {path}:8: field 'source_split' must be one of 'train', 'heldout', 'unknown' with "
                    f"split_by period, got {period!r}"), line
    proc = run_in_process("01_build_pairs.py", *args, "--skip_bad_rows", "true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((run_dir_of(proc) / "metrics.json").read_text())
    assert metrics["dropped"].get("bad_row") == 1, metrics["dropped"]


def test_replies_that_differ_only_by_invisible_characters_are_identical():
    row = {"op_id": "t1", "op_title": "CMV: a view", "op_text": "Some body text.",
           "positive_reply": "You are wrong,\u200b because of this.", "negative_reply": "You are wrong, because\u2060 of this."}
    assert cmv.to_pair(row, "x:1", 470) == "identical_replies"


@pytest.mark.parametrize("text, overall", [("Overall Quality: 1e1", None), ("Overall Quality: 4x", None),
                                           ("Overall Quality: 4.5.", 4.5), ("Overall Quality: 4.", 4.0),
                                           ("Overall Quality: 3\nlater: Overall Quality: n/a", None),
                                           ("Overall Quality: 5/6", 5.0)])
def test_a_rating_is_the_whole_number_after_the_label(text, overall):
    assert review.parse_review(text)["overall"] == overall


def test_the_read_out_cuts_a_review_at_its_rating_section_not_at_prose():
    body = "### Key Points\nThe overall quality of the writing is high.\nRating the novelty is hard.\n"
    assert review.readout_turn(body + "### Rating\nOverall Quality: 4") == body.rstrip() + "\n" + review.RATING_HEADER
    assert review.readout_turn(body + "**Overall Quality:** 4") == body.rstrip() + "\n" + review.RATING_HEADER
    assert review.readout_turn(body) == body.rstrip() + "\n" + review.RATING_HEADER
    assert review.readout_turn(body + "Rating: 4") == body.rstrip() + "\n" + review.RATING_HEADER


@pytest.mark.parametrize("second", ["X", "./X", "X/"])
def test_one_policy_run_given_twice_is_refused(second):
    with pytest.raises(ConfigError, match="field 'policy_runs': X is given twice; give each run once"):
        parse_config(EvalConfig, ["--config", "configs/tiny/05_eval.yaml", "--pairs_run", "p",
                                  "--policy_runs", "X", second])


# --- resources have bounds --------------------------------------------------------------------------

def _no_done(runs: Path) -> None:
    assert not list(runs.glob("*/DONE")), list(runs.glob("*/DONE"))


def test_a_line_of_more_than_the_limit_is_one_error_line(tmp_path):
    from common.data import MAX_LINE_BYTES
    rows = _cmv_rows(3)
    path = tmp_path / "rows.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8", compresslevel=1) as f:
        f.write(json.dumps(rows[0]) + "\n")
        f.write(json.dumps({**rows[1], "op_text": "x" * MAX_LINE_BYTES}) + "\n")
        f.write(json.dumps(rows[2]) + "\n")
    assert path.stat().st_size < 2**20
    runs = tmp_path / "runs"
    for skip in ("false", "true"):
        line = _error(run_in_process("01_build_pairs.py", "--config", PAIRS_01, "--data", path, "--runs_dir", runs,
                                     "--skip_bad_rows", skip))
        assert line.startswith(f"error: {path}:2: the line is longer than {MAX_LINE_BYTES} bytes"), line
    _no_done(runs)


def test_a_config_over_the_size_limit_is_refused_before_a_run_exists(tmp_path):
    from common.config import MAX_CONFIG_BYTES
    config = tmp_path / "big.yaml"
    config.write_text("task: cmv\ndata:\n" + "- data/cmv/cmv_pairs.jsonl.gz\n" * (MAX_CONFIG_BYTES // 30 + 1))
    runs = tmp_path / "runs"
    line = _error(run_in_process("01_build_pairs.py", "--config", config, "--runs_dir", runs), runs)
    assert line == f"error: {config}: {config.stat().st_size} bytes; a config is at most 1024 KiB", line


@pytest.mark.parametrize("script, args, field", [
    ("05_eval.py", ["--config", "configs/tiny/05_eval.yaml", "--pairs_run", "p", "--max_new_tokens", 10**8],
     "max_new_tokens"),
    ("04_train_dpo.py", ["--config", "configs/tiny/04_train_dpo.yaml", "--sft_run", "s", "--max_new_tokens", 8192],
     "max_new_tokens"),
    ("04_train_grpo.py", ["--config", "configs/tiny/04_train_grpo.yaml", "--sft_run", "s", "--reward_run", "r",
                          "--max_completion_length", 10**8], "max_completion_length"),
], ids=["eval", "dpo", "grpo"])
def test_generated_tokens_beyond_the_models_context_are_refused(tmp_path, tiny_model, script, args, field):
    runs = tmp_path / "runs"
    line = _error(run_in_process(script, *args, "--runs_dir", runs), runs)
    assert line.startswith(f"error: field '{field}' ("), line
    assert line.endswith("must fit the model's context of 8192 tokens (max_position_embeddings in "
                         ".cache/models/tiny-llama3/config.json)"), line


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


# --- scripts ----------------------------------------------------------------------------------------

def _judge_dir(path: Path, dev_later_accuracy: float) -> None:
    path.mkdir(parents=True)
    judged = {"n_pairs": 4, "accuracy": dev_later_accuracy, "accuracy_ci95": [0.0, 1.0]}
    audit = {"split": "dev_later", "judge": judged, "other_splits": {"dev": judged, "test": judged}, "periods": {},
             "baselines": {k: {f"{s}_accuracy": 0.5 for s in ("dev_later", "dev", "test")}
                           for k in ("length_only", "bag_of_words")}}
    for name, data in (("judge_audit.json", audit), ("metrics.json", {}), ("manifest.json", {"pairs_run": "p"})):
        (path / name).write_text(json.dumps(data))


CANDIDATES = ("features", "minilm_pairwise", "minilm_pairwise_premise256", "minilm_pairwise_lr5e-5_3ep", "minilm_pairwise_seed7",
              "minilm_pointwise", "minilm_pairwise_reply_only", "smollm2_decoder", "smollm2_decoder_lr3e-4")


def test_judges_later_posts_keeps_run_directories_with_spaces_whole(tmp_path):
    """The script's chain with stand-ins for the stages: the two best judges on dev_later reach the ensemble
    whole, and the best is printed whole."""
    runs = tmp_path / "my runs"
    for k, name in enumerate(CANDIDATES):
        _judge_dir(runs / f"Judge_{name}", (k + 1) / 10)
    fake = tmp_path / "python"
    fake.write_text(f"""#!/usr/bin/env bash
case $1 in
  01_build_pairs.py) echo "run_dir: $RUNS_DIR/pairs run" ;;
  03_train_reward.py) while [[ $1 != --run_name ]]; do shift; done; echo "run_dir: $RUNS_DIR/$2" ;;
  scripts/judges_later_posts.py) if [[ $2 == best* ]]; then exec "{sys.executable}" "$@"; fi ;;
  scripts/judge_ensemble.py) printf '%s\\n' "${{@:2}}" > "{tmp_path}/ensemble_args" ;;
esac
""")
    fake.chmod(0o755)
    env = {**os.environ, "PY": str(fake), "RUNS_DIR": str(runs), "RECIPE_03": "configs/tiny"}
    proc = subprocess.run(["bash", "scripts/judges_later_posts.sh"], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "ensemble_args").read_text().splitlines()[:2] == [
        str(runs / "Judge_smollm2_decoder_lr3e-4"), str(runs / "Judge_smollm2_decoder")]
    assert proc.stdout.strip().splitlines()[-1] == f"best: smollm2_decoder_lr3e-4 {runs / 'Judge_smollm2_decoder_lr3e-4'}"


def test_judge_ensemble_of_an_unfinished_run_is_one_error_line(tmp_path):
    proc = subprocess.run([sys.executable, "scripts/judge_ensemble.py", str(tmp_path / "a b"), str(tmp_path / "c")],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == f"error: input {tmp_path / 'a b'} does not exist (no such file or run directory)"


# --- run directories: the base, the inputs and the lock ---------------------------------------------

def test_the_base_lock_tells_apart_models_of_the_same_shapes(tmp_path, tiny_model):
    import shutil

    from safetensors.torch import load_file, save_file

    from common.config import ModelArgs
    from common.model import fingerprint
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    weights = model / "model.safetensors"
    before = fingerprint(ModelArgs(model_name_or_path=str(model)))
    def header():  # names, dtypes, shapes and offsets: what the lock used to hash
        data = weights.read_bytes()
        return data[8:8 + int.from_bytes(data[:8], "little")]
    before_header = header()
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1e-3  # another release of the same model: same names and shapes
    stat = weights.stat()
    save_file(tensors, weights, metadata={"format": "pt"})
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # even with the old modification time
    assert header() == before_header and weights.stat().st_size == stat.st_size
    after = fingerprint(ModelArgs(model_name_or_path=str(model)))
    assert after["weights_sha256"] != before["weights_sha256"]
    assert fingerprint(ModelArgs(model_name_or_path=str(model))) == after  # read from the cache, the same


def _new_run(tmp_path: Path, *argv, base=None):
    """A run directory as a stage creates it (settings, inputs, lock), without training anything."""
    from common.config import SFTStageConfig
    from common.runs import Run
    new = [] if "--resume" in argv else ["--config", "configs/tiny/02_train_sft.yaml", "--runs_dir", str(tmp_path / "runs")]
    config, overrides = parse_config(SFTStageConfig, [*new, *map(str, argv)])
    run = Run("SFT", config, overrides, inputs={"pairs_run": config.pairs_run}, base=base)
    logging.getLogger().removeHandler(run._handler)
    run._handler.close()
    return run


def _end(run) -> None:
    """The process that ran `run` ends: its lock on the run directory goes with it."""
    lock = getattr(run, "_lock", None)
    if lock is not None:
        lock.close()


def _pairs(runs: Path, seed: int) -> Path:
    proc = run_in_process("01_build_pairs.py", "--config", PAIRS_01, "--runs_dir", runs, "--run_name", "pairs",
                          "--seed", seed)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir_of(proc)


def test_a_resumed_run_refuses_an_input_rebuilt_since_it_started(tmp_path):
    import shutil

    from common.runs import RunError
    pairs = _pairs(tmp_path / "pairs", 1)
    first = _new_run(tmp_path, "--pairs_run", pairs, "--run_name", "sft")
    recorded = (first.dir / "manifest.json").read_text()
    _end(first)
    shutil.rmtree(pairs)
    _pairs(tmp_path / "pairs", 2)  # rebuilt under the same path: finished, unchanged since, but other pairs
    with pytest.raises(RunError, match=rf"--resume {first.dir}: input --pairs_run {pairs} is not what the run "
                                       r"started with \(sha256 "):
        _new_run(tmp_path, "--resume", first.dir)
    assert (first.dir / "manifest.json").read_text() == recorded  # the record of the first segment is kept


def test_a_resumed_run_refuses_another_base(tmp_path):
    from common.runs import RunError
    pairs = _pairs(tmp_path / "pairs", 1)
    first = _new_run(tmp_path, "--pairs_run", pairs, "--run_name", "sft", base={"weights_sha256": "a"})
    _end(first)
    with pytest.raises(RunError, match="the base model is not the one the run started with"):
        _new_run(tmp_path, "--resume", first.dir, base={"weights_sha256": "b"})


def test_one_run_directory_is_run_by_one_process_at_a_time(tmp_path):
    from common.runs import RunError
    pairs = _pairs(tmp_path / "pairs", 1)
    first = _new_run(tmp_path, "--pairs_run", pairs, "--run_name", "sft")
    with pytest.raises(RunError, match=rf"run directory {first.dir} is in use by another process"):
        _new_run(tmp_path, "--resume", first.dir)
    _end(first)  # the first process ended
    again = _new_run(tmp_path, "--resume", first.dir)
    assert len(again.manifest["resumed"]) == 1
    _end(again)
    assert "run.lock" not in json.dumps(json.loads((pairs / "manifest.json").read_text())["artifacts"])


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


# --- resuming at the last step ----------------------------------------------------------------------

def _adapter(run: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(run / "adapter" / "adapter_model.safetensors")


def test_a_run_killed_after_its_last_step_resumes_to_the_same_adapter(tmp_path, tiny_model, pairs_run):
    import shutil

    sft = ["--config", "configs/tiny/02_train_sft.yaml", "--pairs_run", pairs_run, "--runs_dir", tmp_path,
           "--lr_scheduler_type", "constant", "--max_steps", 3, "--save_steps", 2, "--lora_dropout", 0]
    done = run_in_process("02_train_sft.py", *sft, "--run_name", "uninterrupted")
    assert done.returncode == 0, done.stderr[-3000:]
    killed = run_in_process("02_train_sft.py", *sft, "--run_name", "killed")
    assert killed.returncode == 0, killed.stderr[-3000:]
    run = run_dir_of(killed)
    assert (run / "checkpoints" / "checkpoint-3").is_dir()
    os.remove(run / "DONE")  # as a run killed while it saved its adapter leaves it
    shutil.rmtree(run / "adapter")
    resumed = run_in_process("02_train_sft.py", "--resume", run)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["global_step"] == 3 and max(h["step"] for h in metrics["log_history"]) == 3
    # The last step is trained again from checkpoint-2; a resumed step is not bitwise the uninterrupted
    # one (tests/test_resume.py), but it is far closer than one more optimiser step (~learning_rate a weight).
    want, got = _adapter(run_dir_of(done)), _adapter(run)
    assert want.keys() == got.keys()
    assert sum(float((want[k] - got[k]).abs().mean()) for k in want) / len(want) < 2e-4
    segments = json.loads((run / "manifest.json").read_text())["segments"]
    assert [(s["from_step"], s["to_step"]) for s in segments] == [(0, 3), (2, 3)]
    assert all(s["patches"] is not None and s["backends"]["fast_paths"] is True for s in segments), segments
