"""Whether greedy decoding writes the same replies twice, decoder by decoder.

    python bench/decode_determinism.py --model .cache/models/qwen2.5-coder-1.5b-instruct --adapter runs/SFT/adapter \
        --pairs_run runs/Pairs_debate --out runs/determinism          # one GPU; again with --out runs/determinism2
                                                                       # --compare_with runs/determinism
    python bench/decode_determinism.py --tiny --out /tmp/determinism  # CPU smoke run on the tiny model

On one H100, two 05 runs of the same SFT adapter on the same 40 test premises wrote the same greedy reply
for 4 of 40 with the static decoder and for 40 of 40 with `fast_paths: false` (docs/results.md, ninth run).
This found the part that differed, SDPA's cuDNN kernel in the decode step's attention, since replaced there by
two grouped matmuls (docs/performance.md): the model is loaded once as the stages load it (4-bit NF4, rank-64 rsLoRA;
without --adapter its LoRA B gets small random values, so that the adapter counts), and one batch of
prompts (the pairs run's test prompts, else random tokens of real prompt lengths) is decoded greedily
--repeats times by each variant: the static decoder as 05 runs it (bf16 base copies, one CUDA graph a
decode), without the graph, on the 4-bit base, without the adapter, with SDPA's attention as GRPO's rollouts
run it (all backends, or one), and transformers' generate (`--variants` picks some). Writes determinism.json: for each variant, the replies equal in every repeat, the
median token where a repeat first differs from the first, the replies equal to the first variant's and, with
--compare_with, to another process's (replies.json: each variant's first repeat); and the SDPA backend torch
picks for the decode step's attention.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench  # noqa: E402


def prompts(args, tok, vocab: int) -> list[list[int]]:
    from common.data import fit_prompt, token_ids
    if args.pairs_run:
        rows = [json.loads(line) for line in open(Path(args.pairs_run) / "test.jsonl")][:args.prompts]
        return [token_ids(tok.apply_chat_template(fit_prompt(tok, r["prompt"], 512), add_generation_prompt=True,
                                                  tokenize=True)) for r in rows]
    lengths = [12, 20] if args.tiny else json.loads(bench.LENGTHS.read_text())["prompts"]
    rng = random.Random(0)
    return [[rng.randrange(1000, vocab) for _ in range(rng.choice(lengths))] for _ in range(args.prompts)]


def variants(model, tok, args):
    """name -> a function that decodes the prompts once (new token ids of each)."""
    from torch.nn.attention import SDPBackend

    from common import fast
    from common.fast import decode_step
    eos, pad, rp = [tok.eos_token_id], tok.pad_token_id, args.repetition_penalty

    def static(weights="bf16", cuda_graph=None, attention=None, reproducible=True, adapter=True):
        def run(ids):
            kept = decode_step.DECODE_ATTENTION
            decode_step.DECODE_ATTENTION = attention or kept
            try:
                with contextlib.nullcontext() if adapter else model.disable_adapter():
                    return fast.decode(model, ids, args.new_tokens, eos, pad, temperature=0.0, repetition_penalty=rp,
                                       cuda_graph=cuda_graph, weights=weights, reproducible=reproducible)
            finally:
                decode_step.DECODE_ATTENTION = kept
                fast.release_dense_base(model)
        return run

    def hf_generate(ids):
        P = max(map(len, ids))
        batch = torch.full((len(ids), P), pad, dtype=torch.long)
        mask = torch.zeros_like(batch)
        for r, p in enumerate(ids):
            batch[r, P - len(p):], mask[r, P - len(p):] = torch.tensor(p), 1
        device = next(model.parameters()).device
        out = model.generate(input_ids=batch.to(device), attention_mask=mask.to(device), do_sample=False,
                             max_new_tokens=args.new_tokens, repetition_penalty=rp, pad_token_id=pad, eos_token_id=eos)
        # cut as the static decoder cuts: through the first end token (what follows is generate's padding)
        return [row[:next((j + 1 for j, t in enumerate(row) if t in eos), len(row))] for row in out[:, P:].tolist()]

    found = {"static (as 05: grouped-matmul attention, bf16 copies, CUDA graph)": static(),
             "static, no CUDA graph": static(cuda_graph=False), "static, 4-bit base": static(weights="nf4"),
             "static, adapter off": static(adapter=False),
             "static, SDPA attention (as GRPO's rollouts)": static(reproducible=False)}
    if torch.cuda.is_available():
        for backend in ("MATH", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
            found[f"static, SDPA attention, {backend.lower()} only"] = static(
                attention=[getattr(SDPBackend, backend)], reproducible=False)
    found["transformers generate"] = hf_generate
    return {name: run for name, run in found.items() if not args.variants or any(v in name for v in args.variants)}


def attention_backend(model, batch: int, length: int) -> str:
    """The SDPA backend that the decode step's attention (one query a sequence, GQA, an additive mask) runs
    on, as torch chooses it among the step's allowed backends."""
    from torch.nn.attention import sdpa_kernel

    from common.fast.decode_step import DECODE_ATTENTION
    from common.model import unwrap_peft
    cfg, p = unwrap_peft(model).config, next(model.parameters())
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q = torch.zeros(batch, cfg.num_attention_heads, 1, hd, dtype=torch.bfloat16, device=p.device)
    kv = torch.zeros(batch, cfg.num_key_value_heads, length, hd, dtype=torch.bfloat16, device=p.device)
    bias = torch.zeros(batch, 1, 1, length, dtype=torch.bfloat16, device=p.device)
    with sdpa_kernel(DECODE_ATTENTION):
        chosen = torch._fused_sdp_choice(q, kv, kv, attn_mask=bias, dropout_p=0.0, is_causal=False, scale=hd ** -0.5,
                                         enable_gqa=True)
    return {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}.get(chosen, str(chosen))


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/out/determinism")
    ap.add_argument("--model", default=".cache/models/smollm2-135m-instruct")
    ap.add_argument("--adapter", default=None, help="a stage's adapter/ folder (default: random LoRA B)")
    ap.add_argument("--pairs_run", default=None, help="prompts from its test.jsonl (default: random tokens)")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new_tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--repetition_penalty", type=float, default=1.2)
    ap.add_argument("--variants", nargs="*", default=None, help="only the variants whose names hold one of these")
    ap.add_argument("--compare_with", default=None,
                    help="another run's --out (same arguments): each variant's replies against that process's")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        from common.local_models import ensure
        ensure("tiny", bench.TINY_MODEL)
    model, tok = bench.load_lora(bench.TINY_MODEL if args.tiny else Path(args.model), args.adapter)
    ids = prompts(args, tok, min(len(tok), model.config.vocab_size))
    rows, reference, first = [], None, {}
    other = json.loads((Path(args.compare_with) / "replies.json").read_text()) if args.compare_with else {}
    with torch.no_grad():
        for name, decode in variants(model, tok, args).items():
            try:
                t0 = time.perf_counter()
                runs = [decode(ids) for _ in range(args.repeats)]
                seconds = time.perf_counter() - t0
            except Exception as err:  # a backend that refuses these shapes
                rows.append({"variant": name, "error": f"{type(err).__name__}: {err}"[:300]})
                print(json.dumps(rows[-1]), flush=True)
                continue
            reference, first[name] = reference or runs[0], runs[0]
            splits = [d for run in runs[1:] for a, b in zip(runs[0], run) if (d := first_difference(a, b)) is not None]
            rows.append({"variant": name, "prompts": len(ids), "repeats": args.repeats,
                         "equal_in_every_repeat": sum(all(run[r] == runs[0][r] for run in runs[1:])
                                                      for r in range(len(ids))),
                         "median_first_difference_token": statistics.median(splits) if splits else None,
                         "equal_to_first_variant": sum(a == b for a, b in zip(runs[0], reference)),
                         "seconds": round(seconds, 1)})
            if name in other:  # two processes: what a second run of a stage would write
                rows[-1]["equal_to_other_process"] = sum(a == b for a, b in zip(runs[0], other[name]))
            print(json.dumps(rows[-1]), flush=True)
    result = {"meta": bench.meta(args), "rows": rows,
              "decode_attention_backend": attention_backend(model, len(ids), max(map(len, ids)) + args.new_tokens)}
    (out / "determinism.json").write_text(json.dumps(result, indent=1))
    (out / "replies.json").write_text(json.dumps(first))
    print(f"wrote {out / 'determinism.json'}")


if __name__ == "__main__":
    main()
