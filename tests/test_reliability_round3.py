"""A run directory never lies, third probe: command-line values, run locks, resumed runs, bounded
inputs and the readers of replies and reviews. Each case fails the way the README promises: one
`error: ...` line naming the file, line or field, or a DONE run whose records are true."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from conftest import REPO, run_in_process

from common.cli import parse_config
from common.config import ConfigError, PairsConfig

PAIRS_01 = "configs/tiny/01_build_pairs.yaml"


def _error(proc, runs: Path | None = None) -> str:
    """The one error line; with `runs`, no run directory may exist (the input was checked up front)."""
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: "), proc.stderr[-3000:]
    if runs is not None:
        assert not runs.exists() or not any(runs.iterdir()), sorted(runs.iterdir())
    return line


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
