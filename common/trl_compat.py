"""Every private TRL / transformers name the pipeline relies on, in one list, checked at start-up.

The stages reach past the public API of the pinned libraries in a few places: trainer hooks they
extend or replace on a live trainer, TRL internals they reuse, and Llama's modelling code that the
fast decode path calls and Liger's RoPE replaces. A release may rename any of them without notice, and
a stage would then fail deep inside training or, worse, silently lose the change it asked for.
`check()`, run by every stage at start-up (common/cli.py), ends the stage instead with one error naming
the library, its installed version, what is missing and the version the pipeline is tested with.
tests/test_trl_compat.py checks each name. `NAMES` says who uses each one and why; the accessors at
the end are the way to the private attributes that read naturally through a function.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import warnings
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

# library -> (its import name, the version tested: requirements.txt's pin; liger-kernel as model_changes.py installs it)
LIBRARIES = {"trl": ("trl", "1.16.0"), "transformers": ("transformers", "5.24.0"),
             "liger-kernel": ("liger_kernel", "0.8.5")}


class CompatError(RuntimeError):
    pass


@dataclass(frozen=True)
class Private:
    library: str
    owner: str                      # "module" or "module:Class"
    name: str
    used: str                       # who uses it, and why
    params: tuple[str, ...] = ()    # parameters the project calls it with or replaces it by, in this order
    source: tuple[str, str] = ()    # (method of owner, text its code must hold): where the name is set or read
    instance: bool = False          # set on instances (by `source`'s method), not a class attribute


GRPO, TRAINER, LLAMA = "trl:GRPOTrainer", "transformers:Trainer", "transformers.models.llama.modeling_llama"
QWEN2 = "transformers.models.qwen2.modeling_qwen2"
NAMES = [
    # trl
    Private("trl", "trl:RewardTrainer", "_set_signature_columns_if_needed",
            "keep_column (model_changes.add_length_column): sets `_signature_columns`, the column filter, then extended",
            source=("_set_signature_columns_if_needed", "self._signature_columns")),
    Private("trl", "trl:DPOTrainer", "_set_signature_columns_if_needed", "the same, for DPO's pairs",
            source=("_set_signature_columns_if_needed", "self._signature_columns")),
    Private("trl", GRPO, "_tokenize_prompts", "static_decoder.grpo_rollout: prompts tokenised exactly as TRL does",
            params=("self", "prompts")),
    Private("trl", GRPO, "eos_token_ids", "static_decoder.grpo_rollout: the ids that end a reply, as TRL's",
            instance=True, source=("__init__", "self.eos_token_ids")),
    Private("trl", GRPO, "__init__", "04_train_grpo: the experimental `rollout_func` (static_decoder.grpo_rollout)",
            params=("rollout_func",)),
    Private("trl", GRPO, "_prepare_inputs", "shared_prompt.share_grpo_prompts: wrapped to regroup a generation batch",
            params=("self", "generation_batch")),
    Private("trl", GRPO, "_buffered_inputs", "shared_prompt.share_grpo_prompts: the generation batch's micro-batches",
            instance=True, source=("_prepare_inputs", "self._buffered_inputs")),
    Private("trl", GRPO, "_step", "shared_prompt.share_grpo_prompts: which micro-batch a step takes",
            instance=True, source=("_prepare_inputs", "self._step")),
    Private("trl", GRPO, "_get_per_token_logps_and_entropies",
            "shared_prompt.share_grpo_prompts: replaced by the shared-prompt log-probs, calls the original",
            params=("self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size",
                    "compute_entropy", "compute_aux_loss")),
    Private("trl", GRPO, "_generate", "bench/bench.py: wrapped to time GRPO's rollouts"),
    Private("trl", GRPO, "_generate_and_score_completions",
            "generation_batches.GenerationBatches: wrapped to count the generation batches", params=("self", "inputs")),
    Private("trl", "trl.trainer.utils", "split_tensor_dict", "shared_prompt.share_grpo_prompts: re-cut micro-batches",
            params=("tensor_dict", "num_chunks")),
    Private("trl", "trl.trainer.utils", "add_fused_lm_head",
            "shared_prompt.share_prompt: the forward(fused_lm_head=True) TRL installs, its log_probs/entropy fields"),
    Private("trl", "trl.trainer.utils", "disable_dropout_in_model",
            "rewards.set_up_like_reward_trainer: the pointwise judge set up as RewardTrainer's"),
    Private("trl", "trl.trainer.dpo_trainer:DataCollatorForPreference", "torch_call",
            "shared_prompt.SharedPromptCollator: TRL's batch, then the shared layout", params=("self", "examples")),
    Private("trl", "trl.trainer.dpo_trainer:DataCollatorForPreference", "truncation_mode",
            "shared_prompt.SharedPromptCollator: refuses keep_end"),
    Private("trl", "trl.experimental.orpo", "ORPOTrainer", "04_train_dpo: loss orpo"),
    Private("trl", "trl.experimental.orpo", "ORPOConfig", "04_train_dpo: loss orpo"),
    # transformers
    Private("transformers", TRAINER, "_remove_unused_columns", "token_budget.batch_by_tokens: the Trainer's column filter",
            params=("self", "dataset", "description")),
    Private("transformers", TRAINER, "get_train_dataloader", "token_budget.batch_by_tokens: replaced on the trainer",
            params=("self",)),
    Private("transformers", TRAINER, "get_batch_samples",
            "token_budget.weigh_pairs_per_step: replaced on the trainer to count a step's pairs",
            params=("self", "epoch_iterator", "num_batches", "device")),
    Private("transformers", TRAINER, "_run_epoch", "the same: the epoch loop must fetch micro-batches through it",
            source=("_run_epoch", "self.get_batch_samples")),
    Private("transformers", TRAINER, "compute_loss", "token_budget.weigh_pairs_per_step: replaced on the trainer",
            params=("self", "model", "inputs", "return_outputs", "num_items_in_batch")),
    Private("transformers", TRAINER, "loss_is_scaled_for_ga",
            "token_budget.weigh_pairs_per_step: set so that training_step does not divide the loss again",
            source=("training_step", "self.loss_is_scaled_for_ga")),
    Private("transformers", "transformers.trainer_utils", "seed_worker",
            "token_budget.batch_by_tokens: workers seeded as the Trainer seeds them",
            params=("worker_id", "num_workers", "rank")),
    Private("transformers", "transformers:PretrainedConfig", "_attn_implementation",
            "attn_implementation(): padding_free, shared_prompt, rewards, bench switch attention and back"),
    Private("transformers", LLAMA, "apply_rotary_pos_emb",
            "static_decoder._prefill calls it; model_changes.apply_liger_kernels replaces it module-wide",
            params=("q", "k", "cos", "sin")),
    # the static decoder's Llama-shaped models (static_decoder.FAST_DECODE_MODELS): their layers' internals
    *(Private("transformers", f"{module}:{cls}", attr, f"static_decoder._prefill, decode_step: {what}",
              instance=True, source=("__init__", f"self.{attr}"))
      for module, arch in ((LLAMA, "Llama"), (QWEN2, "Qwen2"))
      for cls, attr, what in ((f"{arch}Attention", "head_dim", f"{arch}'s attention"),
                              (f"{arch}Attention", "scaling", f"{arch}'s attention"),
                              (f"{arch}Model", "rotary_emb", "cos/sin"))),
    Private("transformers", "transformers.activations", "ACT2FN", "decode_step.DecodeStep: Llama's MLP activation"),
    Private("transformers", "transformers.modeling_layers:GradientCheckpointingLayer", "gradient_checkpointing",
            "model_changes.checkpoint_some_layers: the per-layer switch that layers_not_checkpointed turns off"),
    Private("transformers", "transformers.modeling_layers:GradientCheckpointingLayer", "_gradient_checkpointing_func",
            "kept_attention.keep_attention_outputs: each layer's checkpoint function, wrapped to keep attention's outputs",
            instance=True, source=("__init_subclass__", "self._gradient_checkpointing_func(partial(forward")),
    # liger-kernel (GPU stages with liger_kernel: true; checked where it is installed)
    Private("liger-kernel", "liger_kernel.transformers.monkey_patch", "_apply_liger_kernel_to_instance",
            "model_changes.apply_liger_kernels: Liger's kernels in one model, not every model of the process"),
    Private("liger-kernel", "liger_kernel.transformers.rope", "liger_rotary_pos_emb",
            "model_changes.apply_liger_kernels: batch folded in place of Llama's apply_rotary_pos_emb"),
]


def problem(p: Private) -> str | None:
    """What is wrong with `p` on the installed versions, or None."""
    module_name, _, class_name = p.owner.partition(":")
    label = f"{class_name or module_name}.{p.name}"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # trl.experimental warns on import
            owner = importlib.import_module(module_name)
    except ImportError as err:
        return f"module {module_name} cannot be imported ({err})"
    if class_name:
        owner = getattr(owner, class_name, None)
        if owner is None:
            return f"{module_name}.{class_name} is missing"
    if p.source:
        method, text = p.source
        code = getattr(owner, method, None)
        if code is None:
            return f"{class_name}.{method} is missing"
        if text not in inspect.getsource(code):
            return f"{label} is no longer set or read in {class_name}.{method} (no `{text}` there)"
    if not p.instance and not hasattr(owner, p.name):
        return f"{label} is missing"
    if p.params:
        names = list(inspect.signature(getattr(owner, p.name)).parameters)
        rest = iter(names)
        if not all(name in rest for name in p.params):  # each in turn, in this order
            return f"{label} takes ({', '.join(names)}), the pipeline relies on ({', '.join(p.params)})"
    return None


def _checked(library: str) -> bool:
    module = LIBRARIES[library][0]
    if library == "liger-kernel":  # imported only once a GPU stage applies it: checked wherever installed
        return importlib.util.find_spec(module) is not None
    return module in sys.modules  # stage 01 imports neither, and importing them would cost it seconds


def check() -> None:
    """Raise one CompatError naming every missing or changed name, by library, with the installed and
    tested versions. Only the libraries the stage has imported are checked (liger-kernel: installed)."""
    found: dict[str, list[str]] = {}
    for p in NAMES:
        if _checked(p.library) and (why := problem(p)):
            found.setdefault(p.library, []).append(f"{why} (used by {p.used})")
    if found:
        raise CompatError("; ".join(
            f"{library} {_installed(library)} is installed and lacks what the pipeline relies on: "
            f"{'; '.join(whys)}. It is tested with {library} {LIBRARIES[library][1]} (requirements.txt); "
            f"install that, or update common/trl_compat.py and its users" for library, whys in found.items()))


def _installed(library: str) -> str:
    try:
        return version(library)
    except PackageNotFoundError:
        return "(version unknown)"


# Accessors -------------------------------------------------------------------------------------

def attn_implementation(model) -> str:
    """The attention a model runs (transformers keeps it private; `set_attn_implementation` changes it)."""
    return model.config._attn_implementation


def keep_column(trainer, name: str) -> None:
    """`name` kept by the trainer's column filter, which would drop any column its model does not take."""
    trainer._set_signature_columns_if_needed()
    trainer._signature_columns = list(trainer._signature_columns) + [name]


def remove_unused_columns(trainer, data, description: str | None = None):
    """`data` as the trainer's column filter leaves it for its collator."""
    return trainer._remove_unused_columns(data, description=description)
