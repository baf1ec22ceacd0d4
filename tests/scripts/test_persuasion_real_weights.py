"""scripts/persuasion_real_weights.sh in its CPU mode (the tiny recipe): every stage runs, and the
comparison table (per model and judge, vs base and vs SFT, with intervals) is written."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, stand_in_interpreter, tiny_bert

pytestmark = pytest.mark.stage  # every test here runs stage scripts (tests/README.md)


def test_the_persuasion_script_runs_every_stage_and_writes_the_comparison(tiny_model, tmp_path):
    bert = tiny_bert(tmp_path)
    # One judge candidate of each family (the whole sweep has its own test: tests/stages/test_period_split.py),
    # each behind a topic gate, so that practice and the eval run against a gated judge whichever is chosen;
    # and two GRPO recipes, the plain one and the anchored, gated one.
    gate = "--topic_gate 4 --topic_gate_quantile 0.2"
    candidates = tmp_path / "candidates.txt"
    candidates.write_text(f"features+topic_gate_4 --config configs/tiny/03_train_reward_features.yaml {gate}\n"
                          f"minilm_pointwise+topic_gate_4 --config configs/tiny/03_train_reward_minilm_pointwise.yaml "
                          f"--judge_model_name_or_path {bert} {gate}\n"
                          f"smollm2_decoder_lr3e-4+topic_gate_4 --config configs/tiny/03_train_reward_smol.yaml "
                          f"--learning_rate 3e-4 {gate}\n")
    framings = tmp_path / "framings.txt"  # the framing chosen on dev first (step 0)
    framings.write_text("none\ndebate You reply to r/ChangeMyView posts: change the poster's view.\n")
    env = {**os.environ, "FRAMINGS": str(framings), "RECIPE": "configs/tiny", "PAIRS_CONFIG": "configs/smol/01_build_pairs.yaml", "MAX_PREMISES": "6",
           "RUNS_DIR": str(tmp_path), "SUMMARY_DIR": str(tmp_path / "summary"), "MINILM": str(bert),
           "PY": sys.executable, "BEST_OF_N": "2", "FLUENCY_MODEL": str(tiny_model), "BUILTIN": "0",
           "CANDIDATES_FILE": str(candidates), "ENSEMBLE_SIZES": "", "GRPO_ONLY": "lr1e-4 par_fluency_gate par_fluency_gate_beta0.05",
           "GRPO_BETAS": "0.05", "RAFT_GREEDY": "1"}
    with open(tmp_path / "chain.log", "w") as log:  # the chain's output to a file, as sbatch --output has it
        proc = subprocess.run(["bash", "scripts/persuasion_real_weights.sh"], cwd=REPO, env=env, stdout=log,
                              stderr=subprocess.STDOUT, text=True)
    text = (tmp_path / "chain.log").read_text()
    assert proc.returncode == 0, text[-4000:]
    # the log keeps every step's lines in order, a stage's echo overwriting none of the earlier ones
    steps = ["framing (chosen on dev)", "training judge (chosen on dev_later)", "run_dir: ", "finished in"]
    where = [text.find(step) for step in steps]
    assert -1 not in where and where == sorted(where), dict(zip(steps, where))
    summary = json.loads((tmp_path / "summary" / "persuasion_real_weights.json").read_text())
    framing = json.loads((tmp_path / "summary" / "persuasion_framing_sweep.json").read_text())
    assert set(framing["framings"]) == {"none", "debate"} and framing["split"] == "dev"
    chosen_pairs = framing["framings"][framing["chosen"]]["pairs_run"]
    assert f"framing (chosen on dev): {chosen_pairs}" in text
    models = list(summary["models"])
    assert models[:3] == ["base", "sft", "grpo"]
    assert {"grpo_from_base", "dpo", "orpo", "raft", "raft_greedy", "best_of_n"} <= set(models), models
    judges = summary["judges"]
    training = next(j for j in judges.values() if j["role"] == "training")
    held_out = [j for j in judges.values() if j["role"] == "held_out"]
    # the cross-fit and the dev judge in the training judge's recipe, a dev judge in each of two other families'
    assert len(held_out) == 4 and len(judges) == 5
    assert len({j["family"] for j in held_out}) == 3 and training["family"] in {j["family"] for j in held_out}
    crossfit = next(j for name, j in summary["judges"].items() if name.endswith("_crossfit"))
    assert len(crossfit["runs"]) == 2 and crossfit["n_pairs"] > 0
    for name, model in summary["models"].items():
        assert model["n"] == summary["n_premises"]
        assert {"looped_share", "premise_copy_share", "distinct_2"} <= set(model)
        for judge in summary["judges"]:
            scored = model["by_judge"][judge]
            low, high = scored["win_rate_vs_base_ci95"]
            assert low <= scored["win_rate_vs_base"] <= high and "lc_win_rate_vs_base_ci95" in scored
            assert ("win_rate_vs_sft" in scored) == (name not in ("base", "sft")), name
    assert set(summary["grpo_recipes"]) == {"lr1e-4", "par_fluency_gate", "par_fluency_gate_beta0.05"}
    # the KL anchor's sweep: the same recipe at beta 0.05, and the one chosen on dev by the checkpoints' dev scores
    swept = summary["grpo_recipes"]["par_fluency_gate_beta0.05"]
    assert "beta: 0.05" in (tmp_path / swept["run"] / "config.yaml").read_text().splitlines()
    on_dev = {n: c["on_dev"]["win_rate_vs_start"] for n, c in summary["grpo_recipes"].items() if c["on_dev"]}
    # with a fluency model every recipe keeps its dev-chosen step (the plain lr1e-4 too), so all are compared
    assert set(on_dev) == {"lr1e-4", "par_fluency_gate", "par_fluency_gate_beta0.05"}
    chosen = summary["grpo_chosen_on_dev"]
    assert on_dev[chosen] == max(on_dev.values())
    # the eval's row of that recipe, and its verdict line, named in the summary and printed
    row = summary["grpo_chosen_on_dev_model"]
    evaluated = json.loads((tmp_path / summary["eval_run"] / "eval.json").read_text())
    assert evaluated[row]["run"] == summary["grpo_recipes"][chosen]["run"]
    assert summary["grpo_chosen_on_dev_verdict"].startswith(f"**{row}** vs sft: ")
    assert f"GRPO recipe chosen on dev: {chosen} (the eval's {row}); its verdict on test: **{row}**" in text
    assert all(c["rewards"] for c in summary["grpo_recipes"].values())
    for recipe in summary["grpo_recipes"].values():  # practice against the gated judge, as its manifest says
        terms = json.loads((tmp_path / recipe["run"] / "manifest.json").read_text())["reward_terms"]
        assert terms.get("judge", terms.get("par", {})).get("topic_gate") is True, terms
    gated = json.loads((tmp_path / summary['grpo_recipes']['par_fluency_gate']['run'] / 'metrics.json').read_text())
    assert {"rewards/par/mean", "rewards/fluency_gate/mean"} <= set(gated["log_history"][0]), gated["log_history"][0]
    assert gated["checkpoint_choice"]["chosen_step"] in [c["step"] for c in gated["checkpoint_choice"]["curve"]]
    per_model = [line for line in summary["verdict"] if line.startswith("**") and line[2:].split("**")[0] in models]
    assert len(per_model) == len(models) - 1  # every model but the base; then the family and fluency lines
    for line in per_model:  # each in the chain's log too, without the judges' figures
        assert f"verdict: {line.split('. Held-out judges: ')[0].replace('**', '')}\n" in text
    assert any(line.startswith("Fluency: each reply's mean token log-probability") for line in summary["verdict"])
    sweep = json.loads((tmp_path / "summary" / "persuasion_decoding_sweep.json").read_text())
    assert sweep["split"] == "dev" and sweep["chosen"] in sweep["decodings"] and len(sweep["decodings"]) == 5
    chosen = sweep["decodings"][sweep["chosen"]]
    assert summary["decoding"]["temperature"] == chosen["temperature"]
    judges = json.loads((tmp_path / "summary" / "judges_later_posts.json").read_text())
    assert sum(bool(j.get("default")) for j in judges["judges"].values()) == 1
    assert {"bag_of_words", "length_only"} == set(judges["baselines"])
    for row in judges["judges"].values():
        for split in ("dev_later", "test"):
            assert 0 <= row[split]["accuracy_ci95"][0] <= row[split]["accuracy"] <= row[split]["accuracy_ci95"][1]
    report = text.strip().splitlines()[-1].split(" ", 1)[1]
    assert "## Verdict" in open(report).read()



FAKE_PY = r'''# A stand-in interpreter: every stage "finishes" with a run directory, except those FAIL names (a crash)
# and those GUARD names (stopped by the length guard), those SLOW names taking 4 s; the helper scripts print
# what the chain reads.
script=$1; shift
echo "$script $*" >> "${CALLS:-/dev/null}"
command=${1:-}  # a helper script's subcommand, before the loop below takes the arguments
runs=$RUNS_DIR; name=""
while (( $# )); do case $1 in --runs_dir) runs=$2; shift 2 ;; --run_name) name=$2; shift 2 ;; *) shift ;; esac; done
case $script in
  scripts/judges_later_posts.py) case $command in best) echo "best: j $runs/Judge" ;; best2) printf '%s\n' a b ;; esac; exit 0 ;;
  scripts/persuasion_real_weights.py) case $command in decoding) echo "--temperature 0" ;; rising) ls -d "$runs"/GRPO_* ;;
    framing) echo "$runs/Pairs_framing_debate" ;; esac; exit 0 ;;
  scripts/*) exit 0 ;;
esac
name=${name:-$(basename "$script" .py)_$RANDOM$RANDOM}
if [[ " $FAIL " == *" $script "* || " $FAIL " == *" $name "* ]]; then echo "Traceback: boom" >&2; exit 1; fi
if [[ " $GUARD " == *" $name "* ]]; then mkdir -p "$runs/$name"; echo "12:00:00 run directory $runs/$name" >&2
  echo "error: reward-hacking guard: mean reply length" >&2; exit 1; fi
if [[ " $SLOW " == *" $name "* ]]; then sleep 4; fi
mkdir -p "$runs/$name" && echo "run_dir: $runs/$name"
'''


def _chain(tmp_path, **env):
    fake = stand_in_interpreter(tmp_path, FAKE_PY)
    proc = subprocess.run(["bash", "scripts/persuasion_real_weights.sh"], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PY": fake, "RUNS_DIR": str(tmp_path / "runs"), "FAIL": "",
                               "GUARD": "", "SLOW": "", **env}, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


GRPO = ["GRPO_lr2e-5", "GRPO_lr1e-4", "GRPO_lr1e-4_beta0.04_temperature0.8", "GRPO_lr3e-4_unscaled"]


@pytest.mark.parametrize("fail, guard, ok", [
    (" ".join(GRPO), "", False), ("04_train_grpo.py", "", False), ("04_train_dpo.py", "", False),
    (GRPO[0], "", False), ("", " ".join(GRPO[:3]), True), ("", " ".join(GRPO), True), ("", "", True)])
def test_the_chain_fails_when_a_stage_fails_and_names_it(tmp_path, fail, guard, ok):
    code, out = _chain(tmp_path, FAIL=fail, GUARD=guard, CALLS=str(tmp_path / "calls"))
    assert (code == 0) == ok, out[-3000:]
    assert ("finished in" in out) == ok, out[-3000:]
    for name in guard.split():
        assert f"stage grpo_{name[5:]} was stopped by its length guard" in out
    if guard:  # the summary draws the stopped recipes' curves too
        summary = next(line for line in (tmp_path / "calls").read_text().splitlines() if line.startswith("scripts/persuasion_real_weights.py summary "))
        assert all(f"{name[5:]}={tmp_path / 'runs' / name}" in summary.split() for name in guard.split()), summary
    if guard == " ".join(GRPO):  # every GRPO recipe stopped: the eval still compares DPO, ORPO and RAFT to SFT
        assert "no GRPO recipe finished" in out and "the eval compares the other practice" in out, out[-3000:]
        evaluated = next(line for line in (tmp_path / "calls").read_text().splitlines()
                         if line.startswith("05_eval.py") and "--policy_runs" in line and "--split train" not in line)
        assert all(f"{tmp_path / 'runs' / run} " in evaluated + " " for run in ("DPO", "ORPO", "RAFT")), evaluated
        policies = evaluated.split("--policy_runs")[1].split("--best_of_n")[0].split()
        assert not any(Path(run).name in GRPO for run in policies), policies
    if not ok:
        assert "error: " in out and ("failed" in out or "no GRPO recipe finished" in out), out[-3000:]
        failed = [g for g in GRPO if g in fail or fail == "04_train_grpo.py"]
        for name in failed:
            assert f"stage grpo_{name[5:]} failed" in out, out[-3000:]


def test_raft_trains_once_its_targets_are_written_not_once_all_practice_has(tmp_path):
    code, out = _chain(tmp_path, SLOW=" ".join(GRPO), CALLS=str(tmp_path / "calls"))
    assert code == 0, out[-3000:]
    raft = [line for line in (tmp_path / "calls").read_text().splitlines() if "--run_name RAFT " in line + " "]
    assert len(raft) == 1 and f"--targets_from {tmp_path / 'runs' / 'RAFT_Targets'} " in raft[0], raft
    ends = {row[0]: int(row[2]) for row in (line.split("\t") for line in
            (tmp_path / "runs" / "logs" / "timeline.tsv").read_text().splitlines())}
    assert ends["raft_targets"] <= ends["raft"] < min(ends[f"grpo_{g[5:]}"] for g in GRPO), ends
    assert (tmp_path / "runs" / "logs" / "raft.log").read_text().startswith("run_dir: ")
    assert not any("--best_of_n_with_greedy" in line or "--targets_without_greedy" in line
                   for line in (tmp_path / "calls").read_text().splitlines())
    # RAFT_GREEDY=1: a second RAFT whose candidates include SFT's greedy reply, evaluated beside the first; one
    # generation for both, the plain one picking among its samples alone
    code, out = _chain(tmp_path, RAFT_GREEDY="1", CALLS=str(tmp_path / "calls_greedy"))
    assert code == 0, out[-3000:]
    calls = (tmp_path / "calls_greedy").read_text().splitlines()
    targets = [line for line in calls if "--best_of_n" in line and "--split train" in line]
    assert len(targets) == 1 and "--best_of_n_with_greedy true" in targets[0], calls
    source = f"--targets_from {tmp_path / 'runs' / 'RAFT_Targets'} "
    plain, greedy = ([line for line in calls if f"--run_name {name} " in line + " "] for name in ("RAFT", "RAFT_Greedy"))
    assert len(plain) == len(greedy) == 1 and source in plain[0] and source in greedy[0], calls
    assert "--targets_without_greedy true" in plain[0] and "--targets_without_greedy" not in greedy[0]
    assert all(" --sft_run " in line for line in plain + greedy), calls  # from SFT's adapter, which sampled them
    assert len({line.split(" --sft_run ")[1].split()[0] for line in plain + greedy + targets}) == 1, calls
    evaluated = next(line for line in calls if "--policy_runs" in line and "--split train" not in line)
    assert f"{tmp_path / 'runs' / 'RAFT'} " in evaluated and f"{tmp_path / 'runs' / 'RAFT_Greedy'}" in evaluated
    assert "--best_of_n_with_greedy true" in evaluated  # the eval's best_of_n has SFT's greedy reply among its candidates
    # targets that failed: RAFT does not train, and says why; the chain names both
    code, out = _chain(tmp_path, FAIL="RAFT_Targets")
    assert code == 1 and "stage raft_targets failed" in out and "stage raft failed" in out, out[-3000:]
    assert "error: stage raft_targets, whose run this stage reads, did not finish" in out


def test_the_judges_second_round_trains_on_the_practised_policys_replies(tmp_path):
    """HARD_NEGATIVES=1: the rising GRPO policy answers train premises, the training judge's recipe trains
    again on those replies as losers (a feature judge too), and an ensemble (which trains nothing) skips the step."""
    code, out = _chain(tmp_path, HARD_NEGATIVES="1")
    assert code == 0, out[-3000:]
    runs = tmp_path / "runs"
    assert (runs / "HardNegative_Replies").is_dir() and (runs / "Judge_j+hard_negatives").is_dir(), out[-3000:]
    # the timeline (one line a finished stage, in the order they finished): the eval does not wait for the
    # second round, which trains only once the eval is written
    timeline = [line.split("\t") for line in (runs / "logs" / "timeline.tsv").read_text().splitlines()]
    names = [row[0] for row in timeline]
    assert {"sft", "dpo", "orpo", "raft", "hard_replies", "05_eval.py", "hard_negatives"} <= set(names), names
    assert names.index("05_eval.py") < names.index("hard_negatives") and names[-1] == "hard_negatives"
    assert all(int(start) <= int(end) and status == "0" for _, start, end, status in timeline)
    shutil.rmtree(runs)
    (runs / "Judge").mkdir(parents=True)
    (runs / "Judge" / "config.yaml").write_text("judge_backbone: ensemble\n")
    code, out = _chain(tmp_path, HARD_NEGATIVES="1")
    assert code == 0 and "hard negatives: the training judge (j, ensemble) trains on no extra pairs" in out
    assert not (runs / "HardNegative_Replies").exists()


def test_the_framing_is_chosen_on_dev_before_anything_trains(tmp_path):
    """FRAMINGS: a pairs run, a feature judge and the base's dev replies for each framing; the chosen framing's
    pairs run is the one every later stage reads, and no other pairs run is built."""
    framings = tmp_path / "framings.txt"
    framings.write_text("# name, then the system prompt\nnone\ndebate You reply to r/ChangeMyView posts.\n")
    calls = tmp_path / "calls.txt"
    code, out = _chain(tmp_path, FRAMINGS=str(framings), CALLS=str(calls))
    assert code == 0, out[-3000:]
    runs = tmp_path / "runs"
    chosen = runs / "Pairs_framing_debate"
    assert f"framing (chosen on dev): {chosen}" in out
    lines = calls.read_text().splitlines()
    # the framings' pairs runs start at once: the calls file has them in either order
    pairs = {line.split("--run_name ")[1].split()[0]: line for line in lines if line.startswith("01_build_pairs.py")}
    assert sorted(pairs) == ["Pairs_framing_debate", "Pairs_framing_none"]
    assert "--system_prompt You reply to r/ChangeMyView posts." in pairs["Pairs_framing_debate"]
    assert "--system_prompt" not in pairs["Pairs_framing_none"]
    evals = [line for line in lines if line.startswith("05_eval.py") and "--run_name Framing_" in line]
    assert len(evals) == 2 and all("--split dev" in line for line in evals)
    sft = next(line for line in lines if line.startswith("02_train_sft.py") and "--run_name SFT" in line)
    assert f"--pairs_run {chosen}" in sft
    # every framing run failing: the recipe's own pairs, and the chain says it failed
    (tmp_path / "failing").mkdir()
    code, out = _chain(tmp_path / "failing", FRAMINGS=str(framings), FAIL="Pairs_framing_none Pairs_framing_debate")
    assert "framing: no framing run finished" in out and code == 1, out[-3000:]



def test_the_framing_rule_takes_the_least_refused_then_the_best_scored(tmp_path):
    """scripts/persuasion_real_weights.py framing: refusal first (within 0.02 of the lowest), the judge's reward
    among those; the sweep's table is written beside the summary."""
    sys.path.insert(0, str(REPO / "scripts"))
    import persuasion_real_weights as prw

    def eval_run(name, refusal, reward):
        run = tmp_path / name
        run.mkdir()
        base = {"refusal_share": refusal, "reward_mean": reward, "reply_words_mean": 120.0, "looped_share": 0.0,
                "premise_copy_share": 0.0}
        (run / "eval.json").write_text(json.dumps({"base": base}))
        (run / "manifest.json").write_text(json.dumps({"pairs_run": f"runs/Pairs_{name}"}))
        return f"{name}={run}"

    runs = [eval_run("none", 0.10, 2.0), eval_run("debate", 0.01, 0.5), eval_run("terse", 0.02, 0.9)]
    assert prw.framing(tmp_path, runs) == "runs/Pairs_terse"  # 0.02 is within 0.02 of 0.01, and scored higher
    sweep = json.loads((tmp_path / "persuasion_framing_sweep.json").read_text())
    assert sweep["chosen"] == "terse" and set(sweep["framings"]) == {"none", "debate", "terse"}
    assert prw.framing(tmp_path, runs[:2]) == "runs/Pairs_debate"  # the most refused loses whatever its score


def test_the_recipe_chosen_on_dev_needs_recipes_scored_alike():
    sys.path.insert(0, str(REPO / "scripts"))
    from persuasion_real_weights import best_on_dev
    def curve(mean, judges=("run:J",), premises=32):
        return {"on_dev": {"dev_judges": list(judges), "premises": premises, "win_rate_vs_start": mean}}
    assert best_on_dev({"a": curve(0.1), "b": curve(0.3), "c": {"on_dev": None}}) == "b"
    assert best_on_dev({"a": curve(0.1), "b": curve(0.3, premises=16)}) is None  # not the same dev premises
    assert best_on_dev({"a": curve(0.1), "b": curve(0.3, judges=("run:K",))}) is None
    assert best_on_dev({"c": {"on_dev": None}}) is None


@pytest.mark.parametrize("env, named", [({"GRPO_BETAS": "0.01,0.1"}, "'0.01,0.1' is not a KL weight"),
                                        ({"GATE_BETA": "-0.04"}, "'-0.04' is not a KL weight"),
                                        ({"CHECKPOINT_EVAL_STEPS": "0"}, "'0' is not a whole number of steps"),
                                        ({"GRPO_SPG": "4 x"}, "'x' is not a whole number of steps"),
                                        ({"DECODING": "--temperature 0 --generation_weights bf16"},
                                         "'--generation_weights' is none of --temperature")])
def test_a_practice_knob_that_is_not_a_number_stops_the_chain_before_anything_trains(tmp_path, env, named):
    code, out = _chain(tmp_path, FLUENCY_MODEL="lm", CALLS=str(tmp_path / "calls"), **env)
    assert code == 1 and named in out, out[-2000:]
    assert not (tmp_path / "calls").exists()  # no stage ran


def test_kl_weights_are_taken_as_python_reads_a_float(tmp_path):
    code, out = _chain(tmp_path, FLUENCY_MODEL="lm", GATE_BETA="4e-2", GRPO_BETAS="0 .01 1.", GRPO_ONLY="par_fluency_gate",
                       CALLS=str(tmp_path / "calls"))
    assert code == 0 and " --beta 4e-2 " in (tmp_path / "calls").read_text(), out[-2000:]


def test_a_grpo_recipe_that_is_not_one_stops_the_chain_before_anything_trains(tmp_path):
    code, out = _chain(tmp_path, GRPO_ONLY="lr1e-4 par_fluency_gate_beta0.05", CALLS=str(tmp_path / "calls"))
    assert code == 1 and "error: GRPO_ONLY names par_fluency_gate_beta0.05, not a GRPO recipe here" in out, out[-2000:]
    assert not (tmp_path / "calls").exists()  # no stage ran
    code, out = _chain(tmp_path, GRPO_ONLY="par_fluency_gate_beta0.05", GRPO_BETAS="0.05", FLUENCY_MODEL="lm",
                       CALLS=str(tmp_path / "calls"))
    assert code == 0, out[-2000:]
    grpo = [line for line in (tmp_path / "calls").read_text().splitlines()
            if line.startswith("04_train_grpo.py") and "--run_name GRPO_par" in line]
    assert len(grpo) == 1 and "--beta 0.05" in grpo[0] and "--reward_funcs par fluency" in grpo[0], grpo
    assert grpo[0].count("--beta") == 1, grpo  # the sweep's value replaces the recipe's own, not added to it
    # the same recipe at one of TRL's steps_per_generation values: one more GRPO run, the gated recipe's arguments
    (tmp_path / "calls").unlink()
    code, out = _chain(tmp_path, GRPO_ONLY="par_fluency_gate par_fluency_gate_spg4", GRPO_SPG="4", FLUENCY_MODEL="lm",
                       CALLS=str(tmp_path / "calls"))
    assert code == 0, out[-2000:]
    grpo = sorted(line for line in (tmp_path / "calls").read_text().splitlines()
                  if line.startswith("04_train_grpo.py") and "--run_name GRPO_par" in line)
    assert len(grpo) == 2 and "--steps_per_generation 4" in grpo[1] and "--steps_per_generation" not in grpo[0], grpo
    assert " --beta 0.04 " in grpo[0], grpo  # the KL anchor chosen on dev, GATE_BETA's default
    assert " --checkpoint_temperature 0 " in grpo[0] + " ", grpo  # the checkpoints decoded as the eval decodes
    assert grpo[1].replace(" --steps_per_generation 4", "").replace("_spg4", "") == grpo[0], grpo


def test_preference_0_skips_dpo_and_orpo_and_the_eval_compares_the_rest(tmp_path):
    code, out = _chain(tmp_path, PREFERENCE="0", CALLS=str(tmp_path / "calls"))
    assert code == 0, out[-3000:]
    calls = (tmp_path / "calls").read_text().splitlines()
    assert not any(line.startswith("04_train_dpo.py") for line in calls), calls
    evaluated = next(line for line in calls if line.startswith("05_eval.py") and "--policy_runs" in line
                     and "--split train" not in line)
    policies = [Path(run).name for run in evaluated.split("--policy_runs")[1].split("--best_of_n")[0].split()]
    assert "RAFT" in policies and not {"DPO", "ORPO"} & set(policies), policies
