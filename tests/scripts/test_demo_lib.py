"""scripts/demo_lib.sh's `stage`, which the demo chains call for every stage."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from conftest import REPO, stand_in_interpreter


def _demo(tmp_path: Path, body: str, **env) -> subprocess.CompletedProcess:
    """A script that sources scripts/demo_lib.sh and runs `body`, with a fake stage interpreter that
    prints its arguments and a run_dir line; the script's stdout and stderr go to one file."""
    fake = stand_in_interpreter(tmp_path, 'echo "stage of $1 args: ${*:2}"\necho "run_dir: /r/$1"\n')
    script = tmp_path / "chain.sh"
    script.write_text(f'source "{REPO}/scripts/demo_lib.sh"\n{body}\n')
    log = tmp_path / "run.log"
    with open(log, "w") as out:
        proc = subprocess.run(["bash", str(script)], stdout=out, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "PY": fake, "RUNS_DIR": str(tmp_path / "runs"), **env})
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


def test_resume_takes_finished_runs_and_renames_unfinished_ones(tmp_path):
    runs = tmp_path / "runs"
    (runs / "Done").mkdir(parents=True)
    (runs / "Done" / "DONE").write_text("")
    (runs / "Half").mkdir()  # a run that stopped: left as it is
    (runs / "Half_2").mkdir()
    body = ('LOGS=$RUNS_DIR/logs; mkdir -p "$LOGS"\n'
            'background a one.py --run_name Done\nbackground b two.py --run_name Half\n'
            'background c three.py --run_name New\nwait_for_all\n'
            'for n in a b c; do echo "$n: $(cat "$LOGS/$n.dir") $(head -1 "$LOGS/$n.log" 2>/dev/null)"; done')
    proc = _demo(tmp_path, body, RESUME="1")
    assert proc.returncode == 0, proc.stdout
    lines = proc.stdout.splitlines()
    assert f"a: {runs / 'Done'} " in lines, proc.stdout  # taken as it is: never run again
    assert f"b: /r/two.py stage of two.py args: --run_name Half_3 --runs_dir {runs}" in lines, proc.stdout
    assert f"c: /r/three.py stage of three.py args: --run_name New --runs_dir {runs}" in lines, proc.stdout
    without = _demo(tmp_path, body)  # without RESUME, every stage runs under the name it is given
    assert "stage of one.py args: --run_name Done" in without.stdout, without.stdout


def test_max_jobs_runs_stages_a_few_at_a_time(tmp_path):
    fake = stand_in_interpreter(tmp_path, name="slow", body='echo start >> "$RUNS_DIR/events"; sleep 0.5\n'
                                                            'echo end >> "$RUNS_DIR/events"; echo "run_dir: /r/$1"\n')
    body = ('mkdir -p "$RUNS_DIR"; LOGS=$RUNS_DIR; '
            'for n in 1 2 3 4; do background s$n x.py; done; wait_for_all')
    proc = _demo(tmp_path, body, MAX_JOBS="2", PY=fake)
    assert proc.returncode == 0, proc.stdout
    running, most = 0, 0
    for event in (tmp_path / "runs" / "events").read_text().split():
        running += 1 if event == "start" else -1
        most = max(most, running)
    assert most == 2, (tmp_path / "runs" / "events").read_text()


def test_a_stage_out_of_gpu_memory_runs_again_alone_with_what_waited_on_it(tmp_path):
    """A stage that ran out of GPU memory beside others runs once more, alone, under the next free run name; a
    stage that waited on it (--after) runs again after it; a stage out of memory twice is a failure."""
    fake = stand_in_interpreter(tmp_path, name="oom", body=r'''name=$3; base=${name%_2}
mkdir -p "$RUNS_DIR/$name"; echo "start $name" >> "$RUNS_DIR/events"; sleep 0.3
if [[ " $OOM " == *" $base "* && ( ! -e "$RUNS_DIR/oom_$base" || -n $TWICE ) ]]; then
  touch "$RUNS_DIR/oom_$base"; echo "end $name"  >> "$RUNS_DIR/events"
  echo "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"; exit 1
fi
echo "end $name" >> "$RUNS_DIR/events"; echo "run_dir: $RUNS_DIR/$name"
''')
    body = ('mkdir -p "$RUNS_DIR"; LOGS=$RUNS_DIR/logs; mkdir -p "$LOGS"\n'
            'background a x.py --run_name A\nbackground b --after a y.py --run_name B --from @a\n'
            'background c z.py --run_name C\nwait_for_all\n'
            'for n in a b c; do echo "$n: $(cat "$LOGS/$n.dir")"; done; echo "chain ok"')
    proc = _demo(tmp_path, body, PY=fake, OOM="A")
    runs = tmp_path / "runs"
    assert proc.returncode == 0 and "chain ok" in proc.stdout, proc.stdout
    assert "stage(s) a b ran out of GPU memory beside other stages" in proc.stdout, proc.stdout
    lines = proc.stdout.splitlines()
    assert f"a: {runs / 'A_2'}" in lines and f"c: {runs / 'C'}" in lines, proc.stdout
    # b never started the first time (a had failed), so it keeps its name, and reads a's second run
    assert f"b: {runs / 'B'}" in lines and "start B\n" not in (runs / "events").read_text().split("start A_2")[0]
    events = (runs / "events").read_text().split("\n")
    second = events.index("start A_2")
    assert events[second + 1] == "end A_2" and events[second + 2] == "start B", events  # alone, then b
    # out of memory twice: a failure, named
    for path in runs.iterdir():
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    proc = _demo(tmp_path, body, PY=fake, OOM="A", TWICE="1")
    assert proc.returncode == 1 and "error: stage(s) failed: a b" in proc.stdout, proc.stdout


def test_a_chain_that_stops_on_an_error_stops_its_background_stages(tmp_path):
    """A stage in the foreground fails while one runs in the background: the chain exits 1 at once and the
    background stage is stopped, not left to finish and write its run after the chain said it failed."""
    fake = stand_in_interpreter(tmp_path, name="stages",
                                body='if [[ $1 == fails.py ]]; then echo "error: no"; exit 1; fi\n'
                                     'sleep 2; touch "$RUNS_DIR/finished"; echo "run_dir: /r/$1"\n')
    body = ('mkdir -p "$RUNS_DIR"; LOGS=$RUNS_DIR/logs; mkdir -p "$LOGS"\n'
            'background slow sleeps.py\nx=$(stage fails.py)\necho "not reached"')
    proc = _demo(tmp_path, body, PY=fake)
    assert proc.returncode == 1 and "error: stage fails.py failed" in proc.stdout, proc.stdout
    assert "not reached" not in proc.stdout
    time.sleep(3)  # the background stage would have finished by now
    assert not (tmp_path / "runs" / "finished").exists()


def test_gpu_jobs_counts_the_stages_a_gpus_free_memory_holds(tmp_path):
    """A chain's default MAX_JOBS: 20 GiB a stage is 3 on an idle 80 GB H100 (81,559 MiB free), 7 on an idle H200
    (143,771 MiB), 1 where another job leaves 40,000 of 81,559 free or the card is smaller than a stage; 8 where
    nvidia-smi says nothing (a machine without a GPU)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    counts = {}
    for total, free in ((81559, 81559), (143771, 143771), (81559, 40000), (16384, 16384), (None, None)):
        # the stand-in answers the query it is asked: total and free differ where another job holds memory
        body = (f'case "$*" in *memory.free*) echo {free};; *) echo {total};; esac\n' if total else "exit 127\n")
        stand_in_interpreter(bin_dir, body, name="nvidia-smi")
        proc = _demo(tmp_path, "gpu_jobs 20", PATH=f"{bin_dir}:{os.environ['PATH']}")
        assert proc.returncode == 0, proc.stdout
        counts[(total, free)] = int(proc.stdout.strip())
    assert counts == {(81559, 81559): 3, (143771, 143771): 7, (81559, 40000): 1, (16384, 16384): 1, (None, None): 8}
