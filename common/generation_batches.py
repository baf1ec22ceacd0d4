"""GRPO's generation batches (TRL's `steps_per_generation`): how many the run sampled and what reusing
them clipped, for metrics.json `rollouts`.

TRL samples per_device_train_batch_size x steps_per_generation completions per process at once (a
generation batch), cuts them into micro-batches and feeds one to each of the next steps_per_generation
micro-steps. At its default (steps_per_generation = gradient_accumulation_steps) that is one generation
batch per optimiser step, sampled by the policy it updates; at k times that, one batch feeds k optimiser
steps, and TRL keeps the sampling policy's per-token log-probs (`old_per_token_logps`) so that the later
steps' importance ratio is clipped (epsilon; `clip_ratio/*` in the log history)."""
from __future__ import annotations


class GenerationBatches:
    """Counts the generation batches a GRPOTrainer samples while training: TRL's
    `_generate_and_score_completions` (private: common/trl_compat.py) runs once per batch, whichever
    backend samples it (the static decoder's rollout_func or TRL's generate), and once more after a
    resume, whose buffered batch was not kept."""

    def __init__(self, trainer):
        self.trainer, self.count = trainer, 0
        sample = trainer._generate_and_score_completions

        def counted(inputs):
            if trainer.model.training:  # evaluation samples its own batches, not reused
                self.count += 1
            return sample(inputs)
        trainer._generate_and_score_completions = counted

    def summary(self, log_history: list[dict]) -> dict:
        """metrics.json `rollouts`: steps_per_generation as TRL resolved it, the optimiser steps a batch
        feeds, the batches sampled in this process's segment of the run, and the highest share of reply
        tokens whose ratio was clipped in a logged step (0 when every step was on-policy; None when TRL
        logged none)."""
        args = self.trainer.args
        clipped = [h["clip_ratio/region_mean"] for h in log_history if h.get("clip_ratio/region_mean") is not None]
        return {"steps_per_generation": args.steps_per_generation,
                "generation_batch_size": args.generation_batch_size,  # completions, over all processes
                "optimiser_steps_per_generation": args.steps_per_generation / args.gradient_accumulation_steps,
                "generation_batches": self.count,
                "clip_ratio_region_max": max(clipped, default=None)}
