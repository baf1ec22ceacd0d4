"""`memory_levers: fit`: which activation-memory levers a training run takes, from the GPU's memory.

Each lever trades time for memory (docs/performance.md, "Which lever for which memory"). From the
fastest:

| plan | gradient_checkpointing | offload_activations | what stays on the GPU |
| --- | --- | --- | --- |
| keep_all | false | false | every layer's saved activations |
| checkpoint | true | false | each layer's input; one layer's activations while it is recomputed |
| offload | true | true, keeping what fits | `offload_keep_gib` of the inputs; the rest in pinned CPU memory |
| offload_all | true | true, keeping none | one layer's activations |

The plan is the first whose estimated peak fits the budget (`memory_budget_gib`, or 90% of the GPU's
memory). If none fits, `offload_all` is taken and the log says by how much it is over. The estimate:
what is allocated once the model is loaded, plus the LoRA's gradients and AdamW's two moments, plus the
activations of the run's largest micro-batch (`micro_batch_tokens`) at bytes a token from the model's
shape (`activation_bytes`), times `SAFETY` (the allocator's slack and the transients not counted).
GRPO adds its rollouts: bf16 copies of the base with `rollout_weights: bf16`, and the static
decoder's KV cache where it is larger than the update's activations (a rollout ends before the update). The run's manifest records the plan and its estimates, and its metrics the
measured peak of every step (`gpu_memory_per_step`), so each run checks its own estimate.

On a CPU, or with `memory_levers: as_set`, the levers stay as the config sets them.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("pipeline")
GIB = 2 ** 30
SAFETY = 1.1  # the activations' estimate times this: the allocator's slack
# One layer's activations while it is recomputed, with the gradients that backward carries through it: the
# layers' worth that checkpointed runs held beside the kept inputs (1.3) and with every input offloaded (1.6),
# measured at 20,480 tokens on the 8B shape (bench/RESULTS.md, "memory_levers fit").
RECOMPUTED_LAYERS = {"checkpoint": 1.3, "offload_all": 1.6}
BUDGET_SHARE = 0.9  # memory_budget_gib 0: this share of the GPU's memory
PLANS = ("keep_all", "checkpoint", "offload", "offload_all")


def activation_bytes(model_config) -> tuple[int, int]:
    """(bytes a token of one decoder layer's saved activations, bytes a token of one layer's input), bf16.

    What a Llama layer with LoRA on every projection saves for backward, per token: the layer's input,
    its normed copy (read by the q/k/v LoRA), q, k and v after RoPE, the attention's output and its
    reshaped copy (the o projection's input), the residual sum and its normed copy: 7 x hidden + 2 x
    the key/value width; then the MLP's gate and up outputs (Liger's SwiGLU saves both) and their product
    (the down projection's input): 3 x intermediate. The frozen 4-bit base weights need no input saved."""
    hidden = model_config.hidden_size
    heads = model_config.num_attention_heads
    kv_width = getattr(model_config, "num_key_value_heads", heads) * getattr(model_config, "head_dim", hidden // heads)
    layer = 2 * (7 * hidden + 2 * kv_width + 3 * model_config.intermediate_size)
    return layer, 2 * hidden


def micro_batch_tokens(config) -> int:
    """The tokens of the run's largest training micro-batch, as its stage lays it out."""
    stage = type(config).__name__
    if stage == "GRPOStageConfig":
        premises = max(1, config.per_device_train_batch_size // config.num_generations)
        if config.group_in_one_sequence:  # a premise once, its replies as branches
            return premises * (config.max_prompt_tokens + config.num_generations * config.max_completion_length)
        return config.per_device_train_batch_size * (config.max_prompt_tokens + config.max_completion_length)
    if config.max_tokens_per_batch:  # the budget counts every row (reward: both replies; DPO: its layout)
        return config.max_tokens_per_batch
    rows = config.per_device_train_batch_size
    if stage == "DPOStageConfig" and config.pair_in_one_sequence:  # prompt, chosen reply, rejected reply
        return rows * (2 * config.max_length - config.max_prompt_tokens)
    if stage in ("RewardStageConfig", "DPOStageConfig"):
        rows *= 2  # chosen and rejected rows
    return rows * config.max_length


def rollout_bytes(config, model) -> tuple[int, int]:
    """GRPO's rollouts: (what they keep for the run, bf16 copies of the base with `rollout_weights: bf16`;
    what a rollout holds while it runs, the static decoder's KV cache, freed before the update)."""
    if type(config).__name__ != "GRPOStageConfig" or config.rollout_backend != "static":
        return 0, 0
    from common.model import unwrap_peft
    lm_config = unwrap_peft(model).config
    heads = lm_config.num_attention_heads
    head_dim = getattr(lm_config, "head_dim", lm_config.hidden_size // heads)
    cache = (2 * lm_config.num_hidden_layers * config.rollout_batch_size * lm_config.num_key_value_heads
             * head_dim * (config.max_prompt_tokens + config.max_completion_length) * 2)
    copies = 0
    if config.rollout_weights == "bf16":  # two bytes for each 4-bit weight (two of them a byte)
        copies = sum(4 * p.numel() for p in model.parameters() if p.dtype == torch.uint8)
    return copies, cache


def estimates(config, model, allocated: int) -> dict[str, float]:
    """The estimated peak (GiB) of each plan; `allocated`: bytes on the GPU with the model loaded."""
    from common.model import unwrap_peft
    layers = unwrap_peft(model).config.num_hidden_layers
    layer, layer_input = activation_bytes(unwrap_peft(model).config)
    tokens = micro_batch_tokens(config)
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    copies, cache = rollout_bytes(config, model)
    fixed = allocated + trainable * 3 + copies  # the LoRA's gradients and AdamW's two moments
    checkpoint = layers * layer_input + RECOMPUTED_LAYERS["checkpoint"] * layer
    kept = {"keep_all": layers * layer, "checkpoint": checkpoint,
            "offload_all": min(RECOMPUTED_LAYERS["offload_all"] * layer, checkpoint)}  # few layers: nothing to gain
    return {plan: (fixed + max(cache, SAFETY * tokens * per_token)) / GIB for plan, per_token in kept.items()}


def budget_gib(config, device) -> float:
    return config.memory_budget_gib or BUDGET_SHARE * torch.cuda.get_device_properties(device).total_memory / GIB


def choose(peaks: dict[str, float], budget: float) -> tuple[str, float]:
    """The fastest plan whose estimated peak fits `budget` (GiB), and the GiB of saved layer inputs it keeps on
    the GPU (the offload plans)."""
    if peaks["keep_all"] <= budget:
        return "keep_all", 0.0
    if peaks["checkpoint"] <= budget:
        return "checkpoint", 0.0
    keep = round((budget - peaks["offload_all"]) / SAFETY, 2)  # the room above offload_all's peak, for inputs
    return ("offload", keep) if keep > 0 else ("offload_all", 0.0)


def fit(config, model) -> dict:
    """Set `config`'s gradient_checkpointing, offload_activations and offload_keep_gib to the fastest plan
    that fits the GPU's budget (with `memory_levers: fit` on a GPU); returns what was decided, for the
    run's manifest (`memory_plan`)."""
    if getattr(config, "memory_levers", "as_set") != "fit":
        return {"levers": "as_set"}
    if not torch.cuda.is_available():
        return {"levers": "as_set", "why": "memory_levers fit plans for a GPU; on the CPU the levers stay as written"}
    budget = budget_gib(config, next(model.parameters()).device)
    peaks = estimates(config, model, torch.cuda.memory_allocated())
    plan, keep = choose(peaks, budget)
    config.gradient_checkpointing = plan != "keep_all"
    config.offload_activations = plan in ("offload", "offload_all")
    config.offload_keep_gib = keep
    peaks = {name: round(gib, 2) for name, gib in peaks.items()}
    decided = {"levers": "fit", "plan": plan, "budget_gib": round(budget, 2), "estimated_peak_gib": peaks,
               "micro_batch_tokens": micro_batch_tokens(config), "gradient_checkpointing": config.gradient_checkpointing,
               "offload_activations": config.offload_activations, "offload_keep_gib": keep}
    if plan == "offload_all" and peaks["offload_all"] > budget:
        log.warning("memory plan: even offloading every saved input is estimated at %.1f GiB, over the %.1f GiB "
                    "budget; lower max_tokens_per_batch or max_length, or set mlp_chunk_tokens", peaks["offload_all"],
                    budget)
    log.info("memory plan: %s (gradient_checkpointing %s, offload_activations %s, keep %.2f GiB) for %d-token "
             "micro-batches within %.1f GiB; estimated peaks %s", plan, config.gradient_checkpointing,
             config.offload_activations, keep, decided["micro_batch_tokens"], budget, peaks)
    return decided
