"""Sweep common/fast/nf4_matmul.py (the split-K NF4 matmul) against the other ways to run the decode step's
4-bit base matmuls, at Llama 3 8B shapes and M = 16, 32, 64 rows, in one command on one GPU (under 8 minutes
on an H200):

    python bench/nf4_sweep.py --out bench/out/nf4_sweep            # one GPU
    python bench/nf4_sweep.py --out /tmp/nf4_sweep --tiny          # CPU smoke run (Triton's interpreter)

For each shape (N x K: q/o 4096x4096, k/v 1024x4096, gate/up 14336x4096, down 4096x14336) and M it times:
- `nf4_matmul` over a bounded grid of configurations (below), each checked against dequantise + matmul first;
- the two earlier fused kernels (bench/nf4_fused.py `nf4_linear`: its default configuration, and the same with
  the byte-indexed pair table of the second design);
- bitsandbytes' `matmul_4bit` (it dequantises, then cuBLAS; the copies rotate the packed bytes, the quant
  state is shared);
- dequantise + cuBLAS as the decode step runs it today (Triton's nf4_dequantize into a bf16 buffer, F.linear),
  and with bitsandbytes' dequantisation;
and the bf16 lm_head (128256 x 4096, cuBLAS) for the table only. Each timing is a CUDA graph of calls rotating
over enough weight copies that they do not fit in L2 (>= 256 MB of packed bytes), as bench/bench_nf4_matmul.py.

The grid, bounded so that the whole run fits its budget: stage 1 times (BLOCK_N, BLOCK_K) in {32x256, 64x128,
64x256, 64x512, 128x128, 128x256, 256x128} x lut {select, memory, prmt} at 3 stages and num_warps by tile size (4 up to 64x128, else
8), each at the power-of-two split-K values that give between half a wave and 6 waves of programs on the GPU's
SMs (at most 5 of them); stage 2 takes each (shape, M)'s best and varies num_warps (4, 8), num_stages (2, 3, 4)
and split-K (halved, doubled). Triton compiles once per (tile, lut, warps, stages, BLOCK_M): N, K and the split
count are run-time arguments; all of them are compiled first, in parallel processes. --budget seconds bound
the grid, each (shape, M) getting an equal share of what is left; what does not fit is recorded as skipped.

Writes under --out: `sweep.json` (every timing, rewritten as it goes), `sweep.md` (best configuration per shape
and M, GB/s on the packed bytes, ratio to dequantise + cuBLAS; the projected base-matmul time a decode step
per token, over the 32 layers' 7 projections), `dispatch.json` (common/fast/nf4_dispatch.py's table:
nf4_matmul where its best beats dequantise + cuBLAS, else dequantize; GRPO's `nf4_matmul_table`), and
`progress.log`.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path

import torch  # noqa: E402  (torch does not import triton: the interpreter is chosen below, before it is)

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_nf4_matmul  # noqa: E402
import bitsandbytes as bnb  # noqa: E402
import bitsandbytes.functional as bnbF  # noqa: E402
import nf4_fused  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common.fast import nf4_dequantize, nf4_dispatch  # noqa: E402
from common.fast.nf4_matmul import Config, nf4_matmul, splits  # noqa: E402

LAYERS = 32
# (name, N, K) of each 4-bit linear of a Llama 3 8B decoder layer
LAYER = [("q", 4096, 4096), ("k", 1024, 4096), ("v", 1024, 4096), ("o", 4096, 4096),
         ("gate", 14336, 4096), ("up", 14336, 4096), ("down", 4096, 14336)]
LM_HEAD = (128256, 4096)
MS = (16, 32, 64)
TILES = [(32, 256), (64, 128), (64, 256), (64, 512), (128, 128), (128, 256), (256, 128)]
LUTS = ("select", "memory", "prmt")
TINY_LUTS = ("select", "memory")  # prmt is PTX: not under the interpreter
TINY_LAYER = [("q", 64, 256), ("down", 96, 320)]  # 320: a K tail past the 256-column tiles
TINY_MS = (4,)
TINY_TILES = [(32, 128)]
TINY_LM_HEAD = (128, 64)
L2_BYTES = 256 << 20  # rotate over at least this many packed bytes: several times the H200's 50 MB L2
MAX_REL_DIFF = 1e-2  # a configuration further than this from dequantise + matmul is wrong, not timed
GPU_SECONDS = 0.03  # GPU time a timing replays (at least 3 replays of its graph)


def warps_for(block_n, block_k):
    return 4 if block_n * block_k <= 64 * 128 else 8


def split_candidates(N, K, block_n, block_k, sms, tiny):
    """Power-of-two split-K values from half a wave to 6 waves of programs (at most 5), within K's tiles."""
    tiles = -(-K // block_k)
    if tiny:
        return [2]
    cols = -(-N // block_n)
    ok = [s for s in (1, 2, 4, 8, 16, 32, 64) if s <= tiles and sms / 2 <= cols * s <= 6 * sms]
    if not ok:  # too few or too many column tiles for any: the split closest to two waves
        ok = [min((s for s in (1, 2, 4, 8, 16, 32, 64) if s <= tiles), key=lambda s: abs(math.log(cols * s / (2 * sms))))]
    return ok[:5]


def _compile(job):
    """In a worker process: run one nf4_matmul configuration for M rows (split-K too: the sum pass), so that its
    binaries land in Triton's disk cache for the sweep's process to load."""
    m, config = job
    try:
        k = 4096
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        packed = torch.randint(0, 256, (256 * k // 2,), dtype=torch.uint8, device="cuda")
        absmax = torch.rand(256 * k // 64, device="cuda")
        code = torch.linspace(-1, 1, 16, device="cuda")
        c = Config(**config)
        nf4_matmul(x, packed, absmax, code, 256, k, launch=c)
        nf4_matmul(x, packed, absmax, code, 256, k, launch=c._replace(split_k=2))
        torch.cuda.synchronize()
        return None
    except Exception as e:  # the sweep's own call will record it
        return f"{type(e).__name__}: {str(e)[:200]}"


def prewarm(sweep, jobs):
    """Compile `jobs` ((M, Config) pairs) in parallel worker processes, into Triton's disk cache: serially,
    Triton's compiles would take most of the budget."""
    jobs = [(m, c._asdict()) for m, c in sorted(jobs)]
    if not jobs:
        return
    workers = max(1, min(len(jobs), (os.cpu_count() or 2) - 2, 14))
    sweep.log(f"compiling {len(jobs)} configurations in {workers} processes")
    import concurrent.futures
    import multiprocessing
    try:
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as ex:
            failed = [(job, err) for job, err in zip(jobs, ex.map(_compile, jobs)) if err]
    except Exception as e:  # compiling in the sweep's process instead is only slower
        sweep.log(f"  parallel compile failed ({type(e).__name__}: {e}); compiling as the grid runs")
        return
    sweep.log(f"  compiled; {len(failed)} failed" + "".join(f"\n    {j}: {e}" for j, e in failed[:10]))


class Sweep:
    def __init__(self, args):
        self.tiny = args.tiny
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        # the interpreter's tl.dot multiplies bf16's raw bits: fp32 on the CPU
        self.dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count if self.device == "cuda" else 132
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log_file = (self.out / "progress.log").open("w")
        self.started = time.monotonic()
        self.deadline = self.slot_deadline = self.started + args.budget
        import triton
        self.result = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name() if self.device == "cuda"
                       else "cpu (triton interpreter)", "sms": self.sms, "torch": torch.__version__,
                       "triton": triton.__version__, "bitsandbytes": bnb.__version__, "dtype": str(self.dtype),
                       "budget_s": args.budget, "timings": []}

    def log(self, msg):
        line = f"[{time.monotonic() - self.started:6.1f} s] {msg}"
        print(line, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def save(self):
        (self.out / "sweep.json").write_text(json.dumps(self.result, indent=1))

    def time_us(self, calls):
        """Microseconds per call of `calls` (thunks, one per weight copy), replayed as one CUDA graph."""
        return bench_nf4_matmul.time_us(calls, self.device, GPU_SECONDS)

    def weights(self, n, k):
        """Distinct (packed, fp32 absmax) copies of one random NF4 weight (absmax decoded, as decode_step keeps
        it), its quant_state, and its bf16 dequantisation (the reference)."""
        copies = 1 if self.tiny else max(2, math.ceil(L2_BYTES / (n * k // 2)))
        w = torch.randn(n, k, device=self.device, dtype=self.dtype)
        packed, qs = bnbF.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
        absmax = bnbF.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset
        del w
        dense = torch.empty(n, k, device=self.device, dtype=self.dtype)
        nf4_dequantize.nf4_dequantize(packed, absmax, qs.code, dense, 64)
        return [(packed.clone(), absmax.clone()) for _ in range(copies)], qs, dense

    def record(self, entry, us, n, k, error=None):
        entry["us"] = us
        if us:
            entry["packed_GBps"] = n * k / 2 / (us * 1e-6) / 1e9
        if error:
            entry["error"] = error
        self.result["timings"].append(entry)
        self.save()
        return entry

    def measure(self, name, n, k, m, calls, check=None, **extra):
        """Time `calls` (after `check()`, which returns the max relative difference to the reference or raises).
        The grid's timings stop at their (shape, M)'s share of the budget, the others at the budget's end."""
        entry = {"kernel": name, "N": n, "K": k, "M": m, **extra, "us": None}
        if time.monotonic() > (self.slot_deadline if name == "nf4_matmul" else self.deadline):
            entry["skipped"] = "budget spent"
            return self.record(entry, None, n, k)
        try:
            if check is not None:
                entry["max_rel_diff"] = check()
                if not entry["max_rel_diff"] <= MAX_REL_DIFF:
                    raise ValueError(f"wrong output: max rel diff {entry['max_rel_diff']:.1e}")
            us = self.time_us(calls)
        except Exception as e:  # a configuration that does not compile (shared memory, registers) or is wrong
            msg = f"{type(e).__name__}: {str(e)[:300]}"
            self.log(f"  {name} N={n} K={k} M={m} {extra.get('config', '')}: {msg[:200]}")
            return self.record(entry, None, n, k, msg)
        return self.record(entry, us, n, k)

    def rel_diff(self, y, ref):
        return ((y.float() - ref).abs().max() / ref.abs().max()).item()

    def run(self, layer, ms, tiles):
        """Baselines, then the grid's stage 1 for every (shape, M), then stage 2 around each one's best (its new
        configurations compiled in parallel first). Each stage's (shape, M) gets an equal share of its budget:
        stage 1 up to 70% of what is left, stage 2 the rest."""
        shapes = sorted({(n, k) for _, n, k in layer}, key=lambda s: s[0] * s[1])
        best = {}  # (n, k, m) -> the best nf4_matmul entry
        base = {}  # (n, k, m) -> dequantise + cuBLAS (Triton) us
        tried = {}  # (n, k, m) -> the configurations timed
        cases = {}  # (n, k, m) -> fused(config): times one nf4_matmul configuration
        for n, k in shapes:
            ws, qs, dense = self.weights(n, k)  # kept to the end: about 300 MB a shape
            buf = torch.empty(n, k, device=self.device, dtype=self.dtype)
            self.log(f"shape {n}x{k}: {len(ws)} weight copies")
            for m in ms:
                x = torch.randn(m, k, device=self.device, dtype=self.dtype)
                y = torch.empty(m, n, device=self.device, dtype=self.dtype)
                ref = F.linear(x, dense).float()

                def tdq(p, a, x=x, qs=qs, buf=buf):
                    nf4_dequantize.nf4_dequantize(p, a, qs.code, buf, 64)
                    return F.linear(x, buf)
                entry = self.measure("dequantize + cuBLAS", n, k, m, [lambda p=p, a=a: tdq(p, a) for p, a in ws],
                                     lambda: self.rel_diff(tdq(*ws[0]), ref))
                base[(n, k, m)] = entry["us"]
                if self.device == "cuda":  # bitsandbytes' own dequantisation, as before commit 967fc7b
                    self.measure("bnb dequantize + cuBLAS", n, k, m, [
                        lambda p=p, a=a: (torch.ops.bitsandbytes.dequantize_4bit.out(
                            p, a, 64, "nf4", qs.shape, buf.dtype, out=buf), F.linear(x, buf)) for p, a in ws])
                self.measure("bnb matmul_4bit", n, k, m,
                             [lambda p=p, x=x: bnb.matmul_4bit(x, p.t(), quant_state=qs) for p, _ in ws],
                             lambda: self.rel_diff(bnb.matmul_4bit(x, ws[0][0].t(), quant_state=qs), ref))
                for name, kw in (("nf4_fused default", {}), ("nf4_fused pair table", {"pair_lut": True})):
                    self.measure(name, n, k, m, [lambda p=p, a=a, kw=kw: nf4_fused.nf4_linear(
                        x, p, a, qs.code, n, k, out=y, **kw) for p, a in ws],
                        lambda kw=kw: self.rel_diff(nf4_fused.nf4_linear(x, *ws[0], qs.code, n, k, out=y, **kw), ref))

                def fused(config, n=n, k=k, m=m, x=x, y=y, ref=ref, ws=ws, qs=qs):
                    tried.setdefault((n, k, m), set()).add(config)
                    entry = self.measure("nf4_matmul", n, k, m, [
                        lambda p=p, a=a: nf4_matmul(x, p, a, qs.code, n, k, launch=config, out=y) for p, a in ws],
                        lambda: self.rel_diff(nf4_matmul(x, *ws[0], qs.code, n, k, launch=config, out=y), ref),
                        config=config._asdict(), splits=splits(k, config)[0])
                    if entry["us"] and (best.get((n, k, m)) is None or entry["us"] < best[(n, k, m)]["us"]):
                        best[(n, k, m)] = entry
                cases[(n, k, m)] = fused

        self.log("stage 1: tiles x lookups x split-K")
        stage_end = time.monotonic() + 0.7 * max(0.0, self.deadline - time.monotonic())
        for i, ((n, k, m), fused) in enumerate(cases.items()):
            self.slot_deadline = time.monotonic() + (stage_end - time.monotonic()) / (len(cases) - i)
            for (bn, bk), lut in itertools.product(tiles, TINY_LUTS if self.tiny else LUTS):
                for s in split_candidates(n, k, bn, bk, self.sms, self.tiny):
                    fused(Config(bn, bk, s, warps_for(bn, bk), 3 if not self.tiny else 1, lut))
            self.log_best(n, k, m, base, best)

        self.log("stage 2: num_warps, num_stages and split-K around each best")
        around = {}
        for (n, k, m) in cases:
            if (n, k, m) in best:
                b = Config(**best[(n, k, m)]["config"])
                new = [b._replace(num_warps=w, num_stages=st) for w in (4, 8) for st in (2, 3, 4)]
                new += [b._replace(split_k=max(1, b.split_k // 2)), b._replace(split_k=b.split_k * 2)]
                if self.tiny:  # the code path, with one more configuration
                    new = [b._replace(num_warps=8)]
                around[(n, k, m)] = [c for c in dict.fromkeys(new)
                                     if c not in tried[(n, k, m)] and splits(k, c)[0] == c.split_k]
        if self.device == "cuda" and not self.tiny:
            prewarm(self, {(m, c._replace(split_k=1)) for (_, _, m), cs in around.items() for c in cs})
        for i, (key, configs) in enumerate(around.items()):
            self.slot_deadline = time.monotonic() + (self.deadline - time.monotonic()) / (len(around) - i)
            for c in configs:
                cases[key](c)
            self.log_best(*key, base, best)
        return shapes, best, base

    def log_best(self, n, k, m, base, best):
        got = best.get((n, k, m))
        self.log(f"  {n}x{k} M={m}: dequantize + cuBLAS {base[(n, k, m)] or float('nan'):.1f} us, best nf4_matmul "
                 + (f"{got['us']:.1f} us {got['config']}" if got else "none"))

    def lm_head(self, n, k, ms):
        w = torch.randn(n, k, device=self.device, dtype=self.dtype)
        for m in ms:
            x = torch.randn(m, k, device=self.device, dtype=self.dtype)
            self.measure("bf16 lm_head cuBLAS", n, k, m, [lambda x=x: F.linear(x, w)])

    def report(self, layer, ms, shapes, best, base, lm_head):
        """sweep.md, dispatch.json and the per-token projection."""
        by = {}
        for t in self.result["timings"]:
            if t["us"] and t["kernel"] != "nf4_matmul":
                by[(t["kernel"], t["N"], t["K"], t["M"])] = t["us"]
        others = ["bnb dequantize + cuBLAS", "bnb matmul_4bit", "nf4_fused default", "nf4_fused pair table"]
        fmt = lambda v: f"{v:.1f}" if v else "-"  # noqa: E731
        lines = [f"# nf4_matmul sweep ({self.result['device']}, {self.sms} SMs)", "",
                 f"`{self.result['command']}`; torch {self.result['torch']}, triton {self.result['triton']}, "
                 f"bitsandbytes {self.result['bitsandbytes']}. Microseconds a call, CUDA graphs over weights beyond "
                 "L2; GB/s on the packed 4-bit bytes.", "",
                 "| N x K | M | dequantize + cuBLAS | " + " | ".join(others) + " | "
                 + " | ".join(f"nf4_matmul {lut}" for lut in LUTS) + " | nf4_matmul best | GB/s | "
                 "vs dequantize + cuBLAS | best config |",
                 "|---|---|---|" + "---|" * (len(others) + len(LUTS)) + "---|---|---|---|"]
        by_lut = {}  # (lut, n, k, m) -> the best time of nf4_matmul with that lookup
        for t in self.result["timings"]:
            if t["us"] and t["kernel"] == "nf4_matmul":
                key = (t["config"]["lut"], t["N"], t["K"], t["M"])
                by_lut[key] = min(by_lut.get(key, math.inf), t["us"])
        entries = []
        for n, k in shapes:
            for m in ms:
                b, d = best.get((n, k, m)), base.get((n, k, m))
                cells = [f"{n} x {k}", str(m), fmt(d), *(fmt(by.get((o, n, k, m))) for o in others),
                         *(fmt(by_lut.get((lut, n, k, m))) for lut in LUTS)]
                if b:
                    cells += [fmt(b["us"]), f"{b['packed_GBps']:.0f}", f"{d / b['us']:.2f}x" if d else "-",
                              ", ".join(f"{key}={v}" for key, v in b["config"].items())]
                else:
                    cells += ["-", "-", "-", "nothing measured"]
                lines.append("| " + " | ".join(cells) + " |")
                wins = bool(b and d and b["us"] < d)
                entries.append({"N": n, "K": k, "M": m, "path": "nf4_matmul" if wins else "dequantize",
                                **({"config": b["config"]} if wins else {})})
        dispatch = {"version": nf4_dispatch.VERSION, "device": self.result["device"],
                    "source": f"bench/nf4_sweep.py ({self.result['command']})", "entries": entries}
        (self.out / "dispatch.json").write_text(json.dumps(dispatch, indent=1))
        nf4_dispatch.read_table(self.out / "dispatch.json")  # what GRPO will read: it must parse
        # per token: 32 layers x 7 projections, each as its own matmul (the decode step stacks q/k/v and gate/up)
        lines += ["", f"Projected base matmuls a decode step ({LAYERS} layers x {len(layer)} projections, ms a "
                  "token; dispatch = the faster of nf4_matmul's best and dequantize + cuBLAS per shape):", "",
                  "| M | dequantize + cuBLAS | bnb dequantize + cuBLAS | bnb matmul_4bit | nf4_matmul best | dispatch "
                  "| bf16 lm_head (not in the sum) |", "|---|---|---|---|---|---|---|"]
        self.result["per_token_ms"] = []
        for m in ms:
            def total(get):
                vals = [get(n, k) for _, n, k in layer]
                return LAYERS * sum(vals) / 1e3 if all(vals) else None
            row = {"M": m,
                   "dequantize_cublas": total(lambda n, k: base.get((n, k, m))),
                   "bnb_dequantize_cublas": total(lambda n, k: by.get(("bnb dequantize + cuBLAS", n, k, m))),
                   "bnb_matmul_4bit": total(lambda n, k: by.get(("bnb matmul_4bit", n, k, m))),
                   "nf4_matmul": total(lambda n, k: (best.get((n, k, m)) or {}).get("us")),
                   "dispatch": total(lambda n, k: min(v for v in (base.get((n, k, m)),
                                                                  (best.get((n, k, m)) or {}).get("us")) if v)
                                     if base.get((n, k, m)) or best.get((n, k, m)) else None),
                   "lm_head": (by.get(("bf16 lm_head cuBLAS", *lm_head, m)) or 0) / 1e3 or None}
            self.result["per_token_ms"].append(row)
            lines.append(f"| {m} | " + " | ".join(f"{row[c]:.2f}" if row[c] else "-" for c in
                                                   ("dequantize_cublas", "bnb_dequantize_cublas", "bnb_matmul_4bit",
                                                    "nf4_matmul", "dispatch", "lm_head")) + " |")
        skipped = sum("skipped" in t for t in self.result["timings"])
        errors = sum("error" in t for t in self.result["timings"])
        lines += ["", f"{len(self.result['timings'])} timings, {errors} failed (see sweep.json), {skipped} skipped "
                  f"(budget), {time.monotonic() - self.started:.0f} s."]
        (self.out / "sweep.md").write_text("\n".join(lines) + "\n")
        self.save()
        self.log("\n".join(lines))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output folder: sweep.json, sweep.md, dispatch.json, progress.log")
    ap.add_argument("--budget", type=float, default=400.0,
                    help="seconds for the whole grid (default 400); timings past it are recorded as skipped")
    ap.add_argument("--tiny", action="store_true", help="small shapes and a 2-configuration grid (on the CPU: "
                    "Triton's interpreter)")
    args = ap.parse_args()
    if not nf4_dequantize.available():
        sys.exit("error: triton is not installed")
    sweep = Sweep(args)
    layer, ms, tiles, lm_head = (TINY_LAYER, TINY_MS, TINY_TILES, TINY_LM_HEAD) if args.tiny else \
        (LAYER, MS, TILES, LM_HEAD)
    sweep.log(f"{sweep.result['device']}: shapes {sorted({(n, k) for _, n, k in layer})}, M {ms}, budget "
              f"{args.budget:.0f} s; writing {sweep.out}")
    sweep.lm_head(*lm_head, ms)
    if sweep.device == "cuda" and not args.tiny:  # stage 1's configurations
        prewarm(sweep, {(m, Config(bn, bk, 1, warps_for(bn, bk), 3, lut)) for m in ms for bn, bk in tiles
                        for lut in LUTS})
    shapes, best, base = sweep.run(layer, ms, tiles)
    sweep.report(layer, ms, shapes, best, base, lm_head)
    sweep.log(f"wrote {sweep.out}/sweep.json, sweep.md, dispatch.json")


if __name__ == "__main__":
    main()
