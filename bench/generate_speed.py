"""Generate speed of real writers, the static decoder against transformers' generate, on CMV posts.

Each model folder is loaded as the stages load a writer (4-bit NF4 base, rank-64 rsLoRA, its B drawn
non-zero so that the adapter counts), then answers the same posts greedily through
`common.generation.generate_replies` twice: `static=True` (the static decoder, where the model is
Llama-shaped) and `static=False` (transformers' generate). Written to OUT/generate_speed.json: new tokens
a second of each decoder, and how far their greedy replies agree (the share of replies equal, and the
mean share of each reply's words that match before the first difference: bf16 rounding differs between
the two, so greedy paths may part late in a reply).

    python bench/generate_speed.py --out bench/out/generate --models .cache/models/qwen2.5-coder-1.5b-instruct \\
        .cache/models/smollm2-135m-instruct
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def posts(n: int, words: int) -> list[list[dict]]:
    """The prompts of the first `n` distinct CMV posts of the bundled data, as stage 01 builds them
    (`common.tasks.cmv.to_pair`: title and body cut to `words` words, give-aways scrubbed)."""
    from common.tasks.cmv import to_pair
    seen, prompts = set(), []
    with gzip.open(REPO / "data/cmv/cmv_pairs.jsonl.gz", "rt") as f:
        for i, line in enumerate(f, 1):
            row = json.loads(line)
            pair = to_pair(row, f"cmv_pairs.jsonl.gz line {i}", words)
            if isinstance(pair, str) or row["op_id"] in seen:  # a dropped row (its reason), or a post seen
                continue
            seen.add(row["op_id"])
            prompts.append(pair["prompt"])
            if len(prompts) == n:
                break
    return prompts


def agreement(a: list[str], b: list[str]) -> dict:
    def prefix(x, y):
        x, y = x.split(), y.split()
        k = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        return k / max(len(x), len(y), 1)
    return {"equal_share": sum(x == y for x, y in zip(a, b)) / len(a),
            "mean_matching_prefix": sum(prefix(x, y) for x, y in zip(a, b)) / len(a)}


def main(args):
    from common.config import ModelArgs
    from common.generation import decoder_for, generate_replies
    from common.model import CAUSAL_LM, load_model, load_tokenizer
    prompts = posts(args.prompts, args.premise_words)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size,
               "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "models": {}}
    for folder in args.models:
        margs = ModelArgs(model_name_or_path=folder)
        tokenizer = load_tokenizer(margs)
        model = load_model(margs, CAUSAL_LM, tokenizer=tokenizer).eval()
        torch.manual_seed(0)
        with torch.no_grad():  # an adapter that matters, as a trained one does
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 1e-3)
        row, replies = {}, {}
        for static in (True, False):
            decoder = decoder_for(model, static)
            if decoder in row:  # a model the static decoder does not take: one row
                continue
            generate_replies(model, tokenizer, prompts[:2], 8, 2, static=static)  # warm-up: graphs, kernels
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            texts = generate_replies(model, tokenizer, prompts, args.max_new_tokens, args.batch_size,
                                     repetition_penalty=args.repetition_penalty, static=static)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            tokens = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts)
            row[decoder] = {"seconds": round(seconds, 2), "new_tokens": tokens,
                            "tokens_per_s": round(tokens / seconds, 1)}
            replies[decoder] = texts
        if len(replies) == 2:
            row["agreement"] = agreement(replies["static"], replies["hf_generate"])
            row["speedup"] = round(row["static"]["tokens_per_s"] / row["hf_generate"]["tokens_per_s"], 2)
        row["sample"] = {d: texts[0][:600] for d, texts in replies.items()}
        results["models"][Path(folder).name] = row
        print(json.dumps({Path(folder).name: {k: v for k, v in row.items() if k != "sample"}}), flush=True)
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    (out / "generate_speed.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", required=True, help="model folders (a writer each)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, default=100, help="CMV posts answered (the chain's eval: 100)")
    ap.add_argument("--batch_size", type=int, default=100, help="replies generated at once")
    ap.add_argument("--max_new_tokens", type=int, default=256)
    ap.add_argument("--premise_words", type=int, default=470)
    ap.add_argument("--repetition_penalty", type=float, default=1.2, help="the qwen-gpu chain's decoding")
    main(ap.parse_args())
