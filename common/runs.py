"""Run directories: dated, numbered, created atomically, never overwritten, and never lying.

A run directory holds `config.yaml` (written first; again by `settle()` with what was decided once the model
was loaded, so that it says what ran), `manifest.json`, `run.log`, `metrics.json`,
the artifacts, and `DONE` (written last, with the digest of every artifact in the manifest).
A stage accepts an input run only when it is finished, of the expected stage, unchanged since it
finished, built on the same base model (the base lock), and descended from the same pairs run as
the stage's other inputs (so no held-out premise was trained on). docs/architecture.md has the contract.
"""
from __future__ import annotations

import dataclasses
import datetime
import fcntl
import logging
import os
import re
import socket
import sys
import time
from pathlib import Path

import yaml

from common import provenance, tracking
from common.config import plain_values, to_dict
from common.data import DataError, read_manifest, write_json
from common.tasks import TASKS, get_task

log = logging.getLogger("pipeline")

# Which stage an input run must come from, by the name of its command-line field.
INPUT_STAGES = {"pairs_run": ("Pairs",), "sft_run": ("SFT",), "reward_run": ("Reward",),
                "policy_runs": ("GRPO", "DPO", "ORPO", "SFT"), "judge_runs": ("Reward",), "crossfit_judge_runs": ("Reward",),
                "ensemble_of": ("Reward",), "replies_from": ("Eval",), "hard_negatives": ("Eval",),
                "targets_from": ("Eval",), "rating_run": ("Reward",), "rating_dev_run": ("Eval",)}
# Inputs that may descend from another pairs run (same task, same base): 05's other judges, e.g. one
# trained on other posts. What keeps their scores honest is 05's check of their training posts.
OWN_LINEAGE = ("judge_runs", "crossfit_judge_runs")
# Inputs loaded on their own base, not on this stage's: a rating model is a predictor of the paper's rating read
# from its own run (RatingModel.from_run), so a review writer may take one of another family (SmolLM2's beside
# Qwen's writer), as review_real_weights.sh's dev pick among RATING_CONFIGS may choose.
OWN_BASE = ("rating_run",)


class RunError(RuntimeError):
    pass


def processes() -> int:
    """Processes of this launch (data parallel: each samples and trains on its own share of a step)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main_process() -> bool:
    """Under a multi-process launch (accelerate launch, torchrun) only rank 0 writes the run directory."""
    return int(os.environ.get("RANK", "0")) == 0


def run_dir_name(stage: str, n: int, today: datetime.date | None = None) -> str:
    today = today or datetime.date.today()
    return f"{today.strftime('%b')}{today.day:02d}_{stage}_Run{n}"


def create_run_dir(runs_dir: str | Path, stage: str, run_name: str | None = None) -> Path:
    """Create a new run directory with a plain mkdir: two runs can never share one."""
    runs_dir = Path(runs_dir)
    try:
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
    except OSError as err:
        raise RunError(f"cannot create a run directory in --runs_dir {runs_dir}: {err.strerror or err}") from None


class Run:
    """The run directory of one stage invocation, from its config to its DONE marker."""

    def __init__(self, stage: str, config, overrides: dict, inputs: dict | None = None,
                 argv: list[str] | None = None, base: dict | None = None):
        """`inputs` maps a field name to an input run directory or a data file (`data[i]`); `base` is
        the fingerprint of the base model this stage loads (None: it loads none). Inputs, their
        lineage and the base lock are checked before anything is created. The inputs' manifests are
        in `self.inputs` (None for files)."""
        self.stage, self.config = stage, config
        self.inputs = {name: check_input(name, path) for name, path in (inputs or {}).items()}
        self.pairs_run, self.task, self.pairs_digest = _common_lineage(self.inputs, inputs or {})
        if self.task in TASKS:  # settings the task cannot work with, refused before anything is made
            get_task(self.task).check_config(config)
        if self.pairs_run and "pairs_run" not in self.inputs:  # inherited (04): it must be unchanged too
            self.pairs_digest = _same_content(self.pairs_run, check_input("pairs_run", self.pairs_run),
                                              self.pairs_digest)
        if base is not None:
            _lock_base(self.inputs, base)
        self.is_main = is_main_process()
        if not self.is_main:
            self._follow(config)
            return
        argv = list(sys.argv if argv is None else argv)
        if config.resume:
            self.dir = Path(config.resume)
            self._lock = hold_lock(self.dir)
            if (self.dir / "DONE").exists():
                raise RunError(f"--resume {self.dir}: that run is finished (DONE); a finished run is never modified")
            self.manifest = read_manifest(self.dir)
            if base is not None and self.manifest.get("base") != base:
                raise RunError(f"--resume {self.dir}: the base model is not the one the run started with (its "
                               f"fingerprint differs from the manifest's `base`); start a new run")
            self.manifest.setdefault("resumed", []).append(
                {"argv": argv, "at": provenance.now(), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
                 "processes": processes()})
        else:
            self.dir = create_run_dir(config.runs_dir, stage, config.run_name)
            self._lock = hold_lock(self.dir)
            (self.dir / "config.yaml").write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
            self.manifest = {
                "stage": stage, "run_name": self.dir.name, "argv": argv, "overrides": overrides,
                "created": provenance.now(), "git": provenance.git_state(), "seed": config.seed,
                "packages": provenance.versions(), "host": socket.gethostname(), "gpu": provenance.gpu(),
                "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                "slurm_job_id": os.environ.get("SLURM_JOB_ID"), "processes": processes(), "wandb_run_id": None,
                "wandb_group": config.wandb_group, "inputs": {}, "base": base,
            }
        if stage == "Pairs":
            self.pairs_run = str(self.dir.resolve())
        self.manifest.update(pairs_run=self.pairs_run, task=self.task or self.manifest.get("task"))
        if stage != "Pairs":  # the lineage by content: a pairs run rebuilt at the same path is another one
            self.manifest["pairs_run_sha256"] = self.pairs_digest or self.manifest.get("pairs_run_sha256")
        self._attach_log()
        for key, value in overrides.items():  # fast_paths false replaced a value the command line asked for
            if not config.fast_paths and key in plain_values(config) and getattr(config, key) != value:
                log.warning("--%s %s is not used: --fast_paths false sets it to %s", key, value, getattr(config, key))
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
        self.manifest = read_manifest(self.dir)

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
        if self.is_main:
            write_json(self.dir / "manifest.json", self.manifest)

    def _record_input(self, name: str, path: Path) -> None:
        manifest = self.inputs[name]
        if manifest is None:  # a data file
            record = {"path": str(path.resolve()), "sha256": provenance.sha256_file(path)}
        else:
            record = {"path": str(path.resolve()), "stage": manifest.get("stage"), "run_name": manifest.get("run_name"),
                      "sha256": provenance.digest_of(manifest["_digests"])}
            if name in OWN_BASE:  # not this run's base: which one it was is kept beside it
                record["base"] = manifest.get("base")
        before = self.manifest["inputs"].get(name)
        if self.config.resume and before and before.get("sha256") != record["sha256"]:
            # a segment on other data would leave a run that no single input describes
            raise RunError(f"--resume {self.dir}: input --{name} {path} is not what the run started with "
                           f"(sha256 {record['sha256'][:12]}, recorded {str(before.get('sha256'))[:12]}): "
                           f"a resumed run trains on its first segment's inputs; start a new run")
        self.manifest["inputs"][name] = record
        if manifest is None:
            return
        if self.manifest.get("wandb_group") is None and manifest.get("wandb_group"):
            self.manifest["wandb_group"] = manifest["wandb_group"]  # one W&B group per pipeline

    def start_tracking(self) -> None:
        tracking.start(self)

    def fail(self, metrics: dict, reason: str) -> None:
        """End the run unfinished on purpose: its metrics are kept, no DONE, one error line."""
        if self.is_main:
            write_json(self.dir / "metrics.json", metrics)
            tracking.log_summary(self.config, metrics)
        raise RunError(reason)

    def finish(self, metrics: dict) -> None:
        """Write metrics.json, close the tracker, record the artifacts' digests, then DONE (last, so a
        crash never leaves a DONE)."""
        if not self.is_main:
            return
        write_json(self.dir / "metrics.json", metrics)
        tracking.log_summary(self.config, metrics)
        tracking.finish(self.config)
        self.manifest["finished"] = provenance.now()
        self.manifest["artifacts"] = provenance.artifact_digests(self.dir)
        self.save_manifest()
        (self.dir / "DONE").write_text(provenance.now() + "\n")
        log.info("done: %s", self.dir)
        logging.getLogger().removeHandler(self._handler)
        self._handler.close()
        self._lock.close()
        print(f"run_dir: {self.dir}", flush=True)  # the one stdout line chaining scripts read


def settle(run, config, changes: dict) -> None:
    """Settings decided once the model is loaded (the levers `memory_levers: fit` chose for this GPU): set on
    `config`, checked, and, in a run directory, config.yaml written again with them before the trainer is
    built, so that it says what ran. A resumed run decides again, for the GPU it runs on now. `run` may be
    a stand-in without a run directory (the bench's)."""
    changed = {name: value for name, value in changes.items() if getattr(config, name) != value}
    if not changed:
        return
    dataclasses.replace(config, **changed)  # checked first (a ConfigError naming the field): the config stays whole
    before = {name: getattr(config, name) for name in changed}
    for name, value in changed.items():
        setattr(config, name, value)
    log.info("set once the model was loaded: %s",
             ", ".join(f"{name} {value} (was {before[name]})" for name, value in changed.items()))
    if isinstance(run, Run) and run.is_main:
        if config is not run.config:
            raise RunError("settle: the config is not the run's, whose config.yaml it would rewrite")
        path = run.dir / "config.yaml"  # the run's settings as written, these fields changed
        recorded = yaml.safe_load(path.read_text())
        recorded.update(changed)
        path.with_suffix(".yaml.tmp").write_text(yaml.safe_dump(recorded, sort_keys=False))
        path.with_suffix(".yaml.tmp").replace(path)  # whole, then renamed: a crash never leaves half a file
        tracking.update_config(config, changed)


LOCK = "run.lock"


def hold_lock(run_dir: Path):
    """An exclusive lock on the run directory for as long as this process runs it (the open file is
    the lock; the system releases it when the process ends, however it ends). Two processes training
    one run would both exit 0 with one manifest recording only one of them."""
    try:
        lock = open(run_dir / LOCK, "a")
    except OSError as err:  # a read-only file system, a lock file that is a folder, no permission
        raise RunError(f"cannot open {run_dir / LOCK} to lock the run ({err.strerror or err}): the run directory "
                       f"must be writable (a read-only file system cannot hold a running run)") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise RunError(f"run directory {run_dir} is in use by another process (it holds {run_dir / LOCK}); "
                       f"one process at a time runs a run: wait for that one to end") from None
    except OSError as err:  # a file system without locks: the run goes on, unguarded, and says so
        log.warning("cannot lock %s (%s): nothing stops a second process from running this run", run_dir, err)
    return lock


def check_input(name: str, path) -> dict | None:
    """A data file (returns None) or a finished, unchanged run directory of the stage that `name`
    expects (returns its manifest, with the artifacts' digests under `_digests`)."""
    if path is None:
        raise RunError(f"--{name} is required")
    path = Path(path)
    if name.startswith(("data", "pdf", "eval_data")):  # data files and PDFs are recorded with their digests
        field = name.split("[")[0]
        if path.is_dir():
            raise DataError(f"--{field} {path}: is a directory; give one or more files")
        if not path.is_file():
            raise DataError(f"--{field} {path}: no such file")
        return None
    manifest = require_done(path)
    expected = INPUT_STAGES.get(name.split("[")[0])  # a list field's inputs are named policy_runs[0], ...
    if expected and manifest.get("stage") not in expected:
        raise RunError(f"--{name} {path}: that is a {manifest.get('stage')} run; --{name} takes a "
                       f"{' or '.join(expected)} run")
    # Rank 0 checks and records the digests; under a multi-process launch the others follow it
    # rather than each hashing every adapter again at start-up.
    manifest["_digests"] = _unchanged_artifacts(path, manifest) if is_main_process() else {}
    return manifest


def require_done(run_dir: str | Path) -> dict:
    run_dir = Path(run_dir)
    if run_dir.is_file():
        raise RunError(f"input {run_dir} is a file, not a run directory: give the folder a stage wrote "
                       f"(it holds manifest.json and DONE)")
    if not run_dir.is_dir():
        raise RunError(f"input {run_dir} does not exist (no such file or run directory)")
    if not (run_dir / "DONE").exists():
        raise RunError(f"input run {run_dir} has no DONE marker: it is unfinished or failed")
    if not (run_dir / "manifest.json").is_file():
        raise RunError(f"input run {run_dir} has no manifest.json: it is not a run directory of this pipeline")
    return read_manifest(run_dir)


def _unchanged_artifacts(run_dir: Path, manifest: dict) -> dict:
    """The artifacts' digests now; every artifact recorded when the run finished must still be there, unchanged."""
    recorded = manifest.get("artifacts")
    if not isinstance(recorded, dict):  # without the list nothing could be checked: refused, not waved through
        raise RunError(f"input run {run_dir} records no artifacts in its manifest.json: whether its files "
                       f"changed since it finished cannot be checked, so it is refused (re-run that stage)")
    now = provenance.artifact_digests(run_dir)
    for rel, digest in recorded.items():
        if rel not in now:
            raise RunError(f"input run {run_dir} is missing {rel}, which it had when it finished: "
                           f"it can no longer be used (re-run that stage)")
        if now[rel] != digest:
            raise RunError(f"input run {run_dir}: {rel} changed after the run finished (sha256 differs): "
                           f"a finished run is never modified; re-run that stage")
    return now


def _lock_base(inputs: dict, fingerprint: dict) -> None:
    """The base lock: every input model run must have been built on exactly this base."""
    for name, manifest in inputs.items():
        if manifest is None or manifest.get("stage") == "Pairs" or name in OWN_BASE:
            continue  # data files and pairs runs use no model; OWN_BASE inputs load their own
        theirs = manifest.get("base")
        if theirs is None:
            raise RunError(f"input '{name}' ({manifest.get('run_name')}) records no base model in its "
                           f"manifest: it cannot be checked against this run's base, so it is refused")
        for key in sorted(set(fingerprint) | set(theirs)):
            if fingerprint.get(key) != theirs.get(key):
                raise RunError(
                    f"base mismatch with input '{name}' ({manifest.get('run_name')}): field '{key}' is "
                    f"{fingerprint.get(key)!r} here but {theirs.get(key)!r} there. "
                    f"Every stage must start from the same base model and LoRA settings.")


def lineage(manifest: dict, path: Path) -> tuple[str | None, str | None]:
    """(path, content digest) of the pairs run that a run descends from (a pairs run descends from
    itself). The digest is that over the pairs run's artifacts when the run was made: a pairs run
    deleted and built again at the same path (another seed, other data) is another pairs run. None
    where it is not known (a run made before runs recorded it, or a rank other than 0)."""
    if manifest.get("stage") == "Pairs":
        digests = manifest.get("_digests")
        return str(Path(path).resolve()), provenance.digest_of(digests) if digests else None
    return manifest.get("pairs_run"), manifest.get("pairs_run_sha256")


def _same_content(path: str, manifest: dict, recorded: str | None) -> str | None:
    """The digest of pairs run `path` now; refused when it is not the content its descendants recorded."""
    _, now = lineage(manifest, Path(path))
    if recorded and now and now != recorded:
        raise RunError(f"pairs run {path} is not the one the input runs were trained on: its content changed "
                       f"(sha256 {now[:12]}, recorded {recorded[:12]}; rebuilt at the same path?), so held-out "
                       f"premises may have been trained on")
    return recorded or now


def _common_lineage(manifests: dict, paths: dict) -> tuple[str | None, str | None, str | None]:
    """(pairs run, task, pairs run's content digest) shared by every input run; different ones are
    refused, naming the runs. Runs descend from one pairs run when its path and its content agree."""
    found = {name: (*lineage(m, Path(paths[name])), m.get("task")) for name, m in manifests.items() if m}
    shared = {name: pdt for name, pdt in found.items() if name.split("[")[0] not in OWN_LINEAGE}
    pairs = {p for p, _, _ in shared.values() if p}
    if len(pairs) > 1:
        listing = "; ".join(f"--{name} {paths[name]} descends from {p}" for name, (p, _, _) in shared.items())
        raise RunError(f"the input runs descend from different pairs runs ({listing}): a stage's inputs must share "
                       f"one pairs run, or held-out premises may have been trained on")
    digests = {d for _, d, _ in shared.values() if d}
    if len(digests) > 1:
        listing = "; ".join(f"--{name} {paths[name]} descends from {p} with sha256 {str(d)[:12]}"
                            for name, (p, d, _) in shared.items())
        raise RunError(f"the input runs descend from different contents of one pairs run path ({listing}): it was "
                       f"rebuilt after some of them were made, so held-out premises may have been trained on")
    tasks = {t for _, _, t in found.values() if t}
    if len(tasks) > 1:
        raise RunError(f"the input runs are of different tasks ({', '.join(sorted(tasks))})")
    return next(iter(pairs), None), next(iter(tasks), None), next(iter(digests), None)
