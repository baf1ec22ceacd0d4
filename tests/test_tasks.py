"""The Task Protocol (common/tasks/protocol.py): every registered task meets it, its `evaluate` returns an
EvalReport and writes into none of its arguments, `task` and `task_options` are checked with one error
line each; and the worked example of docs/architecture.md ("Adding a task"): a toy task, one module
plus one registry line, runs 01 -> 02 -> 05 on the tiny model."""
from __future__ import annotations

import copy
import dataclasses
import inspect
import itertools
import json

import pytest
import yaml
from conftest import error_line, run_dir_of, run_in_process, words

from common.config import ConfigError, PairsConfig
from common.data import read_jsonl
from common.tasks import TASKS, get_task
from common.tasks.protocol import EvalReport, ReadsRatings, Task, TrainsJudge, options

TOY = "tests.toy_task"
DATA = {"cmv": "data/cmv/cmv_pairs.jsonl.gz", "review": "data/review/neurips2025_papers_reviews.jsonl.gz"}


@pytest.fixture
def toy_registered(monkeypatch):
    """The one registry line of a new task (common/tasks/__init__.py's TASKS), for this test only."""
    monkeypatch.setitem(TASKS, "echo", TOY)


def _task(name, request):
    if name == "echo":
        request.getfixturevalue("toy_registered")
    return get_task(name)


def _hooks(protocol) -> dict:
    return {n: v for n, v in vars(protocol).items() if inspect.isfunction(v) and not n.startswith("_")}


@pytest.mark.parametrize("name", [*TASKS, "echo"])
def test_every_registered_task_meets_the_protocol(name, request):
    task = _task(name, request)
    assert isinstance(task, Task), [h for h in (*Task.__annotations__, *_hooks(Task)) if not hasattr(task, h)]
    assert task.NAME == name and dataclasses.is_dataclass(task.Options) and options(task, {}) is not None
    for hook, declared in _hooks(Task).items():  # the same parameters, by name and kind, as the Protocol's
        want = [(p.name, p.kind) for p in inspect.signature(declared).parameters.values()][1:]
        assert [(p.name, p.kind) for p in inspect.signature(getattr(task, hook)).parameters.values()] == want, hook
    if task.READOUT_SCALE:
        assert isinstance(task, ReadsRatings)
    if hasattr(task, "train_judge"):
        assert isinstance(task, TrainsJudge)


def _premises(name: str, task, n: int = 6) -> list[dict]:
    if name == "echo":
        return task.rows_from({"id": "a", "text": words(12, 1)}, "-", None, task.Options()) + \
            task.rows_from({"id": "b", "text": words(12, 2)}, "-", None, task.Options())
    config = PairsConfig(task=name, data=[DATA[name]])
    made = (task.rows_from(row, where, config, task.Options()) for where, row in read_jsonl(DATA[name]))
    return [e for m in itertools.islice((m for m in made if not isinstance(m, str)), n) for e in m[:1]]


@pytest.mark.parametrize("name", [*TASKS, "echo"])
def test_evaluate_returns_an_eval_report_and_writes_into_none_of_its_arguments(name, request):
    task = _task(name, request)
    premises = _premises(name, task)
    replies = {"base": [task.references(p)[0] for p in premises], "sft": ["no answer"] * len(premises)}
    readouts = {"sft": [{"first_window": {"expected": 3.5, "most_likely": 3}} for _ in premises]} \
        if task.READOUT_SCALE else {}
    args = dict(premises=premises, replies=replies, train=premises, readouts=readouts)
    before = copy.deepcopy(args)
    report = task.evaluate(args["premises"], args["replies"], train=args["train"], readouts=args["readouts"],
                           rating=None, seed=1)
    assert isinstance(report, EvalReport)
    assert args == before  # nothing written into what it was handed
    assert set(report.metrics) <= set(replies) and set(report.per_reply) <= set(replies)
    assert all(len(rows) == len(premises) for rows in report.per_reply.values())
    assert isinstance(report.sections, list) and isinstance(report.plots, type(lambda: 0))


def test_task_options_are_the_tasks_own_and_checked_naming_the_field(toy_registered):
    task = get_task("echo")
    assert options(task, {"n_words": 3}).n_words == 3 and options(task, {}).n_words == 6
    for given, said in (({"n_words": 0}, "field 'task_options.n_words' must be at least 1"),
                        ({"n_words": "x"}, "field 'task_options.n_words' expects int"),
                        ({"words": 3}, "field 'task_options.words': the echo task has no such option (its "
                                       "options: n_words)")):
        with pytest.raises(ConfigError) as err:
            options(task, given)
        assert said in str(err.value) and err.value.field == "task_options"
    with pytest.raises(ConfigError, match="the cmv task has no such option"):
        options(get_task("cmv"), {"n_words": 3})


@pytest.mark.stage
def test_a_task_not_registered_is_one_error_naming_the_known_ones(tmp_path):
    proc = run_in_process("01_build_pairs.py", "--config", "configs/tiny/01_build_pairs.yaml", "--task", "chess",
                          "--runs_dir", tmp_path / "runs")
    line = error_line(proc, tmp_path / "runs")
    assert "field 'task'" in line and "(cmv, review)" in line and "'chess'" in line


def _echo_data(path, n: int = 40):
    rows = [{"id": f"t{i}", "text": words(10 + i % 7, i)} for i in range(n)] + [{"id": "blank", "text": " "}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.stage
def test_a_toy_task_runs_01_02_05_on_the_tiny_model(toy_registered, tiny_model, tmp_path):
    runs, data = tmp_path / "runs", _echo_data(tmp_path / "echo.jsonl")
    recipe = tmp_path / "01_build_pairs.yaml"
    recipe.write_text(yaml.safe_dump({"task": "echo", "data": [str(data)], "task_options": {"n_words": 4},
                                      "seed": 42, "report_to": "none"}))
    bad = run_in_process("01_build_pairs.py", "--config", recipe, "--task_options", "{n_words: 0}", "--runs_dir", runs)
    assert "field 'task_options.n_words' must be at least 1" in error_line(bad, runs)

    pairs = run_dir_of(run_in_process("01_build_pairs.py", "--config", recipe, "--runs_dir", runs))
    metrics = json.loads((pairs / "metrics.json").read_text())
    assert metrics["task"] == "echo" and metrics["n_input_rows"] == 41 and metrics["dropped"] == {"no_premise": 1}
    test = [json.loads(line) for line in (pairs / "test.jsonl").read_text().splitlines()]
    assert test and all(len(r["chosen"].split()) == 4 for r in test)
    assert yaml.safe_load((pairs / "config.yaml").read_text())["task_options"] == {"n_words": 4}

    sft = run_dir_of(run_in_process("02_train_sft.py", "--config", "configs/tiny/02_train_sft.yaml",
                                    "--pairs_run", pairs, "--max_steps", 1, "--runs_dir", runs))
    proc = run_in_process("05_eval.py", "--config", "configs/tiny/05_eval.yaml", "--pairs_run", pairs,
                          "--sft_run", sft, "--max_new_tokens", 6, "--runs_dir", runs)
    run = run_dir_of(proc)
    results = json.loads((run / "eval.json").read_text())
    assert set(results) == {"base", "sft"}
    for model, r in results.items():
        assert 0 <= r["exact_match"] <= 1 and r["n"] == len(test) and "bleu" in r  # the task's and the shared ones
    replies = [json.loads(line) for line in (run / "replies.jsonl").read_text().splitlines()]
    assert [r["id"] for r in replies] == [r["id"] for r in test]
    assert all(r[m]["exact"] == (r[m]["reply"].strip() == r["reference"]) for r in replies for m in ("base", "sft"))
    assert "## Echo" in (run / "report.md").read_text()
    assert json.loads((run / "manifest.json").read_text())["task"] == "echo"


def test_a_cmv_reply_is_cut_to_max_reply_tokens_at_a_sentence_end(tiny_model):
    """SFT's target and DPO's two replies stop where generation will (max_reply_tokens), at a sentence end where
    one falls in the last third; without the field only max_length cuts them; the review task refuses it."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from common.tasks import cmv, review
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    reply = " ".join(f"Sentence number {i} makes a point about rent." for i in range(60))
    row = {"prompt": [{"role": "user", "content": "CMV: rents are too high."}], "chosen": reply}
    config = SimpleNamespace(max_prompt_tokens=64, max_length=1024, max_reply_tokens=40)
    cut = cmv.sft_examples(row, tokenizer, config)[0]["completion"][0]["content"]
    n = len(tokenizer(cut, add_special_tokens=False)["input_ids"])
    assert 40 * 2 // 3 <= n <= 40 and cut.endswith(".") and reply.startswith(cut), (n, cut)
    whole = cmv.sft_examples(row, tokenizer, SimpleNamespace(max_prompt_tokens=64, max_length=1024))
    assert len(tokenizer(whole[0]["completion"][0]["content"], add_special_tokens=False)["input_ids"]) > 40
    with pytest.raises(ConfigError, match="max_reply_tokens"):
        review.check_config(SimpleNamespace(max_reply_tokens=40, max_length=1024))
    # DPO's two replies alike
    from conftest import load_stage
    dpo = load_stage("04_train_dpo.py")
    pair = {**row, "rejected": reply.replace("rent", "wages")}
    data = dpo.preference_dataset([pair], [row["prompt"]], [None], tokenizer,
                                  SimpleNamespace(max_length=1024, max_reply_tokens=40))
    for key in ("chosen", "rejected"):
        text = data[0][key][0]["content"]
        assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) <= 40 and text.endswith("."), text


@pytest.mark.parametrize("field, value", [("rating_run", "runs/x"), ("rating_dev_run", "runs/y"),
                                          ("rating_hint_noise", 0.4), ("rating_hint_noise", 0.0)])
def test_the_review_tasks_rating_fields_are_refused_for_cmv(field, value):
    from types import SimpleNamespace
    with pytest.raises(ConfigError, match=f"field '{field}' is the review task's"):
        get_task("cmv").check_config(SimpleNamespace(**{field: value}))
    get_task("cmv").check_config(SimpleNamespace(rating_hint_noise=None))  # off: nothing to refuse
