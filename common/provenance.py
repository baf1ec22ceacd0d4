"""What a manifest records about where a run came from: file digests, the git state, the package
versions, the host and its GPUs."""
from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

PACKAGES = ["torch", "transformers", "trl", "peft", "bitsandbytes", "datasets", "accelerate",
            "sacrebleu", "rouge-score", "wandb"]
# Files of a run directory that are not its artifacts: its bookkeeping, logs (run.log, and the
# slurm-<job>.log the Slurm wrapper copies in when the job ends) and trackers.
NOT_ARTIFACTS = {"manifest.json", "DONE", "run.lock"}
NOT_ARTIFACT_DIRS = {"wandb", "checkpoints"}


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def artifact_digests(run_dir: Path) -> dict[str, str]:
    """{relative path: sha256} of every artifact of a run directory (bookkeeping and logs excluded)."""
    out = {}
    for path in sorted(Path(run_dir).rglob("*")):
        rel = path.relative_to(run_dir)
        if path.is_file() and rel.parts[0] not in NOT_ARTIFACT_DIRS and str(rel) not in NOT_ARTIFACTS \
                and path.suffix not in (".log", ".tmp"):
            out[str(rel)] = sha256_file(path)
    return out


def digest_of(digests: dict[str, str]) -> str:
    """One digest over a run's artifacts (names and contents)."""
    return hashlib.sha256("".join(f"{k}\0{v}\0" for k, v in sorted(digests.items())).encode()).hexdigest()


def git_state() -> dict:
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True,
                                    text=True, check=True).stdout.strip())
        return {"commit": commit, "dirty": dirty}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}


def bench_commit() -> dict:
    """The benchmarks' record of the code they ran: BENCH_COMMIT when set (a tree copied to a GPU machine
    may carry a stale .git), else the git state."""
    if os.environ.get("BENCH_COMMIT"):
        return {"commit": os.environ["BENCH_COMMIT"], "dirty": None}
    return git_state()


def versions() -> dict:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def gpu() -> str | None:
    import torch
    if not torch.cuda.is_available():
        return None
    return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
