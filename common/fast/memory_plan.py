"""`memory_levers: fit`: which activation-memory levers a training run takes, from the GPU's memory.

Each lever trades time for memory (docs/performance.md, "Levers chosen by the GPU's memory"). From the
fastest:

| plan | gradient_checkpointing | layers_not_checkpointed | offload_activations | on the GPU |
| --- | --- | --- | --- | --- |
| keep_all | false | | false | every layer's saved activations |
| checkpoint_some | true | as many as fit | false | those layers' activations, the other layers' inputs |
| checkpoint | true | 0 | false | each layer's input; one layer's activations while it is recomputed |
| offload | true | 0 | true, keeping what fits | `offload_keep_gib` of the inputs; the rest in pinned CPU memory |
| offload_all | true | 0 | true, keeping none | one layer's activations |

The plan is the first whose estimated peak fits the budget (`memory_budget_gib`, or 90% of the GPU's
memory). If none fits, `offload_all` is taken and the log warns, with the estimate and the budget. The estimate:
what is allocated once the model is loaded, plus the LoRA's gradients and AdamW's two moments, plus the
activations of the run's largest micro-batch (`micro_batch_tokens`; DPO's pairs as one sequence: the data's
longest pair, which a short prompt with long replies makes) at bytes a token from the model's shape
(`activation_bytes`) scaled to what the bench measured, times `SAFETY`, plus the logits over the vocabulary
that the stage's loss keeps (`logits_bytes`, in the manifest as `logits`): GRPO's update and ORPO hold them in
fp32, which on a small model with a large vocabulary outweighs its layers (Qwen2.5-Coder-1.5B, 151,936
tokens: ORPO's 16 rows of 768 tokens, 20.9 GiB); SFT and DPO take their log-probs through TRL's fused LM
head, a reward model has a one-number head. GRPO adds its rollouts:
bf16 copies of the base with `rollout_weights: bf16`, and the static decoder's KV cache where it is
larger than the update's activations (a rollout ends before the update). The run's manifest records the
plan and its estimates, and its metrics the measured peak of every step (`gpu_memory_per_step`), so each
run checks its own estimate.

On a CPU, or with `memory_levers: as_set`, the levers stay as the config sets them. The plan is returned,
never set here: the stage sets its levers on the config (`common.runs.settle`) before the trainer is built,
and config.yaml is written again with them, so that it says what ran.
"""
from __future__ import annotations

import logging

import torch

from common.config import DPOStageConfig, GRPOStageConfig, RewardStageConfig
from common.fast import shared_prompt
from common.model import unwrap_peft

log = logging.getLogger("pipeline")
GIB = 2 ** 30
SAFETY = 1.1  # the activations' estimate times this: the allocator's slack
BUDGET_SHARE = 0.9  # memory_budget_gib 0: this share of the GPU's memory
# Measured on the 8B shape (bench/HISTORY.md, "levers chosen by the GPU's memory"), in units of
# `activation_bytes`' layer: a layer that keeps its activations held up to 1.45 of them (20,480 tokens in
# one sequence, cuDNN attention; shorter real-length batches held less); while a checkpointed layer is
# recomputed, its activations and the gradients backward carries through it held 1.3 beside the kept
# inputs, and 1.75 with every input offloaded.
KEPT_LAYER = 1.45
RECOMPUTED_LAYER = {"checkpoint": 1.3, "offload_all": 1.75}
# Bytes a (token, vocabulary entry) of the logits a loss keeps. GRPO's update: the fp32 logits of its completion
# tokens, from which TRL takes log-probs and entropies, and their gradient (bench/RESULTS.md). ORPO
# (trl.experimental.orpo) takes the full logits of its chosen and rejected rows, fp32 (accelerate's autocast
# wrapper casts the model's outputs), a log-softmax of the chosen half for its NLL term, and in backward
# the logits' fp32 gradient: 4 + 2 + 4. Measured on one H200, 2026-12-04, Qwen2.5-Coder-1.5B (vocabulary
# 151,936), 16 rows of 768 tokens, 27 of 28 layers not checkpointed: a peak of 50.03 GiB; less the 2.06 GiB
# fixed (the DPO run's keep_all estimate less its activations) and the layers' activations as the same
# model's SFT held them (0.78 of their estimate: 30.4 GiB), the logits held 17.5 GiB, 10.1 bytes an entry.
# Taken as 12, for backward's transient copies of the sliced logits' gradient: better a slower plan than an
# out-of-memory beside the other stages on a shared GPU. SFT and DPO (TRL's SFTTrainer and DPOTrainer, and
# DPO's pair_in_one_sequence through the same head) compute log-probs with TRL's fused LM head, in tiles of
# 4,096 tokens x 32,768 entries, never the whole logits: none (SFT held 17.9 GiB, 4.2 below its estimate).
LOGIT_BYTES = {"grpo": 8, "orpo": 12}


def activation_bytes(model_config) -> tuple[int, int]:
    """(bytes a token of one decoder layer's saved activations, bytes a token of one layer's input), bf16.

    What a Llama layer with LoRA on every projection saves for backward, per token: the layer's input,
    its normed copy (read by the q/k/v LoRA), q, k and v after RoPE, the attention's output and its
    reshaped copy (the o projection's input), the residual sum and its normed copy: 7 x hidden + 2 x
    the key/value width; then the MLP's gate and up outputs (Liger's SwiGLU saves both) and their product
    (the down projection's input): 3 x intermediate. The frozen 4-bit base weights need no input saved."""
    hidden = model_config.hidden_size
    heads = model_config.num_attention_heads
    head_dim = getattr(model_config, "head_dim", None) or hidden // heads
    kv_width = (getattr(model_config, "num_key_value_heads", None) or heads) * head_dim
    layer = 2 * (7 * hidden + 2 * kv_width + 3 * model_config.intermediate_size)
    return layer, 2 * hidden


def pairs_in_one_sequence(config) -> bool:
    """DPO's pair_in_one_sequence: prompt, chosen and rejected reply in one sequence (ORPO runs TRL's two rows)."""
    return isinstance(config, DPOStageConfig) and config.loss == "dpo" and config.pair_in_one_sequence


def micro_batch_tokens(config, longest_pair: int = 0) -> int:
    """The tokens of the run's largest training micro-batch, as its stage lays it out. `longest_pair`: DPO's
    longest pair as one sequence in the run's data (`shared_prompt.longest_pair`); without it, the pair of a
    prompt of max_prompt_tokens."""
    if isinstance(config, GRPOStageConfig):
        premises = max(1, config.per_device_train_batch_size // config.num_generations)
        if config.group_in_one_sequence:  # a premise once, its replies as branches
            return premises * (config.max_prompt_tokens + config.num_generations * config.max_completion_length)
        return config.per_device_train_batch_size * (config.max_prompt_tokens + config.max_completion_length)
    if config.max_tokens_per_batch:  # the budget counts every row (reward: both replies; DPO: its layout)
        return config.max_tokens_per_batch
    rows = config.per_device_train_batch_size
    if pairs_in_one_sequence(config):
        return rows * (longest_pair or 2 * config.max_length - config.max_prompt_tokens)
    if isinstance(config, (RewardStageConfig, DPOStageConfig)):
        rows *= 2  # chosen and rejected rows
    return rows * config.max_length


def rollout_bytes(config, model) -> tuple[int, int]:
    """GRPO's rollouts: (what they keep for the run, bf16 copies of the base with `rollout_weights: bf16`;
    what a rollout holds while it runs, the static decoder's KV cache, freed before the update)."""
    if not isinstance(config, GRPOStageConfig) or config.rollout_backend != "static":
        return 0, 0
    lm_config = unwrap_peft(model).config
    heads = lm_config.num_attention_heads
    head_dim = getattr(lm_config, "head_dim", None) or lm_config.hidden_size // heads
    # The decoder samples a generation batch (TRL: per_device x steps_per_generation, by default x accumulation)
    # at most rollout_batch_size sequences at a time.
    generation_batch = config.per_device_train_batch_size * (config.steps_per_generation
                                                             or config.gradient_accumulation_steps)
    sequences = min(config.rollout_batch_size, generation_batch)
    cache = (2 * lm_config.num_hidden_layers * sequences * lm_config.num_key_value_heads
             * head_dim * (config.max_prompt_tokens + config.max_completion_length) * 2)
    copies = 0
    if config.rollout_weights == "bf16":  # two bytes for each 4-bit weight (two of them a byte)
        copies = sum(4 * p.numel() for p in model.parameters() if p.dtype == torch.uint8)
    return copies, cache


def logits_bytes(config, model) -> int:
    """The logits over the vocabulary that the stage's loss keeps for a micro-batch (`LOGIT_BYTES`): GRPO's
    update, its completion tokens; ORPO, every token of its chosen and rejected rows. None for SFT and DPO
    (TRL's fused LM head) and the reward models (one number a sequence)."""
    if isinstance(config, GRPOStageConfig):
        loss, tokens = "grpo", config.per_device_train_batch_size * config.max_completion_length
    elif isinstance(config, DPOStageConfig) and config.loss == "orpo":
        loss, tokens = "orpo", micro_batch_tokens(config)
    else:
        return 0
    return LOGIT_BYTES[loss] * tokens * unwrap_peft(model).config.vocab_size


def estimates(config, model, allocated: int, longest_pair: int = 0) -> dict:
    """The estimated peak (GiB) of each plan, the GiB each layer that is not checkpointed adds
    (`per_kept_layer`) and the loss's logits in every plan (`logits`); `allocated`: bytes on the GPU with the
    model loaded; `longest_pair`: as `micro_batch_tokens` takes it."""
    layers = unwrap_peft(model).config.num_hidden_layers
    layer, layer_input = activation_bytes(unwrap_peft(model).config)
    tokens = micro_batch_tokens(config, longest_pair)
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    copies, cache = rollout_bytes(config, model)
    fixed = allocated + trainable * 3 + copies  # the LoRA's gradients and AdamW's two moments
    head = logits_bytes(config, model)
    checkpoint = layers * layer_input + RECOMPUTED_LAYER["checkpoint"] * layer
    kept = {"keep_all": layers * KEPT_LAYER * layer, "checkpoint": checkpoint,
            "offload_all": min(RECOMPUTED_LAYER["offload_all"] * layer, checkpoint)}  # few layers: nothing to gain
    peaks = {plan: (fixed + max(cache, SAFETY * tokens * per_token + head)) / GIB for plan, per_token in kept.items()}
    return {**peaks, "per_kept_layer": SAFETY * tokens * (KEPT_LAYER * layer - layer_input) / GIB, "logits": head / GIB}


def room(config, model) -> tuple[float, int] | None:
    """(the budget in GiB, the bytes allocated with the model loaded) on the GPU that holds `model`; None on a CPU."""
    if not torch.cuda.is_available():
        return None
    device = next(model.parameters()).device
    total = torch.cuda.get_device_properties(device).total_memory
    return config.memory_budget_gib or BUDGET_SHARE * total / GIB, torch.cuda.memory_allocated(device)


def choose(peaks: dict, budget: float, layers: int) -> tuple[str, int, float]:
    """The fastest plan whose estimated peak fits `budget` (GiB): (plan, the layers that keep their activations,
    the GiB of saved layer inputs kept on the GPU by the offload plans)."""
    if peaks["keep_all"] <= budget:
        return "keep_all", layers, 0.0
    if peaks["checkpoint"] <= budget:
        kept = min(layers - 1, int((budget - peaks["checkpoint"]) / peaks["per_kept_layer"]))
        return ("checkpoint_some", kept, 0.0) if kept > 0 else ("checkpoint", 0, 0.0)
    keep = round((budget - peaks["offload_all"]) / SAFETY, 2)  # the room above offload_all's peak, for inputs
    return ("offload", 0, keep) if keep > 0 else ("offload_all", 0, 0.0)


def fit(config, model, dataset=None, tokenizer=None) -> tuple[dict, dict]:
    """The fastest plan that fits the GPU's budget (with `memory_levers: fit` on a GPU), as (the levers it sets:
    gradient_checkpointing, layers_not_checkpointed, offload_activations and offload_keep_gib; the plan, for the
    run's manifest, `memory_plan`). `config` is left as it is: the stage sets the levers on it
    (`common.runs.settle`) before its trainer is built, so that config.yaml says what ran. DPO passes its
    preference `dataset` and `tokenizer`: its micro-batch is planned for the data's longest pair."""
    if config.memory_levers != "fit":
        return {}, {"levers": "as_set"}
    found = room(config, model)
    if found is None:
        return {}, {"levers": "as_set", "why": "memory_levers fit plans for a GPU; on the CPU the levers stay as written"}
    budget, allocated = found
    longest = shared_prompt.longest_pair(dataset, tokenizer, config.max_length) \
        if dataset is not None and pairs_in_one_sequence(config) and not config.max_tokens_per_batch else 0
    peaks = estimates(config, model, allocated, longest)
    plan, kept, keep = choose(peaks, budget, unwrap_peft(model).config.num_hidden_layers)
    levers = {"gradient_checkpointing": plan != "keep_all",
              "layers_not_checkpointed": kept if plan == "checkpoint_some" else 0,
              "offload_activations": plan in ("offload", "offload_all"), "offload_keep_gib": keep}
    peaks = {name: round(gib, 2) for name, gib in peaks.items()}
    decided = {"levers": "fit", "plan": plan, "budget_gib": round(budget, 2), "estimated_peak_gib": peaks,
               "micro_batch_tokens": micro_batch_tokens(config, longest), **levers}
    if plan == "offload_all" and peaks["offload_all"] > budget:
        log.warning("memory plan: even offloading every saved input is estimated at %.1f GiB, over the %.1f GiB "
                    "budget (the loss's logits %.1f of it); lower max_tokens_per_batch, per_device_train_batch_size "
                    "or max_length, or set mlp_chunk_tokens", peaks["offload_all"], budget, peaks["logits"])
    log.info("memory plan: %s (gradient_checkpointing %s, %d layers not checkpointed, offload_activations %s, "
             "keep %.2f GiB) for %d-token micro-batches within %.1f GiB; estimated peaks %s", plan,
             levers["gradient_checkpointing"], levers["layers_not_checkpointed"], levers["offload_activations"], keep,
             decided["micro_batch_tokens"], budget, peaks)
    return levers, decided
