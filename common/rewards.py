"""The reward model as a scorer: one place that turns (prompt, reply) into a number.

Stage 03 trains and measures its judge with it, stage 04 uses it as GRPO's reward function, stage 05
scores every model's replies with it, so the three always format, cut and pad text the same way.

Two judge backbones (stage 03's `judge_backbone`):
- `lora_4bit` (default): the 4-bit base (`judge_model_name_or_path`, default the pipeline's own base)
  + rsLoRA + a one-number score head; input = the chat template of prompt + reply.
- `encoder`: a plain encoder classifier (e.g. all-MiniLM-L6-v2), fully fine-tuned; input = the
  premise and the reply as a text pair ([CLS] premise [SEP] reply [SEP]), no chat template.
Both are right-padded. `RewardScorer.from_run` rebuilds a finished stage-03 run's judge from that
run's own config, and refuses it if the backbone's files changed since (its `judge` fingerprint).
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
import yaml
from transformers import TrainerCallback

from common.config import ModelArgs
from common.data import fit_prompt, fit_reply, truncate_tokens
from common.metrics import hacking_stats
from common.model import ENCODER, SEQ_CLS, fingerprint, load_model, load_tokenizer
from common.runs import RunError, read_json

log = logging.getLogger("pipeline")

LORA_4BIT = "lora_4bit"
JUDGE_BACKBONES = {LORA_4BIT: SEQ_CLS, ENCODER: ENCODER}  # judge_backbone -> load_model kind


def _get(config, key, default=None):
    return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)


def judge_spec(config) -> tuple[ModelArgs, str]:
    """The judge's backbone of a stage-03 config (its dataclass, or the dict of a run's config.yaml):
    (ModelArgs of the judge, load_model kind). LoRA fields are the stage's own."""
    backbone = _get(config, "judge_backbone") or LORA_4BIT
    if backbone not in JUDGE_BACKBONES:
        raise ValueError(f"judge_backbone must be one of {sorted(JUDGE_BACKBONES)}, got {backbone!r}")
    defaults = ModelArgs()
    args = ModelArgs(
        model_name_or_path=_get(config, "judge_model_name_or_path") or _get(config, "model_name_or_path"),
        **{k: _get(config, k, getattr(defaults, k)) for k in
           ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "attn_implementation")})
    return args, JUDGE_BACKBONES[backbone]


def judge_fingerprint(config) -> dict:
    args, kind = judge_spec(config)
    return {"backbone": _get(config, "judge_backbone") or LORA_4BIT, **fingerprint(args, kind)}


class RewardScorer:
    def __init__(self, model, tokenizer, max_prompt_tokens: int, max_length: int, batch_size: int = 8,
                 kind: str = SEQ_CLS):
        self.model, self.tokenizer, self.kind = model, tokenizer, kind
        self.max_prompt_tokens, self.max_length, self.batch_size = max_prompt_tokens, max_length, batch_size
        if kind == ENCODER and max_prompt_tokens + tokenizer.num_special_tokens_to_add(pair=True) >= max_length:
            raise ValueError(f"max_prompt_tokens={max_prompt_tokens} leaves no room for the reply in "
                             f"max_length={max_length}")

    @classmethod
    def load(cls, config, adapter: str | Path | None = None, trainable: bool = True,
             batch_size: int = 8) -> "RewardScorer":
        """The judge of a stage-03 config: fresh (to train) or its saved adapter / fine-tuned model."""
        args, kind = judge_spec(config)
        tokenizer = load_tokenizer(args)
        model = load_model(args, kind, adapter=adapter, trainable=trainable, tokenizer=tokenizer)
        return cls(model, tokenizer, _get(config, "max_prompt_tokens"), _get(config, "max_length"),
                   batch_size, kind)

    @classmethod
    def from_run(cls, reward_run: str | Path, batch_size: int = 8) -> "RewardScorer":
        """Load a finished stage-03 run's judge, frozen, exactly as that run trained it: its backbone
        comes from the run's own config.yaml.
        Refuses the run if the backbone's files differ from the `judge` fingerprint it recorded."""
        reward_run = Path(reward_run)
        trained = yaml.safe_load((reward_run / "config.yaml").read_text())
        manifest = read_json(reward_run / "manifest.json")
        recorded = manifest.get("judge") or manifest.get("base") or {}
        now = judge_fingerprint(trained)
        for key in sorted(set(now) - {"backbone"}):
            if key in recorded and recorded[key] != now[key]:
                raise RunError(f"judge of reward run {reward_run.name} changed since it was trained: field "
                               f"'{key}' is {now[key]!r} now but {recorded[key]!r} in its manifest")
        return cls.load(trained, adapter=reward_run / "adapter", trainable=False, batch_size=batch_size)

    def encode(self, prompt: list[dict], reply: str) -> list[int]:
        if self.kind == ENCODER:
            return self._encode_pair(prompt, reply)
        prompt = fit_prompt(self.tokenizer, prompt, self.max_prompt_tokens)
        reply = fit_reply(self.tokenizer, prompt, reply, self.max_length)
        ids = self.tokenizer.apply_chat_template(prompt + [{"role": "assistant", "content": reply}], tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def _encode_pair(self, prompt: list[dict], reply: str) -> list[int]:
        """Encoder input: the premise (user turns, cut to max_prompt_tokens) and the reply (cut at a
        sentence end to what is left of max_length) as a text pair with the tokenizer's own markers."""
        tok = self.tokenizer
        premise = truncate_tokens(tok, "\n\n".join(m["content"] for m in prompt if m["role"] != "system"),
                                  self.max_prompt_tokens)
        n_premise = len(tok(premise, add_special_tokens=False)["input_ids"])
        budget = self.max_length - n_premise - tok.num_special_tokens_to_add(pair=True)
        reply = truncate_tokens(tok, reply, budget, sentence_boundary=True)
        return list(tok(premise, reply, truncation="only_second", max_length=self.max_length)["input_ids"])

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


class WatchedReward:
    """GRPO's reward function: the judge's scores, plus a reward-hacking watch and a length guard.

    For every batch of completions it records the mean reply length (words), distinct-2 over the
    batch and the overlap with the premise (share of the reply's word 3-grams found in it), logs
    them through TRL's `log_metric` (so they land in the trainer's log history and W&B as
    `watch/...`), and checks the guard: when the mean reply length leaves
    [reference / max_length_ratio, reference * max_length_ratio] for `patience` batches in a row,
    where reference is the mean over the first `reference_batches` batches, it trips; the callback
    from `stop_callback()` then stops training at the end of that step. None disables the guard."""
    __name__ = "reward_model"  # GRPOTrainer names the reward's log column after it

    def __init__(self, scorer: RewardScorer, max_length_ratio: float | None = None, patience: int = 1,
                 reference_batches: int = 1):
        if max_length_ratio is not None and max_length_ratio <= 1:
            raise ValueError(f"max_length_ratio must be > 1 (or None to disable the guard), got {max_length_ratio}")
        self.scorer, self.max_length_ratio = scorer, max_length_ratio
        self.patience, self.reference_batches = max(1, patience), max(1, reference_batches)
        self.history: list[dict] = []
        self.reference: float | None = None
        self.tripped: str | None = None
        self._breaches = 0

    def __call__(self, prompts, completions, log_metric=None, trainer_state=None, **kwargs) -> list[float]:
        replies = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        premises = [p[-1]["content"] if isinstance(p, list) else p for p in prompts]
        stats = hacking_stats(premises, replies)
        scores = self.scorer.score(prompts, replies)
        stats["reward_mean"] = sum(scores) / len(scores) if scores else float("nan")
        # the optimiser step these completions train (the trainer's counter has not moved yet)
        step = trainer_state.global_step + 1 if trainer_state is not None else len(self.history) + 1
        self.history.append({"step": step, **stats})
        if log_metric is not None:
            for key, value in stats.items():
                if key != "reward_mean":
                    log_metric(f"watch/{key}", value)
        self._check(stats["reply_words"], step)
        return scores

    def _check(self, words: float, step: int) -> None:
        if self.max_length_ratio is None or self.tripped:
            return
        if len(self.history) <= self.reference_batches:
            firsts = [h["reply_words"] for h in self.history[: self.reference_batches]]
            self.reference = sum(firsts) / len(firsts)
            return
        low, high = self.reference / self.max_length_ratio, self.reference * self.max_length_ratio
        if low <= words <= high:
            self._breaches = 0
            return
        self._breaches += 1
        if self._breaches >= self.patience:
            self.tripped = (
                f"reward-hacking guard: mean reply length {words:.1f} words at step {step} is outside "
                f"[{low:.1f}, {high:.1f}] (the first {self.reference_batches} batch(es) averaged "
                f"{self.reference:.1f} words; max_length_ratio={self.max_length_ratio}) for {self._breaches} "
                f"batch(es) in a row: the policy is drifting in length, which is how a length-biased judge "
                f"gets gamed. Training stopped; see metrics.json per_step and judge_audit.json of the reward run.")
            log.error(self.tripped)

    def stop_callback(self) -> TrainerCallback:
        watch = self

        class _StopOnGuard(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if watch.tripped:
                    control.should_training_stop = True
                return control

        return _StopOnGuard()


def watch_per_step(log_history: list[dict]) -> list[dict]:
    """Stage 04's per-step record from the trainer's log: reward, reply length, and the watch."""
    return [{"step": h["step"], "reward_mean": h.get("reward"),
             "reply_length_mean": h.get("completions/mean_length"),  # tokens, as TRL counts them
             "reply_words_mean": h.get("watch/reply_words"), "distinct_2": h.get("watch/distinct_2"),
             "premise_overlap": h.get("watch/premise_overlap")}
            for h in log_history if "reward" in h]
