"""Padding-free reward models: training (`padding_free: true` in stage 03) and the scorer's forward.

TRL's reward collator pads the chosen and the rejected replies of a micro-batch to its longest one.
On ChangeMyView's lengths a pair's two replies differ, so part of the tokens the model runs are
padding even in length-sorted token-budget micro-batches (their real share: bench/RESULTS.md). Here a micro-batch runs
as one row holding its sequences end to end, with no padding (`packed_rewards`):
- sequences that share a prefix (a pair's two replies to one prompt; GRPO's replies to one premise)
  are a group: the prefix is computed once, each sequence a branch that continues it, its positions
  counting on from the prefix (`shared_prompt.pack`). Without sharing each sequence is its own group;
- attention is causal inside a group, blind across groups, and a branch sees its prefix and itself,
  never its sibling: FlexAttention's BlockMask on a GPU (its kernel skips the blocks the rule rules
  out), the same rule as a dense SDPA mask on the CPU (FlexAttention has no backward there);
- the one-number head reads each sequence where the padded model's head reads it: its last token that
  is not the pad token.
Every hidden state a head reads is the one of the sequence run alone, so rewards, loss and gradients
are the padded model's (tests/fast/test_padding_free.py). TRL's collator, loss and metrics are untouched: the
wrapped forward takes TRL's padded batch and returns one reward per row of it. With a token budget the
micro-batches are filled to the budget in real tokens, not padded ones (token_budget.py).
"""
from __future__ import annotations

import torch
from transformers.modeling_outputs import SequenceClassifierOutputWithPast

from common.fast.shared_prompt import common_prefix, flex_kernel, pack
from common.model import unwrap_peft
from common.trl_compat import attn_implementation


def packed_rewards(classifier, rows: list[list[list[torch.Tensor]]], attention: str) -> torch.Tensor:
    """The head's value (sequences, 1) for each sequence (1-d CPU tensors, unpadded) of `rows` of groups,
    in order; a group's sequences share their common prefix, computed once. `classifier`: a causal
    decoder with a score head (LlamaForSequenceClassification), running `attention`."""
    device = classifier.score.weight.device
    pad = classifier.config.pad_token_id
    layout = []
    for groups in rows:
        layout.append([])
        for seqs in groups:
            shared = common_prefix(seqs) if len(seqs) > 1 else 0
            layout[-1].append((seqs[0][:shared], [s[shared:] for s in seqs]))
    packed = pack(layout, device)
    # Where each head reads, as LlamaForSequenceClassification picks it (the last token that is not the
    # pad token; the first if all are), as an index into the flattened rows.
    heads, g = [], 0
    for groups, laid in zip(rows, layout):
        for seqs, (prefix, _) in zip(groups, laid):
            for seq in seqs:
                real = (seq != pad).nonzero()
                t = int(real[-1]) if len(real) else 0
                start = int(packed.starts[len(heads)])
                heads.append(int(packed.prefix_starts[g]) + t if t < len(prefix) else start + t - len(prefix))
            g += 1
    hidden = classifier.model(input_ids=packed.ids, position_ids=packed.positions, use_cache=False,
                              attention_mask=packed.mask(attention), **flex_kernel(attention)).last_hidden_state
    return classifier.score(hidden.reshape(-1, hidden.shape[-1])[torch.tensor(heads, device=device)])


def unpad_rows(model, share_prompt: bool = False) -> str:
    """Wrap the reward model's (PeftModel's) forward: a training call with a right-padded batch runs
    padding-free; with `share_prompt` each pair's chosen and rejected rows (TRL puts the chosen rows
    first) share their common prefix, the prompt. Returns the attention the packed rows run:
    flex_attention on a GPU, else sdpa."""
    attention = "flex_attention" if torch.cuda.is_available() else "sdpa"
    classifier = unwrap_peft(model)
    # For good, not per call: gradient checkpointing runs each layer's forward again in backward, after
    # the call has returned, and that recompute must find the attention the mask was built for.
    padded_attention = attn_implementation(classifier)
    if padded_attention != attention:
        classifier.set_attn_implementation(attention)
    forward = model.forward

    def padding_free_forward(input_ids=None, attention_mask=None, **kwargs):
        if not model.training or attention_mask is None or attention_mask.dim() != 2:
            if padded_attention == attention or model.training:
                return forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
            classifier.set_attn_implementation(padded_attention)  # padded eval: no backward, no recompute
            try:
                return forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
            finally:
                classifier.set_attn_implementation(attention)
        lengths = attention_mask.sum(1).tolist()
        rows = [row[:n] for row, n in zip(input_ids.cpu(), lengths)]  # right-padded: the real tokens lead
        n = len(rows) // 2
        pairs = share_prompt and len(rows) == 2 * n
        groups = [[i, n + i] for i in range(n)] if pairs else [[i] for i in range(len(rows))]
        logits = packed_rewards(classifier, [[[rows[i] for i in g] for g in groups]], attention)  # one row
        order = torch.tensor([i for g in groups for i in g], device=logits.device)
        return SequenceClassifierOutputWithPast(logits=logits[torch.argsort(order)])  # TRL's row order

    model.forward = padding_free_forward
    return attention
