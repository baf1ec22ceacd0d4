"""Stage 04: GRPO: the SFT writer practises against the stage-03 judge.

    python 04_train_grpo.py --config configs/smol/04_train_grpo.yaml \
        --sft_run runs/Nov30_SFT_Run1 --reward_run runs/Nov30_Reward_Run1

Starts from the SFT adapter (trained further; the 4-bit base stays frozen), or, with --pairs_run and
no --sft_run, from a fresh adapter on the base (the manifest's `started_from` says which). For each premise the
policy writes `num_generations` replies; the reward terms (`reward_funcs` x `reward_weights`: by default
the reward run's judge alone; PAR, fluency or any scorer: common/reward_terms.py) score them, and GRPO
pushes up the replies that beat their group's mean. A reward-hacking watch logs, every step, the mean
reward and each term's, mean reply length (tokens and words), distinct-2 and overlap with the premise
to metrics.json `per_step` (and W&B); its guard stops the run, unfinished and with a message, when
reply length drifts past `guard_max_length_ratio`. Writes the adapter (adapter/).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from datasets import Dataset
from transformers import set_seed
from trl import GRPOConfig, GRPOTrainer

from common import checkpoint_choice, fast, reward_terms
from common.cli import cli
from common.config import GRPOStageConfig
from common.data import fit_prompt, load_split, one_per_group
from common.generation import decoder_backends
from common.generation_batches import GenerationBatches
from common.model import CAUSAL_LM, fingerprint, load_model, load_tokenizer
from common.runs import Run, settle
from common.training import save_adapter, train, trainer_args
from common.watch import WatchCallback, watch_per_step

log = logging.getLogger("pipeline")


def prompt_dataset(pairs_run: str, tokenizer, config: GRPOStageConfig) -> Dataset:
    """One prompt per premise of the train split (a premise with several pairs is used once)."""
    rows = one_per_group(load_split(pairs_run, "train"))[: config.max_prompts]
    return Dataset.from_list([{"prompt": fit_prompt(tokenizer, r["prompt"], config.max_prompt_tokens)} for r in rows])


def build_trainer(config: GRPOStageConfig, run, policy, reward_funcs, prompts, tokenizer,
                  reward_weights: list[float] | None = None) -> GRPOTrainer:
    levers, run.manifest["memory_plan"] = fast.fit_memory(config, policy)  # memory_levers fit: what this GPU needs
    settle(run, config, levers)  # on the config before the trainer is built, and in config.yaml: what ran
    args = trainer_args(GRPOConfig, config, run, num_generations=config.num_generations,
                        max_completion_length=config.max_completion_length,
                        mask_truncated_completions=config.mask_truncated_completions,
                        temperature=config.temperature, beta=config.beta, scale_rewards=config.scale_rewards,
                        log_completions=False, reward_weights=reward_weights,
                        steps_per_generation=config.steps_per_generation)  # None: TRL's, gradient_accumulation_steps
    reward_funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
    rollout = None
    if config.rollout_backend == "static" and fast.supports_fast_decode(policy):
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental: common/trl_compat.py
        fast.use_nf4_matmul_table(config.nf4_matmul_table)  # which base matmuls skip dequantising (empty: none)
        rollout = fast.grpo_rollout(config.max_completion_length, config.temperature, config.rollout_batch_size,
                                    config.rollout_weights)
    trainer = GRPOTrainer(model=policy, reward_funcs=reward_funcs, args=args, train_dataset=prompts,
                          processing_class=tokenizer, rollout_func=rollout)
    run.manifest["patches"] = fast.apply(trainer, config, judges=reward_terms.learned_judges(reward_funcs))
    # TRL's generate when asked (rollout_backend hf, fast_paths false) or for a model the static decoder
    # does not know: recorded either way.
    decoder = decoder_backends(policy, True, config.rollout_weights, reproducible=False) if rollout \
        else {"decoder": "trl_generate"}
    run.manifest["backends"] = fast.backends(config, run.manifest["patches"], **decoder,
                                             judge_scoring=judge_scoring(reward_funcs))
    return trainer


def judge_scoring(reward_funcs) -> str:
    """How the judge scores the replies: packed (the replies to a premise sharing it) or padded rows;
    plain reward functions are recorded as such."""
    judges = reward_terms.learned_judges(reward_funcs)
    return judges[0].scoring if judges else "reward function"


def main(config: GRPOStageConfig, overrides: dict) -> None:
    # 1. Seed and run directory; both inputs finished, built on this base and on one pairs run.
    set_seed(config.seed)
    inputs = {"sft_run": config.sft_run, "pairs_run": config.pairs_run, "reward_run": config.reward_run}
    run = Run("GRPO", config, overrides, inputs={k: v for k, v in inputs.items() if v}, base=fingerprint(config))
    run.manifest["started_from"] = "sft" if config.sft_run else "base"
    run.start_tracking()

    # 2. Prompts: the premises the SFT model was trained on (its pairs run).
    tokenizer = load_tokenizer(config)
    tokenizer.padding_side = "left"  # generation pads on the left
    prompts = prompt_dataset(run.pairs_run, tokenizer, config)
    log.info("GRPO on %d premises x %d replies", len(prompts), config.num_generations)

    # 3. Models: the policy continues the SFT adapter (or starts a fresh one on the base); the judge is frozen.
    policy = load_model(config, CAUSAL_LM, adapter=Path(config.sft_run) / "adapter" if config.sft_run else None,
                        trainable=True)
    #    The reward: the declared terms (the reward run's judge, as its config and `judge` fingerprint
    #    rebuild it; PAR and fluency against the starting policy's replies, sampled as the rollouts are, kept in
    #    reference_replies.jsonl), plus the watch's statistics at weight 0 (reply length, distinct-2,
    #    premise overlap: TRL logs each one's mean).
    reward_funcs, reward_weights, judge = reward_terms.build(config, run, policy, tokenizer, list(prompts["prompt"]))
    run.manifest["judge"] = run.inputs["reward_run"].get("judge")
    run.save_manifest()

    # 4. GRPO (beta=0: no reference model; DAPO loss, group-scaled rewards: TRL's defaults; beta > 0:
    #    TRL's KL to where the policy started, a frozen copy of the SFT adapter or the base).
    trainer = build_trainer(config, run, policy, reward_funcs, prompts, tokenizer, reward_weights)
    #    The length guard reads the logged reply length and stops training at a step's end; its reference
    #    is kept in the run directory, so a resumed run keeps it.
    guard = WatchCallback(config.guard_max_length_ratio, config.guard_patience, state_path=run.dir / "guard.json")
    trainer.add_callback(guard)
    #    Every generation batch sampled is counted (steps_per_generation: one feeds several steps).
    generation_batches = GenerationBatches(trainer)
    #    With checkpoint_eval_steps, the adapter is kept every N steps (and where it started) to be chosen on dev.
    if config.checkpoint_eval_steps:
        if 0 not in checkpoint_choice.saved_steps(run.dir):
            checkpoint_choice.save_step(policy, run.dir, 0)
        trainer.add_callback(checkpoint_choice.SaveEvery(config.checkpoint_eval_steps, run.dir, policy))

    # 5. Train (resuming this run's last checkpoint if any), save the policy adapter: the last step's, or
    #    with checkpoint_eval_steps the saved step the dev judges like best among those still fluent.
    metrics = train(trainer, run)
    if config.checkpoint_eval_steps and not guard.tripped:
        if metrics["global_step"] not in checkpoint_choice.saved_steps(run.dir):
            checkpoint_choice.save_step(policy, run.dir, metrics["global_step"])
        metrics["checkpoint_choice"] = checkpoint_choice.evaluate(config, run, policy, tokenizer, judge)
    run.manifest["backends"]["decoder_fallbacks"] = list(fast.GRAPH_FAILURES)  # graphs not captured: eager steps
    save_adapter(policy, tokenizer, run)
    metrics["per_step"] = watch_per_step(metrics["log_history"], reward_terms.term_names(reward_funcs))
    metrics["n_prompts"] = len(prompts)
    metrics["rollouts"] = generation_batches.summary(metrics["log_history"])
    if guard.tripped:  # unfinished on purpose (no DONE): stage 05 must not take this policy
        run.fail({**metrics, "stopped_by_guard": guard.tripped}, guard.tripped)
    tied = [e["frac_reward_zero_std"] for e in metrics["log_history"] if "frac_reward_zero_std" in e]
    if tied and min(tied) == 1.0:  # every advantage was zero: the adapter is the one it started from
        run.fail(metrics, "every group of replies got equal rewards at every step, so GRPO's advantages were all "
                 "zero and the policy never moved from where it started (identical replies, or a judge that scores "
                 "them alike: see frac_reward_zero_std in metrics.json)")
    run.finish(metrics)


if __name__ == "__main__":
    cli(main, GRPOStageConfig, __doc__)
