"""Shared-prompt GRPO updates (`shared_prompt.share_grpo_prompts`) against TRL's own rows.

TRL runs each reply as a row of left-padded prompt + right-padded reply; the patch runs each prompt
once with its replies as branches. On the tiny model with a LoRA adapter that is not the identity, the
per-token log-probs, entropies and their gradients equal TRL's (float32 rounding, and bf16's on the
4-bit NF4 base); the replies of a shuffled generation batch are put back together by premise, every
row kept once.

The fp32 case is float32 on a GPU too: the trainer's bf16 autocast (accelerate's, which TRL's method and
ours enter on a GPU) is switched off for it. TRL's rows run with the attention plain TRL gives them, the
policy's sdpa: on a GPU the patch switches the policy to FlexAttention for its packed rows, and TRL's own
rows (6 of 112 tokens) would send FlexAttention to Inductor's decoding kernel, which offers no configuration
for a query of 112 tokens times 2 query heads a key-value head (its block, 256 rows, exceeds the block
mask's 128): `NoValidChoicesError`."""
from __future__ import annotations

import pytest
import torch
from conftest import TINY, exact_fp32, load_stage, words
from datasets import Dataset
from trl import GRPOTrainer

from common.config import GRPOStageConfig
from common.data import token_ids
from common.fast.shared_prompt import _replies_together

PROMPT_WORDS = [30, 7, 55, 12]  # premises of different lengths: left padding differs per row


def _judge(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]


# relative error allowed: float32 rounding, or (4-bit NF4 base, as the pipeline runs it) bf16's with its sums
TOLERANCE = {"fp32": 1e-5, "nf4": 3e-2}


@pytest.fixture(scope="module", params=["fp32", "nf4"])
def trainer(request, tiny_model, tmp_path_factory):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from common.model import CAUSAL_LM, load_model, load_tokenizer, lora_config, unwrap_peft
    from common.trl_compat import attn_implementation
    torch.manual_seed(0)
    config = GRPOStageConfig(model_name_or_path=str(TINY), sft_run="unused", reward_run="unused", report_to="none",
                             per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=2,
                             max_completion_length=12, gradient_checkpointing=False, lora_dropout=0.0)
    tokenizer = load_tokenizer(config)
    tokenizer.padding_side = "left"
    if request.param == "nf4":
        model = load_model(config, CAUSAL_LM, tokenizer=tokenizer)
    else:
        base = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32, attn_implementation="sdpa")
        model = get_peft_model(base, lora_config(config, CAUSAL_LM))
    with torch.no_grad():  # LoRA B starts at zero: give the adapter a real effect
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    prompts = Dataset.from_list([{"prompt": [{"role": "user", "content": words(n, i)}]}
                                 for i, n in enumerate(PROMPT_WORDS)])
    run = type("R", (), {"dir": tmp_path_factory.mktemp("grpo"), "manifest": {}})()
    _judge.__name__ = "judge"
    loaded_attention = attn_implementation(unwrap_peft(model))  # sdpa: what plain TRL runs its rows with
    trainer = load_stage("04_train_grpo.py").build_trainer(config, run, model, _judge, prompts, tokenizer)
    exact_fp32()  # the trainer's arguments turned TF32 on: fp32's tolerance is float32 rounding
    if request.param == "fp32":  # and its bf16 autocast (on a GPU; the CPU's trainer has none): fp32 throughout
        from accelerate.utils import AutocastKwargs
        trainer.accelerator.autocast_handler = AutocastKwargs(enabled=False)
    assert "group_in_one_sequence" in run.manifest["patches"]
    trainer.tolerance = TOLERANCE[request.param]
    trainer.loaded_attention = loaded_attention
    return trainer


def _rows(trainer):
    """TRL's layout of 6 replies to 3 premises, in a shuffled order: left-padded prompts, replies of
    different lengths right-padded (a reply that ended early is masked after its end token); on the
    model's device, as TRL's _prepare_inputs hands them over."""
    tokenizer = trainer.processing_class
    prompt_ids = [token_ids(tokenizer.apply_chat_template([{"role": "user", "content": words(n, i)}],
                                                          add_generation_prompt=True, tokenize=True))
                  for i, n in enumerate(PROMPT_WORDS)]
    order, reply_lengths = [1, 0, 2, 0, 1, 2], [12, 5, 12, 9, 1, 7]
    width = max(len(p) for p in prompt_ids)
    g = torch.Generator().manual_seed(1)
    ids = torch.full((6, width + 12), tokenizer.pad_token_id)
    mask = torch.zeros(6, width + 12, dtype=torch.long)
    for r, (p, n) in enumerate(zip(order, reply_lengths)):
        prompt = torch.tensor(prompt_ids[p])
        ids[r, width - len(prompt):width], mask[r, width - len(prompt):width] = prompt, 1
        ids[r, width:width + n], mask[r, width:width + n] = torch.randint(5, 1000, (n,), generator=g), 1
    device = next(trainer.model.parameters()).device
    return ids.to(device), mask.to(device)


def test_log_probs_entropies_and_gradients_equal_trls_rows(trainer, fresh_compile):
    from common.model import unwrap_peft
    from common.trl_compat import attn_implementation
    ids, mask = _rows(trainer)
    model = trainer.model
    model.train()
    lora = {name: p for name, p in model.named_parameters() if p.requires_grad}
    weights = torch.randn(6, 12, generator=torch.Generator().manual_seed(2)).to(ids.device)
    inner = unwrap_peft(model)
    packed_attention = attn_implementation(inner)  # the patch's: flex_attention on a GPU, sdpa on the CPU

    def run(method, attention):
        inner.set_attn_implementation(attention)
        try:
            model.zero_grad(set_to_none=True)
            logps, entropy, _ = method(model, ids, mask, 12, compute_entropy=True)
            (logps * weights).sum().backward()
        finally:
            inner.set_attn_implementation(packed_attention)
        return logps.detach(), entropy.detach(), {n: p.grad.clone() for n, p in lora.items()}

    # TRL's rows as plain TRL runs them (the policy's attention as loaded), ours as the patch does
    trl = run(lambda *a, **k: GRPOTrainer._get_per_token_logps_and_entropies(trainer, *a, **k),
              trainer.loaded_attention)
    shared = run(trainer._get_per_token_logps_and_entropies, packed_attention)
    reply = mask[:, -12:].bool()
    for ours, theirs in zip(shared[:2], trl[:2]):
        assert ours.shape == theirs.shape == (6, 12)
        assert ours[~reply].eq(0).all() and ours[reply].ne(0).all()
        assert ((ours[reply] - theirs[reply]).norm() / theirs[reply].norm()).item() < trainer.tolerance
    for name, grad in trl[2].items():
        assert grad.abs().sum() > 0, name
        assert ((shared[2][name] - grad).norm() / grad.norm()).item() < trainer.tolerance, name


def test_the_update_computes_each_prompt_once(trainer):
    ids, mask = _rows(trainer)
    seen = []
    hook = trainer.model.register_forward_pre_hook(lambda m, a, k: seen.append(k["input_ids"].shape), with_kwargs=True)
    try:
        with torch.no_grad():
            trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 12)
    finally:
        hook.remove()
    prompt_tokens = int(mask[:, :-12].sum())
    assert seen == [(1, seen[0][1])]  # one packed row
    # each of the 3 prompts once, each reply once plus its copy of the prompt's last token
    assert seen[0][1] == prompt_tokens // 2 - 3 + int(mask[:, -12:].sum()) + 6


@pytest.mark.slow
def test_the_trainer_cuts_its_generation_batch_into_whole_premises(trainer):
    """Through TRL's own _prepare_inputs (rollout, judge, shuffle, split): every micro-batch holds whole
    premises, each premise's replies side by side."""
    import itertools
    trainer.model.train()
    trainer._step, trainer._buffered_inputs = 0, None
    trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    batches = trainer._buffered_inputs
    assert len(batches) == 2 and all(len(b["prompt_ids"]) == 4 for b in batches)
    seen = []
    for batch in batches:
        prompts = [tuple(row[keep.bool()].tolist()) for row, keep in zip(batch["prompt_ids"], batch["prompt_mask"])]
        groups = [len(list(g)) for _, g in itertools.groupby(prompts)]
        assert groups == [2, 2], groups  # num_generations replies to each premise, next to each other
        seen += prompts
    assert len(set(seen)) == 4  # every premise of the generation batch, once


def test_a_shuffled_generation_batch_is_put_back_together_by_premise():
    prompt_ids = torch.tensor([[0, 5, 6], [7, 8, 9], [0, 5, 6], [1, 2, 3], [7, 8, 9], [1, 2, 3], [0, 5, 6], [7, 8, 9]])
    prompt_mask = (prompt_ids != 0).long()
    batches = [{"prompt_ids": prompt_ids[i:i + 4], "prompt_mask": prompt_mask[i:i + 4],
                "advantages": torch.arange(i, i + 4).float(), "names": list("abcdefgh")[i:i + 4],
                "num_items_in_batch": torch.tensor(8)} for i in (0, 4)]
    merged = _replies_together(batches)
    # premises in the order they first appear; each premise's rows in their order
    assert merged["advantages"].tolist() == [0, 2, 6, 1, 4, 7, 3, 5]
    assert merged["names"] == list("acgbehdf")
    assert merged["prompt_ids"][:, 1].tolist() == [5, 5, 5, 8, 8, 8, 2, 2]
    assert merged["num_items_in_batch"].item() == 8
