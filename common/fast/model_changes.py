"""Every change to the model or its data that a config asks for, in one place.

Each stage's `build_trainer` calls `apply(trainer, config)` once its TRL trainer exists; it returns
the names of what it applied, which the run's manifest records (`patches`, and `backends`). DPO's pair
as one sequence needs its collator when the trainer is built: `one_sequence_collator` makes it first.
With `fast_paths: false` the config asks for none of them (each field's `plain` value, common/config.py), and
unmask_right_padding and no_cudnn_attention are left off too (SDPA keeps PyTorch's own choice of
kernel): plain TRL and transformers. Nothing else in the pipeline changes a model's forward or a
trainer's data behind the config's back.

| change | when | what it does |
| --- | --- | --- |
| unmask_right_padding | causal models (training) | drops the attention mask of right-padded batches: SDPA's flash kernel instead of the masked one |
| padding_free | the reward model's padding_free | a micro-batch's sequences as one row, no padding (padding_free.py) |
| prompt_once_per_pair | reward: padding_free and prompt_once_per_pair | a pair's two replies share their prompt in that row |
| pair_in_one_sequence | DPO's pair_in_one_sequence | a pair as one sequence (shared_prompt.py; its collator made by `one_sequence_collator`) |
| group_in_one_sequence | GRPO's group_in_one_sequence | a premise and its replies as one sequence in the update (`shared_prompt.share_grpo_prompts`) |
| judge_in_one_row | GRPO on a GPU, one_sequence_attention flex_attention | the judge scores a step's replies as one row, FlexAttention's block mask, each premise once |
| no_cudnn_attention | on a GPU, unless cudnn_attention | SDPA's flash kernel rather than cuDNN's: on Hopper SDPA picks cuDNN first, which builds a plan for every new sequence length, a CPU cost real-length batches pay nearly every step (docs/performance.md); at long fixed lengths cuDNN's kernel is the faster one (`cudnn_attention: true`) |
| add_length_column | group_by_length, preference data | a `length` column for the length-grouped sampler |
| batch_by_tokens | max_tokens_per_batch > 0 | micro-batches filled to a token budget, length-grouped (token_budget.py) |
| weigh_pairs_per_step | max_tokens_per_batch > 0, reward or DPO | every pair of an optimiser step weighs the same, whatever its micro-batch |
| layers_not_checkpointed | gradient_checkpointing and layers_not_checkpointed > 0 | the last layers keep their activations, the others are checkpointed (`CheckpointSomeLayers`) |
| offload_saved_activations | offload_activations | saved activations in pinned CPU memory, copied on a side stream and back ahead of backward (offload.py) |
| keep_attention_outputs | offload_activations, gradient_checkpointing and keep_attention_outputs, SDPA | each checkpointed layer's attention outputs go to CPU memory with its input, and its recomputation gets them back instead of running attention again (kept_attention.py) |
| apply_liger_kernels | liger_kernel, on a GPU | Liger's Triton RMSNorm, SwiGLU and RoPE (the RoPE through `batch_folded_rope`) |
| chunk_mlps | mlp_chunk_tokens > 0 | MLPs over the sequence in checkpointed pieces |
"""
from __future__ import annotations

import logging
import weakref

import torch
from transformers import TrainerCallback

from common import trl_compat
from common.config import DPOStageConfig, TrainArgs
from common.fast import padding_free, shared_prompt, token_budget
from common.fast.kept_attention import KeepAttentionOutputs
from common.fast.offload import offload_saved_activations
from common.model import unwrap_peft

log = logging.getLogger("pipeline")
_LIGER_MODELS = weakref.WeakSet()  # models whose modules Liger has already replaced


def apply(trainer, config: TrainArgs, judges=()) -> list[str]:
    """Apply what `config` asks for to `trainer` (its model, its data) and to `judges`, GRPO's learned judges
    behind its reward terms (RewardScorer: `packed`, `model`; common.reward_terms.learned_judges); returns the
    names applied."""
    applied, layout = [], token_budget.PADDED
    packs = shared_prompt.packs_rows(trainer.model)  # no: sliding-window layers, plain padded rows
    asked = [name for name, on in (("padding_free", getattr(config, "padding_free", False)),
                                   ("group_in_one_sequence", getattr(config, "group_in_one_sequence", False))) if on]
    if getattr(config, "loss", None) == "dpo" and getattr(config, "pair_in_one_sequence", False):
        asked.append("pair_in_one_sequence")
    if not packs and asked:
        applied += [f"{name}_not_for_this_model" for name in asked]
    if packs and getattr(config, "padding_free", False):
        share = config.prompt_once_per_pair
        padding_free.unpad_rows(trainer.model, share_prompt=share)
        applied += ["padding_free"] + (["prompt_once_per_pair"] if share else [])
        layout = token_budget.PADDING_FREE
    elif config.fast_paths and unmask_right_padding(trainer.model):
        applied.append("unmask_right_padding")
    if isinstance(getattr(trainer, "data_collator", None), shared_prompt.SharedPromptCollator):
        applied.append("pair_in_one_sequence")  # installed with its collator, before the trainer was built
        layout = token_budget.ONE_SEQUENCE
    if packs and getattr(config, "group_in_one_sequence", False):
        shared_prompt.share_grpo_prompts(trainer, config.one_sequence_attention)
        applied.append("group_in_one_sequence")
    if config.fast_paths and getattr(config, "one_sequence_attention", None) == "flex_attention" \
            and torch.cuda.is_available() and judges_in_one_row(judges):
        applied.append("judge_in_one_row")
    if config.group_by_length and add_length_column(trainer):
        applied.append("add_length_column")
    if config.max_tokens_per_batch:
        token_budget.batch_by_tokens(trainer, config.max_tokens_per_batch, layout)
        applied.append("batch_by_tokens")
        if token_budget.is_pairwise(trainer):  # TRL's reward and DPO losses: a mean per micro-batch
            token_budget.weigh_pairs_per_step(trainer)
            applied.append("weigh_pairs_per_step")
    if config.gradient_checkpointing and config.layers_not_checkpointed:
        trainer.add_callback(CheckpointSomeLayers(config.layers_not_checkpointed))
        applied.append("layers_not_checkpointed")
    if config.offload_activations:
        offload_saved_activations(trainer.model, int(config.offload_keep_gib * 2 ** 30))
        applied.append("offload_saved_activations")
        if config.gradient_checkpointing and config.keep_attention_outputs \
                and trl_compat.attn_implementation(unwrap_peft(trainer.model)) == "sdpa":  # not FlexAttention's
            trainer.add_callback(KeepAttentionOutputs())
            applied.append("keep_attention_outputs")
    if config.liger_kernel and torch.cuda.is_available() and apply_liger_kernels(trainer, judges):  # Triton: GPUs only
        applied.append("apply_liger_kernels")
    if config.mlp_chunk_tokens:  # after Liger, whose SwiGLU it then wraps
        chunk_mlps(trainer.model, config.mlp_chunk_tokens)
        applied.append("chunk_mlps")
    if config.fast_paths and torch.cuda.is_available():  # process-wide, so set either way
        torch.backends.cuda.enable_cudnn_sdp(config.cudnn_attention)
        applied.append("cudnn_attention" if config.cudnn_attention else "no_cudnn_attention")
    log.info("model and data changes: %s", ", ".join(applied) or "none")
    return applied


def one_sequence_collator(model, tokenizer, config: DPOStageConfig):
    """DPO's pair as one sequence, when the config asks for it: wraps the model's forward and returns
    the collator that lays pairs out for it (else None, TRL's own collator). Called before the
    DPOTrainer is built, since TRL may precompute reference log-probs in its constructor; `apply`
    then records it. Returns (collator, the attention it runs)."""
    if config.loss != "dpo" or not config.pair_in_one_sequence or not shared_prompt.packs_rows(model):
        return None, None
    attention = shared_prompt.share_prompt(model, config.one_sequence_attention)
    return shared_prompt.SharedPromptCollator(pad_token_id=tokenizer.pad_token_id, max_length=config.max_length), \
        attention


def backends(config, applied: list[str], **parts: str) -> dict:
    """What a stage ran, for its manifest: `fast_paths`, the attention kernel, the model and data changes
    applied (`patches`), and the stage's own parts (decoder, judge scoring)."""
    return {"fast_paths": config.fast_paths, "attention": getattr(config, "attn_implementation", None),
            "patches": applied, **parts}


def judges_in_one_row(judges) -> bool:
    """GRPO's packed 4-bit judges run FlexAttention: the scorer then lays all the replies of a step end to
    end in one row (`RewardScorer._packed`) instead of one padded row per premise under a dense SDPA mask,
    whose masked kernel is slow (docs/performance.md). Same scores (tests/test_rewards.py)."""
    changed = False
    for scorer in judges:
        if scorer.packed:
            classifier = unwrap_peft(scorer.model)
            if trl_compat.attn_implementation(classifier) != "flex_attention":
                classifier.set_attn_implementation("flex_attention")
            changed = True
    return changed


def add_length_column(trainer) -> bool:
    """group_by_length: the sampler reads lengths from `input_ids` (SFT); a preference dataset
    (chosen_ids, rejected_ids) gets a `length` column, the longer reply of each pair (the collator pads
    both to it), kept through the trainer's column filter."""
    data, name = trainer.train_dataset, trainer.args.length_column_name
    if data is None or not hasattr(data, "column_names") or "input_ids" in data.column_names \
            or name in data.column_names:
        return False
    id_columns = [c for c in data.column_names if c.endswith("_ids")]
    if not id_columns:
        return False
    trainer.train_dataset = data.map(lambda row: {name: max(len(row[c]) for c in id_columns)})
    trl_compat.keep_column(trainer, name)  # TRL's column filter would drop the new column
    return True


def apply_liger_kernels(trainer, judges=()) -> bool:
    """Liger's Triton RMSNorm, SwiGLU and RoPE in the trained model (and a GRPO judge's model): fused
    element-wise passes that also save less for backward (bench/RESULTS.md). The loss stays TRL's:
    `use_liger_kernel=True` would also swap in Liger's fused cross-entropy forward, which a sequence
    classifier lacks (lm_head error) and which TRL's own fused LM head replaces anyway."""
    try:
        from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance  # private: trl_compat
    except ImportError:
        log.warning("liger_kernel: true but the liger-kernel package is missing (pip install liger-kernel==0.8.5): "
                    "training runs without its kernels, slower")
        return False
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    from transformers.models.llama import modeling_llama  # apply_rotary_pos_emb replaced: common/trl_compat.py

    models = [trainer.model] + [getattr(j, "model", None) for j in judges]
    for model in models:
        if model is not None and model not in _LIGER_MODELS:
            llama = unwrap_peft(model).config.model_type == "llama"
            _apply_liger_kernel_to_instance(unwrap_peft(model), rope=not llama, rms_norm=True, swiglu=True,
                                            cross_entropy=False, fused_linear_cross_entropy=False)
            if llama:  # as Liger patches it (for every Llama of the process), batch folded
                modeling_llama.apply_rotary_pos_emb = batch_folded_rope(liger_rotary_pos_emb)
            _LIGER_MODELS.add(model)
    return True


def batch_folded_rope(rope):
    """`rope` (an `apply_rotary_pos_emb`) over a batch folded into one sequence. Liger's RoPE kernel
    takes the batch size as a compile-time constant, so every new number of rows in a micro-batch
    (token-budget batches vary it) would compile it again, forward and backward, a CPU cost that the
    profile of real-length SFT shows (docs/performance.md). Folded, it sees batch 1 only.
    Each position keeps its own cos/sin row, so the result is the same."""
    def apply(q, k, cos, sin):  # as Llama's attention calls it
        B, _, T, D = q.shape

        def fold(x):  # (B, H, T, D) -> (1, H, B*T, D); a view of the projections' (B, T, H, D) output
            return x.transpose(1, 2).reshape(1, B * T, x.shape[1], D).transpose(1, 2)

        def unfold(x):
            return x.transpose(1, 2).reshape(B, T, x.shape[1], D).transpose(1, 2)
        cos, sin = (c.expand(B, T, -1).reshape(1, B * T, -1) for c in (cos, sin))
        q, k = rope(fold(q), fold(k), cos, sin)
        return unfold(q), unfold(k)
    return apply


def chunk_mlps(model, tokens: int) -> None:
    """Very long inputs: each MLP runs over the sequence in pieces of `tokens`, each checkpointed, so that
    in backward only one piece's 14336-wide intermediates are alive (about 3 GiB less at 32k tokens,
    for one more MLP forward). Applied after Liger, whose SwiGLU it then wraps."""
    from torch.utils.checkpoint import checkpoint
    for layer in unwrap_peft(model).model.layers:
        def chunked(x, forward=layer.mlp.forward):
            if x.shape[1] <= tokens or not torch.is_grad_enabled():
                return forward(x)
            return torch.cat([checkpoint(forward, part, use_reentrant=False) for part in x.split(tokens, dim=1)],
                             dim=1)
        layer.mlp.forward = chunked


class CheckpointSomeLayers(TrainerCallback):
    """`layers_not_checkpointed`: the Trainer turns checkpointing on for every decoder layer as training
    begins; then the last `n` keep their activations (no recompute in backward), the others stay
    checkpointed. Same gradients as either way (tests/fast/test_memory_plan.py), less recompute for more memory."""

    def __init__(self, n: int):
        self.n = n

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        checkpoint_some_layers(model, self.n)


def checkpoint_some_layers(model, n: int) -> int:
    """Checkpointing off for the last `n` of `model`'s checkpointable decoder layers; returns how many there are."""
    from transformers.modeling_layers import GradientCheckpointingLayer  # internal: common/trl_compat.py
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    for layer in layers[max(len(layers) - n, 0):]:
        layer.gradient_checkpointing = False
    return len(layers)


def unmask_right_padding(model) -> bool:
    """A right-padded training batch needs no attention mask: under causal attention no real token sees
    the padding after it, and pad positions carry no loss (labels -100; the reward head reads the last
    real token). Without the mask SDPA runs its flash kernel instead of the masked one, which real-length
    batches otherwise pay for (bench/RESULTS.md). Left padding (GRPO's prompts) keeps its mask. Not for
    a bidirectional encoder (the MiniLM judge), whose real tokens do see the padding: returns False."""
    flags = [m.is_causal for m in model.modules() if isinstance(getattr(m, "is_causal", None), bool)]
    if not flags or not all(flags):
        return False

    def drop_mask(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if module.training and isinstance(mask, torch.Tensor) and mask.dim() == 2 \
                and bool((mask[:, 1:] <= mask[:, :-1]).all()):
            return args, {**kwargs, "attention_mask": None}
        return None

    model.register_forward_pre_hook(drop_mask, with_kwargs=True)
    return True


