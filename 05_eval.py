"""Stage 05: score held-out premises with the base model and each adapter given.

    python 05_eval.py --config configs/smol/05_eval.yaml --pairs_run runs/Nov30_Pairs_Run1 \
        --reward_run runs/Nov30_Reward_Run1 --sft_run runs/Nov30_SFT_Run1 --policy_run runs/Nov30_GRPO_Run1

For each premise of the test split (one per original post), every model writes a greedy reply.
Replies are compared with the winning reply (BLEU, ROUGE-L), scored by the stage-03 judge, and each
adapter's win rate against the base (judge prefers its reply) comes with a 95% bootstrap interval,
and so does its length-controlled win rate (the judge's length effect regressed out, as in AlpacaEval).
Writes eval.json, replies.jsonl, reply-length and reward histograms (PNG, also to W&B) and a
readable report.md with the plots, the judge's audit verdict and sample replies side by side.
"""
from __future__ import annotations

import logging
from pathlib import Path

from transformers import set_seed

from common.cli import cli
from common.config import EvalConfig
from common.data import fit_prompt, load_split, n_words, one_per_group, read_json, write_json, write_jsonl
from common.generation import generate_replies
from common.metrics import bleu, length_controlled_win_rate, rouge, win_rate
from common.model import CAUSAL_LM, fingerprint, load_model, load_tokenizer
from common.report import log_plots_to_wandb, plot_distributions, write_report
from common.rewards import RewardScorer
from common.runs import Run

log = logging.getLogger("pipeline")


def main(config: EvalConfig, overrides: dict) -> None:
    # 1. Seed, run directory, inputs (all finished, all on this base, all descended from --pairs_run:
    #    the held-out premises below were never trained on).
    set_seed(config.seed)
    optional = {key: getattr(config, key) for key in ("sft_run", "policy_run") if getattr(config, key)}
    run = Run("Eval", config, overrides, inputs={"pairs_run": config.pairs_run, "reward_run": config.reward_run,
                                                 **optional}, base=fingerprint(config))
    # model name in the report -> adapter folder
    adapters = {name: Path(getattr(config, key)) / "adapter"
                for key, name in (("sft_run", "sft"), ("policy_run", "grpo")) if key in optional}
    run.start_tracking()

    # 2. Held-out premises: one per original post, its (first) winning reply as the reference.
    tokenizer = load_tokenizer(config)
    premises = one_per_group(load_split(config.pairs_run, config.split))[: config.max_premises]
    prompts = [fit_prompt(tokenizer, r["prompt"], config.max_prompt_tokens) for r in premises]
    references = [r["chosen"] for r in premises]
    log.info("evaluating %s on %d premises", ["base", *adapters], len(premises))

    # 3. Generate: the base with adapters disabled, then each adapter on the same 4-bit base.
    replies = {}
    names = list(adapters)
    model = load_model(config, CAUSAL_LM, adapter=adapters[names[0]], trainable=False,
                       adapter_name=names[0]) if names else load_model(config, CAUSAL_LM, trainable=False)
    for name in names[1:]:
        model.load_adapter(str(adapters[name]), adapter_name=name, is_trainable=False, autocast_adapter_dtype=False)
    gen = dict(max_new_tokens=config.max_new_tokens, batch_size=config.batch_size,
               repetition_penalty=config.repetition_penalty)
    with model.disable_adapter():
        replies["base"] = generate_replies(model, tokenizer, prompts, **gen)
    for name in names:
        model.set_adapter(name)
        replies[name] = generate_replies(model, tokenizer, prompts, **gen)
    del model

    # 4. Judge every reply; overlap with the winning reply; win rates against the base.
    #    The judge is the reward run's own; the length-controlled win rate regresses its length
    #    effect out of the preference.
    judge = RewardScorer.from_run(config.reward_run, batch_size=config.batch_size)
    run.manifest["judge"] = run.inputs["reward_run"].get("judge")
    run.save_manifest()
    rewards = {name: judge.score(prompts, texts) for name, texts in replies.items()}
    words = {name: [n_words(t) for t in texts] for name, texts in replies.items()}
    results = {}
    for name, texts in replies.items():
        results[name] = {"n": len(texts), "bleu": bleu(texts, references), **rouge(texts, references),
                         "reward_mean": sum(rewards[name]) / len(texts),
                         "reply_words_mean": sum(words[name]) / len(texts),
                         **win_rate(rewards[name], rewards["base"], seed=config.seed),
                         **length_controlled_win_rate(rewards[name], rewards["base"], words[name],
                                                      words["base"], seed=config.seed)}
        log.info("%s: %s", name, results[name])

    # 5. Write eval.json, every reply with its score, the report; mark done.
    write_json(run.dir / "eval.json", results)
    write_jsonl(run.dir / "replies.jsonl", [
        {"id": p["id"], "premise": p["premise"], "reference": p["chosen"],
         **{name: {"reply": replies[name][i], "reward": rewards[name][i]} for name in replies}}
        for i, p in enumerate(premises)])
    plots = plot_distributions(run.dir, replies, rewards)  # reply length and reward, base vs adapters
    log_plots_to_wandb(plots)
    audit = Path(config.reward_run) / "judge_audit.json"
    verdict = read_json(audit)["verdict"]["text"] if audit.is_file() else None
    report = write_report(run.dir / "report.md", run.dir.name, results, premises, replies, rewards,
                          config.n_report_samples, plots, verdict)
    run.finish({"models": results, "n_premises": len(premises), "report": str(report)})
    print(f"report: {report.resolve()}")


if __name__ == "__main__":
    cli(main, EvalConfig, __doc__)
