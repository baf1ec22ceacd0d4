"""Shared-prompt DPO (common/fast/shared_prompt.py) against TRL's own two-sequence DPO, on the same batch,
through TRL's own loss: the tiny model with a LoRA adapter that is not the identity and a policy that
is not its reference, pairs of unequal prompt and reply lengths (so padding and per-pair shifts matter).
Twice: in float32 (the layouts must agree to float32 rounding) and as the pipeline runs it, 4-bit NF4
with bf16 compute (to bf16 rounding)."""
from __future__ import annotations

import pytest
import torch
from conftest import TINY, exact_fp32, load_stage, words
from datasets import Dataset

from common.config import DPOStageConfig
from common.fast.shared_prompt import SHARED_KEYS, SharedPromptCollator, branch_mask

LENGTHS = [(40, 12, 25), (9, 30, 3), (70, 5, 18)]  # words of prompt, chosen, rejected


# relative error allowed on log-probs and gradients: float32 rounding, or bf16's (2^-8) with its sums
TOLERANCE = {"fp32": 1e-5, "nf4": 3e-2}


@pytest.fixture(scope="module", params=["fp32", "nf4"])
def trainer(request, tiny_model, tmp_path_factory):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from common.model import CAUSAL_LM, load_model, load_tokenizer, lora_config
    torch.manual_seed(0)
    config = DPOStageConfig(model_name_or_path=str(TINY), sft_run="unused", max_prompt_tokens=256, max_length=512,
                            report_to="none",
                            per_device_train_batch_size=len(LENGTHS), gradient_checkpointing=False)
    tokenizer = load_tokenizer(config)
    if request.param == "nf4":
        model = load_model(config, CAUSAL_LM, tokenizer=tokenizer)
    else:
        base = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32, attn_implementation="sdpa")
        model = get_peft_model(base, lora_config(config, CAUSAL_LM))
    with torch.no_grad():  # LoRA B starts at zero: give the adapter (policy and `ref` copy) a real effect
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    rows = [{"prompt": [{"role": "user", "content": words(p, i)}],
             "chosen": [{"role": "assistant", "content": words(c, i + 1)}],
             "rejected": [{"role": "assistant", "content": words(r, i + 2)}]} for i, (p, c, r) in enumerate(LENGTHS)]
    run = type("R", (), {"dir": tmp_path_factory.mktemp("dpo"), "manifest": {}})()
    trainer = load_stage("04_train_dpo.py").build_trainer(config, run, model, tokenizer, Dataset.from_list(rows))
    assert "ref" in model.peft_config and run.manifest["patches"][:2] == ["unmask_right_padding", "pair_in_one_sequence"]
    with torch.no_grad():  # the policy moves away from its reference (TRL's frozen `ref` copy): loss != log 2
        for name, p in model.named_parameters():
            if "lora_B.default" in name:
                p.add_(torch.randn_like(p) * 0.05)
    trainer.tolerance = TOLERANCE[request.param]
    exact_fp32()
    return trainer


def _relative_error(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _batch(trainer):
    examples = [trainer.train_dataset[i] for i in range(len(LENGTHS))]
    assert isinstance(trainer.data_collator, SharedPromptCollator)
    device = next(trainer.model.parameters()).device  # the model's, as the trainer's _prepare_inputs would move them
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in trainer.data_collator(examples).items()}


def _trl_batch(batch):
    return {k: v for k, v in batch.items() if k not in SHARED_KEYS}


def _log_probs(trainer, batch):
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    inputs = {k: v for k, v in batch.items() if k not in ("completion_mask", "ref_chosen_logps", "ref_rejected_logps")}
    with torch.no_grad():
        return trainer.model(**inputs, labels=labels, fused_lm_head=True, use_cache=False).log_probs


def test_the_rule_hides_the_chosen_reply_from_the_rejected_one():
    # prompt of 4 tokens (0..3), chosen 2 (first branch 3..5), rejected 2 (second branch 6..8)
    branch = torch.tensor([[0, 0, 0, 1, 1, 1, 2, 2, 2]])
    mask = branch_mask(torch.zeros_like(branch), branch, "sdpa")[0, 0]
    assert mask.tril().equal(mask)  # causal
    assert not mask[6:, 3:6].any()  # the second branch never sees the first
    assert mask[6:, :3].all() and mask[3:6, :3].all()  # both see the shared prompt
    assert mask[8, 6:9].all() and mask[5, 3:6].all()  # and their own branch


def test_shared_prompt_log_probs_equal_trls_two_sequences(trainer):
    batch = _batch(trainer)
    n = len(LENGTHS)
    # the shared layout is shorter: one prompt per pair instead of two
    assert batch["shared_input_ids"].shape[1] < 2 * batch["input_ids"].shape[1]
    assert batch["shared_input_ids"].shape[0] == n and batch["input_ids"].shape[0] == 2 * n
    trainer.model.eval()
    two_sequences = _log_probs(trainer, _trl_batch(batch))
    shared = _log_probs(trainer, batch)
    reply = batch["completion_mask"][:, 1:].bool()
    assert shared.shape == two_sequences.shape
    assert shared[~reply].eq(0).all()
    assert reply.sum() > 0 and shared[reply].ne(0).all()
    assert _relative_error(shared, two_sequences) < trainer.tolerance
    assert _relative_error(shared.sum(1), two_sequences.sum(1)) < trainer.tolerance


def test_a_dpo_step_gives_trls_loss_and_gradients(trainer):
    batch = _batch(trainer)
    trainer.model.train()
    lora = {name: p for name, p in trainer.model.named_parameters() if p.requires_grad}
    assert lora and all("lora_" in name for name in lora)

    def loss_and_grads(inputs):
        trainer.model.zero_grad(set_to_none=True)
        loss = trainer.compute_loss(trainer.model, inputs)
        loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in lora.items()}

    trl_loss, trl_grads = loss_and_grads(_trl_batch(batch))
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    shared_loss, shared_grads = loss_and_grads(batch)
    shared_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    assert abs(trl_loss.item() - 0.6931) > 1e-3  # the policy is not its reference
    assert shared_loss.item() == pytest.approx(trl_loss.item(), rel=trainer.tolerance)
    for name in lora:
        assert trl_grads[name].abs().sum() > 0, name
        assert _relative_error(shared_grads[name], trl_grads[name]) < trainer.tolerance, name
    for key in ("logps/chosen", "logps/rejected"):
        assert shared_metrics[key] == pytest.approx(trl_metrics[key], rel=trainer.tolerance), key
    # rewards = beta x (log-prob - reference log-prob): the rounding of the log-probs, times beta
    rounding = trainer.args.beta * trainer.tolerance * abs(trl_metrics["logps/chosen"])
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert shared_metrics[key] == pytest.approx(trl_metrics[key], abs=rounding), key


def test_reference_log_probs_equal_trls(trainer):
    batch = _batch(trainer)
    trl_chosen, trl_rejected = trainer.compute_ref_log_probs(trainer.model, _trl_batch(batch))
    chosen, rejected = trainer.compute_ref_log_probs(trainer.model, batch)
    assert _relative_error(chosen, trl_chosen) < trainer.tolerance
    assert _relative_error(rejected, trl_rejected) < trainer.tolerance


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["fp32"], indirect=True)
def test_flex_attention_block_mask_gives_the_same_log_probs(trainer, fresh_compile):
    """The BlockMask the GPU recipes use (attn_implementation flex_attention) against the sdpa mask."""
    batch = _batch(trainer)
    trainer.model.eval()
    sdpa = _log_probs(trainer, batch)
    base = trainer.model.get_base_model()
    base.set_attn_implementation("flex_attention")
    try:
        flex = _log_probs(trainer, batch)
    finally:
        base.set_attn_implementation("sdpa")
    assert _relative_error(flex, sdpa) < trainer.tolerance
