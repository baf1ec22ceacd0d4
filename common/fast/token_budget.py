"""Micro-batches filled to a token budget (`max_tokens_per_batch`) instead of a fixed example count.

Why: on real-length data a micro-batch of 8 examples holds far fewer tokens than 8 x 768, so the fixed
cost of dequantising every 4-bit weight on each forward and backward is spread over fewer tokens than in
uniform batches (docs/performance.md). A budget in padded tokens keeps the memory of the
uniform batches while every micro-batch carries about as many tokens.

Padding: SFT's length-sorted micro-batches are nearly all real tokens, so SFT stays padded. The reward
model's carry more padding (a pair's two replies differ in length; docs/performance.md); `padding_free`
(padding_free.py) runs them without padding, and the budget then counts real tokens (rows 0 below).

How: each example costs rows x length padded tokens: SFT one row of its sequence; the reward model
two rows (chosen, rejected) of the longer reply; DPO its shared-prompt sequence (prompt + chosen +
rejected + 1) when shared_prompt is on, else TRL's two rows of the longer prompt + reply. A
micro-batch costs examples x rows x its longest. Examples are sorted by length, ties in a seeded
random order, and cut greedily into micro-batches within the budget; an example over the budget is
a micro-batch of its own. The micro-batches are fixed for the run and each epoch visits them in a
new order (seed + epoch), as fairseq's `batch_by_size` does: the count per epoch stays constant,
which the Trainer's step count, learning-rate schedule and skip of batches on resume rely on.
Under several processes accelerate deals the micro-batches out in turn (`BatchSamplerShard`).
Not covered there: a multi-process run resumed inside its second or a later epoch. accelerate's
skip wrapper around `BatchSamplerShard` passes no `set_epoch` on, so that epoch would replay the
first epoch's order (one process is tested; transformers' own BatchRebalanceSampler shares this).

The loss: an optimiser step now holds micro-batches of different sizes. SFT is exact as TRL runs
it (each token's loss is divided by the step's token count, `num_items_in_batch`). TRL's reward
and DPO losses are means over a micro-batch's pairs, which the Trainer divides by the number of
micro-batches: a pair in a small micro-batch would weigh more. `weigh_pairs_per_step` makes every
pair of a step weigh the same: the mean over the step's pairs (over every process's), as one
plain batch of the same pairs gives (tests/fast/test_token_budget.py).
"""
from __future__ import annotations

import logging
from functools import partial

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Sampler

from common import trl_compat

log = logging.getLogger("pipeline")


def pack(lengths: list[int], rows: int, budget: int, seed: int) -> list[list[int]]:
    """Indices cut into micro-batches of at most `budget` padded tokens (examples x rows x longest),
    in increasing length (ties in a seeded random order); an example over the budget stands alone.
    rows 0: padding-free micro-batches, which cost the sum of their lengths."""
    g = torch.Generator().manual_seed(seed)
    tie = torch.randperm(len(lengths), generator=g).tolist()
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], tie[i]))
    batches, current, total = [], [], 0
    for i in order:  # increasing: the example added is the batch's longest
        cost = total + lengths[i] if rows == 0 else (len(current) + 1) * rows * lengths[i]
        if current and cost > budget:
            batches.append(current)
            current, total = [], 0
        current.append(i)
        total += lengths[i]
    if current:
        batches.append(current)
    return batches


class TokenBudgetBatchSampler(Sampler):
    """The packed micro-batches, in a new order each epoch (set_epoch, as the Trainer calls it). No
    `batch_size` attribute: accelerate then shards it as batches of varying size."""

    def __init__(self, lengths: list[int], rows: int, budget: int, seed: int):
        self.batches = pack(lengths, rows, budget, seed)
        self.lengths, self.rows, self.budget, self.seed, self.epoch = lengths, rows, budget, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        for i in torch.randperm(len(self.batches), generator=g).tolist():
            yield self.batches[i]


# How the trainer lays an example out, which sets its cost: TRL's padded rows, the reward model's
# padding-free row (padding_free.py), or DPO's pair as one sequence (shared_prompt.py). `model_changes.apply`
# knows which it installed and says so.
PADDED, PADDING_FREE, ONE_SEQUENCE = "padded", "padding_free", "one_sequence"


def example_sizes(trainer, layout: str = PADDED) -> tuple[list[int], int]:
    """Each example's padded length (rounded up to `pad_to_multiple_of`, as the collators pad) and rows."""
    lengths, rows = _example_lengths(trainer, layout)
    multiple = getattr(trainer.args, "pad_to_multiple_of", None) or 1
    return [-(-n // multiple) * multiple for n in lengths], rows


def _example_lengths(trainer, layout: str) -> tuple[list[int], int]:
    """Each training example's padded length and rows per example, from the trainer's tokenised
    dataset as its collator will pad it (SFT: input_ids; reward: chosen_ids, rejected_ids; DPO:
    prompt_ids, chosen_ids, rejected_ids, replies cut to max_length as TRL's collator cuts them)."""
    data = trainer.train_dataset
    columns = set(data.column_names)
    if "prompt_ids" in columns:  # DPO
        limit = trainer.args.max_length or float("inf")
        prompts = [len(p) for p in data["prompt_ids"]]
        chosen = [min(len(c), limit - p) for c, p in zip(data["chosen_ids"], prompts)]
        rejected = [min(len(r), limit - p) for r, p in zip(data["rejected_ids"], prompts)]
        if layout == ONE_SEQUENCE:  # the prompt once, both replies
            return [p + c + r + 1 for p, c, r in zip(prompts, chosen, rejected)], 1
        return [p + max(c, r) for p, c, r in zip(prompts, chosen, rejected)], 2
    if {"chosen_ids", "rejected_ids"} <= columns:
        if layout == PADDING_FREE:  # both replies, no padding
            return [len(c) + len(r) for c, r in zip(data["chosen_ids"], data["rejected_ids"])], 0
        return [max(len(c), len(r)) for c, r in zip(data["chosen_ids"], data["rejected_ids"])], 2  # padded together
    if "input_ids" in columns:  # SFT (TRL's dataset is cut to max_length already)
        return [len(ids) for ids in data["input_ids"]], 1
    raise ValueError(f"max_tokens_per_batch: no token ids in the training data (columns {sorted(columns)})")


def batch_by_tokens(trainer, budget: int, layout: str = PADDED) -> None:
    """The trainer's training DataLoader draws TokenBudgetBatchSampler's micro-batches; the rest is the
    Trainer's: its column filter, collator, worker seeding and accelerate's prepare (device placement,
    sharding over processes). Replaces `get_train_dataloader` on the trainer; the column filter is
    private (common/trl_compat.py)."""
    from transformers.trainer_utils import seed_worker  # its parameters: common/trl_compat.py

    def get_train_dataloader():
        lengths, rows = example_sizes(trainer, layout)
        sampler = TokenBudgetBatchSampler(lengths, rows, budget, trainer.args.seed)
        padded = sum(len(b) * rows * max(lengths[i] for i in b) if rows else sum(lengths[i] for i in b)
                     for b in sampler.batches)
        log.info("max_tokens_per_batch %d: %d examples in %d micro-batches (%.1f examples, %.0f padded tokens "
                 "each; %.1f%% of them real)", budget, len(lengths), len(sampler), len(lengths) / len(sampler),
                 padded / len(sampler), 100 * max(rows, 1) * sum(lengths) / padded)
        args = trainer.args
        data = trl_compat.remove_unused_columns(trainer, trainer.train_dataset, description="Training")
        loader = DataLoader(data, batch_sampler=sampler, collate_fn=trainer.data_collator,
                            num_workers=args.dataloader_num_workers, pin_memory=args.dataloader_pin_memory,
                            worker_init_fn=partial(seed_worker, num_workers=args.dataloader_num_workers,
                                                   rank=args.process_index))
        return trainer.accelerator.prepare(loader)

    trainer.get_train_dataloader = get_train_dataloader  # replaced on the trainer: common/trl_compat.py


def weigh_pairs_per_step(trainer) -> None:
    """Reward and DPO trainers: every pair of an optimiser step weighs the same, whatever micro-batch it
    is in. `get_batch_samples` (the Trainer fetching a step's micro-batches) counts the step's pairs,
    over every process; each micro-batch's loss, TRL's mean over its pairs, is then scaled by its
    pairs x processes / the step's pairs, and the Trainer told not to divide it again
    (`loss_is_scaled_for_ga`). Evaluation losses stay TRL's. What the Trainer must still do with these
    hooks is checked in common/trl_compat.py."""
    get_batch_samples, compute_loss = trainer.get_batch_samples, trainer.compute_loss
    step = {}

    def counting_batch_samples(epoch_iterator, num_batches, device):
        batches, num_items = get_batch_samples(epoch_iterator, num_batches, device)
        pairs = torch.tensor(sum(len(b["input_ids"]) // 2 for b in batches), device=device)  # chosen + rejected rows
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(pairs)
        step["pairs"] = int(pairs)
        return batches, num_items

    def weighted_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
        pairs = len(inputs["input_ids"]) // 2
        out = compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        if not trainer.model.training:
            return out
        scale = pairs * trainer.accelerator.num_processes / step["pairs"]
        return (out[0] * scale, *out[1:]) if return_outputs else out * scale

    # Replaced on the trainer; what the Trainer must still do with them: common/trl_compat.py.
    trainer.get_batch_samples, trainer.compute_loss = counting_batch_samples, weighted_loss
    trainer.loss_is_scaled_for_ga = True


def is_pairwise(trainer) -> bool:
    return "chosen_ids" in trainer.train_dataset.column_names
