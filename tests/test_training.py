"""common/training.py's train(): what the model is after training."""
from __future__ import annotations

from types import SimpleNamespace

import torch
from conftest import TINY, tf32


def test_after_training_the_model_runs_outside_the_runs_autocast(tmp_path, tiny_model):
    """A bf16 run (here on the CPU's autocast, as a GPU's) leaves the model's forward wrapped in it, and on a GPU
    TF32 on for the process; stage 03 then rated its dev papers in bf16 and stage 05 the same model in float32.
    After train() the forward is the model's own (its logits equal the class's forward, exactly) and fp32
    matmuls are full precision again."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from common.training import train
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
    ids = torch.randint(3, 100, (4, 12))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    args = TrainingArguments(output_dir=str(tmp_path / "checkpoints"), bf16=True, use_cpu=True, max_steps=1,
                             per_device_train_batch_size=2, report_to="none", save_strategy="no")
    trainer = Trainer(model=model, args=args, train_dataset=data)
    run = SimpleNamespace(dir=tmp_path, manifest={}, save_manifest=lambda: None, task="cmv", is_main=True)
    with tf32(True):  # what TrainingArguments(tf32=True) does on a GPU (transformers' enable_tf32)
        train(trainer, run)
        tf32_after = torch.backends.cuda.matmul.fp32_precision
    assert tf32_after == "ieee"  # fp32 matmuls after training run in full precision, as in stage 05's process
    with torch.no_grad():
        called = trainer.model(input_ids=ids[:1]).logits
        own = type(trainer.model).forward(trainer.model, input_ids=ids[:1]).logits
    assert called.dtype == own.dtype == torch.float32
    assert torch.equal(called, own)
