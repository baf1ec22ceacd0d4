"""The performance code, behind one seam: everything outside common/fast/ reaches it only through the
names below: `fit_memory` (once the model is loaded: the levers it returns are set on the config by
`common.runs.settle`), `apply` (and DPO's `one_sequence_collator`), `backends`, GRPO's rollouts by the static
decoder, the static decoder of stage 05 and DPO's rejected replies (`decode`, picked in
`common/generation.py`; `use_nf4_matmul_table` for GRPO's), and the judge's packed rows (`packs_rows`,
`packed_rewards`, in `common/rewards.py`). A change to a loss, a reward or a task needs none of it; `fast_paths: false` turns
all of it off (docs/architecture.md). The code here reads only FastArgs fields of a config (those
declared with `plain=` in common/config.py), and never changes one.
"""
from common.fast.memory_plan import fit as fit_memory
from common.fast.model_changes import apply, backends, one_sequence_collator
from common.fast.nf4_dispatch import use_table as use_nf4_matmul_table
from common.fast.padding_free import packed_rewards
from common.fast.shared_prompt import packs_rows
from common.fast.static_decoder import (
    GRAPH_FAILURES,
    decode,
    grpo_rollout,
    release_dense_base,
    supports_fast_decode,
    weights_backend,
)

__all__ = ["GRAPH_FAILURES", "apply", "backends", "decode", "fit_memory", "grpo_rollout", "one_sequence_collator",
           "packed_rewards", "packs_rows", "release_dense_base", "supports_fast_decode", "use_nf4_matmul_table",
           "weights_backend"]
