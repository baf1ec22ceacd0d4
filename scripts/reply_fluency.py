"""How fluent each model's replies are, by a plain language model's perplexity of them.

    python scripts/reply_fluency.py EVAL_RUN_REPLIES_JSONL MODEL_DIR [--premises N] [--models base sft ...]

A judge can prefer text that no reader would: word salad scores low perplexity under no language model.
For each model of a stage-05 replies.jsonl, the mean per-token negative log-likelihood of its replies (alone,
no premise) under MODEL_DIR (e.g. the base, .cache/models/smollm2-135m-instruct, in full precision), and
its exponent, the perplexity. Prints JSON.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.data import read_jsonl  # noqa: E402


@torch.no_grad()
def mean_nll(model, tokenizer, texts: list[str], max_tokens: int = 256) -> float:
    total, count = 0.0, 0
    for text in texts:
        ids = tokenizer(text, return_tensors="pt", truncation=True, max_length=max_tokens)["input_ids"]
        if ids.shape[1] < 2:
            continue
        loss = model(input_ids=ids, labels=ids).loss  # mean over the text's predicted tokens
        total += loss.item() * (ids.shape[1] - 1)
        count += ids.shape[1] - 1
    return total / max(count, 1)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("replies", type=Path)
    parser.add_argument("model", type=Path)
    parser.add_argument("--premises", type=int, default=30)
    parser.add_argument("--models", nargs="*")
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    rows = [row for _, row in read_jsonl(args.replies)][: args.premises]
    names = args.models or [k for k, v in rows[0].items() if isinstance(v, dict) and "reply" in v]
    out = {"replies": str(args.replies), "model": str(args.model), "n_premises": len(rows), "models": {}}
    for name in names:
        nll = mean_nll(model, tokenizer, [row[name]["reply"] for row in rows])
        out["models"][name] = {"mean_nll": nll, "perplexity": math.exp(nll)}
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
