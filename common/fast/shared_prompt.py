"""Replies to one prompt with the prompt computed once: DPO's `pair_in_one_sequence`, GRPO's
`group_in_one_sequence`, the reward model's `prompt_once_per_pair` (packed rows).

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
gradients are TRL's (tests/stages/test_dpo.py checks this on the tiny model). The reference pass goes through
the same layout.

How it plugs into TRL without copying its loss code: `SharedPromptCollator` returns TRL's own batch
(the two-sequence layout, which TRL reads for its masks and metrics) plus the shared layout
(`shared_*`); `share_prompt(model)` wraps the PeftModel's forward so that a call carrying `shared_*`
runs the shared sequence through TRL's fused LM head and hands back each per-token field (log_probs,
entropy, mean_logits, is_top1) laid out as TRL's two-sequence batch. Every DPO loss variant and every
metric TRL computes from those fields therefore stays TRL's.

The same idea for any number of replies (`pack`, `Packed`): rows of groups, each a prefix and its
branches, end to end. GRPO's update runs a premise with its 4 replies that way
(`share_grpo_prompts`), and the reward model and its judge a pair's or a premise's replies
(padding_free.py).

Attention (`branch_mask`, one rule for all of them): causal, within a group, a branch seeing its
prompt and itself. flex_attention (the GPU default, `one_sequence_attention`) gets a BlockMask, which
skips the blocks the rule masks out; sdpa gets the same rule as a boolean (rows, 1, L, L) mask, which
sends it to a slower masked kernel (bench/RESULTS.md) and is what the CPU runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from trl.trainer.dpo_trainer import DataCollatorForPreference  # internal: common/trl_compat.py

from common.trl_compat import attn_implementation

SHARED_KEYS = ("shared_input_ids", "shared_position_ids", "shared_labels", "shared_branch", "shared_gather")
PER_TOKEN_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


@dataclass
class SharedPromptCollator(DataCollatorForPreference):
    """TRL's preference batch (chosen rows, then rejected rows) plus the same pairs in the shared layout."""

    def torch_call(self, examples):
        if self.truncation_mode != "keep_start":  # keep_end may cut the two prompts differently
            raise ValueError("pair_in_one_sequence needs truncation_mode keep_start")
        batch = super().torch_call(examples)
        n, ids, completion = len(examples), batch["input_ids"], batch["completion_mask"]
        seqs, positions, labels, branches, shifts = [], [], [], [], []
        for b, example in enumerate(examples):
            # TRL keeps the prompt whole (its dataset drops a prompt of max_length or more) and cuts replies.
            p = len(example["prompt_ids"])
            c, r = int(completion[b].sum()), int(completion[n + b].sum())
            prompt, chosen, rejected = ids[b, :p], ids[b, p:p + c], ids[n + b, p:p + r]
            seqs.append(torch.cat([prompt, chosen, prompt[-1:], rejected]))
            positions.append(torch.cat([torch.arange(p + c), torch.arange(p - 1, p + r)]))
            labels.append(torch.cat([torch.full((p,), -100), chosen, torch.tensor([-100]), rejected]))
            branches.append(torch.tensor([0] * (p - 1) + [1] * (c + 1) + [2] * (r + 1)))  # prompt, chosen, rejected
            shifts.append(c + 1)  # a rejected token sits c+1 places later than in TRL's layout
        length = max(len(s) for s in seqs)
        batch["shared_input_ids"] = _pad(seqs, length, self.pad_token_id)
        batch["shared_position_ids"] = _pad(positions, length, 0)
        batch["shared_labels"] = _pad(labels, length, -100)
        batch["shared_branch"] = _pad(branches, length, -1)
        # shared_gather[i, j]: where TRL's per-token value (row i, shifted position j) is in the shared
        # output flattened; chosen rows keep their positions, rejected rows move by c+1.
        cols = torch.arange(ids.shape[1] - 1)
        row_start = torch.arange(n) * (length - 1)
        chosen = row_start[:, None] + cols[None, :]
        rejected = row_start[:, None] + cols[None, :] + torch.tensor(shifts)[:, None]
        batch["shared_gather"] = torch.cat([chosen, rejected]).clamp(max=n * (length - 1) - 1)
        return batch


def longest_pair(dataset, tokenizer, max_length: int) -> int:
    """Tokens of the longest pair of `dataset` (conversational prompt, chosen, rejected) as one sequence:
    TRL's tokens (the chat template), each reply cut as its collator cuts it (prompt + reply to max_length),
    and the prompt's last token again before the rejected reply. A short prompt leaves each of its replies
    room up to max_length, so the longest pair need not be the one with the longest prompt: what
    `memory_levers: fit` plans DPO's micro-batch for (memory_plan.micro_batch_tokens)."""
    def lengths(conversations, **kwargs):
        ids = tokenizer.apply_chat_template(conversations, tokenize=True, return_dict=True, **kwargs)["input_ids"]
        return [len(row) for row in ids]
    prompt, chosen, rejected = (list(dataset[column]) for column in ("prompt", "chosen", "rejected"))
    prompts = lengths(prompt, add_generation_prompt=True)
    chosen = lengths([p + c for p, c in zip(prompt, chosen)])
    rejected = lengths([p + r for p, r in zip(prompt, rejected)])
    return max((min(c, max_length) + 1 + min(r, max_length) - p for p, c, r in zip(prompts, chosen, rejected)
                if p < max_length), default=0)  # TRL drops a pair whose prompt fills max_length


def packs_rows(model) -> bool:
    """Whether the packed layouts hold for `model` (a PeftModel or not): our mask makes every layer attend
    causally within its sequence. A model with sliding-window layers (Gemma 3, every layer_types entry
    `sliding_attention`) sees only its window there, so it runs the plain padded rows instead, and the
    stages record that (common/fast/model_changes.py `apply`, the judge's `judge_scoring`)."""
    model_config = getattr(getattr(model, "get_base_model", lambda: model)(), "config", None)
    return "sliding_attention" not in (getattr(model_config, "layer_types", None) or [])


def _pad(rows, length, value):
    out = torch.full((len(rows), length), value, dtype=rows[0].dtype)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out


def flex_kernel(attn_implementation: str) -> dict:
    """The forward's kwargs that make FlexAttention run its main kernel on packed rows. Inductor otherwise
    picks its decoding kernel for a query shorter than 128 tokens, which found no configuration for a short
    fp32 row on an H100 (`NoValidChoicesError` in tests/fast/test_padding_free.py); the main one runs any length."""
    return {"kernel_options": {"FORCE_USE_FLEX_ATTENTION": True}} if attn_implementation == "flex_attention" else {}


def branch_mask(doc: torch.Tensor, branch: torch.Tensor, attn_implementation: str):
    """The attention of rows of prompts and their branches (rows, L): causal, within a group (`doc`), a
    branch (`branch` > 0) seeing its prompt (0) and itself, never a sibling; -1 marks padding, which
    sees only the padding before it, so that no query row is empty. A FlexAttention BlockMask
    (flex_attention, which skips the blocks the rule rules out) or the same rule as a boolean
    (rows, 1, L, L) mask (sdpa)."""
    def rule(b, h, q, kv):
        return (kv <= q) & (doc[b, q] == doc[b, kv]) & ((branch[b, kv] <= 0) | (branch[b, kv] == branch[b, q]))
    rows, length = doc.shape
    if attn_implementation == "flex_attention":
        from torch.nn.attention.flex_attention import create_block_mask
        return create_block_mask(rule, B=rows, H=None, Q_LEN=length, KV_LEN=length, device=doc.device)
    if attn_implementation != "sdpa":
        raise ValueError(f"a branch mask runs with sdpa or flex_attention, not {attn_implementation}")
    q = torch.arange(length, device=doc.device)
    return rule(torch.arange(rows, device=doc.device)[:, None, None, None], None, q[None, None, :, None],
                q[None, None, None, :])


def share_prompt(model, attention: str = "flex_attention") -> str:
    """Wrap the PeftModel's forward: a call with the collator's `shared_*` tensors runs the shared
    sequence and returns TRL's fused-LM-head output laid out as TRL's two-sequence batch. Called
    before the DPOTrainer is built, since TRL may precompute reference log-probs in its constructor.
    The model then runs `attention` on a GPU, sdpa on the CPU (FlexAttention has no backward there);
    returns the one it runs."""
    attention = attention if torch.cuda.is_available() else "sdpa"
    inner = model.get_base_model()
    if attn_implementation(inner) != attention:
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
        branch = shared["shared_branch"]
        running = attn_implementation(model)
        out = forward(input_ids=ids, position_ids=shared["shared_position_ids"],
                      attention_mask=branch_mask(torch.where(branch >= 0, 0, -1), branch, running),
                      labels=shared["shared_labels"], **flex_kernel(running), **kwargs)
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
    return attention


# Several replies to one prompt, packed into rows ------------------------------------------------
# GRPO samples 4 replies to each premise, and a reward pair is two replies to one: their common
# prefix is computed once, each reply a branch that continues it: the DPO layout above for any number
# of branches, several groups end to end in a row.

@dataclass
class Packed:
    """Rows of groups of (prefix, branches) end to end, right-padded to one length."""
    ids: torch.Tensor            # (rows, L)
    positions: torch.Tensor      # (rows, L): a branch's positions continue from its group's prefix
    doc: torch.Tensor            # (rows, L): the group of each token in its row; -1 in the padding
    branch: torch.Tensor         # (rows, L): 0 in a prefix, j in its group's j-th branch; -1 in the padding
    prefix_starts: torch.Tensor  # (groups,), on the CPU: where each prefix starts in the flattened rows
    starts: torch.Tensor         # (branches,), on the CPU: where each branch starts, groups in order, ditto

    def mask(self, attention: str):
        return branch_mask(self.doc, self.branch, attention)


def pack(rows: list[list[tuple[torch.Tensor, list[torch.Tensor]]]], device) -> Packed:
    """Rows on `device`, each from groups of (prefix ids, [branch ids, ...]), 1-d CPU tensors (built on
    the CPU: one copy to the device, no synchronisation per group)."""
    parts, prefix_starts, starts = [], [], []
    width = max(sum(len(p) + sum(len(b) for b in bs) for p, bs in row) for row in rows)
    for r, row in enumerate(rows):
        n = r * width
        for g, (prefix, branches) in enumerate(row):
            prefix_starts.append(n)
            parts.append((r, prefix, torch.arange(len(prefix)), g, 0))
            n += len(prefix)
            for j, tokens in enumerate(branches, 1):
                starts.append(n)
                parts.append((r, tokens, torch.arange(len(prefix), len(prefix) + len(tokens)), g, j))
                n += len(tokens)

    def column(field, pad):
        out = torch.full((len(rows), width), pad, dtype=torch.long)
        for r in range(len(rows)):
            values = [field(p) for p in parts if p[0] == r]
            row = torch.cat(values)
            out[r, :len(row)] = row
        return out.to(device)
    return Packed(ids=column(lambda p: p[1], 0), positions=column(lambda p: p[2], 0),
                  doc=column(lambda p: torch.full((len(p[1]),), p[3]), -1),
                  branch=column(lambda p: torch.full((len(p[1]),), p[4]), -1),
                  prefix_starts=torch.tensor(prefix_starts), starts=torch.tensor(starts))


def common_prefix(rows: list[torch.Tensor]) -> int:
    """Length of the prefix all `rows` share, at most one less than the shortest (every branch keeps a token)."""
    shortest = min(len(r) for r in rows)
    same = torch.stack([r[:shortest] == rows[0][:shortest] for r in rows[1:]]).all(0) if len(rows) > 1 \
        else torch.ones(shortest, dtype=torch.bool)
    differs = (~same).nonzero()
    return min(int(differs[0]) if len(differs) else shortest, shortest - 1)


def share_grpo_prompts(trainer, attention: str = "flex_attention") -> str:
    """GRPO's update with each premise computed once: the replies of a micro-batch to one premise run
    as branches of one row, `prompt[:-1] | prompt[-1] reply_1 | prompt[-1] reply_2 | ...` (each branch
    starts with its own copy of the prompt's last token, which predicts the reply's first token, as in
    the DPO layout above). At 4 replies of 256 tokens to a 400-token premise that is about half the
    tokens of TRL's one row per reply. TRL shuffles a generation batch before cutting it into
    micro-batches; here each premise's replies are then put back together (the premises stay shuffled),
    which leaves TRL's loss unchanged: it sums over the whole generation batch (DAPO, its default,
    divides by all its tokens). The log-probs and entropies are handed back in TRL's (rows, reply
    tokens) layout, so TRL's loss and metrics are its own (tests/fast/test_shared_prompt.py). Returns the
    attention the model runs: `attention` on a GPU, sdpa on the CPU."""
    from trl.trainer.utils import split_tensor_dict  # internal, as are the trainer's names below: common/trl_compat.py

    from common.model import unwrap_peft
    attention = attention if torch.cuda.is_available() else "sdpa"
    inner = unwrap_peft(trainer.model)
    if attn_implementation(inner) != attention:
        inner.set_attn_implementation(attention)
    original_logps, original_prepare = trainer._get_per_token_logps_and_entropies, trainer._prepare_inputs

    def prepare_inputs(generation_batch):
        buffered = trainer._buffered_inputs
        inputs = original_prepare(generation_batch)
        if trainer.model.training and trainer._buffered_inputs is not buffered:  # a new generation batch
            batches = trainer._buffered_inputs
            trainer._buffered_inputs = split_tensor_dict(_replies_together(batches), len(batches))
            inputs = trainer._buffered_inputs[trainer._step % trainer.args.steps_per_generation]
        return inputs

    def per_token_logps(model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
                        compute_aux_loss=False, **images):
        if compute_aux_loss or any(v is not None for v in images.values()):
            return original_logps(model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                                  compute_aux_loss, **images)
        batch_size = batch_size or len(input_ids)
        parts = [_branch_logps(trainer, model, input_ids[s:s + batch_size], attention_mask[s:s + batch_size],
                               logits_to_keep, attention) for s in range(0, len(input_ids), batch_size)]
        return (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]) if compute_entropy else None,
                None)

    trainer._prepare_inputs, trainer._get_per_token_logps_and_entropies = prepare_inputs, per_token_logps
    return attention


def _replies_together(batches: list[dict]) -> dict:
    """A generation batch cut into micro-batches, whole again with each premise's replies next to each
    other, the premises in the order they first appear."""
    merged = {}
    for key, first in batches[0].items():
        values = [b[key] for b in batches]
        if isinstance(first, torch.Tensor) and first.ndim > 0:
            merged[key] = torch.cat(values)
        elif isinstance(first, list):
            merged[key] = [v for value in values for v in value]
        else:
            merged[key] = first
    prompts = merged["prompt_ids"].masked_fill(merged["prompt_mask"] == 0, -1)
    _, group = torch.unique(prompts, dim=0, return_inverse=True)
    rows = torch.arange(len(group), device=group.device)
    first_seen = torch.full_like(group, len(group)).scatter_reduce(0, group, rows, "amin")
    order = torch.argsort(first_seen[group] * len(group) + rows)
    listed = order.tolist()
    return {key: value[order] if isinstance(value, torch.Tensor) and value.ndim > 0
            else [value[i] for i in listed] if isinstance(value, list) else value
            for key, value in merged.items()}


def _branch_logps(trainer, model, input_ids, attention_mask, n_reply, attention):
    """TRL's per-token (log-prob, entropy) of the last `n_reply` columns of its rows (left-padded prompt,
    right-padded reply), computed with the rows of one prompt as branches of one packed row."""
    ids, keep = input_ids.cpu(), attention_mask.bool().cpu()
    prompt_len = ids.shape[1] - n_reply
    prompts = [row[:prompt_len][k[:prompt_len]] for row, k in zip(ids, keep)]
    replies = [row[prompt_len:][k[prompt_len:]] for row, k in zip(ids, keep)]  # up to its end token
    groups: dict[tuple, list[int]] = {}
    for r, prompt in enumerate(prompts):
        groups.setdefault(tuple(prompt.tolist()), []).append(r)
    layout, order = [], []
    for rows in groups.values():
        prompt = prompts[rows[0]]
        layout.append((prompt[:-1], [torch.cat([prompt[-1:], replies[r]]) for r in rows]))
        order += rows
    packed = pack([layout], input_ids.device)  # one row: no padding
    labels = packed.ids.masked_fill(packed.branch == 0, -100)
    labels[0, packed.starts.to(labels.device)] = -100  # a branch's copy of the prompt's last token: no reply token
    with trainer.accelerator.autocast():
        out = model(input_ids=packed.ids, position_ids=packed.positions, labels=labels,
                    attention_mask=packed.mask(attention), fused_lm_head=True,  # TRL's: common/trl_compat.py
                    **flex_kernel(attention))
    # Row r's k-th reply token sits at start + 1 + k, and its prediction at start + k of the shifted output.
    index = torch.zeros(len(ids), n_reply, dtype=torch.long)
    valid = torch.zeros(len(ids), n_reply, dtype=torch.bool)
    for start, r in zip(packed.starts.tolist(), order):
        n = len(replies[r])
        index[r, :n] = torch.arange(start, start + n)
        valid[r, :n] = True
    index, valid = index.to(input_ids.device), valid.to(input_ids.device)
    zero = torch.zeros((), device=input_ids.device)
    return (torch.where(valid, out.log_probs[0][index], zero),
            torch.where(valid, out.entropy[0][index], zero) if out.entropy is not None else None)
