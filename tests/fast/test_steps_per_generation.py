"""GRPO's `steps_per_generation` (TRL's): one generation batch feeding several optimiser steps.

A tiny GRPO run through stage 04's `build_trainer` (the static decoder's rollouts, and TRL's generate; the
update one row a reply and with `group_in_one_sequence`): at steps_per_generation 2 with one micro-batch a step, half as
many generation batches as optimiser steps, the second step's loss against the sampling policy's
log-probs (its importance ratio away from 1); at the default, the run of today (steps_per_generation null,
TRL's gradient_accumulation_steps) and that value set explicitly give the same rewards and losses."""
from __future__ import annotations

import pytest
import torch
from conftest import TINY, load_stage, words
from datasets import Dataset

from common.config import ConfigError, GRPOStageConfig
from common.generation_batches import GenerationBatches


def _judge(prompts, completions, **kwargs):  # replies of one length, varied rewards: advantages that move the policy
    texts = [c[0]["content"] for c in completions]  # conversational prompts: a reply is one message
    return [float(sum(map(ord, t)) % 97) for t in texts]


_judge.__name__ = "judge"


def _grpo(tmp_path, steps: int, **over) -> dict:
    """A 4-premise GRPO run on the tiny model: its log history, the batches sampled, the loss inputs' ratios."""
    from transformers import set_seed

    from common.model import CAUSAL_LM, load_model, load_tokenizer
    config = GRPOStageConfig(model_name_or_path=str(TINY), sft_run="unused", reward_run="unused", report_to="none",
                             per_device_train_batch_size=4, num_generations=2, max_completion_length=6,
                             gradient_checkpointing=False, lora_dropout=0.0, max_steps=steps, logging_steps=1,
                             save_steps=1000, learning_rate=1e-2, warmup_ratio=0.0, seed=7, **over)
    set_seed(config.seed)
    tokenizer = load_tokenizer(config)
    tokenizer.padding_side = "left"
    model = load_model(config, CAUSAL_LM, tokenizer=tokenizer, trainable=True)
    prompts = Dataset.from_list([{"prompt": [{"role": "user", "content": words(n, i)}]}
                                 for i, n in enumerate([9, 4, 13, 6])])
    run = type("R", (), {"dir": tmp_path, "manifest": {}})()
    trainer = load_stage("04_train_grpo.py").build_trainer(config, run, model, _judge, prompts, tokenizer)
    assert run.manifest["backends"]["decoder"] == {"static": "static", "hf": "trl_generate"}[config.rollout_backend]
    assert ("group_in_one_sequence" in run.manifest["patches"]) == config.group_in_one_sequence
    batches = GenerationBatches(trainer)
    ratios, replies, compute = [], [], trainer._compute_loss

    def loss_with_ratio(model, inputs):  # how far the policy that updates is from the one that sampled
        replies.append([tuple(r) for r in inputs["completion_ids"].tolist()])
        old = inputs.get("old_per_token_logps")
        if old is not None:
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
            mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            with torch.no_grad():
                now = trainer._get_per_token_logps_and_entropies(model, ids, mask, inputs["completion_ids"].size(1))[0]
            reply = inputs["completion_mask"].bool()
            ratios.append((now - old)[reply].abs().max().item())
        else:
            ratios.append(None)
        return compute(model, inputs)
    trainer._compute_loss = loss_with_ratio
    trainer.train()
    history = trainer.state.log_history
    return {"history": history, "batches": batches.count, "summary": batches.summary(history), "ratios": ratios,
            "steps": trainer.state.global_step, "replies": replies}


@pytest.mark.parametrize("group_in_one_sequence,rollout_backend", [(False, "static"), (True, "static"), (True, "hf")])
def test_two_steps_share_a_generation_batch_and_clip_against_its_log_probs(tmp_path, tiny_model,
                                                                         group_in_one_sequence, rollout_backend):
    run = _grpo(tmp_path, 4, steps_per_generation=2, group_in_one_sequence=group_in_one_sequence,
                rollout_backend=rollout_backend)
    assert run["steps"] == 4 and run["batches"] == 2  # half as many generation batches as optimiser steps
    summary = run["summary"]
    assert summary["steps_per_generation"] == 2 and summary["generation_batch_size"] == 8
    assert summary["optimiser_steps_per_generation"] == 2 and summary["generation_batches"] == 2
    # TRL kept the sampling policy's log-probs for every step (the largest |log ratio| of a step's reply
    # tokens): the first step of a batch is that policy (up to bf16 rounding of the 4-bit base: the packed
    # rows of the update are not those the log-probs were taken on), the second one update later
    first, second = run["ratios"][0::2], run["ratios"][1::2]
    assert all(r is not None and r < 5e-3 for r in first), run["ratios"]
    assert all(r is not None and r > 5e-2 for r in second), run["ratios"]
    # each step takes its own micro-batch of the generation batch: its 8 replies once each over the 2 steps
    for a, b in zip(run["replies"][0::2], run["replies"][1::2]):
        assert len(a) == len(b) == 4 and len(set(a + b)) == 8
    logged = [h for h in run["history"] if "loss" in h]
    assert len(logged) == 4 and all("clip_ratio/region_mean" in h for h in logged)
    assert summary["clip_ratio_region_max"] == max(h["clip_ratio/region_mean"] for h in logged)
    # rewards are logged with the step that sampled them
    assert [h["step"] for h in run["history"] if "reward" in h] == [1, 3]


@pytest.mark.parametrize("group_in_one_sequence", [False, True])
def test_the_default_is_one_generation_batch_per_optimiser_step(tmp_path, tiny_model, group_in_one_sequence):
    default = _grpo(tmp_path / "default", 2, gradient_accumulation_steps=2, group_in_one_sequence=group_in_one_sequence)
    explicit = _grpo(tmp_path / "explicit", 2, gradient_accumulation_steps=2, steps_per_generation=2,
                     group_in_one_sequence=group_in_one_sequence)
    assert default["summary"]["steps_per_generation"] == 2  # TRL's default: gradient_accumulation_steps
    assert default["batches"] == explicit["batches"] == 2  # one per optimiser step
    assert default["ratios"] == [None] * 4  # on-policy: TRL computes no old log-probs (no extra forward)

    def per_step(run):
        return [(h["step"], h["reward"], h["loss"]) for h in run["history"] if "loss" in h]
    assert len(per_step(default)) == 2 and any(h.get("reward_std", 0) > 0 for h in default["history"])
    assert per_step(default) == per_step(explicit)


def test_a_generation_batch_must_hold_whole_groups():
    with pytest.raises(ConfigError, match="steps_per_generation") as err:
        GRPOStageConfig(pairs_run="p", reward_run="r", per_device_train_batch_size=6, num_generations=4,
                        gradient_accumulation_steps=2, steps_per_generation=1)
    assert err.value.field == "steps_per_generation"
    assert GRPOStageConfig(pairs_run="p", reward_run="r", per_device_train_batch_size=6, num_generations=4,
                           gradient_accumulation_steps=2, steps_per_generation=4).steps_per_generation == 4
