"""A rating for every review, on the tiny model: the read-out (common/readout.py) against the
model's own logits, parsed ratings kept, every window read; the decoding fields (bf16 generation
weights give the same greedy tokens as the 4-bit ones; n-gram blocking, static decoder = HF generate);
and scripts/review_real_weights.sh end to end in its CPU mode."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO, random_lora, run_dir_of, run_stage

from common.config import ConfigError, EvalConfig
from common.data import load_split, token_ids
from common.tasks import review, review_text

TINY = "configs/tiny/review"


@pytest.fixture(scope="module")
def nf4_tiny(tiny_model):
    """The tiny Llama as the pipeline loads it (NF4 base, rsLoRA), its LoRA B not zero."""
    from common.config import ModelArgs
    from common.model import CAUSAL_LM, load_model, load_tokenizer
    args = ModelArgs(model_name_or_path=str(tiny_model))
    tok = load_tokenizer(args)
    model = load_model(args, CAUSAL_LM, tokenizer=tok).eval()
    random_lora(model, 0)
    return model, tok


@pytest.fixture(scope="module")
def pairs(tiny_model, tmp_path_factory):
    runs = tmp_path_factory.mktemp("review_pairs")
    return run_dir_of(run_stage("01_build_pairs.py", "--config", f"{TINY}/01_build_pairs.yaml", "--runs_dir", runs))


def _by_hand(model, tok, prompt, turn) -> float:
    """The expected rating by hand: each value's probability is the model's probability of the whole
    assistant turn ending in it (`turn + " v"`, every token's log-probability from the full logits of
    the unpadded sequence), renormalised over the six values."""
    from common.model import unwrap_peft
    head = token_ids(tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True))
    logp = []
    for v in range(1, 7):
        ids = head + tok(f"{turn} {v}", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = unwrap_peft(model)(input_ids=torch.tensor([ids], device=model.device)).logits[0].float().cpu()
        steps = torch.log_softmax(logits[len(head) - 1:-1], -1)
        logp.append(float(steps.gather(1, torch.tensor(ids[len(head):])[:, None]).sum()))
    p = torch.softmax(torch.tensor(logp, dtype=torch.float64), 0)
    return float((p * torch.arange(1, 7)).sum())


@pytest.mark.stage
def test_read_out_equals_the_expected_value_from_the_logits(nf4_tiny, pairs):
    from common.readout import read_scale
    model, tok = nf4_tiny
    rows = load_split(pairs, "test")[:3]
    prompts = [review_text.prompt_for(r["paper"][:300 * (i + 1)]) for i, r in enumerate(rows)]  # unequal lengths
    replies = ["### Key Points\nA method.", "Strengths: clear. Weaknesses: none. The paper lacks the paper lacks",
               "### Key Points\nGood.\n### Rating\nOverall Quality: seven"]
    turns = [review.readout_turn(r) for r in replies]
    reads = read_scale(model, tok, prompts, turns, (1, 6), max_tokens_per_batch=600)  # several padded batches
    assert len(reads) == 3
    for read, prompt, turn in zip(reads, prompts, turns):
        assert read["expected"] == pytest.approx(_by_hand(model, tok, prompt, turn), abs=2e-3)
        assert 1 <= read["expected"] <= 6 and read["most_likely"] == 1 + max(range(6), key=read["probs"].__getitem__)
        assert 0 < read["scale_mass"] <= 1 and sum(read["probs"]) == pytest.approx(1, abs=1e-4)


def test_the_read_out_follows_the_review_cut_before_its_rating_section():
    assert review.readout_turn("### Key Points\nX.\n### Rating\nOverall Quality: 9") == \
        "### Key Points\nX.\n" + review.RATING_HEADER
    assert review.readout_turn("loops loops") == "loops loops\n" + review.RATING_HEADER
    assert review.readout_turn("text. Overall quality: n/a").endswith("text.\n" + review.RATING_HEADER)


@pytest.mark.stage
def test_parsed_ratings_are_never_replaced_and_every_paper_gets_one(pairs):
    papers = load_split(pairs, "test")[:4]
    replies = {"sft": ["### Rating\nOverall Quality: 5\nReview Confidence: 3", "it loops it loops",
                       "Overall Quality: 9", "### Rating\nOverall Quality: 2"]}
    reads = [{"first_window": {"expected": 3.25, "most_likely": 3}} for _ in papers]
    out = review.evaluate(papers, replies, train=load_split(pairs, "train"), readouts={"sft": reads}, rating=None,
                          seed=1)
    per = out.per_reply["sft"]
    assert [p["rating"] for p in per] == [5.0, 3.25, 3.25, 2.0]  # 9 is off the scale: read out
    assert [p["rating_source"] for p in per] == ["parsed", "readout", "readout", "parsed"]
    r = out.metrics["sft"]
    assert r["format_compliance"] == 0.5 and r["n_rated"] == 2 and r["all_papers"]["n"] == 4
    assert r["all_papers"]["n_readout"] == 2 and r["all_papers"]["reading"] == "first_window"
    gold = [sum(p["human_ratings"]) / len(p["human_ratings"]) for p in papers]
    assert r["all_papers"]["rating_mae"] == pytest.approx(sum(abs(a - b) for a, b in zip([5, 3.25, 3.25, 2], gold)) / 4)
    low, high = r["all_papers"]["rating_mae_ci"]
    assert low <= r["all_papers"]["rating_mae"] <= high


@pytest.mark.stage
def test_reading_all_windows_reads_every_window(nf4_tiny, pairs):
    from common.readout import rating_readouts
    model, tok = nf4_tiny
    row = load_split(pairs, "test")[0]
    windows = review.reading_windows(row, tok, 512, 64)
    ids = tok(row["paper"], add_special_tokens=False)["input_ids"]
    assert len(windows) >= len(ids) // 512 > 1
    texts = [w[0]["content"][len(review_text.INSTRUCTION):] for w in windows]
    assert row["paper"].startswith(texts[0][:100]) and row["paper"].rstrip().endswith(texts[-1].rstrip()[-100:])
    for before, after in zip(texts, texts[1:]):  # neighbours share text: no token is skipped
        assert after.lstrip("\ufffd")[:30] in before
    for w in windows:
        assert len(token_ids(tok.apply_chat_template(w, add_generation_prompt=True, tokenize=True))) <= 512
    (read,) = rating_readouts(model, tok, review, [windows[0]], ["### Key Points\nA method."], [windows])
    every = read["all_windows"]
    assert every["n_windows"] == len(windows) == len(every["per_window"])
    assert every["expected"] == pytest.approx(sum(every["per_window"]) / len(windows))
    # the same read in another batch (bf16 compute: a GPU's kernels round batch by batch)
    assert every["per_window"][0] == pytest.approx(read["first_window"]["expected"], abs=2e-3)


@pytest.mark.stage
def test_bf16_generation_weights_give_the_same_greedy_tokens(nf4_tiny, pairs):
    """The dequantise-once path (bf16 copies of the 4-bit base) against dequantising every token."""
    from common.generation import generate_replies
    model, tok = nf4_tiny
    prompts = [review_text.prompt_for(r["paper"][:200 * (i + 1)]) for i, r in enumerate(load_split(pairs, "test")[:3])]
    every_token = generate_replies(model, tok, prompts, 24, 3, weights="nf4")
    once = generate_replies(model, tok, prompts, 24, 3, weights="bf16")
    assert once == every_token and any(once)
    assert "_dense_base" not in model.__dict__  # freed after generating


def test_no_repeat_ngram_static_decoder_equals_hf_generate_and_repeats_nothing(tiny_model):
    """In fp32, where the two decoders' logits agree to float precision (bf16 can flip near-ties)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList

    from common.fast.static_decoder import decode
    from common.model import eos_ids
    from common.ngram_block import ReplyNgramBlock
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model)
    prompts = [[0, 3, 442, 271, 4] + [10 + (i % 3)] * n for i, n in enumerate((4, 9, 4))]
    eos = eos_ids(model, tok)
    plain = decode(model, prompts, 30, eos, tok.pad_token_id, temperature=0.0)
    blocked = decode(model, prompts, 30, eos, tok.pad_token_id, temperature=0.0, no_repeat_ngram_size=2)
    width = max(map(len, prompts))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False, eos_token_id=eos,
                         pad_token_id=tok.pad_token_id, logits_processor=LogitsProcessorList([ReplyNgramBlock(2, width)]))
    for mine, theirs in zip(blocked, ref[:, width:].tolist()):
        assert mine == theirs[:len(mine)]
    for reply in blocked:
        grams = list(zip(reply, reply[1:]))
        assert len(grams) == len(set(grams))
    assert any(len(set(zip(r, r[1:]))) < len(r) - 1 for r in plain)  # the tiny model repeats without the block


def test_decoding_fields_are_checked():
    with pytest.raises(ConfigError, match="no_repeat_ngram_size"):
        EvalConfig(pairs_run="x", no_repeat_ngram_size=1)
    with pytest.raises(ConfigError, match="evaluate_base"):
        EvalConfig(pairs_run="x", evaluate_base=False, reward_run="y")
    with pytest.raises(ConfigError, match="window_overlap"):
        EvalConfig(pairs_run="x", reading="all_windows", max_prompt_tokens=256, window_overlap=256)


@pytest.mark.stage
def test_the_real_weights_script_runs_every_stage_on_the_cpu(tiny_model, tmp_path):
    """scripts/review_real_weights.sh with the tiny recipe: the rating model trained beside SFT, the dev
    sweep, the pick, both DPOs and ORPO, the test eval of five models and the reranked reviews with a rating
    for every paper, every rating source, and the summary."""
    env = {**os.environ, "RECIPE": TINY, "RUNS_DIR": str(tmp_path), "SUMMARY_DIR": str(tmp_path / "summary"),
           "DECODINGS": "--repetition_penalty 1.0 --no_repeat_ngram_size 0 --temperature 0\n"
                        "--repetition_penalty 1.0 --no_repeat_ngram_size 3 --temperature 0",
           "EVAL_FLAGS": "--max_premises 4",  # the blend's four weights need four dev papers
           "PY": sys.executable,  # scripts/demo_lib.sh's default is .venv's
           "RATING_CONFIGS": f"{TINY}/03_train_rating.yaml", "RERANK_N": "2",
           "MAX_JOBS": "4"}  # on a GPU the default comes from its free memory: fewer at once beside other work
    proc = subprocess.run(["bash", "scripts/review_real_weights.sh"], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # the rating model started before SFT ended: it needs only the pairs run
    timeline = {line.split("\t")[0]: line.split("\t")[1:] for line in (tmp_path / "logs" / "timeline.tsv").read_text().splitlines()}
    assert int(timeline["rating_0"][0]) <= int(timeline["02_train_sft.py"][1]) and timeline["rating_0"][2] == "0"
    # where the pick reads all windows, as the sweep did, the sweep's run is the blend's dev eval: none runs again
    picked_all_windows = "--reading all_windows" in proc.stderr.split("picked on the dev papers:")[1].splitlines()[0]
    assert ("dev_eval" in timeline) != picked_all_windows, sorted(timeline)
    # DPO, ORPO and the blend's dev eval read only SFT's run: they ran at once
    after_sft = [timeline[name] for name in ("dpo_base", "dpo_sft", "orpo", "dev_eval") if name in timeline]
    assert max(int(t[0]) for t in after_sft) < min(int(t[1]) for t in after_sft), after_sft
    assert all(t[2] == "0" for t in after_sft)
    summary = json.loads((tmp_path / "summary" / "review_real_weights.json").read_text())
    assert set(summary["models"]) == {"base", "sft", "dpo (base-rejected)", "dpo (sft-rejected)", "orpo (sft-rejected)",
                                      "rerank_by_rating"}
    assert {"rating_model", "bag_of_words", "sft_blend"} <= set(summary["rating_sources"])
    for name, m in summary["models"].items():
        assert m["all_papers"]["n"] == m["n"] == 4, name  # a rating for every paper
    assert len(summary["dev_sweep"]) == 2 and {r["no_repeat_ngram_size"] for r in summary["dev_sweep"]} == {0, 3}
    assert [r["rejected_from"] for r in summary["preference_runs"]] == ["base", "sft", "sft"]
    assert all(r["steps"] and "loss" in r["steps"][0] for r in summary["preference_runs"])
    assert (tmp_path / "summary" / "review_preference_curves.png").stat().st_size > 0
    report = proc.stdout.strip().splitlines()[-1]
    assert report.startswith("report: ") and "## Ratings" in open(report.split(" ", 1)[1]).read()

