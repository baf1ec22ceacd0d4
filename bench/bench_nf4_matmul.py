"""The fused NF4 matmul (bench/nf4_fused.py) against bitsandbytes' dequantise + cuBLAS, at Llama 3 8B shapes.

    python bench/bench_nf4_matmul.py --out bench/out/nf4_fused.json            # one GPU
    python bench/bench_nf4_matmul.py --out bench/out/nf4_fused.json --sweep    # + other configurations (M=64)
    python bench/bench_nf4_matmul.py --tiny --sweep --out /tmp/nf4_fused.json  # CPU smoke run (interpreter)

For M (sequences per decode step) in --m and each linear shape (N, K) of a decoder layer: (a) bitsandbytes'
dequantize_4bit into a preallocated bf16 buffer then F.linear, as the decode step does today, and (b) nf4_linear
with its default configuration. Each is timed as a CUDA graph of calls (so launch overhead is not measured),
rotating over enough copies of the weight that they do not fit in L2 (in a decode step each weight is read
once, from HBM). Reports microseconds per call, GB/s on the packed 4-bit bytes (absmax adds 1/8 more),
the max relative difference of the two outputs, and the whole 32-layer model's time per decode step.

--sweep then times, at M = --sweep-m for each shape, a bounded set of configurations around the default
(`nf4_fused._config`): each knob varied alone (BLOCK_K 64/256, BLOCK_N 32/128, split-K halved/doubled/1,
2 and 4 stages, 8 warps, pair_lut, two_dots) and a few pairs (BLOCK_K 512 only at 8 warps and 2 stages, the
smallest shared memory it can have, which may still not fit); then, per shape, the default with every knob that
helped on its own set to its best value. Configurations run outer and shapes inner, so each compiles once
(N, K and the split count are not compile-time constants); --sweep-budget seconds bounds the whole sweep
(what is left is skipped). It prints the best configuration per shape: what to change `_config` to.
Results go to --out as JSON, rewritten after each measurement, so a run cut short keeps what it measured.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

# Without a GPU the kernel runs under Triton's interpreter, which must be chosen before triton is imported
# (bitsandbytes imports it); torch is imported only to ask whether there is a GPU.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bitsandbytes.functional as bnbF  # noqa: E402
import nf4_fused  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common.fast import nf4_dequantize  # noqa: E402

LAYERS = 32
# (name, N, K) of each 4-bit linear in a Llama 3 8B decoder layer
LAYER = [("q", 4096, 4096), ("k", 1024, 4096), ("v", 1024, 4096), ("o", 4096, 4096),
         ("gate", 14336, 4096), ("up", 14336, 4096), ("down", 4096, 14336)]
TINY_SHAPES = [(64, 128), (96, 256), (256, 512)]
L2_BYTES = 256 << 20  # rotate over at least this many packed bytes: several times the H200's 50 MB L2


def weights(n, k, copies, device):
    """`copies` distinct (packed, absmax) of one random NF4 weight, and its quant_state."""
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    packed, qs = bnbF.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    absmax = (bnbF.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset) if qs.nested else qs.absmax.float()
    return [(packed.clone(), absmax.clone()) for _ in range(copies)], qs


def dequant_linear(x, packed, absmax, qs, buf):
    if buf.is_cuda:
        torch.ops.bitsandbytes.dequantize_4bit.out(packed, absmax, qs.blocksize, "nf4", qs.shape, buf.dtype, out=buf)
    else:  # bitsandbytes 0.50 registers the out= form for CUDA only
        buf.copy_(torch.ops.bitsandbytes.dequantize_4bit(packed, absmax, qs.blocksize, "nf4", qs.shape, buf.dtype))
    return F.linear(x, buf)


def triton_dequant_linear(x, packed, absmax, qs, buf):
    nf4_dequantize.nf4_dequantize(packed, absmax, qs.code, buf, qs.blocksize)
    return F.linear(x, buf)


def time_us(calls, device, gpu_seconds: float | None = None):
    """Microseconds per call of `calls` (a list of thunks, one per weight copy), run as one CUDA graph:
    about 2000 calls in all, or replays for about `gpu_seconds` of GPU time (at least 3)."""
    if device != "cuda":  # the interpreter: only checks that it runs
        t = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - t) / len(calls) * 1e6
    for c in calls[:2]:  # compile, and let cuBLAS pick its kernel, outside the capture
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    reps = max(3, math.ceil(gpu_seconds / max(start.elapsed_time(end) * 1e-3, 1e-6))) if gpu_seconds else \
        max(3, math.ceil(2000 / len(calls)))
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * len(calls))


# Sweep variations around the default configuration d (a nf4_fused.Config), as keyword overrides of nf4_linear.
VARIATIONS = [
    ("default", lambda d: {}),
    ("split 1", lambda d: {"split_k": 1}),
    ("split /2", lambda d: {"split_k": max(1, d.split_k // 2)}),
    ("split x2", lambda d: {"split_k": d.split_k * 2}),
    ("2 stages", lambda d: {"num_stages": 2}),
    ("4 stages", lambda d: {"num_stages": 4}),
    ("8 warps", lambda d: {"num_warps": 8}),
    ("pair_lut", lambda d: {"pair_lut": True}),
    ("two_dots", lambda d: {"two_dots": True}),
    ("pair_lut, two_dots", lambda d: {"pair_lut": True, "two_dots": True}),
    ("pair_lut, 2 stages", lambda d: {"pair_lut": True, "num_stages": 2}),
    ("block_k 64", lambda d: {"block_k": 64}),
    ("block_k 256", lambda d: {"block_k": 256}),
    ("block_k 256, 8 warps", lambda d: {"block_k": 256, "num_warps": 8}),
    ("block_k 256, 8 warps, pair_lut", lambda d: {"block_k": 256, "num_warps": 8, "pair_lut": True}),
    ("block_k 512, 8 warps, 2 stages", lambda d: {"block_k": 512, "num_warps": 8, "num_stages": 2}),
    ("block_n 32", lambda d: {"block_n": 32}),
    ("block_n 128, 8 warps", lambda d: {"block_n": 128, "num_warps": 8}),
    ("block_n 128, 8 warps, split /2", lambda d: {"block_n": 128, "num_warps": 8, "split_k": max(1, d.split_k // 2)}),
    ("block_n 128, 8 warps, pair_lut", lambda d: {"block_n": 128, "num_warps": 8, "pair_lut": True}),
    ("block_n 128, 8 warps, block_k 256, 2 stages", lambda d: {"block_n": 128, "num_warps": 8, "block_k": 256,
                                                               "num_stages": 2}),
]
MAX_REL_DIFF = 2e-2  # a sweep configuration further than this from bitsandbytes' output is wrong, not timed
TINY_VARIATIONS = ["default", "pair_lut, two_dots", "block_k 64"]
KNOBS = ("block_n", "block_k", "split_k", "num_warps", "num_stages", "pair_lut", "two_dots")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--m", default="64,128", help="batch sizes (rows of x), comma separated")
    ap.add_argument("--tiny", action="store_true", help="small shapes (and on CPU, the interpreter)")
    ap.add_argument("--sweep", action="store_true", help="also time configurations around the default")
    ap.add_argument("--sweep-m", type=int, default=64, help="the batch size the sweep runs at (default 64)")
    ap.add_argument("--sweep-budget", type=float, default=75.0, help="seconds for the whole sweep; the rest is skipped")
    args = ap.parse_args()
    if not nf4_fused.available():
        sys.exit("triton is not installed")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter's tl.dot mishandles bf16
    ms = [int(m) for m in args.m.split(",")] if not args.tiny else [4, 16]
    sweep_m = args.sweep_m if not args.tiny else ms[0]
    shapes = TINY_SHAPES if args.tiny else sorted({(n, k) for _, n, k in LAYER})
    import triton
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (triton interpreter)",
              "torch": torch.__version__, "triton": triton.__version__, "dtype": str(dtype), "rows": [], "sweep": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        out.write_text(json.dumps(result, indent=1))

    print("| M | N | K | bnb dequant + linear (us) | triton dequant + linear (us) | nf4_linear (us) | speedup "
          "| nf4 GB/s (packed) | BLOCK_N, BLOCK_K, SPLIT_K | max rel diff |", flush=True)
    print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
    state = {}  # (n, k) -> what the sweep needs: weight copies, quant state, x and out at sweep_m, bnb's time
    for n, k in shapes:
        copies = 1 if args.tiny else max(2, math.ceil(L2_BYTES / (n * k // 2)))
        ws, qs = weights(n, k, copies, device)
        buf = torch.empty(n, k, device=device, dtype=dtype)
        for m in ms:
            x = torch.randn(m, k, device=device, dtype=dtype)
            y = torch.empty(m, n, device=device, dtype=dtype)
            ref = dequant_linear(x, *ws[0], qs, buf).float()
            diff = ((nf4_fused.nf4_linear(x, *ws[0], qs.code, n, k, out=y).float() - ref).abs().max()
                    / ref.abs().max()).item()
            base = time_us([lambda p=p, a=a: dequant_linear(x, p, a, qs, buf) for p, a in ws], device)
            tdq = time_us([lambda p=p, a=a: triton_dequant_linear(x, p, a, qs, buf) for p, a in ws], device)
            bnb_only = time_us([lambda p=p, a=a: torch.ops.bitsandbytes.dequantize_4bit.out(
                p, a, qs.blocksize, "nf4", qs.shape, buf.dtype, out=buf) for p, a in ws], device) if device == "cuda" else 0
            tdq_only = time_us([lambda p=p, a=a: nf4_dequantize.nf4_dequantize(p, a, qs.code, buf, qs.blocksize)
                                for p, a in ws], device)
            fused = time_us([lambda p=p, a=a: nf4_fused.nf4_linear(x, p, a, qs.code, n, k, out=y) for p, a in ws],
                            device)
            config = nf4_fused._config(m, n, k, 64, x.device)
            gbs = n * k / 2 / (fused * 1e-6) / 1e9
            row = {"M": m, "N": n, "K": k, "bnb_us": base, "triton_dequant_us": tdq, "nf4_us": fused,
                   "bnb_dequant_only_us": bnb_only, "triton_dequant_only_us": tdq_only, "nf4_packed_GBps": gbs,
                   **config._asdict(), "max_rel_diff": diff}
            result["rows"].append(row)
            save()
            print(f"| {m} | {n} | {k} | {base:.1f} | {tdq:.1f} | {fused:.1f} | {base / fused:.2f}x | {gbs:.0f} "
                  f"| {config.block_n}, {config.block_k}, {config.split_k} | {diff:.1e} |", flush=True)
            if m == sweep_m:
                state[(n, k)] = dict(ws=ws, qs=qs, x=x, y=y, base=base, ref=ref)
        if args.sweep and (n, k) not in state:  # the sweep's M is not among --m
            x = torch.randn(sweep_m, k, device=device, dtype=dtype)
            y = torch.empty(sweep_m, n, device=device, dtype=dtype)
            ref = dequant_linear(x, *ws[0], qs, buf).float()
            base = time_us([lambda p=p, a=a: dequant_linear(x, p, a, qs, buf) for p, a in ws], device)
            state[(n, k)] = dict(ws=ws, qs=qs, x=x, y=y, base=base, ref=ref)
        if not args.sweep:
            state.pop((n, k), None)  # free the weight copies

    if args.sweep:
        sweep(args, result, save, state, sweep_m, device)

    if not args.tiny:  # the whole model's base-weight matmuls per decode step
        keys = ("bnb_us", "triton_dequant_us", "nf4_us", "bnb_dequant_only_us", "triton_dequant_only_us")
        print("\n| M | ms / decode step: " + " | ".join(keys) + " |", flush=True)
        print("|---|" + "---|" * len(keys), flush=True)
        result["per_step"] = []
        for m in ms:
            t = {(r["N"], r["K"]): r for r in result["rows"] if r["M"] == m}
            step = {key: LAYERS * sum(t[(n, k)][key] for _, n, k in LAYER) / 1e3 for key in keys}
            result["per_step"].append({"M": m, **{key[:-3] + "_ms": v for key, v in step.items()}})
            print(f"| {m} | " + " | ".join(f"{step[key]:.2f}" for key in keys) + " |", flush=True)
        save()
    print(f"\nwrote {out}", flush=True)


def sweep(args, result, save, state, m, device):
    """Variations around the default (configurations outer, shapes inner, so each compiles once), then per shape
    the default with each knob that helped alone set to its best value. Bounded by --sweep-budget seconds."""
    deadline = time.monotonic() + args.sweep_budget
    variations = [v for v in VARIATIONS if not args.tiny or v[0] in TINY_VARIATIONS]
    defaults = {shape: nf4_fused._config(m, *shape, 64, state[shape]["x"].device) for shape in state}
    print(f"\nsweep at M={m}: {len(variations)} variations x {len(state)} shapes, then a combined best per shape "
          f"(budget {args.sweep_budget:.0f} s)", flush=True)

    def measure(shape, name, kw):
        n, k = shape
        st = state[shape]
        d = defaults[shape]
        full = {**d._asdict(), **kw}
        entry = {"M": m, "N": n, "K": k, "variation": name, **full, "us": None}
        if k % full["block_k"] or full["block_k"] < 64:
            return None  # block_k must divide K
        if time.monotonic() > deadline:
            entry["skipped"] = "sweep budget spent"
        else:
            try:  # checked against bitsandbytes (as the table's max rel diff) before it is timed
                y = nf4_fused.nf4_linear(st["x"], *st["ws"][0], st["qs"].code, n, k, out=st["y"], **full).float()
                entry["max_rel_diff"] = ((y - st["ref"]).abs().max() / st["ref"].abs().max()).item()
                if not entry["max_rel_diff"] <= MAX_REL_DIFF:
                    raise ValueError(f"wrong output: max rel diff {entry['max_rel_diff']:.1e} vs bitsandbytes")
                entry["us"] = time_us([lambda p=p, a=a: nf4_fused.nf4_linear(st["x"], p, a, st["qs"].code, n, k,
                                                                              out=st["y"], **full)
                                       for p, a in st["ws"]], device)
                entry["packed_GBps"] = n * k / 2 / (entry["us"] * 1e-6) / 1e9
            except Exception as e:  # a configuration that does not compile (shared memory, registers) or run
                entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"  M={m} N={n} K={k} {name} {kw}: {entry['error'][:200]}", flush=True)
        result["sweep"].append(entry)
        save()
        return entry

    for name, make in variations:
        for shape in state:
            measure(shape, name, make(defaults[shape]))
    print("\n| N | K | default (us) | best (us) | best GB/s (packed) | best / bnb | best configuration |", flush=True)
    print("|---|---|---|---|---|---|---|", flush=True)
    for shape in state:
        n, k = shape
        mine = [s for s in result["sweep"] if (s["M"], s["N"], s["K"]) == (m, n, k) and s["us"]]
        if not mine:
            print(f"| {n} | {k} | - | - | - | - | nothing measured |", flush=True)
            continue
        default = next((s for s in mine if s["variation"] == "default"), None)
        # the combined best: each knob at the value of the best single-knob variation that changed it and beat
        # the default, if that is not already a measured configuration
        d = defaults[shape]._asdict()
        combined = {}
        if default is not None:
            for knob in KNOBS:
                better = [s for s in mine if s[knob] != d[knob] and s["us"] < default["us"]
                          and all(s[o] == d[o] for o in KNOBS if o != knob)]
                if better:
                    combined[knob] = min(better, key=lambda s: s["us"])[knob]
        if len(combined) > 1:
            entry = measure(shape, "combined best", combined)
            if entry and entry["us"]:
                mine.append(entry)
        best = min(mine, key=lambda s: s["us"])
        print(f"| {n} | {k} | {default['us'] if default else float('nan'):.1f} | {best['us']:.1f} "
              f"| {n * k / 2 / (best['us'] * 1e-6) / 1e9:.0f} | {state[shape]['base'] / best['us']:.2f}x "
              f"| {best['variation']}: {', '.join(f'{key}={best[key]}' for key in KNOBS)} |", flush=True)
    result["sweep_best"] = {f"{n}x{k}": min((s for s in result["sweep"] if (s["N"], s["K"]) == (n, k) and s["us"]),
                                              key=lambda s: s["us"], default=None) for n, k in state}
    save()


if __name__ == "__main__":
    main()
