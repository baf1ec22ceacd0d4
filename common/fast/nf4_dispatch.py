"""Which kernel runs each 4-bit base matmul of the decode step: a table (N, K, M) -> an `nf4_matmul` Config, or
"dequantize" (the Triton dequantisation into a bf16 buffer, then cuBLAS: decode_step's default path).

`bench/nf4_sweep.py` writes the table on a GPU (its `dispatch.json`); GRPO reads it when `nf4_matmul_table`
names it (off by default: with no table every matmul dequantises). For M rows the entry of the same shape
with the smallest table M >= M applies; a shape or an M past the table's dequantises.

    {"version": 1, "device": "NVIDIA H200", "source": "bench/nf4_sweep.py ...",
     "entries": [{"N": 4096, "K": 4096, "M": 64, "path": "nf4_matmul",
                  "config": {"block_n": 128, "block_k": 256, "split_k": 4, "num_warps": 4, "num_stages": 3,
                             "lut": "select"}},
                 {"N": 1024, "K": 4096, "M": 64, "path": "dequantize"}]}
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from common.config import ConfigError
from common.fast.nf4_matmul import Config, check_launch

VERSION = 1
PATHS = ("nf4_matmul", "dequantize")


@dataclass
class Table:
    source: str
    device: str = ""
    # (N, K) -> [(M, Config or None for "dequantize")], M ascending
    shapes: dict = field(default_factory=dict)

    def plan(self, N: int, K: int, M: int) -> Config | None:
        """The Config for an (M, K) @ (N, K)^T matmul, or None: dequantise."""
        return next((c for m, c in self.shapes.get((N, K), []) if m >= M), None)

    def describe(self) -> str:
        fused = sum(c is not None for rows in self.shapes.values() for _, c in rows)
        total = sum(len(rows) for rows in self.shapes.values())
        return f"{Path(self.source).name} ({fused} of {total} (shape, M) entries on nf4_matmul)"


def read_table(path: str | Path) -> Table:
    """The table at `path`; a ConfigError (field nf4_matmul_table) naming the file and entry if it is wrong."""
    where = f"nf4_matmul_table {path}"

    def bad(msg):
        return ConfigError(f"{where}: {msg}", "nf4_matmul_table")
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as err:
        raise bad(f"cannot read it ({err.strerror})") from None
    except json.JSONDecodeError as err:
        raise bad(f"not JSON (line {err.lineno}: {err.msg})") from None
    if not isinstance(doc, dict) or doc.get("version") != VERSION or not isinstance(doc.get("entries"), list):
        raise bad(f"expected an object with version {VERSION} and a list of entries (bench/nf4_sweep.py writes it)")
    table = Table(source=str(path), device=str(doc.get("device", "")))
    for i, e in enumerate(doc["entries"]):
        try:
            N, K, M, kind = int(e["N"]), int(e["K"]), int(e["M"]), e["path"]
            if kind not in PATHS:
                raise ValueError(f"path {kind!r}: one of {', '.join(PATHS)}")
            launch = None
            if kind == "nf4_matmul":
                launch = Config(**e["config"])
                check_launch(launch, K, 64)
        except (KeyError, TypeError, ValueError) as err:
            raise bad(f"entries[{i}]: {type(err).__name__} {err}") from None
        rows = table.shapes.setdefault((N, K), [])
        if any(m == M for m, _ in rows):
            raise bad(f"entries[{i}]: N {N}, K {K}, M {M} given twice")
        rows.append((M, launch))
        rows.sort(key=lambda r: r[0])
    return table


_ACTIVE: Table | None = None


def use_table(path: str | Path | None) -> Table | None:
    """Make the table at `path` the one decode steps read from now on (None: none, every matmul dequantises)."""
    global _ACTIVE
    _ACTIVE = read_table(path) if path else None
    return _ACTIVE


def active() -> Table | None:
    return _ACTIVE
