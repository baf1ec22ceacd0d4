"""Stage 04: GRPO: the SFT writer practises against the stage-03 judge.

    python 04_train_grpo.py --config configs/smol/04_train_grpo.yaml \
        --sft_run runs/Nov30_SFT_Run1 --reward_run runs/Nov30_Reward_Run1

Starts from the SFT adapter (trained further; the 4-bit base stays frozen). For each premise the
policy writes `num_generations` replies; the reward run's judge scores them, and GRPO pushes up the
replies that beat their group's mean. A reward-hacking watch logs, every step, the mean reward, mean
reply length (tokens and words), distinct-2 and overlap with the premise to metrics.json `per_step`
(and W&B); its guard stops the run, unfinished and with a message, when reply length drifts past
`guard_max_length_ratio`. Writes the adapter (adapter/).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from datasets import Dataset
from transformers import set_seed
from trl import GRPOConfig, GRPOTrainer

from common.config import ModelArgs, RunArgs, TrainArgs
from common.data import fit_prompt, load_split
from common.generation import grpo_rollout, supports_fast_decode
from common.model import CAUSAL_LM, fingerprint, load_model, load_tokenizer
from common.rewards import RewardScorer, WatchedReward, watch_per_step
from common.runs import Run, RunError, cli, write_json
from common.training import save_adapter, train, trainer_args

log = logging.getLogger("pipeline")


@dataclass
class GRPOStageConfig(RunArgs, ModelArgs, TrainArgs):
    sft_run: str | None = None
    reward_run: str | None = None
    max_prompts: int = 1000
    max_prompt_tokens: int = 512
    max_completion_length: int = 256
    num_generations: int = 4
    temperature: float = 1.0
    beta: float = 0.0
    reward_batch_size: int = 16
    # Reward-hacking guard: stop when the mean reply length (words) of `guard_patience` batches in a
    # row leaves [ref / ratio, ref * ratio], ref = the first batch's mean. null turns it off.
    guard_max_length_ratio: float | None = 2.0
    guard_patience: int = 2
    # "static": common.generation.decode (static KV cache, one CUDA graph a token, unmerged LoRA);
    # "hf": TRL's own transformers generate. rollout_batch_size sequences are sampled at once.
    rollout_backend: str = "static"
    rollout_batch_size: int = 64


def prompt_dataset(pairs_run: str, tokenizer, config: GRPOStageConfig) -> Dataset:
    """One prompt per premise of the train split (a premise with several pairs is used once)."""
    seen, prompts = set(), []
    for row in load_split(pairs_run, "train"):
        if row["group_id"] not in seen:
            seen.add(row["group_id"])
            prompts.append({"prompt": fit_prompt(tokenizer, row["prompt"], config.max_prompt_tokens)})
    return Dataset.from_list(prompts[: config.max_prompts])


def build_trainer(config: GRPOStageConfig, run, policy, judge, prompts, tokenizer) -> GRPOTrainer:
    args = trainer_args(GRPOConfig, config, run, num_generations=config.num_generations,
                        max_completion_length=config.max_completion_length,
                        temperature=config.temperature, beta=config.beta, log_completions=False)
    if config.rollout_backend not in ("static", "hf"):
        raise ValueError(f"rollout_backend must be 'static' or 'hf', got {config.rollout_backend!r}")
    rollout = None
    if config.rollout_backend == "static" and supports_fast_decode(policy):
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is marked experimental
        rollout = grpo_rollout(config.max_completion_length, config.temperature, config.rollout_batch_size)
    return GRPOTrainer(model=policy, reward_funcs=judge, args=args, train_dataset=prompts,
                       processing_class=tokenizer, rollout_func=rollout)


def main(config: GRPOStageConfig, overrides: dict) -> None:
    # 1. Seed and run directory; both inputs finished and built on this base.
    set_seed(config.seed)
    run = Run("GRPO", config, overrides, inputs={"sft_run": config.sft_run, "reward_run": config.reward_run})
    run.lock_base(fingerprint(config))
    run.start_tracking()

    # 2. Prompts: the premises the SFT model was trained on (its pairs run).
    pairs_run = run.inputs["sft_run"]["inputs"]["pairs_run"]["path"]
    tokenizer = load_tokenizer(config)
    tokenizer.padding_side = "left"  # generation pads on the left
    prompts = prompt_dataset(pairs_run, tokenizer, config)
    log.info("GRPO on %d premises x %d replies", len(prompts), config.num_generations)

    # 3. Models: the policy continues the SFT adapter; the judge is frozen.
    policy = load_model(config, CAUSAL_LM, adapter=Path(config.sft_run) / "adapter", trainable=True)
    #    The judge is the reward run's own (its config and `judge` fingerprint), watched: reply
    #    length, distinct-2 and premise overlap of every batch go to the log (watch/...).
    judge = WatchedReward(RewardScorer.from_run(config.reward_run, batch_size=config.reward_batch_size),
                          config.guard_max_length_ratio, config.guard_patience)
    run.manifest["judge"] = run.inputs["reward_run"].get("judge")
    run.save_manifest()

    # 4. GRPO (beta=0: no reference model; DAPO loss, group-scaled rewards: TRL's defaults).
    trainer = build_trainer(config, run, policy, judge, prompts, tokenizer)
    trainer.add_callback(judge.stop_callback())  # the length guard stops training at a step's end

    # 5. Train (resuming this run's last checkpoint if any), save the policy adapter.
    metrics = train(trainer, run)
    save_adapter(policy, tokenizer, run)
    metrics["per_step"] = watch_per_step(metrics["log_history"])
    metrics["n_prompts"] = len(prompts)
    if judge.tripped:  # unfinished on purpose (no DONE): stage 05 must not take this policy
        metrics["stopped_by_guard"] = judge.tripped
        write_json(run.dir / "metrics.json", metrics)
        run.log_metrics(metrics)
        raise RunError(judge.tripped)
    run.finish(metrics)


if __name__ == "__main__":
    cli(main, GRPOStageConfig)
