"""Strict dataclass configs: YAML under configs/, overridden by `--field value` on the command line.

Every stage has one flat dataclass. An unknown key in the YAML or on the command line is an error
that names it, so a typo never silently falls back to a default. The overrides are returned so that
the run's manifest can record exactly what differed from the YAML.
"""
from __future__ import annotations

import dataclasses
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml


class ConfigError(ValueError):
    pass


@dataclass
class RunArgs:
    """Fields every stage has (DESIGN.md: common fields)."""
    runs_dir: str = "runs"
    run_name: str | None = None
    seed: int = 42
    report_to: str = "none"  # "wandb" or "none"
    wandb_project: str = "persuasion-pipeline"
    wandb_group: str | None = None  # default: inherited from the input runs (one group per pipeline)
    resume: str | None = None  # an unfinished run directory of this stage to continue


@dataclass
class ModelArgs:
    """The one base model every stage starts from, and its LoRA. Part of the base fingerprint."""
    model_name_or_path: str = "meta-llama/Meta-Llama-3-8B-Instruct"
    lora_r: int = 64
    lora_alpha: int = 16
    lora_dropout: float = 0.05
    lora_target_modules: list[str] = field(default_factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    attn_implementation: str = "sdpa"


@dataclass
class TrainArgs:
    """Optimisation fields shared by the training stages (02, 03, 04)."""
    learning_rate: float = 2e-4
    num_train_epochs: float = 1.0
    max_steps: int = -1
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    warmup_ratio: float = 0.03
    lr_scheduler_type: str = "cosine"
    weight_decay: float = 0.0
    gradient_checkpointing: bool = True
    group_by_length: bool = False  # batches of similar length: little padding on real-length data
    offload_activations: bool = False  # checkpointed layer inputs in CPU memory (very long inputs)
    liger_kernel: bool = False  # Liger's Triton RMSNorm/SwiGLU/RoPE kernels (GPU; package liger-kernel)
    mlp_chunk_tokens: int = 0  # > 0: MLPs run in checkpointed pieces of this many tokens (very long inputs)
    logging_steps: int = 10
    save_steps: int = 200
    max_train_examples: int | None = None  # a slice of the train split (demo, smoke runs)


def _type_ok(value, annotation) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if origin is list:
        (inner,) = typing.get_args(annotation)
        return isinstance(value, list) and all(_type_ok(v, inner) for v in value)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, annotation)


def _coerce(name: str, value, annotation, where: str):
    if float in (annotation, *typing.get_args(annotation)) and isinstance(value, str):
        try:  # YAML 1.1 reads "1e-4" (no dot) as a string
            value = float(value)
        except ValueError:
            pass
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not _type_ok(value, annotation):
        raise ConfigError(f"{where}: field '{name}' expects {annotation}, got {value!r}")
    return value


def parse_config(cls, argv: list[str] | None = None):
    """Build `cls` from `--config FILE` plus `--field value` overrides.

    Returns (config, overrides) where overrides maps each overridden field to its new value.
    Values on the command line are read as YAML scalars (`--lora_r 16`, `--learning_rate 1e-4`);
    a list field takes several words (`--data a.jsonl b.jsonl`); all are type-checked.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    values: dict = {}

    pairs = []  # (field, raw value) in command-line order; a list field takes every value up to the next --
    i = 0
    while i < len(argv):
        key = argv[i]
        if not key.startswith("--"):
            raise ConfigError(f"command line: expected --field, got {key!r}")
        key, _, inline = key[2:].replace("-", "_").partition("=")
        values_end = i + 1
        while values_end < len(argv) and not argv[values_end].startswith("--"):
            values_end += 1
        raws = [inline] if inline else argv[i + 1:values_end]
        if not raws:
            raise ConfigError(f"command line: --{key} needs a value")
        if len(raws) > 1 and not _is_list(hints.get(key)):
            raise ConfigError(f"command line: --{key} takes one value, got {raws}")
        pairs.append((key, raws))
        i = i + 1 if inline else values_end

    config_path = None
    for key, raws in pairs:
        if key == "config":
            config_path = raws[0]
    if config_path is not None:
        path = Path(config_path)
        if not path.is_file():
            raise ConfigError(f"--config: no such file {path}")
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: expected a mapping of fields")
        for key, value in loaded.items():
            if key not in names:
                raise ConfigError(f"{path}: unknown field '{key}' (known: {', '.join(sorted(names))})")
            values[key] = _coerce(key, value, hints[key], str(path))

    overrides = {}
    for key, raws in pairs:
        if key == "config":
            continue
        if key not in names:
            raise ConfigError(f"command line: unknown field '--{key}' (known: {', '.join(sorted(names))})")
        values[key] = overrides[key] = _coerce(key, _parse_raw(raws, hints[key]), hints[key], "command line")

    try:
        config = cls(**values)
    except TypeError as err:  # a required field without a default
        raise ConfigError(f"{cls.__name__}: {err}") from None
    return config, overrides


def _accepts_str(annotation) -> bool:
    return annotation is str or str in typing.get_args(annotation)


def _is_list(annotation) -> bool:
    return typing.get_origin(annotation) is list or any(typing.get_origin(a) is list for a in typing.get_args(annotation))


def _parse_raw(raws: list[str], annotation):
    """Command-line strings -> a value: list fields (all lists of strings) take each word or a YAML
    list, string fields keep the text, anything else is read as YAML; `null` is None."""
    if _is_list(annotation):
        return yaml.safe_load(raws[0]) if len(raws) == 1 and raws[0].startswith("[") else list(raws)
    (raw,) = raws
    if raw.lower() in ("null", "~"):
        return None
    return raw if _accepts_str(annotation) else yaml.safe_load(raw)


def to_dict(config) -> dict:
    return dataclasses.asdict(config)
