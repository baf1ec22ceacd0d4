"""Tasks: each module knows how to read its source rows, build prompts and targets, and its extra
metrics. Stages look a task up by name here and never branch on it."""
from common.tasks import cmv

TASKS = {cmv.NAME: cmv}


def get_task(name: str):
    if name not in TASKS:
        raise ValueError(f"unknown task '{name}' (known: {', '.join(sorted(TASKS))})")
    return TASKS[name]
