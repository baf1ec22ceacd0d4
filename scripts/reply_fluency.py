"""How fluent each model's replies are, by a plain language model's perplexity of them.

    python scripts/reply_fluency.py EVAL_RUN_REPLIES_JSONL MODEL_DIR [--premises N] [--models base sft ...]

A judge can prefer text that no reader would: word salad scores low perplexity under no language model.
For each model of a stage-05 replies.jsonl, its replies' mean per-token log-probability (alone, no premise)
under MODEL_DIR (common/fluency.py: best a model of another family than the writer, e.g. Gemma-3-270M),
as `mean_nll` and its exponent, the perplexity (replies weighted alike). Prints JSON. Stage 05 computes
the same figures itself with `fluency_model_name_or_path`; this reads a finished run's replies.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.data import read_jsonl  # noqa: E402
from common.fluency import FluencyScorer, perplexity  # noqa: E402


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("replies", type=Path)
    parser.add_argument("model", type=Path)
    parser.add_argument("--premises", type=int, default=30)
    parser.add_argument("--models", nargs="*")
    parser.add_argument("--batch_size", type=int, default=16)
    args = parser.parse_args(argv)
    scorer = FluencyScorer(args.model, batch_size=args.batch_size)
    rows = [row for _, row in read_jsonl(args.replies)][: args.premises]
    names = args.models or [k for k, v in rows[0].items() if isinstance(v, dict) and "reply" in v]
    out = {"replies": str(args.replies), "model": str(args.model), "family": scorer.family, "n_premises": len(rows),
           "models": {}}
    for name in names:
        ppl = perplexity(scorer.score([[]] * len(rows), [row[name]["reply"] for row in rows]))
        out["models"][name] = {"mean_nll": math.log(ppl), "perplexity": ppl}
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
