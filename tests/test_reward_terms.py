"""GRPO's reward as declared terms (common/reward_terms.py): PAR and the fluency gate on fixed scores,
and a reward added as one function plus two YAML lines driving a tiny GRPO run."""
from __future__ import annotations

import json
import math

import pytest

from common.checkpoint_choice import choose, family, win_rate
from common.config import ConfigError, GRPOStageConfig
from common.reward_terms import FluencyGate, ParScorer, Term, gate_value, par
from common.scorers import FunctionScorer


def shorter(prompts, replies, **kwargs):
    """The worked example of docs/architecture.md: a reward for shorter replies."""
    return [-len(r.split()) / 10 for r in replies]


def blind_to_the_reply(prompts, replies, **kwargs):
    """A reward that reads only the premise: every reply to one premise gets the same, on any device
    (stages/test_pipeline.py's GRPO run whose groups all tie)."""
    return [float(len(json.dumps(prompt))) for prompt in prompts]


def test_par_is_the_sigmoid_of_the_margin_over_the_reference():
    values = par([2.0, 0.0, -3.0, 800.0, -800.0], [0.0, 0.0, 1.0, 0.0, 0.0])
    assert values[0] == pytest.approx(1 / (1 + math.exp(-2))) and values[1] == 0.5
    assert values[2] == pytest.approx(1 / (1 + math.exp(4)))
    assert values[3] == 1.0 and 0 <= values[4] < 1e-300  # no overflow at any margin
    assert all(0 < v < 1 for v in values[:3])


def test_par_scores_each_reply_against_the_reference_to_its_own_premise():
    table = {"good": 3.0, "bad": -1.0, "ref a": 1.0, "ref b": -1.0}
    calls = []

    def judge_fn(prompts, replies, **_):
        calls.append(list(replies))
        return [table[r] for r in replies]
    judge = FunctionScorer(judge_fn, "judge")
    a, b = [{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]
    scorer = ParScorer(judge, {json.dumps(a): "ref a", json.dumps(b): "ref b"})
    got = scorer.score([a, a, b, b], ["good", "bad", "good", "bad"])
    assert got == pytest.approx(par([3.0, -1.0, 3.0, -1.0], [1.0, 1.0, -1.0, -1.0]))
    scorer.score([a, b], ["bad", "good"])
    assert sum("ref a" in c for c in calls) == 1  # the reference is scored once per premise


def test_the_fluency_gate_sets_a_salad_replys_whole_reward():
    salad, prose = "the the persuade delta view view", "I think your view misses one point."
    fluency = FunctionScorer(lambda p, r, **_: [-9.0 if x == salad else -2.0 for x in r], "fluency")
    judge = Term(FunctionScorer(lambda p, r, **_: [5.0 if x == salad else 1.0 for x in r], "judge"))
    extra = Term(FunctionScorer(shorter, "shorter"))
    terms = [(judge, 1.0), (extra, 0.5)]
    gate = FluencyGate(fluency, threshold=-4.0, terms=terms, weight=2.0, gate_reward=0.0)
    prompts, completions = [[{"role": "user", "content": "p"}]] * 2, [salad, prose]
    outputs = [judge(prompts, completions), extra(prompts, completions), gate(prompts, completions)]
    total = [sum(w * out[i] for w, out in zip((1.0, 0.5, 2.0), outputs)) for i in range(2)]  # TRL's weighted sum
    assert total[0] == pytest.approx(0.0) and outputs[0][0] == 5.0  # the judge loved the salad; the gate zeroes it
    assert total[1] == pytest.approx(1.0 + 0.5 * shorter(None, [prose])[0]) and outputs[2][1] == 0.0
    assert gate_value(total[1], -2.0, -4.0) == total[1] and gate_value(7.0, -9.0, -4.0, -1.0) == -1.0


def test_reward_weights_must_match_reward_funcs():
    with pytest.raises(ConfigError, match="reward_weights") as err:
        GRPOStageConfig(pairs_run="p", reward_run="r", reward_funcs=["judge", "par"], reward_weights=[1.0])
    assert err.value.field == "reward_weights"
    with pytest.raises(ConfigError, match="'reward_funcs': 'judeg' is none of"):
        GRPOStageConfig(pairs_run="p", reward_run="r", reward_funcs=["judeg"], reward_weights=[1.0])
    with pytest.raises(ConfigError, match="dev_judges"):
        GRPOStageConfig(pairs_run="p", reward_run="r", checkpoint_eval_steps=2, fluency_model_name_or_path="m")
    with pytest.raises(ConfigError, match="fluency_model_name_or_path"):
        GRPOStageConfig(pairs_run="p", reward_run="r", reward_funcs=["fluency"], reward_weights=[1.0])
    with pytest.raises(ConfigError, match="checkpoint_no_repeat_ngram_size") as err:
        GRPOStageConfig(pairs_run="p", reward_run="r", checkpoint_no_repeat_ngram_size=1)
    assert err.value.field == "checkpoint_no_repeat_ngram_size"


@pytest.fixture(scope="module")
def grpo_with_terms(tiny_model, pairs_run, tmp_path_factory):
    from conftest import REPO, run_dir_of, run_stage
    runs = tmp_path_factory.mktemp("terms")
    reward = run_dir_of(run_stage("03_train_reward.py", "--config", "configs/tiny/03_train_reward.yaml",
                                  "--pairs_run", pairs_run, "--runs_dir", runs))
    recipe = runs / "04_train_grpo.yaml"
    recipe.write_text((REPO / "configs/tiny/04_train_grpo.yaml").read_text()
                      + 'reward_funcs: [judge, par, fluency, "tests.test_reward_terms:shorter"]\n'
                      + "reward_weights: [1.0, 0.5, 0.1, 0.5]\nbeta: 0.05\n"
                      + "fluency_model_name_or_path: .cache/models/tiny-llama3\n"
                      + 'checkpoint_eval_steps: 1\ncheckpoint_eval_premises: 3\ndev_judges: [judge, "tests.test_reward_terms:shorter"]\n'
                      + "checkpoint_repetition_penalty: 1.2\n")  # the checkpoints decoded as 05 would
    grpo = run_dir_of(run_stage("04_train_grpo.py", "--config", recipe, "--pairs_run", pairs_run,
                                "--reward_run", reward, "--runs_dir", runs))
    return grpo


@pytest.mark.stage
def test_a_reward_added_as_a_function_and_two_yaml_lines_drives_grpo(grpo_with_terms):
    run = grpo_with_terms
    metrics = json.loads((run / "metrics.json").read_text())
    manifest = json.loads((run / "manifest.json").read_text())
    assert (run / "DONE").is_file() and metrics["global_step"] == 2
    assert [manifest["reward_terms"][n]["spec"] for n in ("judge", "par", "fluency", "shorter")] == \
        ["judge", "par", "fluency", "tests.test_reward_terms:shorter"]
    for step in metrics["per_step"]:
        assert step["reward/shorter"] == pytest.approx(-step["reply_words_mean"] / 10, abs=1e-4)
        assert 0 < step["reward/par"] < 1 and isinstance(step["reward/judge"], float)
        assert step["reward/fluency"] <= 0
        assert step["reward_mean"] == pytest.approx(step["reward/judge"] + 0.5 * step["reward/par"] + 0.1 *
                                                    step["reward/fluency"] + 0.5 * step["reward/shorter"], abs=1e-3)
        assert step["distinct_2"] is not None and step["premise_overlap"] is not None
        assert 0 <= step["conceded_share"] <= 1  # the watch's share that concede, logged by TRL at weight 0
    assert any("kl" in h for h in metrics["log_history"])  # beta > 0: TRL's KL to the start, static rollouts
    # steps_per_generation at TRL's default: a generation batch a step, each step on the policy that sampled it
    assert metrics["rollouts"]["generation_batches"] == 2 and metrics["rollouts"]["steps_per_generation"] == 1
    assert metrics["rollouts"]["clip_ratio_region_max"] == 0
    rows = [json.loads(line) for line in (run / "reference_replies.jsonl").read_text().splitlines()]
    assert rows and manifest["reference_replies_sha256"] and "reference_replies.jsonl" in manifest["artifacts"]


def test_reference_replies_are_sampled_as_the_rollouts_are(tiny_model, tmp_path):
    """PAR's and the fluency gate's reference: the starting policy's reply sampled at the rollouts'
    temperature from the run's seed, not its greedy reply (greedy replies loop and read as more fluent than
    any sample: a gate measured against them shut every rollout out)."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.generation import generate_replies
    from common.reward_terms import reference_replies
    model, tokenizer = AutoModelForCausalLM.from_pretrained(tiny_model), AutoTokenizer.from_pretrained(tiny_model)
    prompts = [[{"role": "user", "content": "Tell me why the sky is blue."}], [{"role": "user", "content": "Why?"}]]
    config = SimpleNamespace(max_completion_length=12, rollout_batch_size=2, temperature=1.0, seed=3,
                             rollout_weights="nf4", fast_paths=False, rollout_backend="static")
    run = SimpleNamespace(dir=tmp_path, manifest={}, save_manifest=lambda: None)
    got = list(reference_replies(config, run, model, tokenizer, prompts).values())
    sampled = generate_replies(model, tokenizer, prompts, 12, 2, temperature=1.0, seed=3, static=False)
    greedy = generate_replies(model, tokenizer, prompts, 12, 2, temperature=0.0, static=False)
    assert got == sampled and got != greedy


def test_a_resumed_run_refuses_changed_reference_replies(tmp_path):
    from types import SimpleNamespace

    from common import provenance
    from common.reward_terms import REFERENCE_REPLIES, FluencyPenalty, reference_replies
    from common.runs import RunError
    prompts = [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]]
    path = tmp_path / REFERENCE_REPLIES
    path.write_text("".join(json.dumps({"prompt": p, "reply": r}) + "\n" for p, r in zip(prompts, ["x y", "z"])))
    run = SimpleNamespace(dir=tmp_path, manifest={"reference_replies_sha256": provenance.sha256_file(path)})
    assert reference_replies(None, run, None, None, prompts) == {json.dumps(prompts[0]): "x y", json.dumps(prompts[1]): "z"}
    with pytest.raises(RunError, match="other premises"):
        reference_replies(None, run, None, None, prompts[::-1])
    path.write_text(path.read_text().replace("x y", "x w"))
    with pytest.raises(RunError, match="changed since the run wrote it"):
        reference_replies(None, run, None, None, prompts)
    path.unlink()
    with pytest.raises(RunError, match="is gone"):
        reference_replies(None, run, None, None, prompts)
    # the fluency penalty: nothing above the reference's level, the shortfall below it, nothing for nan
    penalty = FluencyPenalty(FunctionScorer(lambda p, r, **_: [-1.0, -4.5, math.nan], "lp"), reference_lp=-2.0)
    assert penalty.score(prompts + prompts[:1], ["a", "b", "c"]) == [0.0, -2.5, 0.0]


def test_the_checkpoint_choice_follows_the_dev_judges_among_fluent_steps():
    def row(step, judge, fluency):
        return {"step": step, "win_rate_vs_start": judge, "fluency": fluency}
    curve = [row(0, 0.1, -3.0), row(10, 0.4, -3.2), row(20, 0.9, -4.0), row(30, 0.6, -3.4), row(40, 0.6, -3.1)]
    assert choose(curve, tolerance=0.5) == 30  # step 20 scores best but lost 1 nat of fluency; 30 ties 40: earlier
    assert choose(curve, tolerance=2.0) == 20
    assert choose(curve, tolerance=0.05) == 0  # nothing kept the start's fluency but the start
    assert choose([row(0, 0.5, -3.0), row(5, 0.2, -3.0)], tolerance=1.0) == 0  # the dev judges never improved
    assert choose([row(0, 0.5, -3.0), row(5, 0.9, math.nan)], tolerance=1.0) == 0  # unmeasured fluency never qualifies
    # the win rate against the start's replies: ties half, a premise either could not be scored on left out
    assert win_rate([0.2, 5.0, 1.0, math.nan], [0.1, 7.0, 1.0, 3.0]) == 0.5
    assert win_rate([0.003, 0.004], [0.002, 0.001]) == 1.0  # a judge of tiny spread counts as much as any
    assert math.isnan(win_rate([math.nan], [1.0]))


def test_the_checkpoint_choice_names_each_judge_s_family_as_the_verdict_does(tmp_path):
    """A feature judge has no neural model to read a model_type from: its family is "features", as in 05's
    verdict; a function has none."""
    from conftest import REPO

    from common.config import RewardStageConfig
    run = tmp_path / "Judge_features"
    run.mkdir()
    (run / "manifest.json").write_text(json.dumps({"stage": RewardStageConfig.STAGE}))
    recipe = (REPO / "configs/tiny/03_train_reward_features.yaml").read_text()
    (run / "config.yaml").write_text(recipe.replace("pairs_run: null", "pairs_run: runs/Pairs"))
    assert family(str(run)) == family(f"run:{run}") == "features"
    assert family("tests.test_reward_terms:shorter") is None and family(None) is None


@pytest.mark.stage
def test_grpo_keeps_the_step_the_dev_judges_chose(grpo_with_terms):
    from safetensors.torch import load_file
    run = grpo_with_terms
    choice = json.loads((run / "metrics.json").read_text())["checkpoint_choice"]
    assert [c["step"] for c in choice["curve"]] == [0, 1, 2] and (run / "checkpoints.png").is_file()
    assert choice["curve"][0]["win_rates_vs_start"] == {"judge": 0.5, "shorter": 0.5}  # the start against itself
    assert choice["chosen_step"] == choose(choice["curve"], choice["fluency_tolerance"])
    assert choice["dev_judge_families"] == ["llama", None] and choice["warning"] is None
    assert choice["training_judge_family"] == "llama"
    assert choice["decoding"] == {"repetition_penalty": 1.2, "temperature": 0.0, "no_repeat_ngram_size": 0, "seed": 42}
    for c in choice["curve"]:
        assert set(c["judges"]) == set(c["win_rates_vs_start"]) == {"judge", "shorter"} and c["fluency"] < 0
        assert c["win_rate_vs_start"] == sum(c["win_rates_vs_start"].values()) / 2
        assert 0 <= c["cut_share"] <= 1 and c["reply_words_mean"] > 0
    kept = load_file(run / "adapter" / "adapter_model.safetensors")
    chosen = load_file(run / "steps" / f"step-{choice['chosen_step']}" / "adapter_model.safetensors")
    assert kept.keys() == chosen.keys() and all((kept[k] == chosen[k]).all() for k in kept)


@pytest.mark.stage
def test_stage_05_names_the_step_a_grpo_run_kept(grpo_with_terms):
    """Stage 05's Models line says which step a dev choice kept; step 0 is the adapter the run started from, whose
    rows against SFT compare two decodes of one model."""
    from common.eval_outputs import kept_step, model_line
    run = grpo_with_terms
    metrics = json.loads((run / "metrics.json").read_text())
    chosen = metrics["checkpoint_choice"]["chosen_step"]
    assert kept_step(metrics) == {"step": chosen, "of": [0, 1, 2]}
    assert model_line("grpo", {"run": "G", "checkpoint_kept": kept_step(metrics)}).startswith(
        f"grpo = G (step {chosen} of 0, 1, 2 kept on dev")
    assert model_line("grpo", {"run": "G", "checkpoint_kept": {"step": 0, "of": [0, 4, 8]}}) == \
        "grpo = G (step 0 of 0, 4, 8 kept on dev: the adapter it started from)"
    assert model_line("dpo", {"run": "D"}) == "dpo = D"
    assert kept_step({"global_step": 2}) is None  # a run with no dev choice (DPO, SFT, GRPO without it)
