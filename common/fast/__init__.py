"""The performance code, behind one seam: a stage reaches it only through the names below: `fit_memory`
(before its trainer's arguments), `apply` (and DPO's `one_sequence_collator`), `backends`, and GRPO's
rollouts by the static decoder (stage 05 and DPO's rejected replies pick their decoder in
`common/generation.py`). A change to a loss, a reward or a task needs none of it; `fast_paths: false`
turns all of it off (docs/architecture.md).
"""
from common.fast.memory_plan import fit as fit_memory
from common.fast.model_changes import apply, backends, one_sequence_collator
from common.fast.static_decoder import GRAPH_FAILURES, grpo_rollout, supports_fast_decode, weights_backend

__all__ = ["GRAPH_FAILURES", "apply", "backends", "fit_memory", "grpo_rollout", "one_sequence_collator",
           "supports_fast_decode", "weights_backend"]
