"""Practice and its baselines, on the tiny recipe: GRPO and DPO from the base (no SFT run), best-of-n as
the model practice must beat, the shape of the replies (loops, copying, variety) and the verdict that
opens the report."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import run_dir_of, run_stage

from common.best_of_n import keep_best
from common.data import read_jsonl
from common.watch import conceded, looped, refused, reply_shape


def test_keep_best_keeps_the_argmax_of_each_premise():
    scores = {"a": 0.1, "b": 0.9, "c": 0.5, "d": -1.0, "e": -0.2, "f": -0.2}
    seen = []

    def score(prompts, texts):
        seen.append((list(prompts), list(texts)))
        return [scores[t] for t in texts]
    best, kept = keep_best(["p1", "p2"], [["a", "b", "c"], ["d", "e", "f"]], score)
    assert best == ["b", "e"]  # on a tie the first candidate
    assert kept == [[0.1, 0.9, 0.5], [-1.0, -0.2, -0.2]]
    assert seen == [(["p1"] * 3 + ["p2"] * 3, list("abcdef"))]  # one call, each candidate with its own premise


def test_off_topic_share_counts_replies_to_other_premises():
    """Ten premises, each with a real reply on its topic: a model that answers each premise with the reply to
    the next one is off topic in every reply; one that gives the real replies back is at the real replies'
    own share (the 10% floor: the lowest of ten, which no reply is under)."""
    from common.watch import off_topic_shares
    topics = ["cats pets fur", "taxes sugar health", "trains rail tickets", "school homework exams",
              "rent housing landlords", "coffee caffeine sleep", "voting elections ballots", "meat vegans farms",
              "phones screens children", "guns crime laws"]
    premises = [f"I think {t} matter a lot, change my view on {t.split()[0]}." for t in topics]
    real = [f"About {t.split()[0]}: consider the {t.split()[1]} and the {t.split()[2]} again." for t in topics]
    shares = off_topic_shares(premises, [[r] for r in real], {"echo": real, "shifted": real[1:] + real[:1]})
    assert shares == {"echo": 0.0, "shifted": 1.0}


def test_reply_shape_on_hand_made_texts():
    loop = "I have always loved music a lot. " * 3
    assert looped(loop) and not looped("I have always loved music a lot. Music is good to me.")
    assert not looped("yes. yes. yes. yes.")  # a sentence of under five words is no loop
    # a list whose items differ in a word, with no full stop between them: a run of 8 words said 3 times
    items = " ".join(f"{i}) A desire to avoid offending people who might think this is {w}"
                     for i, w in enumerate(["rude", "stupid", "annoying"], 5))
    assert looped("It's probably a combination of: " + items) and not looped(items.rsplit(" 7)", 1)[0])
    premise = "the cat sat on the mat today"
    shape = reply_shape([premise, premise], ["the cat sat on the mat", "a dog ran far away"])
    # reply 1: its four 3-grams all occur in the premise; reply 2: none of its three
    assert shape["premise_copy_share"] == pytest.approx((1.0 + 0.0) / 2)
    assert shape["looped_share"] == 0.0
    assert reply_shape([premise], [loop])["looped_share"] == 1.0
    assert reply_shape(["x"], ["a b a b"])["distinct_2"] == pytest.approx(2 / 3)  # ab, ba, ab


def test_refusal_share_on_fixed_text():
    refusals = ["I'm sorry, but I can't help with that request.", "I cannot assist with changing views.",
                "As an AI language model, I do not hold opinions.", "I\u2019m sorry, but I cannot do that.",
                "i am unable to provide an argument here."]
    arguments = ["I can't help but think your view misses the cost to renters.",  # "can't help but": no refusal
                 "Sorry to hear that, but consider the data: rents fell where supply rose.",
                 "Your premise rests on one study. " + "x " * 120 + "As an AI researcher I disagree.",  # past the head
                 ""]
    assert [refused(t) for t in refusals] == [True] * 5
    assert [refused(t) for t in arguments] == [False] * 4
    shape = reply_shape(["p"] * 4, refusals[:1] + arguments[:3])
    assert shape["refusal_share"] == pytest.approx(1 / 4)


def test_conceded_share_on_fixed_text():
    concessions = ["I agree with your points. Your reasoning is sound.", "You\u2019re right, the cost is real.",
                   "That's a fair point, but rents still rose.", "I think your critique is spot on.",
                   "Your points are valid; here is another."]
    arguments = ["I'm not sure I agree with your reading of the data.", "I don't agree: rents fell where supply rose.",
                 "Is it right to judge a city by one year?", "The study agreed with neither side.", ""]
    assert [conceded(t) for t in concessions] == [True] * 5
    assert [conceded(t) for t in arguments] == [False] * 5
    assert reply_shape(["p"] * 4, concessions[:1] + arguments[:3])["conceded_share"] == pytest.approx(1 / 4)


@pytest.fixture(scope="module")
def from_base(tiny_model, pairs_run, tmp_path_factory):
    runs = tmp_path_factory.mktemp("practice")
    common = ["--runs_dir", runs]
    sft = run_dir_of(run_stage("02_train_sft.py", "--config", "configs/tiny/02_train_sft.yaml",
                               "--pairs_run", pairs_run, *common))
    reward = run_dir_of(run_stage("03_train_reward.py", "--config", "configs/tiny/03_train_reward.yaml",
                                  "--pairs_run", pairs_run, *common))
    held_out = run_dir_of(run_stage("03_train_reward.py", "--config", "configs/tiny/03_train_reward.yaml",
                                    "--pairs_run", pairs_run, "--train_split", "dev", "--audit_split", "test",
                                    "--run_name", "HeldOut_Judge", *common))
    grpo = run_dir_of(run_stage("04_train_grpo.py", "--config", "configs/tiny/04_train_grpo.yaml",
                                "--pairs_run", pairs_run, "--reward_run", reward, *common))
    dpo = run_dir_of(run_stage("04_train_dpo.py", "--config", "configs/tiny/04_train_dpo.yaml",
                               "--pairs_run", pairs_run, *common))
    evalrun = run_dir_of(run_stage(
        "05_eval.py", "--config", "configs/tiny/05_eval.yaml", "--pairs_run", pairs_run, "--reward_run", reward,
        "--judge_runs", held_out, "--sft_run", sft, "--policy_runs", grpo, dpo, "--best_of_n", 3,
        "--best_of_n_temperature", 1.0, "--temperature", 0.7, "--no_repeat_ngram_size", 3, *common))
    return {"pairs": pairs_run, "sft": sft, "reward": reward, "held_out": held_out, "grpo": grpo, "dpo": dpo,
            "eval": evalrun}


@pytest.mark.stage
def test_grpo_and_dpo_start_from_the_base_without_an_sft_run(from_base):
    for key, inputs in (("grpo", {"pairs_run", "reward_run"}), ("dpo", {"pairs_run"})):
        run = from_base[key]
        manifest = json.loads((run / "manifest.json").read_text())
        assert (run / "DONE").is_file() and (run / "adapter" / "adapter_model.safetensors").is_file()
        assert manifest["started_from"] == "base" and set(manifest["inputs"]) == inputs
        assert manifest["pairs_run"] == str(from_base["pairs"].resolve())


@pytest.mark.stage
def test_grpo_without_sft_or_pairs_run_is_refused(tmp_path, from_base):
    proc = run_stage("04_train_grpo.py", "--config", "configs/tiny/04_train_grpo.yaml", "--reward_run",
                     from_base["reward"], "--runs_dir", tmp_path / "runs", check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and lines[-1].startswith("error: ") and "--pairs_run" in lines[-1], proc.stderr


@pytest.mark.stage
def test_eval_takes_policies_from_the_base_and_best_of_n(from_base):
    results = json.loads((from_base["eval"] / "eval.json").read_text())
    judges = results.pop("judges")
    assert set(results) == {"base", "sft", "grpo_from_base", "dpo_from_base", "best_of_n"}
    for name, r in results.items():
        assert 0 <= r["looped_share"] <= 1 and 0 <= r["premise_copy_share"] <= 1 and 0 <= r["distinct_2"] <= 1
        assert 0 <= r["off_topic_share"] <= 1 and set(r["by_judge"]) == set(judges)
    for name in ("grpo_from_base", "dpo_from_base", "best_of_n"):
        assert "win_rate_vs_sft" in results[name]["by_judge"][from_base["held_out"].name]


@pytest.mark.stage
def test_best_of_n_keeps_the_training_judges_favourite(from_base):
    from common.config import load_run_config
    from common.data import fit_prompt, load_split, one_per_group
    from common.model import load_tokenizer
    from common.rewards import RewardScorer
    rows = [row for _, row in read_jsonl(from_base["eval"] / "replies.jsonl")]
    config = load_run_config(from_base["eval"])
    tokenizer = load_tokenizer(config)
    premises = one_per_group(load_split(from_base["pairs"], "test"))[: config.max_premises]
    judge = RewardScorer.from_run(from_base["reward"], batch_size=4)
    for row, premise in zip(rows, premises):
        best = row["best_of_n"]
        assert len(best["candidates"]) == 3
        prompt = fit_prompt(tokenizer, premise["prompt"], config.max_prompt_tokens)
        by_hand = judge.score([prompt] * 3, best["candidates"])
        # stage 05 scored every premise's candidates in one call, several premises to a forward; here one premise:
        # on a GPU the bf16 judge's kernels may round a unit apart
        assert by_hand == pytest.approx(best["candidate_scores"], abs=5e-3 if torch.cuda.is_available() else 1e-4)
        # the kept reply is the first of the best by the scores stage 05 had (by hand they may be a unit apart, and
        # two candidates that close may swap places: their order is the stage's, not a rescoring's)
        assert best["reply"] == best["candidates"][max(range(3), key=best["candidate_scores"].__getitem__)]
        # scored again among every model's replies: the bf16 judge rounds a little differently in another batch
        assert best["reward"] == pytest.approx(max(by_hand), abs=0.01)


@pytest.mark.stage
def test_eval_records_its_decoding_and_opens_with_the_verdict(from_base):
    manifest = json.loads((from_base["eval"] / "manifest.json").read_text())
    assert manifest["decoding"]["temperature"] == 0.7 and manifest["decoding"]["no_repeat_ngram_size"] == 3
    assert manifest["decoding"]["repetition_penalty"] == 1.0 and manifest["decoding"]["seed"] == 42
    assert manifest["best_of_n"] == {"n": 3, "from": "sft", "temperature": 1.0, "scorer": f"run:{from_base['reward']}",
                                     "fluency_gate": "none (no fluency model, or no greedy reply of its source)",
                                     "passed_share": None}
    metrics = json.loads((from_base["eval"] / "metrics.json").read_text())
    results = json.loads((from_base["eval"] / "eval.json").read_text())
    held_out = from_base["held_out"].name
    for model in ("sft", "grpo_from_base", "dpo_from_base", "best_of_n"):
        (line,) = [line for line in metrics["verdict"] if line.startswith(f"**{model}** vs ")]
        assert f"Held-out judges: {held_out} (" in line and "vs base" in line and "rejected: " in line
        # no fluency model: no gain holds, whatever the judges say (common/verdict.py)
        verdict = results[model]["verdict"]
        assert not verdict["holds"] and "fluency not checked (no fluency_model_name_or_path)" in verdict["reasons"]
    assert any(line.startswith("Fluency was not checked") for line in metrics["verdict"])
    # the held-out judge's own accuracy on its audit's pairs, in eval.json and after the verdict's lines
    assert results["judges"][held_out]["audit"]["split"] == "test"
    audit = json.loads((from_base["held_out"] / "judge_audit.json").read_text())["judge"]
    assert any(line.startswith(f"Held-out judges' own accuracy (the real winner picked, on their audit's pairs): "
                               f"{held_out} {audit['accuracy']:.2f}") for line in metrics["verdict"]), metrics["verdict"]
    # the run each model came from, in eval.json and in a line after the verdict's
    assert [results[m].get("run") for m in ("sft", "grpo_from_base", "dpo_from_base", "best_of_n")] == \
        [from_base["sft"].name, from_base["grpo"].name, from_base["dpo"].name, None]
    assert f"Models: sft = {from_base['sft'].name}; grpo_from_base = {from_base['grpo'].name}; dpo_from_base = " \
        f"{from_base['dpo'].name}." in metrics["verdict"]
    # GRPO's reward and best-of-n's picker were the (llama) training judge: a llama judge does not count for them
    assert [results[m]["verdict"].get("practised_against") for m in ("sft", "grpo_from_base", "dpo_from_base",
                                                                       "best_of_n")] == [None, ["llama"], None, ["llama"]]
    report = (from_base["eval"] / "report.md").read_text()
    head = report.split("## Verdict", 1)
    assert len(head) == 2 and "| model |" not in head[0]  # the verdict comes before any table
    assert "looped | copied | distinct-2 | refused" in report


@pytest.mark.stage
def test_a_cut_reply_carries_no_gradient_with_mask_truncated_completions(tmp_path, from_base):
    """Every reply cut at 3 tokens: with mask_truncated_completions no token trains (grad norm 0, the loss
    0), without it they all do."""
    grad = {}
    for mask in ("true", "false"):
        run = run_dir_of(run_stage("04_train_grpo.py", "--config", "configs/tiny/04_train_grpo.yaml",
                                   "--pairs_run", from_base["pairs"], "--reward_run", from_base["reward"],
                                   "--max_completion_length", 3, "--mask_truncated_completions", mask,
                                   "--guard_max_length_ratio", "null", "--runs_dir", tmp_path / mask))
        logged = [h for h in json.loads((run / "metrics.json").read_text())["log_history"] if "grad_norm" in h]
        assert logged and all(h["completions/clipped_ratio"] == 1.0 for h in logged), logged
        assert f"mask_truncated_completions: {mask}" in (run / "config.yaml").read_text()
        grad[mask] = [h["grad_norm"] for h in logged]
    assert all(g == 0 for g in grad["true"]) and all(g > 0 for g in grad["false"]), grad


@pytest.mark.stage
def test_raft_practised_against_its_targets_picker(from_base):
    from common.eval_inputs import practised_against
    run = SimpleNamespace(config=SimpleNamespace(policy_runs=["r/RAFT", "r/DPO"], replies_from=None), inputs={
        "policy_runs[0]": {"stage": "SFT", "targets_from": {"scorer": f"run:{from_base['reward']}"}},
        "policy_runs[1]": {"stage": "DPO", "inputs": {"sft_run": {"path": str(from_base["sft"])}}}})
    adapters = {"raft": Path("r/RAFT/adapter"), "dpo": Path("r/DPO/adapter")}
    # a function scorer (best_of_n's here) is no judge of a family
    assert practised_against(run, adapters, {}, "tests.test_scorers:words") == {"raft": ["llama"]}
