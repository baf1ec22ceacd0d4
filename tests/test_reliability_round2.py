"""A run directory never lies, second probe: each case is a command a new user or an attacker might
give, and each must end the way the README promises: one `error: ...` line (before any run directory
exists where the input can be checked up front), a count in metrics.json for what is dropped, a
refusal that names the runs, or a DONE run whose records are true.

Stage commands run in this process (`_run`: the script as __main__, through its own `cli`), which is
what the command line does, without a new interpreter for each."""
from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import REPO, error_line, load_stage, run_dir_of, run_in_process
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from common.data import DataError
from common.runs import RunError
from common.tasks import cmv, review

REVIEWS = REPO / "data" / "review" / "neurips2025_papers_reviews.jsonl.gz"
REVIEW_01 = "configs/tiny/review/01_build_pairs.yaml"
N_PAPERS = 8  # one dev and one test paper, six to train on


# --- running a stage --------------------------------------------------------------------------------

def _run(script: str, *args) -> subprocess.CompletedProcess:
    return run_in_process(script, *args)


_error = error_line


def _no_done(runs: Path) -> None:
    """A row is read after the run directory exists: the stopped run is left without DONE."""
    assert not list(runs.glob("*/DONE")), list(runs.glob("*/DONE"))


def _done(proc) -> tuple[Path, dict]:
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    run = run_dir_of(proc)
    assert (run / "DONE").is_file()
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["n_rows_used"] + sum(metrics["dropped"].values()) == metrics["n_input_rows"], metrics
    return run, metrics


# --- review rows ------------------------------------------------------------------------------------

def _papers(n: int = N_PAPERS) -> list[dict]:
    """The first bundled papers with their text cut short (the tests need rows, not long papers)."""
    with gzip.open(REVIEWS, "rt", encoding="utf-8") as f:
        rows = [json.loads(next(f)) for _ in range(n)]
    for row in rows:
        row["paper_markdown_main"] = row["paper_markdown_main"][:1500]
        row.pop("paper_markdown_after_references", None)
    return rows


def _write(path: Path, rows) -> Path:
    # json.dumps escapes a lone surrogate (valid JSON, not text), as a scraper's output may hold it
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _build_review(tmp_path: Path, rows, *extra, name: str = "papers.jsonl"):
    path = _write(tmp_path / name, rows)
    return path, _run("01_build_pairs.py", "--config", REVIEW_01, "--data", path,
                      "--runs_dir", tmp_path / "runs", *extra)


def _splits(run: Path) -> dict[str, list[dict]]:
    return {s: [json.loads(line) for line in (run / f"{s}.jsonl").read_text().splitlines()]
            for s in ("train", "dev", "test")}


@pytest.mark.parametrize("rating", [99, 0, 1.7e307])
def test_a_rating_off_the_scale_is_a_bad_row(tmp_path, rating):
    rows = _papers()
    rows[2]["reviews"][1]["rating"] = rating
    path, proc = _build_review(tmp_path, rows)
    assert _error(proc).startswith(
        f"error: {path}:3: field 'reviews[1].rating' must be a number from 1 to 6 or null"), proc.stderr
    _no_done(tmp_path / "runs")
    run, metrics = _done(_build_review(tmp_path, rows, "--skip_bad_rows", "true", name="again.jsonl")[1])
    assert metrics["dropped"] == {"bad_row": 1}
    for row in sum(_splits(run).values(), []):  # every target's rating reads back, on the scale
        assert review.parse_review(row["chosen"])["overall"] == row["rating"]


def test_the_same_paper_under_another_id_is_a_duplicate(tmp_path):
    rows = _papers()
    rows.append({**rows[3], "paper_id": rows[3]["paper_id"] + "_copy"})
    _, proc = _build_review(tmp_path, rows, "--seed", 45, "--dev_fraction", 0.25, "--test_fraction", 0.25)
    run, metrics = _done(proc)
    assert metrics["dropped"] == {"duplicate_pair": 1}
    papers = {split: {r["paper"] for r in found} for split, found in _splits(run).items()}
    assert not (papers["train"] & papers["dev"] or papers["train"] & papers["test"] or papers["dev"] & papers["test"])
    # the same paper with other reviews under another id is the same premise too
    rows[-1]["reviews"] = rows[-1]["reviews"][:1]
    run, metrics = _done(_build_review(tmp_path, rows, name="other.jsonl")[1])
    assert metrics["dropped"] == {"duplicate_premise": 1}


@pytest.mark.parametrize("rating", [1e308, 10**400])
def test_a_huge_rating_is_one_error_line_or_a_counted_bad_row(tmp_path, rating):
    rows = _papers()
    rows[4]["reviews"][0]["rating"] = rating
    path, proc = _build_review(tmp_path, rows)
    assert _error(proc).startswith(f"error: {path}:5: field 'reviews[0].rating'")
    _no_done(tmp_path / "runs")
    _, metrics = _done(_build_review(tmp_path, rows, "--skip_bad_rows", "true", name="again.jsonl")[1])
    assert metrics["dropped"] == {"bad_row": 1}


@pytest.mark.parametrize("field", ["title", "paper_markdown_main", "paper_id"])
def test_a_lone_surrogate_in_a_review_row_is_a_bad_row(tmp_path, field):
    rows = _papers()
    rows[1][field] = "before \ud800 after"
    path, proc = _build_review(tmp_path, rows)
    assert _error(proc).startswith(f"error: {path}:2: field '{field}' is not valid Unicode")
    _no_done(tmp_path / "runs")
    _, metrics = _done(_build_review(tmp_path, rows, "--skip_bad_rows", "true", name="again.jsonl")[1])
    assert metrics["dropped"] == {"bad_row": 1}


def _pdf(path: Path, content: bytes = b"") -> Path:
    """A one-page PDF whose text is 'Hello paper', then `content` in its content stream."""
    stream = b"BT /F1 12 Tf 10 50 Td (Hello paper) Tj ET " + content
    objs = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 200 100] /Contents 4 0 R "
            b"/Resources << /Font << /F1 5 0 R >> >> >>",
            b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream",
            b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    out, offsets = b"%PDF-1.4\n", []
    for i, body in enumerate(objs, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % i + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objs) + 1) + b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objs) + 1, xref)
    path.write_bytes(out)
    return path


def test_a_pdf_of_deeply_nested_arrays_is_one_error_line(tmp_path):
    rows = _papers()
    rows[2]["paper_markdown_main"] = ""
    pdf = _pdf(tmp_path / f"{rows[2]['paper_id']}.pdf", b"[" * 5000 + b"]" * 5000 + b" TJ")
    _, proc = _build_review(tmp_path, rows, "--pdf", pdf)
    assert f"{pdf}: unreadable PDF" in _error(proc)
    _, metrics = _done(_build_review(tmp_path, rows, "--pdf", pdf, "--skip_bad_rows", "true", name="again.jsonl")[1])
    assert metrics["dropped"] == {"bad_row": 1}


def test_pdfs_are_recorded_and_one_that_names_no_paper_is_counted(tmp_path):
    rows = _papers()
    rows[2]["paper_markdown_main"] = ""
    own, stray = _pdf(tmp_path / f"{rows[2]['paper_id']}.pdf"), _pdf(tmp_path / "no_such_paper.pdf")
    (tmp_path / "copy").mkdir()
    twice = _pdf(tmp_path / "copy" / own.name)
    _, proc = _build_review(tmp_path, rows, "--pdf", own, twice)
    assert _error(proc, tmp_path / "runs") == \
        f"error: command line: field 'pdf': two files are named {own.stem}.pdf; each paper takes one PDF"
    run, metrics = _done(_build_review(tmp_path, rows, "--pdf", own, stray, name="again.jsonl")[1])
    assert metrics["pdf_unused"] == [str(stray)]
    assert any(r["paper"].endswith("Hello paper") for r in sum(_splits(run).values(), []))
    inputs = json.loads((run / "manifest.json").read_text())["inputs"]
    assert inputs["pdf[0]"]["sha256"] == hashlib.sha256(own.read_bytes()).hexdigest()


# --- preference stage: rejected.jsonl read back on resume ------------------------------------------

@pytest.fixture(scope="module")
def rejected_replies():
    return load_stage("04_train_dpo.py").rejected_replies


def _resumed_dpo(tmp_path, saved_lines: list[str], recorded: str | None):
    (tmp_path / "rejected.jsonl").write_text("".join(line + "\n" for line in saved_lines))
    run = SimpleNamespace(dir=tmp_path, is_main=True, manifest={"rejected_sha256": recorded} if recorded else {},
                          save_manifest=lambda: None)
    config = SimpleNamespace(rejected_from="sft", sft_run=str(tmp_path), max_new_tokens=4, generation_batch_size=1)
    rows = [{"id": "p1", "chosen": "a real review"}, {"id": "p2", "chosen": "another"}]
    return run, config, rows


def test_a_resumed_dpo_run_refuses_a_changed_rejected_file(tmp_path, rejected_replies):
    written = [json.dumps({"id": i, "rejected": "written by the sft model", "model": "sft", "sft_run": "s"})
               for i in ("p1", "p2")]
    digest = hashlib.sha256("".join(line + "\n" for line in written).encode()).hexdigest()
    changed = [written[0], json.dumps({"id": "p2", "rejected": "swapped in later", "model": "sft", "sft_run": "s"})]
    run, config, rows = _resumed_dpo(tmp_path, changed, digest)
    with pytest.raises(RunError, match="rejected.jsonl is missing or changed since this run wrote it"):
        rejected_replies(run, config, None, None, rows, [[], []])
    run, config, rows = _resumed_dpo(tmp_path, written, digest)  # unchanged: read back, nothing generated
    assert rejected_replies(run, config, None, None, rows, [[], []]) == ["written by the sft model"] * 2


@pytest.mark.parametrize("bad", ['{"id": "p1", "rejected": "no model"}', '["p1", "a list"]'])
def test_a_malformed_rejected_row_on_resume_is_one_error_line(tmp_path, rejected_replies, bad):
    good = json.dumps({"id": "p2", "rejected": "r", "model": "sft", "sft_run": "s"})
    run, config, rows = _resumed_dpo(tmp_path, [bad, good], None)
    with pytest.raises(DataError, match=r"rejected.jsonl:1: expected an object with the strings"):
        rejected_replies(run, config, None, None, rows, [[], []])


# --- judges in stage 05 -----------------------------------------------------------------------------

def _judge(tmp_path, name: str, rows: list[dict], split: str = "train"):
    from common.judges import write_train_posts
    path = tmp_path / name
    path.mkdir()
    write_train_posts(path, split, rows)
    return str(path), SimpleNamespace(judge_objective="pairwise", judge_backbone="lora_4bit",
                                      judge_model_name_or_path=None, model_name_or_path="m", train_split=split,
                                      pairs_run=str(tmp_path / "its_pairs_run"))


def _premises(n: int) -> list[dict]:
    return [{"group_id": f"post{i}", "prompt": [{"role": "user", "content": f"premise {i}"}]} for i in range(n)]


def test_a_judge_trained_on_the_scored_posts_under_other_ids_is_refused(tmp_path):
    from common.judges import describe_judges
    scored = _premises(4)
    renamed = [{**p, "group_id": p["group_id"] + "_renamed"} for p in scored]
    own, own_config = _judge(tmp_path, "Dec01_Reward_Run1", _premises(8)[4:])
    other, other_config = _judge(tmp_path, "Dec01_Reward_Run2", renamed)
    with pytest.raises(RunError, match=f"--judge_runs {other}: judge Dec01_Reward_Run2 trained on 4 of the 4 premises"):
        describe_judges({"Dec01_Reward_Run1": own, "Dec01_Reward_Run2": other}, "Dec01_Reward_Run1", scored,
                        set(), {"Dec01_Reward_Run1": own_config, "Dec01_Reward_Run2": other_config})


def test_the_training_judge_is_refused_when_it_trained_on_the_scored_premises(tmp_path):
    from common.judges import describe_judges
    scored = _premises(4)
    judge, config = _judge(tmp_path, "Dec01_Reward_Run1", scored, split="test")
    with pytest.raises(RunError, match=f"--reward_run {judge}: judge Dec01_Reward_Run1 trained on 4 of the 4"):
        describe_judges({"Dec01_Reward_Run1": judge}, "Dec01_Reward_Run1", scored, set(), {"Dec01_Reward_Run1": config})


# --- settings ---------------------------------------------------------------------------------------

SFT = ["--config", "configs/tiny/02_train_sft.yaml", "--pairs_run", "runs/not_needed"]


@pytest.mark.parametrize("script, args", [
    ("02_train_sft.py", [*SFT, "--learning_rate", "inf"]),
    ("02_train_sft.py", [*SFT, "--learning_rate", ".nan"]),
    ("04_train_dpo.py", ["--config", "configs/tiny/04_train_dpo.yaml", "--sft_run", "s", "--beta", "inf"]),
], ids=["lr_inf", "lr_nan", "dpo_beta_inf"])
def test_a_non_finite_setting_is_refused_before_a_run_exists(tmp_path, script, args):
    line = _error(_run(script, *args, "--runs_dir", tmp_path / "runs"), tmp_path / "runs")
    assert "must be a finite number" in line, line


def test_infinite_epochs_are_refused_before_a_run_exists(tmp_path):
    line = _error(_run("02_train_sft.py", *SFT, "--num_train_epochs", "inf", "--runs_dir", tmp_path / "runs"),
                  tmp_path / "runs")
    assert line.startswith("error: command line: field 'num_train_epochs' must be a finite number"), line


def test_an_empty_config_or_a_missing_model_is_one_error_line(tmp_path, tiny_model):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing set\n")
    line = _error(_run("02_train_sft.py", "--config", empty, "--pairs_run", "p", "--runs_dir", tmp_path / "runs"),
                  tmp_path / "runs")
    assert line == f"error: {empty}: the config is empty; give a recipe (configs/<recipe>/0N_<stage>.yaml)"
    line = _error(_run("02_train_sft.py", *SFT, "--model_name_or_path", tmp_path / "no_such_model",
                       "--runs_dir", tmp_path / "runs"), tmp_path / "runs")
    assert line.startswith(f"error: field 'model_name_or_path': no usable model at '{tmp_path / 'no_such_model'}'")


def _alias_bomb(levels: int = 9) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "\n".join(lines) + f"\ndata: *a{levels - 1}\n"


def test_a_yaml_alias_bomb_is_refused_at_once_in_a_short_line(tmp_path):
    config = tmp_path / "bomb.yaml"
    config.write_text(_alias_bomb())
    started = time.time()
    line = _error(_run("01_build_pairs.py", "--config", config, "--runs_dir", tmp_path / "runs"), tmp_path / "runs")
    assert time.time() - started < 10 and len(line) < 300, (time.time() - started, len(line))
    assert line.startswith(f"error: {config}:2: YAML aliases (*name) are not allowed"), line


def test_a_key_given_twice_in_a_config_is_refused(tmp_path):
    config = tmp_path / "twice.yaml"
    config.write_text("task: cmv\nseed: 1\nreport_to: none\nseed: 2\n")
    line = _error(_run("01_build_pairs.py", "--config", config, "--runs_dir", tmp_path / "runs"), tmp_path / "runs")
    assert line == f"error: {config}:4: field 'seed' is given twice", line


def test_a_window_overlap_of_max_length_is_refused_before_a_run_exists(tmp_path, tiny_model):
    pairs, _ = _done(_build_review(tmp_path, _papers())[1])
    line = _error(_run("02_train_sft.py", "--config", "configs/tiny/review/02_train_sft.yaml", "--pairs_run", pairs,
                       "--window_overlap", 4096, "--runs_dir", tmp_path / "sft"), tmp_path / "sft")
    assert line == ("error: field 'window_overlap' (4096) must be well below max_length (4096) for the review "
                    "task's windows: lower window_overlap"), line


# --- input runs -------------------------------------------------------------------------------------

def test_a_corrupt_manifest_in_an_input_or_resumed_run_is_one_error_line(tmp_path, tiny_model, pairs_run):
    broken = tmp_path / "Dec01_Pairs_Run9"
    shutil.copytree(pairs_run, broken)
    (broken / "manifest.json").write_text('{"stage": "Pairs", "artif')
    line = _error(_run("02_train_sft.py", *SFT[:2], "--pairs_run", broken, "--runs_dir", tmp_path / "runs"),
                  tmp_path / "runs")
    assert line.startswith(f"error: {broken / 'manifest.json'}: not a readable manifest"), line
    os.remove(broken / "DONE")
    line = _error(_run("01_build_pairs.py", "--resume", broken))
    assert line.startswith(f"error: --resume {broken}: {broken / 'manifest.json'}: not a readable manifest"), line


def test_an_input_run_without_an_artifact_list_is_refused(tmp_path, pairs_run):
    from common.runs import check_input
    copy = tmp_path / "Dec01_Pairs_Run9"
    shutil.copytree(pairs_run, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    del manifest["artifacts"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    (copy / "test.jsonl").write_text("")
    with pytest.raises(RunError, match=f"input run {copy} records no artifacts"):
        check_input("pairs_run", copy)


def test_eval_of_an_empty_split_is_one_error_line(tmp_path, tiny_model):
    _, proc = _build_review(tmp_path, _papers(2), "--dev_fraction", 0, "--test_fraction", 0.5)
    pairs, metrics = _done(proc)
    assert metrics["n_pairs"]["dev"] == 0
    line = _error(_run("05_eval.py", "--config", "configs/tiny/review/05_eval.yaml", "--pairs_run", pairs,
                       "--split", "dev", "--runs_dir", tmp_path / "runs"))
    assert line == f"error: {pairs}: its dev split holds no premises to score", line


# --- what the task reads ----------------------------------------------------------------------------

def test_the_rating_parser_reads_the_rating_not_prose_or_another_scale():
    rated = "### Rating\nOverall Quality: 4\nReview Confidence: 3\n"
    assert review.parse_review(rated + "Note: the overall quality 1 of the writing could improve.") == \
        {"overall": 4.0, "confidence": 3.0}
    assert review.parse_review("Overall Quality: 5 out of 10\nReview Confidence: 3 out of 5") == \
        {"overall": None, "confidence": 3.0}


def test_replies_that_differ_only_in_white_space_are_identical():
    row = {"op_id": "t1", "op_title": "CMV: a view", "op_text": "Some body text.",
           "positive_reply": "You are  wrong,\nbecause of this.", "negative_reply": "You are wrong, because of  this."}
    assert cmv.to_pair(row, "x:1", 470) == "identical_replies"


# --- the Slurm wrapper ------------------------------------------------------------------------------

def test_stage_sh_passes_list_fields_of_several_words(tmp_path):
    fake = tmp_path / "python"  # stands in for the launcher: records the arguments it is given
    fake.write_text('#!/usr/bin/env bash\ncase $1 in -c) exit 0 ;; -V) echo fake; exit 0 ;; esac\n'
                    'printf "%s\\n" "$@" > "$ARGS_OUT"\n')
    fake.chmod(0o755)
    done = [tmp_path / name for name in ("A", "B")]
    for run in done:
        run.mkdir()
        (run / "DONE").write_text("")
    env = {**os.environ, "PYTHON": str(fake), "ARGS_OUT": str(tmp_path / "args")}
    env.pop("SLURM_JOB_ID", None)

    def stage(*args):
        return subprocess.run(["bash", "slurm/stage.sh", "05_eval.py", "--config", "configs/tiny/05_eval.yaml",
                               *map(str, args), "--runs_dir", tmp_path / "runs", "--run_name", "E1"],
                              cwd=REPO, env=env, capture_output=True, text=True)
    stage("--policy_runs", *done, "--seed", 3)
    args = (tmp_path / "args").read_text().splitlines()
    at = args.index("--policy_runs")
    assert args[at:at + 5] == ["--policy_runs", *map(str, done), "--seed", "3"], args
    proc = stage("--judge_runs", done[0], tmp_path / "unfinished")
    assert proc.returncode != 0 and f"input --judge_runs {tmp_path / 'unfinished'} is not a finished run" in proc.stderr


# --- property-based: hostile review rows and settings ---------------------------------------------

_HOSTILE_NUMBER = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.integers(-10**6, 10**6),
    st.integers(10**18, 10**400), st.sampled_from([0, 7, 1.7e307, 1e308, -1e308, 3.5, 6, 1]))
_HOSTILE_TEXT = st.one_of(st.text(max_size=20), st.just("a \ud800 b"), st.just("\udfff"),
                          st.text(alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), max_size=3))
_NESTING = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=5),
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                        max_leaves=6)
_ROW_FIELDS = ("paper_id", "title", "abstract", "paper_markdown_main", "reviews")
_REVIEW_FIELDS = ("rating", "confidence", "text")
_ROW_OPS = st.one_of(
    st.tuples(st.just("rating"), st.integers(0, 7), st.sampled_from(("rating", "confidence")), _HOSTILE_NUMBER),
    st.tuples(st.just("text"), st.integers(0, 7), st.sampled_from(("paper_id", "title", "abstract",
                                                                   "paper_markdown_main")), _HOSTILE_TEXT),
    st.tuples(st.just("review_text"), st.integers(0, 7), _HOSTILE_TEXT),
    st.tuples(st.just("nest_row"), st.integers(0, 7), st.sampled_from(_ROW_FIELDS), _NESTING),
    st.tuples(st.just("nest_review"), st.integers(0, 7), st.sampled_from(_REVIEW_FIELDS), _NESTING),
    st.tuples(st.just("whole_row"), st.integers(0, 7), _NESTING),
)


def _apply(rows: list, op: tuple) -> None:
    kind, i = op[0], op[1]
    row = rows[i]
    if not isinstance(row, dict):
        return
    reviews = row.get("reviews") if isinstance(row.get("reviews"), list) else []
    first = reviews[0] if reviews and isinstance(reviews[0], dict) else None
    if kind in ("rating", "nest_review") and first is not None:
        first[op[2]] = op[3]
    elif kind == "review_text" and first is not None:
        first["text"] = op[2]
    elif kind in ("text", "nest_row"):
        row[op[2]] = op[3]
    elif kind == "whole_row":
        rows[i] = op[2]


@pytest.fixture(scope="module")
def papers():
    return _papers()


@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=st.lists(_ROW_OPS, min_size=1, max_size=3), skip=st.booleans())
def test_hostile_review_rows_end_in_a_documented_outcome(papers, ops, skip):
    rows = json.loads(json.dumps(papers))
    for op in ops:
        _apply(rows, op)
    with contextlib.ExitStack() as stack:
        import tempfile
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        path, proc = _build_review(tmp, rows, "--skip_bad_rows", str(skip).lower())
        if proc.returncode:  # one located line, no DONE anywhere
            line = _error(proc)
            event("error: " + line.split(": ", 2)[-1][:40])
            assert line.startswith(f"error: {path}:") or "split(s)" in line, line
            _no_done(tmp / "runs")
            return
        run, metrics = _done(proc)
        event(f"done, dropped {sorted(metrics['dropped'])}")
        assert metrics["n_input_rows"] == len(rows)
        for row in sum(_splits(run).values(), []):  # a target's rating is on the scale and reads back
            assert review.parse_review(row["chosen"])["overall"] == row["rating"]
            assert 1 <= row["rating"] <= 6 and all(1 <= r <= 6 for r in row["human_ratings"])


_CONFIG_VALUES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from([".inf", "-.inf", ".nan", ".NaN", "1e400", "-1e400", "1.0e+400", "nan", "inf"]),
    st.integers(-10**30, 10**30).map(str), st.integers(19, 5000).map(lambda n: "9" * n),
    st.integers(1, 6).map(lambda n: "&x " + "[" * n + "1" + "]" * n),
    st.just("[" * 3000 + "]" * 3000))
_FIELDS = ("learning_rate", "num_train_epochs", "warmup_ratio", "lora_dropout", "max_steps", "lora_r", "seed",
           "max_length", "window_overlap", "save_steps")


@settings(max_examples=30, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(_FIELDS), value=_CONFIG_VALUES, where=st.sampled_from(["yaml", "command_line", "twice"]),
       aliases=st.integers(0, 6))
def test_hostile_settings_are_a_checked_config_or_one_short_error(tmp_path, field, value, where, aliases):
    from common.cli import parse_config
    from common.config import INT_LIMIT, ConfigError, SFTStageConfig
    base = Path("configs/tiny/review/02_train_sft.yaml").read_text()
    text = base if where == "command_line" else base + f"\n{field}: {value}\n"
    if where == "twice":
        text += f"{field}: {value}\n"
    if aliases:
        text = text.replace("seed: 42", "") + _alias_bomb(aliases).replace("data:", "seed:")
    config_path = tmp_path / "c.yaml"
    config_path.write_text(text)
    argv = ["--config", str(config_path), "--pairs_run", "p"]
    argv += ["--" + field, value] if where == "command_line" else []
    started = time.time()
    try:
        config, _ = parse_config(SFTStageConfig, argv)
    except ConfigError as err:
        assert len(str(err)) < 500 and time.time() - started < 10, str(err)[:500]
        event("error: " + str(err).split(": ")[-2][-30:])
        return
    event("config")
    assert where == "command_line" or (where == "yaml" and not aliases)
    for name, got in vars(config).items():
        if isinstance(got, float):
            assert got == got and abs(got) != float("inf"), (name, got)
        if isinstance(got, int):
            assert abs(got) <= INT_LIMIT, name
