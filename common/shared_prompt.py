"""Shared-prompt DPO: each preference pair as one sequence, the prompt computed once.

TRL's DPOTrainer runs a pair as two sequences, prompt + chosen and prompt + rejected, so a 19k-token
paper goes through the 4-bit model twice (and twice more for the reference) for two 1k-token
reviews. Here a pair is one sequence (prefix sharing, Wang et al. 2024):

    prompt[:-1] | prompt[-1] chosen | prompt[-1] rejected
    positions:  0 .. P-2 | P-1 .. P+C-1 | P-1 .. P+R-1

Both branches start with the prompt's last token, so every reply token is predicted from a hidden
state of its own branch (the first chosen token from the first copy, the first rejected token from
the second), and each position has one label. The second branch attends to the shared prompt and
to itself, never to the first branch, and its positions continue from the prompt: every hidden state
equals the one of the two-sequence layout, so the per-token log-probabilities, the loss and the
gradients are TRL's (tests/test_dpo.py checks this on the tiny model). The reference pass goes through
the same layout.

How it plugs into TRL without copying its loss code: `SharedPromptCollator` returns TRL's own batch
(the two-sequence layout, which TRL reads for its masks and metrics) plus the shared layout
(`shared_*`); `share_prompt(model)` wraps the PeftModel's forward so that a call carrying `shared_*`
runs the shared sequence through TRL's fused LM head and hands back each per-token field (log_probs,
entropy, mean_logits, is_top1) laid out as TRL's two-sequence batch. Every DPO loss variant and every
metric TRL computes from those fields therefore stays TRL's.

Attention: flex_attention (the GPU default, `shared_prompt_attention`) gets a BlockMask, which skips
the blocks the rule masks out; sdpa gets the same rule as a boolean (batch, 1, L, L) mask, which sends
it to a slower masked kernel (bench/RESULTS.md) and is what the CPU runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from trl.trainer.dpo_trainer import DataCollatorForPreference

SHARED_KEYS = ("shared_input_ids", "shared_position_ids", "shared_labels", "shared_bounds", "shared_gather")
PER_TOKEN_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


@dataclass
class SharedPromptCollator(DataCollatorForPreference):
    """TRL's preference batch (chosen rows, then rejected rows) plus the same pairs in the shared layout."""

    def torch_call(self, examples):
        if self.truncation_mode != "keep_start":  # keep_end may cut the two prompts differently
            raise ValueError("shared_prompt needs truncation_mode keep_start")
        batch = super().torch_call(examples)
        n, ids, completion = len(examples), batch["input_ids"], batch["completion_mask"]
        seqs, positions, labels, bounds, shifts = [], [], [], [], []
        for b, example in enumerate(examples):
            # TRL keeps the prompt whole (its dataset drops a prompt of max_length or more) and cuts replies.
            p = len(example["prompt_ids"])
            c, r = int(completion[b].sum()), int(completion[n + b].sum())
            prompt, chosen, rejected = ids[b, :p], ids[b, p:p + c], ids[n + b, p:p + r]
            seqs.append(torch.cat([prompt, chosen, prompt[-1:], rejected]))
            positions.append(torch.cat([torch.arange(p + c), torch.arange(p - 1, p + r)]))
            labels.append(torch.cat([torch.full((p,), -100), chosen, torch.tensor([-100]), rejected]))
            bounds.append((p - 1, p + c))  # the first branch starts at p-1, the second at p+c
            shifts.append(c + 1)  # a rejected token sits c+1 places later than in TRL's layout
        length = max(len(s) for s in seqs)
        batch["shared_input_ids"] = _pad(seqs, length, self.pad_token_id)
        batch["shared_position_ids"] = _pad(positions, length, 0)
        batch["shared_labels"] = _pad(labels, length, -100)
        batch["shared_bounds"] = torch.tensor(bounds)
        # shared_gather[i, j]: where TRL's per-token value (row i, shifted position j) is in the shared
        # output flattened; chosen rows keep their positions, rejected rows move by c+1.
        cols = torch.arange(ids.shape[1] - 1)
        row_start = torch.arange(n) * (length - 1)
        chosen = row_start[:, None] + cols[None, :]
        rejected = row_start[:, None] + cols[None, :] + torch.tensor(shifts)[:, None]
        batch["shared_gather"] = torch.cat([chosen, rejected]).clamp(max=n * (length - 1) - 1)
        return batch


def _pad(rows, length, value):
    out = torch.full((len(rows), length), value, dtype=rows[0].dtype)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out


def branch_rule(bounds: torch.Tensor):
    """The attention rule as a FlexAttention mask_mod: causal, except that the second branch (from
    bounds[b, 1]) does not see the first (bounds[b, 0] up to bounds[b, 1])."""
    def rule(b, h, q, kv):
        first, second = bounds[b, 0], bounds[b, 1]
        return (kv <= q) & ~((q >= second) & (kv >= first) & (kv < second))
    return rule


def attention_mask(bounds: torch.Tensor, length: int, attn_implementation: str):
    """The branch rule for the attention the model runs (rule_mask)."""
    return rule_mask(branch_rule(bounds), bounds.shape[0], length, bounds.device, attn_implementation)


def rule_mask(rule, batch: int | None, length: int, device, attn_implementation: str):
    """A FlexAttention mask_mod `rule` as the attention the model runs: a BlockMask (flex_attention) or a
    boolean mask (sdpa) of (batch or 1, 1, length, length). Shared with common/padding_free.py."""
    if attn_implementation == "flex_attention":
        from torch.nn.attention.flex_attention import create_block_mask
        return create_block_mask(rule, B=batch, H=None, Q_LEN=length, KV_LEN=length, device=device)
    if attn_implementation != "sdpa":
        raise ValueError(f"a rule mask runs with sdpa or flex_attention, not {attn_implementation}")
    q = torch.arange(length, device=device)
    b = torch.arange(batch or 1, device=device)
    return rule(b[:, None, None, None], None, q[None, None, :, None], q[None, None, None, :])


def share_prompt(model, attention: str = "flex_attention") -> str:
    """Wrap the PeftModel's forward: a call with the collator's `shared_*` tensors runs the shared
    sequence and returns TRL's fused-LM-head output laid out as TRL's two-sequence batch. Called
    before the DPOTrainer is built, since TRL may precompute reference log-probs in its constructor.
    The model then runs `attention` on a GPU, sdpa on the CPU (FlexAttention has no backward there);
    returns the one it runs."""
    attention = attention if torch.cuda.is_available() else "sdpa"
    inner = model.get_base_model()
    if inner.config._attn_implementation != attention:
        inner.set_attn_implementation(attention)
    forward = model.forward

    def shared_forward(*args, **kwargs):
        shared = {key: kwargs.pop(key, None) for key in SHARED_KEYS}
        if shared["shared_input_ids"] is None:
            return forward(*args, **kwargs)
        if not kwargs.get("fused_lm_head"):
            raise ValueError("a shared-prompt batch runs through TRL's fused LM head only")
        labels = kwargs.pop("labels")  # TRL's layout: which of its positions carry a reply token
        for key in ("input_ids", "attention_mask", "position_ids"):
            kwargs.pop(key, None)
        ids = shared["shared_input_ids"]
        out = forward(input_ids=ids, position_ids=shared["shared_position_ids"],
                      attention_mask=attention_mask(shared["shared_bounds"], ids.shape[1],
                                                     model.config._attn_implementation),
                      labels=shared["shared_labels"], **kwargs)
        keep = labels[:, 1:] != -100
        for field in PER_TOKEN_FIELDS:
            value = getattr(out, field, None)
            if value is not None:
                gathered = value.reshape(-1)[shared["shared_gather"]]
                setattr(out, field, torch.where(keep, gathered, torch.zeros((), dtype=value.dtype,
                                                                              device=value.device)))
        if getattr(out, "label_mask", None) is not None:
            out.label_mask = keep
        return out

    model.forward = shared_forward
    model.shares_prompt = True
    return attention
