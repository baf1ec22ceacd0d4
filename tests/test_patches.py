"""The private names of TRL and Liger that the pipeline relies on: each test fails as soon as a
new release renames one, instead of a stage silently losing the change it asked for."""
from __future__ import annotations

import inspect

import trl


def test_trainers_still_filter_columns_through_signature_columns():
    # common.patches.add_length_column extends the column filter of TRL's trainers.
    for trainer in (trl.SFTTrainer, trl.RewardTrainer):
        assert callable(getattr(trainer, "_set_signature_columns_if_needed", None)), trainer
        assert "_signature_columns" in inspect.getsource(trainer._set_signature_columns_if_needed)


def test_grpo_still_tokenizes_prompts_and_accepts_a_rollout_function():
    # common.generation.grpo_rollout tokenises prompts exactly as TRL does, and is passed as rollout_func.
    assert callable(getattr(trl.GRPOTrainer, "_tokenize_prompts", None))
    assert "rollout_func" in inspect.signature(trl.GRPOTrainer.__init__).parameters


def test_length_column_survives_the_column_filter(tiny_model):
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from common.patches import add_length_column
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    data = Dataset.from_list([{"chosen_ids": [1, 2, 3], "rejected_ids": [1, 2]}] * 4)
    args = trl.RewardConfig(output_dir="/tmp/unused", use_cpu=True, bf16=False, report_to="none",
                            train_sampling_strategy="group_by_length")
    trainer = trl.RewardTrainer(model=model, args=args, processing_class=tokenizer, train_dataset=data)
    assert add_length_column(trainer)
    kept = trainer._remove_unused_columns(trainer.train_dataset)
    assert "length" in kept.column_names and kept["length"] == [3] * 4


def test_trainer_hooks_of_token_budget_batches_still_exist():
    # common.token_budget: the Trainer's column filter (private), the step's micro-batches fetched in
    # get_batch_samples, and training_step reading loss_is_scaled_for_ga (transformers >= 5.19).
    import transformers
    trainer = transformers.Trainer
    assert callable(getattr(trainer, "_remove_unused_columns", None))
    assert list(inspect.signature(trainer.get_batch_samples).parameters) == ["self", "epoch_iterator", "num_batches",
                                                                              "device"]
    assert "get_batch_samples" in inspect.getsource(trainer._run_epoch)
    assert "self.loss_is_scaled_for_ga" in inspect.getsource(trainer.training_step)
