"""Weights & Biases for a run: online when WANDB_API_KEY is set, else offline inside the run
directory (`wandb sync RUN_DIR/wandb/offline-run-*` uploads it later). The W&B run is named after
the run directory; all runs of one pipeline share a group. Nothing here is needed for the run
directory's own record (metrics.json, run.log), which is written W&B or not."""
from __future__ import annotations

import os

from common.config import to_dict


def start(run) -> None:
    if run.config.report_to != "wandb" or not run.is_main:
        return
    import wandb
    if not os.environ.get("WANDB_API_KEY"):
        os.environ["WANDB_MODE"] = "offline"
    os.environ["WANDB_DIR"] = str(run.dir)
    os.environ.setdefault("WANDB_CACHE_DIR", str(run.dir / "wandb" / "cache"))
    os.environ.setdefault("WANDB_SILENT", "true")
    (run.dir / "wandb").mkdir(exist_ok=True)
    resume_id = run.manifest.get("wandb_run_id")  # a resumed run continues its own W&B run
    wb = wandb.init(project=run.config.wandb_project, name=run.dir.name, dir=str(run.dir),
                    group=run.manifest["wandb_group"], job_type=run.stage, config=to_dict(run.config),
                    id=resume_id, resume="allow" if resume_id else None)
    run.manifest["wandb_run_id"] = wb.id
    run.save_manifest()


def update_config(config, changed: dict) -> None:
    """Settings decided after the W&B run started (the memory plan's levers), as config.yaml has them."""
    if config.report_to == "wandb":
        import wandb
        if wandb.run is not None:
            wandb.config.update(changed, allow_val_change=True)


def log_summary(config, metrics: dict) -> None:
    if config.report_to == "wandb":
        import wandb
        if wandb.run is not None:
            wandb.run.summary.update(flatten(metrics))


def finish(config) -> None:
    if config.report_to == "wandb":
        import wandb
        if wandb.run is not None:
            wandb.finish()


def flatten(metrics: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in metrics.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float, str, bool)) or value is None:
            out[f"{prefix}{key}"] = value
    return out
