"""Padding-free reward-model training (`padding_free: true` in stage 03).

TRL's reward collator pads the chosen and the rejected replies of a micro-batch to its longest one.
On ChangeMyView's lengths a pair's two replies differ, so about 11% of the tokens the model runs are
padding even in length-sorted token-budget micro-batches (bench/RESULTS.md). Here a training
micro-batch runs as one row holding its sequences end to end, with no padding:
- positions restart at every sequence, so each one is encoded as it would be alone;
- attention is causal inside a sequence and blind across them: FlexAttention's document mask on a GPU
  (its kernel skips the blocks the mask rules out), the same rule as a dense SDPA mask on the CPU
  (FlexAttention has no backward there);
- the one-number head reads each sequence where the padded model's head reads it: its last token that
  is not the pad token.
TRL's collator, loss and metrics are untouched: the wrapped forward takes TRL's padded batch and
returns one reward per row of it. Evaluation and scoring keep the padded forward. With a token budget
the micro-batches are filled to the budget in real tokens, not padded ones (token_budget.py).
"""
from __future__ import annotations

import torch
from transformers.modeling_outputs import SequenceClassifierOutputWithPast

from common.model import unwrap_peft
from common.shared_prompt import rule_mask


def document_mask(doc: torch.Tensor, attention: str):
    """Causal attention within each sequence (`doc[i]`: the sequence of packed token i), none across."""
    def rule(b, h, q, kv):
        return (kv <= q) & (doc[q] == doc[kv])
    return rule_mask(rule, None, doc.shape[0], doc.device, attention)


def unpad_rows(model) -> str:
    """Wrap the reward model's (PeftModel's) forward: a training call with a right-padded batch runs
    padding-free. Returns the attention the packed rows run: flex_attention on a GPU, else sdpa."""
    attention = "flex_attention" if torch.cuda.is_available() else "sdpa"
    classifier = unwrap_peft(model)
    # For good, not per call: gradient checkpointing runs each layer's forward again in backward, after
    # the call has returned, and that recompute must find the attention the mask was built for.
    padded_attention = classifier.config._attn_implementation
    if padded_attention != attention:
        classifier.set_attn_implementation(attention)
    forward = model.forward

    def padding_free_forward(input_ids=None, attention_mask=None, **kwargs):
        if not model.training or attention_mask is None or attention_mask.dim() != 2:
            if padded_attention == attention or model.training:
                return forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
            classifier.set_attn_implementation(padded_attention)  # scoring: no backward, no recompute
            try:
                return forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
            finally:
                classifier.set_attn_implementation(attention)
        keep = attention_mask.bool()
        lengths = keep.sum(1)
        ids = input_ids[keep]  # row after row: the sequences end to end
        doc = torch.repeat_interleave(torch.arange(len(lengths), device=ids.device), lengths)
        starts = lengths.cumsum(0) - lengths
        positions = torch.arange(len(ids), device=ids.device) - starts[doc]
        # the head's token, as LlamaForSequenceClassification picks it: the last one that is not the pad
        index = torch.arange(len(ids), device=ids.device)
        last = torch.full_like(lengths, -1).scatter_reduce(
            0, doc, torch.where(ids != classifier.config.pad_token_id, index, -1), "amax")
        last = torch.where(last < 0, starts, last)  # a sequence of pad tokens only: its first, as HF does
        hidden = classifier.model(input_ids=ids[None], position_ids=positions[None], use_cache=False,
                                  attention_mask=document_mask(doc, attention)).last_hidden_state
        return SequenceClassifierOutputWithPast(logits=classifier.score(hidden[0, last]))

    model.forward = padding_free_forward
    model.padding_free = True
    return attention
