"""Tasks: each module knows how to read its source rows, build prompts and targets, and its extra
metrics. Stages look a task up by name here and never branch on it.

What a task module holds is the `Task` Protocol of common/tasks/protocol.py (its hooks, typed, and
`EvalReport`, what stage 05's `evaluate` returns); docs/architecture.md, "Adding a task", walks
through one. The registry maps a task's name to its module, imported on first use, so that
common/config.py can check a `task` name here without importing a task (each imports the config).
"""
from __future__ import annotations

import importlib

TASKS = {"cmv": "common.tasks.cmv", "review": "common.tasks.review"}


def get_task(name: str):
    """The task module registered under `name`."""
    if name not in TASKS:
        raise ValueError(f"unknown task '{name}' (known: {', '.join(sorted(TASKS))})")
    return importlib.import_module(TASKS[name])
