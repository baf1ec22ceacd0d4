"""Run directories: dated, numbered, created atomically, never overwritten.

A run directory holds `config.yaml` (written first), `manifest.json`, `run.log`, `metrics.json`,
the artifacts, and `DONE` (written last). Later stages accept only inputs that have `DONE`, and only
inputs built on the same base model (the base lock).
"""
from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

from common.config import to_dict

log = logging.getLogger("pipeline")

PACKAGES = ["torch", "transformers", "trl", "peft", "bitsandbytes", "datasets", "accelerate",
            "sacrebleu", "rouge-score", "wandb"]


class RunError(RuntimeError):
    pass


def run_dir_name(stage: str, n: int, today: datetime.date | None = None) -> str:
    today = today or datetime.date.today()
    return f"{today.strftime('%b')}{today.day:02d}_{stage}_Run{n}"


def create_run_dir(runs_dir: str | Path, stage: str, run_name: str | None = None) -> Path:
    """Create a new run directory with a plain mkdir: two runs can never share one."""
    runs_dir = Path(runs_dir)
    runs_dir.mkdir(parents=True, exist_ok=True)
    if run_name is not None:
        path = runs_dir / run_name
        try:
            path.mkdir()
        except FileExistsError:
            raise RunError(f"run directory {path} already exists; runs are never overwritten "
                           f"(pick another --run_name, or --resume it if it is unfinished)") from None
        return path
    prefix = run_dir_name(stage, 0)[: -1]  # "Nov30_SFT_Run"
    taken = [int(m.group(1)) for p in runs_dir.iterdir()
             if (m := re.fullmatch(re.escape(prefix) + r"(\d+)", p.name))]
    n = max(taken, default=0) + 1
    while True:  # another process may take the same number between listing and mkdir
        path = runs_dir / f"{prefix}{n}"
        try:
            path.mkdir()
            return path
        except FileExistsError:
            n += 1


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def sha256_run(run_dir: Path) -> str:
    """One digest over a finished run's artifacts (names and contents), logs and trackers excluded."""
    digest = hashlib.sha256()
    for path in sorted(run_dir.rglob("*")):
        rel = path.relative_to(run_dir)
        if not path.is_file() or rel.parts[0] in ("wandb", "checkpoints") or path.name == "run.log":
            continue
        digest.update(str(rel).encode() + b"\0" + sha256_file(path).encode() + b"\0")
    return digest.hexdigest()


def _git_state() -> dict:
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True,
                                    text=True, check=True).stdout.strip())
        return {"commit": commit, "dirty": dirty}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _gpu() -> str | None:
    import torch
    if not torch.cuda.is_available():
        return None
    return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"


def write_json(path: Path, data) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    tmp.replace(path)


def read_json(path: Path):
    return json.loads(Path(path).read_text())


class Run:
    """The run directory of one stage invocation, from its config to its DONE marker."""

    def __init__(self, stage: str, config, overrides: dict, inputs: dict | None = None,
                 argv: list[str] | None = None):
        """`inputs` maps a name to an input run directory (must be DONE) or a data file; all are
        checked before anything is created. Their manifests are in `self.inputs`."""
        self.stage = stage
        self.config = config
        self.inputs = {name: _check_input(name, path) for name, path in (inputs or {}).items()}
        # Under a multi-process launch (accelerate launch, torchrun) every process runs the stage:
        # rank 0 creates and writes the run directory, the others only use it (its checkpoints).
        self.is_main = int(os.environ.get("RANK", "0")) == 0
        if not self.is_main:
            self._follow(config)
            return
        if config.resume:
            self.dir = Path(config.resume)
            if not (self.dir / "config.yaml").is_file():
                raise RunError(f"--resume {self.dir}: not a run directory (no config.yaml)")
            if (self.dir / "DONE").exists():
                raise RunError(f"--resume {self.dir}: that run is finished (DONE); a finished run is never modified")
            self.manifest = read_json(self.dir / "manifest.json")
            self.manifest.setdefault("resumed", []).append(
                {"argv": list(sys.argv if argv is None else argv), "at": _now(),
                 "slurm_job_id": os.environ.get("SLURM_JOB_ID")})
        else:
            self.dir = create_run_dir(config.runs_dir, stage, config.run_name)
            (self.dir / "config.yaml").write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
            self.manifest = {
                "stage": stage,
                "run_name": self.dir.name,
                "argv": list(sys.argv if argv is None else argv),
                "overrides": overrides,
                "created": _now(),
                "git": _git_state(),
                "seed": config.seed,
                "packages": _versions(),
                "host": socket.gethostname(),
                "gpu": _gpu(),
                "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
                "wandb_run_id": None,
                "wandb_group": config.wandb_group,
                "inputs": {},
                "base": None,
            }
        self._attach_log()
        for name, path in (inputs or {}).items():
            self._record_input(name, Path(path))
        # One W&B group per pipeline: given, else inherited from the inputs, else this (first) run.
        self.manifest["wandb_group"] = self.manifest.get("wandb_group") or self.dir.name
        self.save_manifest()
        log.info("run directory %s", self.dir)

    def _follow(self, config) -> None:
        """Not rank 0: wait for rank 0's run directory; write nothing in it."""
        if not (config.resume or config.run_name):
            raise RunError("a multi-process launch needs --run_name or --resume: every process must find "
                           "the same run directory")
        self.dir = Path(config.resume or Path(config.runs_dir) / config.run_name)
        deadline = time.time() + 600
        while not (self.dir / "manifest.json").is_file():
            if time.time() > deadline:
                raise RunError(f"rank 0 did not create {self.dir} within 10 minutes")
            time.sleep(0.5)
        self.manifest = read_json(self.dir / "manifest.json")

    def _attach_log(self) -> None:
        handler = logging.FileHandler(self.dir / "run.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root = logging.getLogger()
        root.setLevel(logging.INFO)
        root.addHandler(handler)
        if not any(isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
                   for h in root.handlers):
            stream = logging.StreamHandler()
            stream.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
            root.addHandler(stream)
        self._handler = handler

    def save_manifest(self) -> None:
        if not self.is_main:
            return
        write_json(self.dir / "manifest.json", self.manifest)

    def _record_input(self, name: str, path: Path) -> None:
        digest = sha256_file(path) if path.is_file() else sha256_run(path)
        self.manifest["inputs"][name] = {"path": str(path.resolve()), "sha256": digest}
        manifest = self.inputs[name]
        if manifest:
            self.manifest["inputs"][name]["stage"] = manifest.get("stage")
            if self.manifest.get("wandb_group") is None and manifest.get("wandb_group"):
                self.manifest["wandb_group"] = manifest["wandb_group"]  # one W&B group per pipeline

    def lock_base(self, fingerprint: dict) -> None:
        """The base lock: every input run must have been built on exactly this base."""
        for name, manifest in self.inputs.items():
            theirs = (manifest or {}).get("base")
            if theirs is None:
                continue  # data files and pairs runs use no model
            for key in sorted(set(fingerprint) | set(theirs)):
                if fingerprint.get(key) != theirs.get(key):
                    raise RunError(
                        f"base mismatch with input '{name}' ({manifest.get('run_name')}): field '{key}' is "
                        f"{fingerprint.get(key)!r} here but {theirs.get(key)!r} there. "
                        f"Every stage must start from the same base model and LoRA settings.")
        self.manifest["base"] = fingerprint
        self.save_manifest()

    def start_tracking(self) -> None:
        """W&B: online with WANDB_API_KEY, else offline inside the run directory."""
        if self.config.report_to != "wandb" or not self.is_main:
            return
        import wandb
        if not os.environ.get("WANDB_API_KEY"):
            os.environ["WANDB_MODE"] = "offline"
        os.environ["WANDB_DIR"] = str(self.dir)
        os.environ.setdefault("WANDB_CACHE_DIR", str(self.dir / "wandb" / "cache"))
        os.environ.setdefault("WANDB_SILENT", "true")
        (self.dir / "wandb").mkdir(exist_ok=True)
        resume_id = self.manifest.get("wandb_run_id")
        wb = wandb.init(project=self.config.wandb_project, name=self.dir.name, dir=str(self.dir),
                        group=self.manifest["wandb_group"], job_type=self.stage,
                        config=to_dict(self.config), id=resume_id, resume="allow" if resume_id else None)
        self.manifest["wandb_run_id"] = wb.id
        self.save_manifest()

    def log_metrics(self, metrics: dict) -> None:
        if self.config.report_to == "wandb":
            import wandb
            if wandb.run is not None:
                wandb.run.summary.update({k: v for k, v in _flatten(metrics).items()})

    def finish(self, metrics: dict) -> None:
        """Write metrics.json, close the tracker, then DONE (last, so a crash never leaves a DONE)."""
        if not self.is_main:
            return
        write_json(self.dir / "metrics.json", metrics)
        self.log_metrics(metrics)
        if self.config.report_to == "wandb":
            import wandb
            if wandb.run is not None:
                wandb.finish()
        self.manifest["finished"] = _now()
        self.save_manifest()
        (self.dir / "DONE").write_text(_now() + "\n")
        log.info("done: %s", self.dir)
        logging.getLogger().removeHandler(self._handler)
        self._handler.close()
        print(f"run_dir: {self.dir}", flush=True)  # the one stdout line chaining scripts read


def _check_input(name: str, path) -> dict | None:
    """A data file (returns None) or a finished run directory (returns its manifest)."""
    if path is None:
        raise RunError(f"--{name} is required")
    path = Path(path)
    if path.is_file():
        return None
    return require_done(path)


def cli(main, config_cls) -> None:
    """Entry point of a stage: bad configs, inputs and data end with a one-line error, no traceback."""
    from common.config import ConfigError, parse_config
    from common.data import DataError
    try:
        main(*parse_config(config_cls))
    except (ConfigError, RunError, DataError) as err:
        sys.exit(f"error: {err}")


def require_done(run_dir: str | Path) -> dict:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunError(f"input {run_dir} does not exist (no such file or run directory)")
    if not (run_dir / "DONE").exists():
        raise RunError(f"input run {run_dir} has no DONE marker: it is unfinished or failed")
    return read_json(run_dir / "manifest.json")


def _flatten(metrics: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in metrics.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float, str, bool)) or value is None:
            out[f"{prefix}{key}"] = value
    return out


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
