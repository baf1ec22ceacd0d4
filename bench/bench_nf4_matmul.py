"""The fused NF4 matmul (bench/nf4_fused.py) against bitsandbytes' dequantise + cuBLAS, at Llama 3 8B shapes.

    python bench/bench_nf4_fused.py --out bench/out/nf4_fused.json            # one GPU
    python bench/bench_nf4_fused.py --out bench/out/nf4_fused.json --sweep    # + other configurations
    python bench/bench_nf4_fused.py --tiny --out /tmp/nf4_fused.json          # CPU smoke run (interpreter)

For M (sequences per decode step) in --m and each linear shape (N, K) of a decoder layer: (a) bitsandbytes'
dequantize_4bit into a preallocated bf16 buffer then F.linear, as the decode step does today, and (b) nf4_linear
with its default configuration. Each is timed as a CUDA graph of calls (so launch overhead is not measured),
rotating over enough copies of the weight that they do not fit in L2 (in a decode step each weight is read
once, from HBM). Reports microseconds per call, GB/s on the packed 4-bit bytes (absmax adds 1/8 more),
the max relative difference of the two outputs, and the whole 32-layer model's time per decode step.
--sweep also times BLOCK_N in {32, 64, 128} x SPLIT_K in {1, 2, 4, 8}, and the default tile at 1-3 pipeline
stages, for each shape: what to change `nf4_fused._config` to.
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


def time_us(calls, device):
    """Microseconds per call of `calls` (a list of thunks, one per weight copy), run as one CUDA graph."""
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
    graph.replay()
    torch.cuda.synchronize()
    reps = max(3, math.ceil(2000 / len(calls)))  # about 2000 calls in all
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * len(calls))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--m", default="64,128", help="batch sizes (rows of x), comma separated")
    ap.add_argument("--tiny", action="store_true", help="small shapes (and on CPU, the interpreter)")
    ap.add_argument("--sweep", action="store_true", help="also time every (BLOCK_N, SPLIT_K) of a small grid")
    args = ap.parse_args()
    if not nf4_fused.available():
        sys.exit("triton is not installed")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter's tl.dot mishandles bf16
    ms = [int(m) for m in args.m.split(",")] if not args.tiny else [4, 16]
    shapes = TINY_SHAPES if args.tiny else sorted({(n, k) for _, n, k in LAYER})
    import triton
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (triton interpreter)",
              "torch": torch.__version__, "triton": triton.__version__, "dtype": str(dtype), "rows": [], "sweep": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        out.write_text(json.dumps(result, indent=1))

    print("| M | N | K | bnb dequant + linear (us) | triton dequant + linear (us) | nf4_linear (us) | speedup "
          "| nf4 GB/s (packed) | BLOCK_N, SPLIT_K | max rel diff |", flush=True)
    print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
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
                   "block_n": config[0], "split_k": config[1], "max_rel_diff": diff}
            result["rows"].append(row)
            save()
            print(f"| {m} | {n} | {k} | {base:.1f} | {tdq:.1f} | {fused:.1f} | {base / fused:.2f}x | {gbs:.0f} | {config[0]}, "
                  f"{config[1]} | {diff:.1e} |", flush=True)
            if args.sweep:
                # the (BLOCK_N, SPLIT_K) grid at the default 4 stages, then the default tile at fewer stages
                # (at 2+ stages triton also prefetches the code-table gathers through shared memory)
                grid = [(bn, sp, st, warps, two) for two in (False, True) for bn in (32, 64) for sp in (1, 2, 4, 8)
                        for st, warps in ((3, 4),)]
                for block_n, split, stages, warps, two_dots in grid:
                    kw = dict(block_n=block_n, split_k=split, num_stages=stages, num_warps=warps, two_dots=two_dots)
                    try:
                        t = time_us([lambda p=p, a=a: nf4_fused.nf4_linear(x, p, a, qs.code, n, k, out=y, **kw)
                                     for p, a in ws], device)
                    except Exception as e:  # a configuration that does not compile (shared memory) or run
                        t = None
                        print(f"  sweep M={m} N={n} K={k} {kw}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    result["sweep"].append({"M": m, "N": n, "K": k, **kw, "us": t})
                    save()
                best = min((s for s in result["sweep"] if (s["M"], s["N"], s["K"]) == (m, n, k) and s["us"]),
                           key=lambda s: s["us"])
                print(f"  sweep M={m} N={n} K={k}: best {best['us']:.1f} us ({base / best['us']:.2f}x bnb) at "
                      f"{ {key: best[key] for key in kw} }", flush=True)

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


if __name__ == "__main__":
    main()
