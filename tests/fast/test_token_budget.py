"""Token-budget micro-batches (`max_tokens_per_batch`, common/fast/token_budget.py).

The packing: every example once per epoch, no micro-batch over the budget unless it is one
over-long example, the same micro-batches each epoch in a new order. The collators: a micro-batch's
padded size is what the budget counted (SFT, reward, DPO in both layouts). The loss: one optimiser
step of token-budget micro-batches of different sizes gives the loss and LoRA gradients of one plain
batch of the same examples, for SFT, the reward model and DPO, on the tiny model in float32."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import TINY, exact_fp32, load_stage, words

from common.config import DPOStageConfig, RewardStageConfig, SFTStageConfig
from common.fast import token_budget
from common.fast.token_budget import TokenBudgetBatchSampler, pack

# words of prompt, chosen, rejected: unequal, so micro-batches differ in size and padding matters
LENGTHS = [(40, 12, 25), (9, 30, 3), (70, 5, 18), (3, 4, 6), (20, 40, 9), (12, 7, 30), (5, 3, 2), (33, 22, 11)]
BUDGET = {"sft": 160, "reward": 240, "dpo": 200}  # 2 to 4 micro-batches of 1 to 4 examples over LENGTHS
COMMON = dict(model_name_or_path=str(TINY), report_to="none", lora_dropout=0.0, gradient_checkpointing=False,
              max_prompt_tokens=96, max_length=160, per_device_train_batch_size=len(LENGTHS))


def _rows():
    return [{"id": str(i), "prompt": [{"role": "user", "content": words(p, i)}], "chosen": words(c, i + 1),
             "rejected": words(r, i + 2)} for i, (p, c, r) in enumerate(LENGTHS)]


def _run(tmp_path):
    return SimpleNamespace(dir=tmp_path, manifest={}, save_manifest=lambda: None, task="cmv", is_main=True)


def _lora_model(kind, config):
    """The tiny model in float32 with a LoRA adapter whose B is not zero (so it matters)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from common.model import CAUSAL_LM, SEQ_CLS, lora_config
    torch.manual_seed(0)
    if kind == "reward":
        base = AutoModelForSequenceClassification.from_pretrained(TINY, num_labels=1, dtype=torch.float32)
        base.config.pad_token_id = 2
    else:
        base = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32, attn_implementation="sdpa")
    model = get_peft_model(base, lora_config(config, SEQ_CLS if kind == "reward" else CAUSAL_LM))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model


def build(kind, tmp_path, **over):
    """A trainer as its stage builds it (02's and 04's build_trainer; 03's RewardTrainer and scorer)."""
    from common.model import load_tokenizer
    if kind == "sft":
        config = SFTStageConfig(pairs_run="unused", **COMMON, **over)
        tokenizer = load_tokenizer(config)
        run = _run(tmp_path)
        trainer = load_stage("02_train_sft.py").build_trainer(config, run, _lora_model(kind, config), tokenizer,
                                                           _rows(), [])
        trainer.applied = run.manifest["patches"]
        exact_fp32()
        return trainer
    if kind == "reward":
        import trl

        from common import fast
        from common.rewards import RewardScorer, preference_dataset
        from common.training import trainer_args
        config = RewardStageConfig(pairs_run="unused", **COMMON, **over)
        tokenizer = load_tokenizer(config)
        scorer = RewardScorer(_lora_model(kind, config), tokenizer, config.max_prompt_tokens, config.max_length)
        args = trainer_args(trl.RewardConfig, config, _run(tmp_path), max_length=config.max_length)
        trainer = trl.RewardTrainer(model=scorer.model, args=args, processing_class=tokenizer,
                                    train_dataset=preference_dataset(_rows(), scorer))
        trainer.applied = fast.apply(trainer, config)
        exact_fp32()
        return trainer
    config = DPOStageConfig(sft_run="unused", **COMMON, **over)
    tokenizer = load_tokenizer(config)
    model = _lora_model(kind, config)
    dpo = load_stage("04_train_dpo.py")
    rows = _rows()
    data = dpo.preference_dataset(rows, [r["prompt"] for r in rows], [None] * len(rows), tokenizer, config)
    run = _run(tmp_path)
    trainer = dpo.build_trainer(config, run, model, tokenizer, data)
    trainer.applied = run.manifest["patches"]
    with torch.no_grad():  # the policy moves away from its reference (TRL's frozen `ref` copy)
        for name, p in model.named_parameters():
            if "lora_B.default" in name:
                p.add_(torch.randn_like(p) * 0.05)
    exact_fp32()
    return trainer


def one_step(trainer):
    """One optimiser step over the whole epoch, as the Trainer's loop runs it (get_batch_samples, then
    training_step on each micro-batch): its loss and the LoRA gradients, and the micro-batch sizes."""
    loader = trainer.get_train_dataloader()
    batches, num_items = trainer.get_batch_samples(iter(loader), len(loader), trainer.args.device)
    trainer.current_gradient_accumulation_steps = len(batches)
    trainer.model.zero_grad(set_to_none=True)
    loss = sum(trainer.training_step(trainer.model, batch, num_items) for batch in batches)
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    return loss.item(), grads, [len(b["input_ids"]) for b in batches]


def _relative_error(a, b):
    return ((a - b).norm() / b.norm()).item()


# --- the packing ------------------------------------------------------------------------------------

def test_every_example_once_per_epoch_within_the_budget():
    lengths = [int(x) for x in torch.randint(5, 300, (500,), generator=torch.Generator().manual_seed(0))]
    lengths[7] = 900  # over the budget: a micro-batch of its own
    sampler = TokenBudgetBatchSampler(lengths, rows=2, budget=1200, seed=3)
    epochs = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert len(batches) == len(sampler)  # the count the Trainer plans its steps with
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
        for b in batches:
            assert len(b) * 2 * max(lengths[i] for i in b) <= 1200 or b == [7]
        epochs.append(batches)
    assert [7] in epochs[0]
    assert sorted(map(sorted, epochs[0])) == sorted(map(sorted, epochs[1]))  # the same micro-batches...
    assert epochs[0] != epochs[1] != epochs[2]  # ...in a new order each epoch
    sampler.set_epoch(1)
    assert list(sampler) == epochs[1]  # an epoch's order is fixed by seed + epoch: resume skips into it
    # full: a micro-batch closes only when the next example would not fit
    packed = pack(lengths, 2, 1200, seed=3)
    for b, nxt in zip(packed, packed[1:]):
        assert (len(b) + 1) * 2 * max(lengths[i] for i in b + nxt[:1]) > 1200


# --- the budget counts what the collators pad ------------------------------------------------------

@pytest.mark.parametrize("kind,over,key", [("sft", {}, "input_ids"), ("reward", {}, "input_ids"),
                                           ("dpo", {}, "shared_input_ids"),
                                           ("dpo", {"pair_in_one_sequence": False}, "input_ids")])
def test_micro_batches_pad_to_what_the_budget_counts(kind, over, key, tmp_path):
    budget = BUDGET[kind] * (2 if key == "input_ids" and kind == "dpo" else 1)
    trainer = build(kind, tmp_path, max_tokens_per_batch=budget, **over)
    loader = trainer.get_train_dataloader()
    lengths, rows = loader.batch_sampler.lengths, loader.batch_sampler.rows  # as the trainer's layout costs them
    seen, sizes = 0, []
    for batch in loader:
        n = len(batch["input_ids"]) // (2 if kind != "sft" else 1)
        padded = batch[key].numel()
        assert padded <= budget or n == 1
        sizes.append(n)
        seen += n
    assert seen == len(LENGTHS) == len(lengths) and len(sizes) == len(loader) > 1
    assert len(set(sizes)) > 1  # micro-batches of different sizes
    # the collated sizes are the counted ones: padded = examples x rows x longest
    batches = loader.batch_sampler.batches
    counted = sorted(len(b) * rows * max(lengths[i] for i in b) for b in batches)
    assert counted == sorted(trainer.data_collator([trainer._remove_unused_columns(trainer.train_dataset)[i]
                                                    for i in b])[key].numel() for b in batches)
    assert "batch_by_tokens" in trainer.applied
    assert ("weigh_pairs_per_step" in trainer.applied) == (kind != "sft")


# --- the same loss and gradients as one plain batch ----------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sft", "reward", "dpo"])
def test_token_budget_step_equals_one_plain_batch(kind, tmp_path):
    trainer = build(kind, tmp_path)  # per_device_train_batch_size = every example: one plain batch
    plain_loss, plain_grads, plain_sizes = one_step(trainer)
    assert len(plain_sizes) == 1
    token_budget.batch_by_tokens(trainer, BUDGET[kind], token_budget.ONE_SEQUENCE if kind == "dpo" else token_budget.PADDED)
    if kind != "sft":
        token_budget.weigh_pairs_per_step(trainer)
    loss, grads, sizes = one_step(trainer)
    assert len(sizes) > 1 and len(set(sizes)) > 1 and sum(sizes) == plain_sizes[0]
    assert loss == pytest.approx(plain_loss, rel=1e-5)
    assert plain_grads.keys() == grads.keys() and any("lora_" in n for n in grads)
    for name in grads:
        assert plain_grads[name].abs().sum() > 0, name
        assert _relative_error(grads[name], plain_grads[name]) < 1e-5, name


@pytest.mark.slow
def test_without_equal_pair_weights_the_reward_step_differs(tmp_path):
    """What weigh_pairs_per_step is for: TRL's per-micro-batch means, divided by the number of
    micro-batches, weigh a pair in a small micro-batch more than one plain batch does."""
    trainer = build("reward", tmp_path)
    plain_loss, plain_grads, _ = one_step(trainer)
    token_budget.batch_by_tokens(trainer, BUDGET["reward"])
    loss, grads, sizes = one_step(trainer)
    assert len(set(sizes)) > 1
    assert loss != pytest.approx(plain_loss, rel=1e-5)
    assert max(_relative_error(grads[n], plain_grads[n]) for n in grads) > 1e-2


def test_the_budget_is_refused_where_it_does_not_apply():
    from common.config import ConfigError, GRPOStageConfig
    with pytest.raises(ConfigError, match="length-grouped already"):
        SFTStageConfig(pairs_run="x", max_tokens_per_batch=6144, group_by_length=True)
    with pytest.raises(ConfigError, match="ORPO"):
        DPOStageConfig(sft_run="x", loss="orpo", max_tokens_per_batch=6144)
    with pytest.raises(ConfigError, match="GRPO"):
        GRPOStageConfig(sft_run="x", reward_run="y", max_tokens_per_batch=6144)
    assert SFTStageConfig(pairs_run="x", max_tokens_per_batch=6144).max_tokens_per_batch == 6144


@pytest.mark.slow
def test_a_resumed_run_sees_the_batches_and_losses_of_an_uninterrupted_one(tmp_path):
    """Through the stages' train(): 14 steps over more than two epochs, checkpoint at step 8 (inside the
    second epoch); a fresh trainer resumed from it gets the uninterrupted run's micro-batches 9 to 14
    (the Trainer skips into that epoch's order) and its losses."""
    import shutil

    from common.training import train

    def run(name, checkpoint=None):
        trainer = build("sft", tmp_path / name, max_tokens_per_batch=BUDGET["sft"], max_steps=14, save_steps=8,
                        logging_steps=1, learning_rate=1e-3)
        seen, collate = [], trainer.data_collator
        trainer.data_collator = lambda examples: seen.append(
            sorted(tuple(e["input_ids"]) for e in examples)) or collate(examples)
        if checkpoint:
            shutil.copytree(checkpoint, tmp_path / name / "checkpoints" / checkpoint.name)
        metrics = train(trainer, _run(tmp_path / name))
        losses = {h["step"]: h["loss"] for h in metrics["log_history"] if "loss" in h}
        return seen, losses, len(trainer.get_train_dataloader())

    whole, whole_losses, per_epoch = run("whole")
    assert per_epoch < 8 < 2 * per_epoch  # step 8 lies inside the second epoch
    assert whole[:per_epoch] != whole[per_epoch:2 * per_epoch]  # whose order is not the first epoch's
    resumed, resumed_losses, _ = run("resumed", tmp_path / "whole" / "checkpoints" / "checkpoint-8")
    assert resumed[:6] == whole[8:14]  # (accelerate's loader collates one batch ahead: each list has one more)
    assert sorted(resumed_losses) == sorted(whole_losses) == list(range(1, 15))  # 1-8 from the checkpoint's log
    for step in range(9, 15):
        assert resumed_losses[step] == pytest.approx(whole_losses[step], rel=1e-4), step
