"""FastArgs: the config fields the performance code (common/fast/) may read, each declaring in its `arg(...)`
what `fast_paths: false` makes of it (`plain=`: the value that switches its fast path off, or KEPT). The
code there reads no other field and changes none; `PLAIN_PATHS` is derived from the declarations; the rest
of the pipeline reaches common/fast/ through its face only; and the memory plan is set on the config
before the trainer is built, so that config.yaml says what ran."""
from __future__ import annotations

import ast
import dataclasses
import json
import logging
import typing

import pytest
import yaml
from conftest import REPO, run_dir_of, run_in_process

from common import config as config_module
from common.cli import help_text
from common.config import (
    KEPT,
    PLAIN_PATHS,
    STAGE_CONFIGS,
    ConfigError,
    DPOStageConfig,
    SFTStageConfig,
    fast_args,
    load_run_config,
    plain_values,
    type_ok,
)
from common.fast import memory_plan
from common.runs import Run, settle

FAST = sorted((REPO / "common" / "fast").glob("*.py"))
CONFIG_CLASSES = {name for name, value in vars(config_module).items()
                  if isinstance(value, type) and dataclasses.is_dataclass(value)}
# The least each stage config needs to be built.
REQUIRED = {"Pairs": {}, "SFT": {"pairs_run": "p"}, "Reward": {"pairs_run": "p"},
            "GRPO": {"sft_run": "s", "reward_run": "r"}, "DPO": {"sft_run": "s"}, "ORPO": {"sft_run": "s", "loss": "orpo"},
            "Eval": {"pairs_run": "p", "reward_run": "r"}}


def config_uses(path) -> list[tuple[str, str, int]]:
    """(field, "read" or "write", line) for every use of the stage config in `path`: `config.X`, and
    getattr/hasattr/setattr(config, "X"). A config taken under another name, or a field named at run time,
    is a use that cannot be checked: ("?", why, line)."""
    uses = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "config":
            uses.append((node.attr, "write" if isinstance(node.ctx, (ast.Store, ast.Del)) else "read", node.lineno))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "hasattr", "setattr") and node.args \
                and isinstance(node.args[0], ast.Name) and node.args[0].id == "config":
            name = node.args[1]
            if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
                uses.append(("?", "a field named at run time", node.lineno))
            else:
                uses.append((name.value, "write" if node.func.id == "setattr" else "read", node.lineno))
        elif isinstance(node, ast.arg) and node.annotation is not None and node.arg != "config":
            named = {n.id for n in ast.walk(node.annotation) if isinstance(n, ast.Name)}
            if named & CONFIG_CLASSES:
                uses.append(("?", f"a config taken as '{node.arg}'", node.lineno))
    return uses


def test_the_fast_code_reads_only_fast_args_and_changes_none():
    declared = {}  # field -> the stage configs that have it, and whether each declares it FastArgs
    for cls in set(STAGE_CONFIGS.values()):
        fast = fast_args(cls)
        for f in dataclasses.fields(cls):
            declared.setdefault(f.name, []).append((cls.__name__, f.name in fast))
    read = set()
    for path in FAST:
        for name, use, line in config_uses(path):
            where = f"{path.relative_to(REPO)}:{line}"
            assert name != "?", f"{where}: {use}; the fast code takes the stage config as `config`, by field name"
            assert use == "read", f"{where}: sets config.{name}; the fast code returns what it decides (the stage sets it)"
            assert name in declared, f"{where}: config.{name} is no config field"
            undeclared = [cls for cls, fast in declared[name] if not fast]
            assert not undeclared, f"{where}: config.{name} is read by the fast code but not a FastArgs field of " \
                                   f"{', '.join(undeclared)}: declare it with arg(..., plain=...)"
            read.add(name)
    # the walk sees what it should: the switch, a fast path's field, a lever, a shape
    assert {"fast_paths", "pair_in_one_sequence", "offload_activations", "max_length", "memory_levers"} <= read


def test_config_uses_sees_reads_writes_and_other_names(tmp_path):
    code = tmp_path / "code.py"
    code.write_text("def f(config, cfg: SFTStageConfig):\n    config.a = config.b + getattr(config, 'c', 0)\n"
                    "    getattr(config, name)\n")
    assert sorted(config_uses(code)) == [("?", "a config taken as 'cfg'", 1), ("?", "a field named at run time", 3),
                                         ("a", "write", 2), ("b", "read", 2), ("c", "read", 2)]


def test_plain_paths_are_what_the_declarations_say():
    union = {}
    for stage, cls in STAGE_CONFIGS.items():
        hints = typing.get_type_hints(cls)
        plain = plain_values(cls)
        for name, value in plain.items():  # a value the field takes, and not KEPT
            assert type_ok(value, hints[name]) and value is not KEPT, (stage, name, value)
        union.update(plain)
        # fast_paths false changes exactly the declared fields, each to its plain value
        fast, slow = cls(**REQUIRED[stage]), cls(**REQUIRED[stage], fast_paths=False)
        changed = {f.name for f in dataclasses.fields(cls) if getattr(fast, f.name) != getattr(slow, f.name)}
        assert changed == {"fast_paths"} | {n for n in plain if getattr(fast, n) != plain[n]}, stage
        assert all(getattr(slow, n) == value for n, value in plain.items()), stage
    assert PLAIN_PATHS == union and {"pair_in_one_sequence", "memory_levers", "rollout_backend"} <= set(PLAIN_PATHS)
    shown = help_text(DPOStageConfig, "")  # --help names each plain value, and only those
    assert "  --pair_in_one_sequence (bool; default true; fast_paths false: false)" in shown
    assert "  --max_length (int; default 768)" in shown and "  --beta (float; default 0.1)" in shown


def test_outside_common_fast_the_pipeline_goes_through_its_face():
    """Stage scripts and common/ modules import `common.fast` (its __init__'s names), never a module inside it."""
    bypasses = []
    for path in [*REPO.glob("0*.py"), *(REPO / "common").rglob("*.py")]:
        if FAST[0].parent in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            bypasses += [f"{path.relative_to(REPO)}:{node.lineno} {m}" for m in modules if m.startswith("common.fast.")]
    assert not bypasses, bypasses


@pytest.mark.stage
def test_config_yaml_says_the_memory_plan_that_ran(tiny_model, pairs_run, tmp_path, monkeypatch):
    """memory_levers fit on a GPU whose budget leaves room for one layer's activations (the tiny model's
    estimates; on this CPU, the GPU's room is given): checkpointing on, the last layer not checkpointed,
    unlike the recipe. config.yaml says those levers, the manifest's plan says them, and the trainer ran them."""
    def room(config, model):
        peaks = memory_plan.estimates(config, model, allocated=0)
        return (peaks["checkpoint"] + peaks["per_kept_layer"] + peaks["keep_all"]) / 2, 0  # room for one, not two
    monkeypatch.setattr(memory_plan, "room", room)
    recipe = yaml.safe_load((REPO / "configs/tiny/02_train_sft.yaml").read_text())
    assert recipe["gradient_checkpointing"] is False and "layers_not_checkpointed" not in recipe
    proc = run_in_process("02_train_sft.py", "--config", "configs/tiny/02_train_sft.yaml", "--pairs_run", pairs_run,
                          "--runs_dir", tmp_path, "--memory_levers", "fit", "--max_steps", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = run_dir_of(proc)
    manifest = json.loads((run / "manifest.json").read_text())
    plan, ran = manifest["memory_plan"], load_run_config(run)
    assert plan["levers"] == "fit" and plan["plan"] == "checkpoint_some"
    assert (ran.gradient_checkpointing, ran.layers_not_checkpointed) == (True, 1) == \
        (plan["gradient_checkpointing"], plan["layers_not_checkpointed"])
    assert (ran.offload_activations, ran.offload_keep_gib) == (plan["offload_activations"], plan["offload_keep_gib"])
    assert "layers_not_checkpointed" in manifest["backends"]["patches"]  # applied: the trainer ran the plan
    assert ran.memory_levers == "fit" and ran.max_steps == 1  # the rest as the command line gave it


@pytest.mark.stage
def test_settle_checks_first_and_rewrites_only_what_changed(pairs_run, tmp_path):
    config = SFTStageConfig(pairs_run=str(pairs_run), runs_dir=str(tmp_path), gradient_checkpointing=False)
    run = Run("SFT", config, {}, inputs={"pairs_run": pairs_run}, argv=["test"])
    try:
        written = (run.dir / "config.yaml").read_text()
        settle(run, config, {"gradient_checkpointing": False})  # as set already: nothing to write
        assert (run.dir / "config.yaml").read_text() == written
        with pytest.raises(ConfigError, match="layers_not_checkpointed"):
            settle(run, config, {"gradient_checkpointing": True, "layers_not_checkpointed": -1})
        assert (config.gradient_checkpointing, config.layers_not_checkpointed) == (False, 0)  # left whole
        settle(run, config, {"gradient_checkpointing": True, "layers_not_checkpointed": 1})
        assert yaml.safe_load((run.dir / "config.yaml").read_text()) == \
            {**yaml.safe_load(written), "gradient_checkpointing": True, "layers_not_checkpointed": 1}
        assert (config.gradient_checkpointing, config.layers_not_checkpointed) == (True, 1)
        assert not list(run.dir.glob("*.tmp"))
    finally:
        logging.getLogger().removeHandler(run._handler)
        run._handler.close()
        run._lock.close()
