"""The command line of every stage: `--config FILE` plus `--field value` overrides, `--resume DIR`,
`--help`, and the one-line `error: ...` for bad settings, inputs and data.

    python 0N_<stage>.py --config configs/<recipe>/0N_<stage>.yaml [--field value ...]
    python 0N_<stage>.py --resume runs/Nov30_SFT_Run3        # the run's own settings

An unknown key, in the file or on the command line, is an error that names it. The overrides are
returned so that the run's manifest records exactly what differed from the YAML. A resumed run
keeps the settings in its own `config.yaml`: a value given again must be the same.
"""
from __future__ import annotations

import dataclasses
import errno
import logging
import os
import sys
import typing
from pathlib import Path

import yaml

from common.config import (
    STAGE_CONFIGS,
    ConfigError,
    describe,
    load_yaml,
    plain_values,
    read_config_text,
    shown,
    type_ok,
    under_current_names,
    unknown_field_hint,
)
from common.data import DataError, read_manifest

log = logging.getLogger("pipeline")
NOT_COMPARED_ON_RESUME = ("resume", "run_name")  # how the run was found, not how it runs


def parse_config(cls, argv: list[str] | None = None):
    """Build `cls` from `--config FILE` (or `--resume DIR`'s config.yaml) plus `--field value`
    overrides. Returns (config, overrides). Command-line values are read as YAML scalars
    (`--lora_r 16`, `--learning_rate 1e-4`); a list field takes several words (`--data a b`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    pairs = _split_argv(argv, hints)
    given = dict(pairs)
    for key in given:
        if key != "config" and key not in names:
            raise ConfigError(f"command line: unknown field '--{key}' {unknown_field_hint(cls, key)}")
    if cls.STAGE and "config" not in given and "resume" not in given:
        raise ConfigError("--config is required: a recipe, configs/<recipe>/0N_<stage>.yaml "
                          "(or --resume RUN_DIR to continue a run)")

    values, sources = {}, {}
    if "config" in given:
        path = Path(given["config"][0])
        for key, value in _read_yaml(path, cls, names).items():
            values[key], sources[key] = _coerce(key, value, hints[key], str(path)), str(path)
    overrides = {}
    for key, raws in pairs:
        if key == "config":
            continue
        values[key] = overrides[key] = _coerce(key, _parse_raw(key, raws, hints[key]), hints[key], "command line")
        sources[key] = "command line"

    if values.get("resume"):
        values = _bind_to_run(cls, Path(values["resume"]), values, sources, names, hints)
        overrides = {"resume": values["resume"]}
    try:
        config = cls(**values)
        if hasattr(config, "check_given") and not values.get("resume"):  # what was set, not only its value
            config.check_given(set(sources))
    except ConfigError as err:
        where = sources.get(err.field, "config")
        raise ConfigError(f"{where}: {err}", err.field) from None
    return config, overrides


def _split_argv(argv: list[str], hints: dict) -> list[tuple[str, list[str]]]:
    """(field, raw values) in command-line order; a list field takes every value up to the next --.
    A field given twice is refused: the later value would silently replace the earlier one."""
    pairs, i = [], 0
    while i < len(argv):
        key = argv[i]
        if not key.startswith("--"):
            raise ConfigError(f"command line: expected --field, got {key!r}")
        key, _, inline = key[2:].partition("=")
        key = key.replace("-", "_")  # --lora-r is --lora_r; the value keeps its dashes (paths, file names)
        if any(k == key for k, _ in pairs):
            raise ConfigError(f"command line: --{key} is given twice; give each field once")
        end = i + 1
        while end < len(argv) and not argv[end].startswith("--"):
            end += 1
        raws = [inline] if inline else argv[i + 1:end]
        if not raws:
            raise ConfigError(f"command line: --{key} needs a value")
        if len(raws) > 1 and not _is_list(hints.get(key)):
            raise ConfigError(f"command line: --{key} takes one value, got {raws}")
        pairs.append((key, raws))
        i = i + 1 if inline else end
    return pairs


def _read_yaml(path: Path, cls, names: set, written_by_run: bool = False) -> dict:
    """A config file's fields; a run's own config.yaml (`written_by_run`) under today's names."""
    if not path.is_file():
        raise ConfigError(f"--config: no such file {path}")
    loaded = load_yaml(read_config_text(path), str(path))
    if loaded is None:  # every field would take its default, the model a hub id: nothing falls back to that
        raise ConfigError(f"{path}: the config is empty; give a recipe (configs/<recipe>/0N_<stage>.yaml)")
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: expected a mapping of fields")
    if written_by_run:
        loaded = under_current_names(cls, loaded, str(path))
    for key in loaded:
        if key not in names:
            raise ConfigError(f"{path}: unknown field '{key}' {unknown_field_hint(cls, key)}")
    return loaded


def _bind_to_run(cls, run_dir: Path, requested: dict, sources: dict, names: set, hints: dict) -> dict:
    """--resume: the run's own stage and settings. A value asked for again must equal the run's."""
    if (run_dir / "DONE").exists():
        raise ConfigError(f"--resume {run_dir}: that run is finished (DONE); a finished run is never modified")
    if not (run_dir / "manifest.json").is_file() or not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"--resume {run_dir}: not a run directory (no manifest.json and config.yaml)")
    try:
        stage = read_manifest(run_dir).get("stage")
    except DataError as err:
        raise ConfigError(f"--resume {run_dir}: {err}") from None
    if STAGE_CONFIGS.get(stage) is not cls:
        raise ConfigError(f"--resume {run_dir}: that is a {stage} run; this script continues {cls.STAGE} runs only")
    recorded = _read_yaml(run_dir / "config.yaml", cls, names, written_by_run=True)
    for key, value in requested.items():
        if key in NOT_COMPARED_ON_RESUME:
            continue
        theirs = _coerce(key, recorded.get(key), hints[key], str(run_dir / "config.yaml"))
        if value != theirs:
            raise ConfigError(f"--resume {run_dir}: field '{key}' is {value!r} ({sources[key]}) but {theirs!r} in "
                              f"the run's config.yaml; a resumed run keeps its settings (start a new run to change them)")
    return {**recorded, "resume": str(run_dir)}


def _coerce(name: str, value, annotation, where: str):
    if float in (annotation, *typing.get_args(annotation)) and isinstance(value, str):
        try:  # YAML 1.1 reads "1e-4" (no dot) as a string
            value = float(value)
        except ValueError:
            pass
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not type_ok(value, annotation):
        raise ConfigError(f"{where}: field '{name}' expects {describe(annotation)}, got {shown(value)}", name)
    return value


def _accepts_str(annotation) -> bool:
    return annotation is str or str in typing.get_args(annotation) or \
        any(isinstance(a, str) for a in typing.get_args(annotation))  # Literal choices


def _is_list(annotation) -> bool:
    return typing.get_origin(annotation) is list or any(typing.get_origin(a) is list for a in typing.get_args(annotation))


def _list_item(annotation):
    lists = [annotation] if typing.get_origin(annotation) is list else \
        [a for a in typing.get_args(annotation) if typing.get_origin(a) is list]
    return (typing.get_args(lists[0]) or (str,))[0]


def _parse_raw(key: str, raws: list[str], annotation):
    """Command-line strings -> a value: list fields take each word (read as its item type: `--reward_weights
    1 0.5`) or a YAML list, string fields keep the text, anything else is read as YAML; `null` is None."""
    where = f"command line: --{key}"
    if _is_list(annotation):
        if len(raws) == 1 and raws[0].startswith("["):
            return load_yaml(raws[0], where)
        item = _list_item(annotation)
        return [raw if _accepts_str(item) else _parse_raw(key, [raw], item) for raw in raws]
    (raw,) = raws
    if raw.lower() in ("null", "~"):
        return None
    if _accepts_str(annotation):
        return raw
    try:
        return load_yaml(raw, where)
    except ConfigError:
        return raw  # the type check names the field


def help_text(cls, doc: str) -> str:
    """The stage's docstring, then every field with its type, default and help: the stage's own
    fields first, then each shared group."""
    lines = [doc.strip(), "", "Options (in the YAML of --config, or as --field value):"]
    hints, fields, done = typing.get_type_hints(cls), {f.name: f for f in dataclasses.fields(cls)}, set()
    plains = plain_values(cls)  # each fast path's field, with the value fast_paths false sets
    for klass in cls.__mro__:
        names = [n for n in vars(klass).get("__annotations__", {}) if n in fields and n not in done]
        if not names:
            continue
        lines += ["", f"{klass.__name__}: {(klass.__doc__ or '').strip().splitlines()[0]}"]
        for name in names:
            f = fields[name]
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            plain = f"; fast_paths false: {yaml.safe_dump(plains[name]).splitlines()[0]}" if name in plains else ""
            lines.append(f"  --{name} ({describe(hints[name])}; default {yaml.safe_dump(default).splitlines()[0]}{plain})")
            if f.metadata.get("help"):
                lines.append(f"      {f.metadata['help']}")
            done.add(name)
    return "\n".join(lines)


CUDA_ALLOC_CONF = "expandable_segments:True"
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)  # the disk or the user's quota is full: not a bug, one line
# The oldest release of each library whose private hooks the stages use (trainer patches, token-budget
# batches: `Trainer.training_step` reads `loss_is_scaled_for_ga` from transformers 5.19 on).
MIN_VERSIONS = {"transformers": "5.19.0", "trl": "1.16.0"}


def check_versions() -> None:
    """One `error:` line at start-up when an installed library is older than the stages can work with."""
    from importlib.metadata import version

    from packaging.version import Version
    for name, oldest in MIN_VERSIONS.items():
        if Version(version(name)) < Version(oldest):
            raise ConfigError(f"{name} {version(name)} is installed; the stages need {name} >= {oldest} "
                              f"(requirements.txt pins the tested versions)")


def check_private_names() -> None:
    """One `error:` line at start-up when a TRL or transformers release lacks a private name the stages
    rely on (common/trl_compat.py lists them)."""
    from common import trl_compat
    try:
        trl_compat.check()
    except trl_compat.CompatError as err:
        raise ConfigError(str(err)) from None


def cli(main, config_cls, doc: str = "") -> None:
    """Entry point of a stage: `--help`, then main(config, overrides). Bad settings, inputs and data
    end with one `error: ...` line (also written to the run's log when the run directory exists)."""
    from common.data import DataError
    from common.runs import RunError
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(help_text(config_cls, doc))
        return
    # Before CUDA's allocator starts: one growable segment instead of fixed ones, so that batches of
    # varying shapes (GRPO's premises, real-length micro-batches) reuse freed memory rather than
    # reserving more each step (docs/performance.md). A value the user set is kept; the manifest records it.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", CUDA_ALLOC_CONF)
    try:
        check_versions()
        check_private_names()
        main(*parse_config(config_cls))
    except (ConfigError, RunError, DataError) as err:
        _to_run_log(f"error: {err}")
        sys.exit(f"error: {err}")
    except OSError as err:
        if err.errno not in DISK_FULL:
            _to_run_log("the stage failed", sys.exc_info())
            raise
        # not written to run.log: there is no room for it
        where = f"{err.filename}: " if err.filename else _run_dir_named()
        sys.exit(f"error: {where}{err.strerror or err} (errno {err.errno}); the run is left unfinished, "
                 f"without DONE: free space, then run the stage again")
    except Exception:  # a bug: its traceback goes to run.log too, then to the terminal as usual
        _to_run_log("the stage failed", sys.exc_info())
        raise


def _run_dir_named() -> str:
    """`in RUN_DIR: ` for an error without a file name (a full disk on a write's flush): the run's folder."""
    for handler in reversed(logging.getLogger().handlers):  # the run's own log: the newest run.log
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).name == "run.log":
            return f"writing in {Path(handler.baseFilename).parent}: "
    return "writing the run directory: "


def _to_run_log(message: str, exc_info=None) -> None:
    """The run's log file (when a run directory exists) says why the run failed."""
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, message, None, exc_info)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)
