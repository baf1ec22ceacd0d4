"""Which GPU allocations outlive a bench run, and the stack that made each: a leak finder.

    python bench/live_blocks.py --out bench/out/leak --rows "grpo ours 20gib" --grpo_steps 6   # one GPU

Runs `bench.py` (its --sections, --rows, --grpo_steps, --deadline) under the CUDA allocator's history.
When the bench returns, its trainers and models are released, so what is still allocated is held by
something of the process's own: a cache, a global, a library's per-stream state. Every such block is
grouped by the Python stack that allocated it, largest first, in `live_blocks.txt` under --out and on
the terminal. A group that grows with the steps run is a leak. GPU only.
"""
from __future__ import annotations

import argparse
import collections
import gc
import os
import sys
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as the stages run
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402


def live_blocks() -> list[tuple[str, int, int]]:
    """(allocating stack, bytes, blocks) of every allocated block in the allocator's snapshot, largest first."""
    groups = collections.defaultdict(lambda: [0, 0])
    for segment in torch.cuda.memory._snapshot()["segments"]:
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                frames = [f for f in block.get("frames", []) if f["filename"].endswith(".py")]
                stack = " < ".join(f"{Path(f['filename']).name}:{f['line']}:{f['name']}" for f in frames[:12])
                groups[stack][0] += block["size"]
                groups[stack][1] += 1
    return sorted(((stack, size, n) for stack, (size, n) in groups.items()), key=lambda row: -row[1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sections", default="grpo")
    ap.add_argument("--rows", default="grpo ours 20gib")
    ap.add_argument("--grpo_steps", default="6")
    ap.add_argument("--deadline", default="300")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("live_blocks needs a GPU")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._record_memory_history(max_entries=300000)
    import bench
    bench.main(["--out", str(out / "bench"), "--work", str(out / "work"), "--sections", args.sections, "--rows", args.rows,
                "--grpo_steps", args.grpo_steps, "--deadline", args.deadline])
    gc.collect()
    text = f"allocated after the bench returned: {torch.cuda.memory_allocated() / 2 ** 30:.3f} GiB\n" + "".join(
        f"{size / 2 ** 20:10.1f} MiB {n:5d} blocks  {stack}\n" for stack, size, n in live_blocks()[:80])
    (out / "live_blocks.txt").write_text(text)
    print(text, flush=True)


if __name__ == "__main__":
    main()
