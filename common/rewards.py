"""The reward model as a scorer: one place that turns (prompt, reply) into a number.

Stage 03 measures its judge with it, stage 04 uses it as GRPO's reward function, stage 05 scores
every model's replies with it, so the three always format, cut and pad text the same way: the chat
template of prompt + reply (as TRL's RewardTrainer trains on), right-padded.
"""
from __future__ import annotations

from pathlib import Path

import torch
import yaml

from common.config import ModelArgs
from common.data import fit_prompt, fit_reply
from common.model import SEQ_CLS, load_model, load_tokenizer


class RewardScorer:
    __name__ = "reward_model"  # GRPOTrainer names each reward function's log column after it

    def __init__(self, model, tokenizer, max_prompt_tokens: int, max_length: int, batch_size: int = 8):
        self.model, self.tokenizer = model, tokenizer
        self.max_prompt_tokens, self.max_length, self.batch_size = max_prompt_tokens, max_length, batch_size

    @classmethod
    def from_run(cls, reward_run: str | Path, model_args: ModelArgs, batch_size: int = 8) -> "RewardScorer":
        """Load a finished stage-03 run: the 4-bit base, its adapter and score head, frozen."""
        trained = yaml.safe_load((Path(reward_run) / "config.yaml").read_text())
        tokenizer = load_tokenizer(model_args)
        model = load_model(model_args, SEQ_CLS, adapter=Path(reward_run) / "adapter", trainable=False,
                           tokenizer=tokenizer)
        return cls(model, tokenizer, trained["max_prompt_tokens"], trained["max_length"], batch_size)

    def encode(self, prompt: list[dict], reply: str) -> list[int]:
        prompt = fit_prompt(self.tokenizer, prompt, self.max_prompt_tokens)
        reply = fit_reply(self.tokenizer, prompt, reply, self.max_length)
        ids = self.tokenizer.apply_chat_template(prompt + [{"role": "assistant", "content": reply}], tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    @torch.no_grad()
    def score(self, prompts: list[list[dict]], replies: list[str]) -> list[float]:
        was_training = self.model.training
        self.model.eval()
        scores = []
        for start in range(0, len(replies), self.batch_size):
            batch = [self.encode(p, r) for p, r in zip(prompts[start:start + self.batch_size],
                                                        replies[start:start + self.batch_size])]
            width = max(map(len, batch))
            pad = self.tokenizer.pad_token_id
            input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids in batch])
            attention = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids in batch])
            device = next(self.model.parameters()).device
            logits = self.model(input_ids=input_ids.to(device), attention_mask=attention.to(device)).logits
            scores.extend(logits[:, 0].float().tolist())
        self.model.train(was_training)
        return scores

    def __call__(self, prompts, completions, **kwargs) -> list[float]:
        """GRPO reward function: conversational prompts and completions (lists of messages)."""
        replies = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return self.score(prompts, replies)
