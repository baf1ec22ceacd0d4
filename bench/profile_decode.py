"""Where a GRPO rollout's decode step spends its time: kernels of the fused step, by operator.

    python bench/profile_decode.py --out bench/out/decode    # one GPU, the random Llama 3 8B shape
    python bench/profile_decode.py --tiny --out /tmp/decode  # CPU smoke run on the tiny model

For each base-weight mode ("nf4", "bf16"): 64 prompts of real ChangeMyView prompt lengths (up to
512 tokens), the milliseconds per new token of the CUDA-graph decode (over 128 tokens, prefill
excluded), then three eager steps under torch.profiler: kernel count and GPU time per step, and the
operators by GPU time with their input shapes. If the kernels' own time is close to the graph's ms per
token, the step is bound by the kernels, not by launching them. Writes decode_profile.json and one
table per mode under --out.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench  # noqa: E402


def load(args):
    from common.local_models import ensure
    path = bench.TINY_MODEL if args.tiny else Path(args.model)
    if args.tiny:
        ensure("tiny", path)
    else:
        bench.build_random_model(path)
    model, tok = bench.load_lora(path)
    if torch.cuda.is_available():  # as GRPO runs it (liger_kernel: true)
        from common.fast.model_changes import apply_liger_kernels
        apply_liger_kernels(SimpleNamespace(model=model))
    return model, tok


def attention_variants(B=64, L=768, nq=32, nkv=8, hd=128, iters=50) -> list[dict]:
    """The decode step's attention (one query per sequence over a (B, nkv, L, hd) cache, an additive
    mask for left padding) by several kernels, each timed and checked against the first."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    q = torch.randn(B, nq, 1, hd, device=dev, dtype=dt)
    keys, values = (torch.randn(B, nkv, L, hd, device=dev, dtype=dt) for _ in range(2))
    bias = torch.zeros(B, 1, 1, L, device=dev)
    for b in range(B):
        bias[b, ..., :b * 4] = float("-inf")  # left padding of up to 252 slots
    scale, rep = hd ** -0.5, nq // nkv

    def grouped_bmm():  # DecodeStep's: query head j reads K/V head j // rep without copying K/V
        scores = torch.matmul(q.view(B, nkv, rep, hd), keys.transpose(-1, -2))
        probs = torch.add(bias, scores, alpha=scale).softmax(-1).to(dt)
        return torch.matmul(probs, values).view(B, nq, 1, hd)

    def transposed_bmm():  # K (L, hd) @ q^T: the long side as the matmul's rows
        scores = torch.matmul(keys, q.view(B, nkv, rep, hd).transpose(-1, -2))  # (B, nkv, L, rep)
        probs = torch.add(bias.transpose(-1, -2), scores, alpha=scale).softmax(-2).to(dt)
        return torch.matmul(values.transpose(-1, -2), probs).permute(0, 1, 3, 2).reshape(B, nq, 1, hd)

    def sdpa(backend=None, mask=True):
        def run():
            m = bias.to(dt) if mask else None
            with sdpa_kernel(backend) if backend else contextlib.nullcontext():
                return F.scaled_dot_product_attention(q, keys, values, attn_mask=m, scale=scale, enable_gqa=True)
        return run
    variants = {"grouped_bmm": grouped_bmm, "transposed_bmm": transposed_bmm, "sdpa_default": sdpa(),
                "sdpa_efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION), "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
                "sdpa_math": sdpa(SDPBackend.MATH),
                "sdpa_flash_no_mask (wrong: speed bound only)": sdpa(SDPBackend.FLASH_ATTENTION, mask=False)}
    ref, rows = grouped_bmm().float(), []
    for name, fn in variants.items():
        try:
            out = fn()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            torch.cuda.synchronize()
            rows.append({"variant": name, "B": B, "L": L, "us_per_layer": round(1000 * start.elapsed_time(end) / iters, 1),
                         "max_abs_diff": round(float((out.float() - ref).abs().max()), 4)})
        except Exception as err:  # a backend that refuses these shapes
            rows.append({"variant": name, "error": f"{type(err).__name__}: {err}"[:300]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/out/decode")
    ap.add_argument("--model", default="/tmp/llama3-8b-random")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new_tokens", type=int, default=128)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from torch.profiler import ProfilerActivity, profile

    results = {"meta": bench.meta(args), "rows": []}
    if torch.cuda.is_available():
        results["attention"] = [r for L in (518, 768) for r in attention_variants(L=L)]
    import common.fast.static_decoder as gen
    from common.fast.decode_step import DecodeStep
    model, tok = load(args)
    vocab = min(len(tok), model.config.vocab_size) if args.tiny else 100_000
    lengths = json.loads(bench.LENGTHS.read_text())["prompts"] if not args.tiny else [12, 20]
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, vocab) for _ in range(rng.choice(lengths))] for _ in range(args.batch)]
    eos = [tok.eos_token_id]
    capture = gen._capture
    for weights in ("nf4", "bf16"):
        gen.decode(model, prompts[:2], 4, eos, tok.pad_token_id, weights=weights, reproducible=False)  # warm-up
        marks = []

        def timed_capture(step, state):  # decode calls it once its prefill is done
            bench.sync()
            marks.append(time.perf_counter())
            return capture(step, state)
        gen._capture = timed_capture
        bench.mem_reset()
        bench.sync()
        t0 = time.perf_counter()
        gen.decode(model, prompts, args.new_tokens, [-1], tok.pad_token_id, weights=weights,
                   reproducible=False)  # GRPO's step (SDPA's attention); no end token
        bench.sync()
        t1 = time.perf_counter()
        gen._capture = capture
        prefill = (marks[0] - t0) if marks else None
        ms = 1000 * (t1 - marks[0]) / (args.new_tokens - 1) if marks else None

        # Eager steps 2-4 under the profiler (step 1 picks kernels).
        prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else []),
                       record_shapes=True)
        calls = {"n": 0}
        step_call = DecodeStep.__call__

        def profiled(self, *a):
            calls["n"] += 1
            if calls["n"] == 2:
                bench.sync()
                prof.start()
            result = step_call(self, *a)
            if calls["n"] == 4:
                bench.sync()
                prof.stop()
            return result
        DecodeStep.__call__ = profiled
        try:
            gen.decode(model, prompts, 6, [-1], tok.pad_token_id, weights=weights, cuda_graph=False, reproducible=False)
        finally:
            DecodeStep.__call__ = step_call
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        gpu_ms = sum(e.device_time for e in kernels) / 1000 / 3
        row = {"weights": weights, "batch": args.batch, "new_tokens": args.new_tokens, "prefill_s": prefill,
               "graph_ms_per_token": ms, "kernels_per_step": len(kernels) / 3, "kernel_ms_per_step": gpu_ms,
               "peak_gib": bench.peak_gib()}
        results["rows"].append(row)
        print(json.dumps(row), flush=True)
        sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        (out / f"decode_{weights}.txt").write_text(
            json.dumps(row) + "\n\n"
            + prof.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=70) + "\n\nby input shape:\n"
            + prof.key_averages(group_by_input_shape=True).table(sort_by=sort, row_limit=30, max_name_column_width=50,
                                                                  max_shapes_column_width=90))
        (out / "decode_profile.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
