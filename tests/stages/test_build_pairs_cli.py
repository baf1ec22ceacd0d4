"""Stage 01 through its command line: any file in the bundled format, row accounting, bad input."""
from __future__ import annotations

import gzip
import json

import pytest
from conftest import REPO, run_dir_of, run_stage

pytestmark = pytest.mark.stage  # every test here runs stage scripts (tests/README.md)

BUNDLED = REPO / "data" / "cmv" / "cmv_pairs.jsonl.gz"


def _rows():
    with gzip.open(BUNDLED, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _build(tmp_path, *data, extra=()):
    return run_stage("01_build_pairs.py", "--config", "configs/tiny/01_build_pairs.yaml", "--task", "cmv",
                     "--data", *data, "--runs_dir", tmp_path / "runs", *extra, check=False)


def _check_accounting(run):
    metrics = json.loads((run / "metrics.json").read_text())
    assert sum(metrics["n_pairs"].values()) + sum(metrics["dropped"].values()) == metrics["n_input_rows"]
    for split in ("train", "dev", "test"):
        lines = (run / f"{split}.jsonl").read_text().splitlines()
        assert len(lines) == metrics["n_pairs"][split]
    return metrics


def test_another_slice_in_the_bundled_format_works(tmp_path):
    # an uncompressed slice from the middle of the file, plus a second gzipped slice: two input files
    rows = _rows()
    first, second = tmp_path / "slice.jsonl", tmp_path / "slice2.jsonl.gz"
    first.write_text("".join(json.dumps(r) + "\n" for r in rows[700:1000]))
    with gzip.open(second, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows[1200:1300])
    proc = _build(tmp_path, first, second)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = run_dir_of(proc)
    metrics = _check_accounting(run)
    assert metrics["n_input_rows"] == 400
    for split, accuracy in metrics["length_only_accuracy"].items():  # balanced on any slice, too
        assert 0.45 <= accuracy <= 0.55, (split, accuracy)
    groups = {split: {json.loads(l)["group_id"] for l in (run / f"{split}.jsonl").read_text().splitlines()}
              for split in ("train", "dev", "test")}
    assert not (groups["train"] & groups["dev"] or groups["train"] & groups["test"] or groups["dev"] & groups["test"])
    manifest = json.loads((run / "manifest.json").read_text())
    assert {"data[0]", "data[1]"} <= set(manifest["inputs"])


def test_whole_bundled_file_is_accounted_for_and_length_balanced(tmp_path):
    proc = _build(tmp_path, BUNDLED)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = _check_accounting(run_dir_of(proc))
    assert metrics["n_input_rows"] == 1525
    for split, accuracy in metrics["length_only_accuracy"].items():
        assert 0.45 <= accuracy <= 0.55, (split, accuracy)


def test_invalid_json_names_file_and_line(tmp_path):
    rows = _rows()[:80]  # enough posts that every split keeps pairs after balancing
    path = tmp_path / "bad.jsonl"
    lines = [json.dumps(r) for r in rows]
    lines[6] = lines[6][:-5]  # truncated record on line 7
    path.write_text("\n".join(lines) + "\n")
    proc = _build(tmp_path, path)
    assert proc.returncode != 0
    assert f"{path}:7: not valid JSON" in proc.stderr

    proc = _build(tmp_path, path, extra=("--skip_bad_rows", "true"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = _check_accounting(run_dir_of(proc))
    assert metrics["dropped"]["bad_row"] == 1 and metrics["n_input_rows"] == 80


@pytest.mark.parametrize("field, value", [("positive_reply", None), ("op_id", 12345)])
def test_wrong_field_type_names_file_line_and_field(tmp_path, field, value):
    rows = _rows()[:5]
    rows[2][field] = value
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = _build(tmp_path, path)
    assert proc.returncode != 0
    assert f"{path}:3: field '{field}' must be a string" in proc.stderr


def test_missing_data_file_is_a_clear_error(tmp_path):
    proc = _build(tmp_path, tmp_path / "nope.jsonl")
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == f"error: --data {tmp_path / 'nope.jsonl'}: no such file"
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
