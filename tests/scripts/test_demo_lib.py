"""scripts/demo_lib.sh's `stage`, which the demo chains call for every stage."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from conftest import REPO


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
