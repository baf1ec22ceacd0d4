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
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not _type_ok(value, annotation):
        raise ConfigError(f"{where}: field '{name}' expects {annotation}, got {value!r}")
    return value


def parse_config(cls, argv: list[str] | None = None):
    """Build `cls` from `--config FILE` plus `--field value` overrides.

    Returns (config, overrides) where overrides maps each overridden field to its new value.
    Values on the command line are read as YAML scalars/lists (`--lora_r 16`, `--report_to none`,
    `--adapters [a, b]`), then type-checked against the dataclass.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    values: dict = {}

    pairs = []
    i = 0
    while i < len(argv):
        key = argv[i]
        if not key.startswith("--"):
            raise ConfigError(f"command line: expected --field, got {key!r}")
        key = key[2:].replace("-", "_")
        if "=" in key:
            key, raw = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(argv):
                raise ConfigError(f"command line: --{key} needs a value")
            raw = argv[i + 1]
            i += 2
        pairs.append((key, raw))

    config_path = None
    for key, raw in pairs:
        if key == "config":
            config_path = raw
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
    for key, raw in pairs:
        if key == "config":
            continue
        if key not in names:
            raise ConfigError(f"command line: unknown field '--{key}' (known: {', '.join(sorted(names))})")
        value = raw if hints[key] is str else yaml.safe_load(raw)
        if hints[key] in (str, str | None) and value is not None and not isinstance(value, str):
            value = raw
        values[key] = overrides[key] = _coerce(key, value, hints[key], "command line")

    try:
        config = cls(**values)
    except TypeError as err:  # a required field without a default
        raise ConfigError(f"{cls.__name__}: {err}") from None
    return config, overrides


def to_dict(config) -> dict:
    return dataclasses.asdict(config)
