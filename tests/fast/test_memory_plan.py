"""`memory_levers: fit` (common/fast/memory_plan.py): the tokens of each stage's largest micro-batch (DPO's: its
data's longest pair), the logits each loss keeps (on Qwen2.5-Coder-1.5B's shape, against what its stages measured
on an H200), the estimated peak of each plan, the choice of plan against a budget, and that on the CPU or with `as_set` the
levers stay as written. What the estimates are worth on a GPU is measured by the bench (bench/RESULTS.md)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import TINY

from common.config import DPOStageConfig, GRPOStageConfig, RewardStageConfig, SFTStageConfig
from common.fast import memory_plan

LLAMA3_8B = SimpleNamespace(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                            num_hidden_layers=32)
GIB = 2 ** 30
# configs/qwen-gpu's preference stage, measured on one H200 on 2026-12-04 (Qwen2.5-Coder-1.5B-Instruct)
PREFERENCE = dict(sft_run="s", per_device_train_batch_size=8, max_prompt_tokens=512, max_length=768, memory_budget_gib=28)


def qwen_15b():
    """Qwen2.5-Coder-1.5B's shape, no weights: a small model with a large vocabulary."""
    from transformers import Qwen2Config
    config = Qwen2Config(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         intermediate_size=8960, vocab_size=151936)
    return SimpleNamespace(config=config, parameters=lambda: iter([]))


def measured_fixed_gib(model) -> float:
    """GiB allocated with the model loaded plus the LoRA's optimiser state in the measured runs: the DPO run's
    keep_all estimate (28.05 GiB, its manifest) less its activations."""
    return 28.05 - memory_plan.estimates(DPOStageConfig(**PREFERENCE), model, allocated=0)["keep_all"]


def test_micro_batch_tokens_follow_each_stage_layout():
    assert memory_plan.micro_batch_tokens(SFTStageConfig(pairs_run="p", max_tokens_per_batch=6144)) == 6144
    assert memory_plan.micro_batch_tokens(SFTStageConfig(pairs_run="p", per_device_train_batch_size=3, max_length=700)) == 2100
    # the reward model: chosen and rejected rows
    assert memory_plan.micro_batch_tokens(RewardStageConfig(pairs_run="p", per_device_train_batch_size=3, max_length=700)) == 4200
    # DPO: prompt, chosen and rejected in one sequence, or TRL's two rows
    one = DPOStageConfig(sft_run="s", per_device_train_batch_size=1, max_prompt_tokens=19456, max_length=20480)
    two = DPOStageConfig(sft_run="s", per_device_train_batch_size=1, max_prompt_tokens=19456, max_length=20480,
                         pair_in_one_sequence=False)
    assert memory_plan.micro_batch_tokens(one) == 19456 + 2 * 1024
    assert memory_plan.micro_batch_tokens(two) == 2 * 20480
    # ORPO runs TRL's two rows a pair, whatever pair_in_one_sequence says (it is DPO's)
    assert memory_plan.micro_batch_tokens(DPOStageConfig(**PREFERENCE, loss="orpo")) == 2 * 8 * 768
    # GRPO: a premise once with its replies as branches, or one row a reply
    grpo = dict(sft_run="s", reward_run="r", per_device_train_batch_size=16, num_generations=4, max_prompt_tokens=512,
                max_completion_length=256)
    assert memory_plan.micro_batch_tokens(GRPOStageConfig(**grpo)) == 4 * (512 + 4 * 256)
    assert memory_plan.micro_batch_tokens(GRPOStageConfig(**grpo, group_in_one_sequence=False)) == 16 * (512 + 256)


def test_activation_bytes_of_a_llama_layer():
    layer, layer_input = memory_plan.activation_bytes(LLAMA3_8B)
    assert layer_input == 2 * 4096
    assert layer == 2 * (7 * 4096 + 2 * 1024 + 3 * 14336)  # 147,456 bytes a token


def test_estimates_order_the_plans_and_grow_with_the_micro_batch():
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(TINY)
    small, large = (SFTStageConfig(pairs_run="p", max_tokens_per_batch=n) for n in (1000, 4000))
    a, b = (memory_plan.estimates(c, model, allocated=2 ** 30) for c in (small, large))
    for peaks in (a, b):
        assert peaks["keep_all"] > peaks["checkpoint"] >= peaks["offload_all"] > 1.0  # 1 GiB allocated
    llama = SimpleNamespace(config=LLAMA3_8B, parameters=lambda: iter([]))
    peaks = memory_plan.estimates(SFTStageConfig(pairs_run="p", max_tokens_per_batch=20480), llama, allocated=0)
    assert peaks["keep_all"] > 5 * peaks["checkpoint"] > 5 * peaks["offload_all"] > 5 * 3.0
    layer, layer_input = memory_plan.activation_bytes(model.config)
    layers = model.config.num_hidden_layers
    per_token = memory_plan.SAFETY * layers * memory_plan.KEPT_LAYER * layer / 2 ** 30
    assert b["keep_all"] - a["keep_all"] == pytest.approx(3000 * per_token, rel=1e-6)
    assert b["checkpoint"] - a["checkpoint"] == pytest.approx(
        3000 * memory_plan.SAFETY * (layers * layer_input + memory_plan.RECOMPUTED_LAYER["checkpoint"] * layer) / 2 ** 30,
        rel=1e-6)
    assert b["per_kept_layer"] == pytest.approx(4 * a["per_kept_layer"])


@pytest.mark.parametrize("budget, plan, kept, keep", [(60.0, "keep_all", 32, 0.0), (30.0, "checkpoint_some", 8, 0.0),
                                                      (18.5, "checkpoint", 0, 0.0),
                                                      (14.2, "offload", 0, 2.2 / memory_plan.SAFETY),
                                                      (12.0, "offload_all", 0, 0.0), (8.0, "offload_all", 0, 0.0)])
def test_the_fastest_plan_that_fits_is_chosen(budget, plan, kept, keep):
    peaks = {"keep_all": 50.0, "checkpoint": 18.0, "offload_all": 12.0, "per_kept_layer": 1.5}
    assert memory_plan.choose(peaks, budget, layers=32) == (plan, kept, pytest.approx(keep, abs=0.01))


def test_layers_not_checkpointed_give_the_same_gradients(tiny_model):
    """The last layers keep their activations, the others are recomputed: the gradients equal those of
    checkpointing every layer and of checkpointing none (the tiny model, float32)."""
    from transformers import AutoModelForCausalLM

    from common.fast.model_changes import checkpoint_some_layers
    torch.manual_seed(0)
    ids = torch.randint(0, 200, (2, 24))
    grads, flags = [], []
    for n in (None, 0, 1):  # no checkpointing, every layer, all but the last
        model = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).train()
        if n is not None:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            assert checkpoint_some_layers(model, n) == model.config.num_hidden_layers
        flags.append([layer.gradient_checkpointing for layer in model.model.layers])
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert flags[1] == [True] * len(flags[1]) and flags[2] == [True] * (len(flags[2]) - 1) + [False]
    for other in grads[1:]:
        for g, h in zip(grads[0], other):
            torch.testing.assert_close(g, h, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("levers", ["as_set", "fit"])
def test_on_the_cpu_and_as_set_the_levers_stay_as_written(levers):
    if levers == "fit" and torch.cuda.is_available():
        pytest.skip("fit plans on a GPU: the bench measures it")
    config = SFTStageConfig(pairs_run="p", memory_levers=levers, gradient_checkpointing=True, offload_activations=True,
                            offload_keep_gib=1.5)
    changes, decided = memory_plan.fit(config, torch.nn.Linear(2, 2))
    assert changes == {} and decided["levers"] == "as_set" and ("CPU" in decided.get("why", "")) == (levers == "fit")
    assert (config.gradient_checkpointing, config.offload_activations, config.offload_keep_gib) == (True, True, 1.5)


def test_plain_paths_plan_nothing():
    assert SFTStageConfig(pairs_run="p", memory_levers="fit", fast_paths=False).memory_levers == "as_set"


def test_grpo_counts_its_rollout_cache_where_it_outweighs_the_update():
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(TINY)
    c = model.config
    config = GRPOStageConfig(sft_run="s", reward_run="r", per_device_train_batch_size=4, num_generations=4,
                             max_prompt_tokens=100, max_completion_length=20, rollout_batch_size=256,
                             steps_per_generation=64)
    copies, cache = memory_plan.rollout_bytes(config, model)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    per_sequence = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 120 * 2
    assert copies == 0  # a full-precision model: no 4-bit weights to copy
    assert cache == 256 * per_sequence  # a generation batch of 4 x 64 sampled at once
    # The decoder holds the smaller of its batch and the generation batch: 4 x 1 at TRL's default.
    for spg, rollout_batch, sequences in ((64, 100, 100), (None, 256, 4)):
        smaller = GRPOStageConfig(**{**vars(config), "steps_per_generation": spg, "rollout_batch_size": rollout_batch})
        assert memory_plan.rollout_bytes(smaller, model)[1] == sequences * per_sequence
    peaks = memory_plan.estimates(config, model, allocated=0)
    assert peaks["offload_all"] * 2 ** 30 >= cache  # the rollout's cache outweighs one premise's update here
    assert memory_plan.logits_bytes(config, model) == 8 * 4 * 20 * c.vocab_size  # fp32 and its gradient
    assert memory_plan.logits_bytes(SFTStageConfig(pairs_run="p"), model) == 0
    config.rollout_backend = "hf"
    assert memory_plan.rollout_bytes(config, model) == (0, 0)


def test_orpo_counts_its_logits_and_keeps_within_its_budget():
    """ORPO keeps fp32 logits over Qwen's 151,936-token vocabulary for its 16 rows of 768 tokens: its estimate is
    that of the same tokens without a head plus the logits, it covers the 50.03 GiB ORPO measured with 27 of 28
    layers not checkpointed, and within the 28 GiB budget that ran then it keeps fewer layers."""
    model = qwen_15b()
    orpo = DPOStageConfig(**PREFERENCE, loss="orpo")
    allocated = int(measured_fixed_gib(model) * GIB)
    peaks = memory_plan.estimates(orpo, model, allocated=allocated)
    no_head = memory_plan.estimates(SFTStageConfig(pairs_run="p", max_tokens_per_batch=2 * 8 * 768), model,
                                    allocated=allocated)
    logits = memory_plan.LOGIT_BYTES["orpo"] * 2 * 8 * 768 * 151936 / GIB
    assert peaks["logits"] == pytest.approx(logits) and logits > 14  # over half the budget
    for plan in ("keep_all", "checkpoint", "offload_all"):
        assert peaks[plan] == pytest.approx(no_head[plan] + logits)
    assert peaks["checkpoint"] + 27 * peaks["per_kept_layer"] >= 50.03
    plan, kept, _ = memory_plan.choose(peaks, orpo.memory_budget_gib, layers=28)
    assert plan == "checkpoint_some" and 0 < kept < 27
    assert peaks["checkpoint"] + kept * peaks["per_kept_layer"] <= orpo.memory_budget_gib


def test_fused_heads_and_reward_heads_add_nothing():
    """SFT and DPO take their log-probs through TRL's fused LM head and a reward model has a one-number head:
    no logits counted. SFT's estimate stays above the 17.88 GiB it measured and within 30% of it."""
    model = qwen_15b()
    sft = SFTStageConfig(pairs_run="p", per_device_train_batch_size=8, max_length=768)
    dpo = DPOStageConfig(**PREFERENCE)
    reward = RewardStageConfig(pairs_run="p", per_device_train_batch_size=16, max_length=768)
    for config in (sft, dpo, reward):
        assert memory_plan.logits_bytes(config, model) == 0
        assert memory_plan.estimates(config, model, allocated=0)["logits"] == 0
    same_tokens = memory_plan.estimates(SFTStageConfig(pairs_run="p", max_tokens_per_batch=8192), model, allocated=0)
    assert memory_plan.estimates(dpo, model, allocated=0)["keep_all"] == pytest.approx(same_tokens["keep_all"])
    fixed = int(measured_fixed_gib(model) * GIB)
    assert 17.88 <= memory_plan.estimates(sft, model, allocated=fixed)["keep_all"] <= 1.3 * 17.88


def test_dpo_plans_for_the_data_longest_pair(monkeypatch):
    """DPO's pair as one sequence: a short prompt leaves each reply room up to max_length, so the longest pair
    (as the collator lays it out) is longer than that of a prompt of max_prompt_tokens; fit plans for it."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from common.fast.shared_prompt import SharedPromptCollator, longest_pair
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    words = "the view holds because every case shows it again and again ".split()

    def text(n):
        return " ".join(words[i % len(words)] for i in range(n))

    def pair(prompt, chosen, rejected):
        return {"prompt": [{"role": "user", "content": text(prompt)}],
                "chosen": [{"role": "assistant", "content": text(chosen)}],
                "rejected": [{"role": "assistant", "content": text(rejected)}]}
    rows = [pair(40, 5, 8), pair(3, 80, 70), pair(10, 20, 25)]  # a long prompt; a short one with long replies
    config = DPOStageConfig(sft_run="s", per_device_train_batch_size=3, max_prompt_tokens=48, max_length=64,
                            memory_levers="fit")

    def trl_ids(row):  # TRL's tokens of a conversational pair: the prompt, then each reply after it
        p = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True)
        c, r = (tokenizer.apply_chat_template(row["prompt"] + row[k], tokenize=True, return_dict=True)["input_ids"]
                for k in ("chosen", "rejected"))
        n = len(p["input_ids"])
        return {"prompt_ids": c[:n], "chosen_ids": c[n:], "rejected_ids": r[n:]}
    collator = SharedPromptCollator(pad_token_id=0, max_length=config.max_length)
    laid_out = [collator([trl_ids(row)])["shared_input_ids"].shape[1] for row in rows]
    longest = longest_pair(Dataset.from_list(rows), tokenizer, config.max_length)
    assert longest == max(laid_out) == laid_out[1]
    assert longest > 2 * config.max_length - config.max_prompt_tokens  # what was planned without the data
    batch = collator([trl_ids(row) for row in rows])["shared_input_ids"]
    assert batch.numel() == memory_plan.micro_batch_tokens(config, longest)
    assert memory_plan.micro_batch_tokens(DPOStageConfig(**PREFERENCE, loss="orpo"), longest) == 2 * 8 * 768
    from transformers import AutoConfig
    monkeypatch.setattr(memory_plan, "room", lambda config, model: (80.0, 0))  # a GPU's room, on this CPU
    model = SimpleNamespace(config=AutoConfig.from_pretrained(TINY), parameters=lambda: iter([]))
    _, decided = memory_plan.fit(config, model, Dataset.from_list(rows), tokenizer)
    assert decided["micro_batch_tokens"] == 3 * longest
