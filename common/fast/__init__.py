"""The performance code, behind one seam: a stage reaches it only through `apply` (and DPO's
`one_sequence_collator`), `backends`, and the decoders that `common/generation.py` and GRPO's
rollouts pick. A change to a loss, a reward or a task needs none of it; `fast_paths: false` turns all
of it off (docs/architecture.md).
"""
from common.fast.model_changes import apply, backends, one_sequence_collator

__all__ = ["apply", "backends", "one_sequence_collator"]
