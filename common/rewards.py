"""The reward model as a scorer: one place that turns (prompt, reply) into a number.

Stage 03 trains and measures its judge with it, stage 04 uses it as GRPO's reward function, stage 05
scores every model's replies with it, so the three always format, cut and pad text the same way.

Two judge backbones (stage 03's `judge_backbone`):
- `lora_4bit` (default): the 4-bit base (`judge_model_name_or_path`, default the pipeline's own base)
  + rsLoRA + a one-number score head; input = the chat template of prompt + reply.
- `encoder`: a plain encoder classifier (e.g. all-MiniLM-L6-v2), fully fine-tuned; input = the
  premise and the reply as a text pair ([CLS] premise [SEP] reply [SEP]), no chat template.
Both are right-padded. Either can be trained pairwise (winner vs loser, TRL's RewardTrainer) or
pointwise (each reply alone, delta vs no delta, `judge_objective`); the scorer reads the one number
the same way for both, so stages 04 and 05 use either unchanged. `RewardScorer.from_run` rebuilds a finished stage-03 run's judge from that
run's own config, and refuses it if the backbone's files changed since (its `judge` fingerprint).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from common import fast
from common.config import ModelArgs, RewardStageConfig, load_run_config
from common.data import fit_prompt, fit_reply, read_json, token_ids, truncate_tokens
from common.model import ENCODER, SEQ_CLS, fingerprint, load_model, load_tokenizer, unwrap_peft
from common.runs import RunError
from common.trl_compat import attn_implementation

log = logging.getLogger("pipeline")

JUDGE_BACKBONES = {"lora_4bit": SEQ_CLS, "encoder": ENCODER}  # judge_backbone -> load_model kind


def judge_spec(config: RewardStageConfig) -> tuple[ModelArgs, str]:
    """The judge's backbone of a stage-03 config: (ModelArgs of the judge, load_model kind). LoRA
    fields are the stage's own."""
    args = ModelArgs(model_name_or_path=config.judge_model_name_or_path or config.model_name_or_path,
                     lora_r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                     lora_target_modules=list(config.lora_target_modules),
                     attn_implementation=config.attn_implementation)
    return args, JUDGE_BACKBONES[config.judge_backbone]


def judge_fingerprint(config: RewardStageConfig) -> dict:
    if config.judge_backbone == "features":  # no weights: the features' version and names identify it
        from common.feature_judge import feature_fingerprint
        return feature_fingerprint()
    if config.judge_backbone == "ensemble":  # its members' digests are in its ensemble.json
        return {"backbone": "ensemble", "ensemble_of": [str(Path(p).resolve()) for p in config.ensemble_of],
                "combine": config.ensemble_combine, "lambda": config.ensemble_lambda}
    args, kind = judge_spec(config)
    return {"backbone": config.judge_backbone, **fingerprint(args, kind)}


def preference_dataset(rows: list[dict], scorer: "RewardScorer"):
    """Pre-tokenised pairs for TRL's RewardTrainer, encoded by the scorer that later judges (same cut,
    same format)."""
    from datasets import Dataset
    return Dataset.from_list([{"chosen_ids": scorer.encode(r["prompt"], r["chosen"]),
                               "rejected_ids": scorer.encode(r["prompt"], r["rejected"])} for r in rows])


def pointwise_dataset(rows: list[dict], scorer: "RewardScorer"):
    """The pointwise judge's examples: every pair gives two single replies, the winner labelled 1 (it
    earned a delta) and the loser 0, encoded by the scorer that later judges. Stage 01 balanced each
    pair's lengths, so length cannot tell the labels apart here either."""
    from datasets import Dataset
    # A corruption or a policy's reply (`negative`, stage 03's --corruptions and --hard_negatives) is one
    # no-delta example: its real reply is a train pair's, already there.
    return Dataset.from_list([{"input_ids": scorer.encode(r["prompt"], r[key]), "labels": label}
                              for r in rows for key, label in (("chosen", 1.0), ("rejected", 0.0))
                              if not (r.get("negative") and key == "chosen")])


class PadRight:
    """Collates pointwise examples as the scorer pads them: right padding, attention mask, float labels."""

    def __init__(self, pad_token_id: int):
        self.pad = pad_token_id

    def __call__(self, examples: list[dict]) -> dict:
        width = max(len(e["input_ids"]) for e in examples)
        return {"input_ids": torch.tensor([e["input_ids"] + [self.pad] * (width - len(e["input_ids"])) for e in examples]),
                "attention_mask": torch.tensor([[1] * len(e["input_ids"]) + [0] * (width - len(e["input_ids"]))
                                                for e in examples]),
                "labels": torch.tensor([float(e["labels"]) for e in examples])}


def set_up_like_reward_trainer(model, gradient_checkpointing: bool) -> None:
    """The pointwise judge's model set up as TRL's RewardTrainer sets up the pairwise one, so that the
    two objectives differ only in their loss: dropout off (RewardConfig.disable_dropout); a 4-bit
    judge's trainable LoRA and head weights in bf16 (TRL's QLoRA rule; the saved adapter then reloads
    to exactly the scores the judge was measured with); input gradients for checkpointing a PeftModel."""
    from trl.trainer.utils import disable_dropout_in_model  # internal: common/trl_compat.py
    disable_dropout_in_model(model)
    if getattr(model, "is_loaded_in_4bit", False) or getattr(unwrap_peft(model), "is_loaded_in_4bit", False):
        for name, param in model.named_parameters():
            if param.requires_grad:
                param.data = param.data.to(torch.bfloat16)
    if gradient_checkpointing and hasattr(model, "get_base_model"):
        model.enable_input_require_grads()


def pointwise_loss(outputs, labels, num_items_in_batch=None):
    """Binary cross-entropy of the score (a logit: log-odds of a delta) against the label. Summed and
    divided by the examples of the whole accumulated batch, which is what the Trainer expects of a
    `compute_loss_func` (it then does not divide by the accumulation steps again)."""
    loss = torch.nn.functional.binary_cross_entropy_with_logits(outputs.logits[:, 0].float(), labels.float(),
                                                                reduction="sum")
    return loss / (num_items_in_batch if num_items_in_batch is not None else labels.numel())


class RewardScorer:
    def __init__(self, model, tokenizer, max_prompt_tokens: int, max_length: int, batch_size: int = 8,
                 kind: str = SEQ_CLS, packed: bool = True):
        self.model, self.tokenizer, self.kind = model, tokenizer, kind
        self.name = "judge"  # a Scorer (common/scorers.py); from_run names it after its run
        # False: right-padded batches, as transformers scores them (asked, or a model the packed rows do not fit)
        self.packed = packed and kind == SEQ_CLS and fast.packs_rows(model)
        self._unpackable = packed and kind == SEQ_CLS and not self.packed
        self.max_prompt_tokens, self.max_length, self.batch_size = max_prompt_tokens, max_length, batch_size
        self._fitted: dict[str, list[dict]] = {}  # prompt -> prompt cut to max_prompt_tokens (GRPO scores 4 replies each)
        if kind == ENCODER and max_prompt_tokens + tokenizer.num_special_tokens_to_add(pair=True) >= max_length:
            raise ValueError(f"max_prompt_tokens={max_prompt_tokens} leaves no room for the reply in "
                             f"max_length={max_length}")

    @property
    def scoring(self) -> str:
        """How it scores, for a manifest's `judge_scoring`: "packed" (the replies to a prompt share it) or
        "padded" (transformers' padded rows)."""
        if self.packed:
            return "packed"
        why = ["sliding-window layers"] if self._unpackable else []
        if attn_implementation(unwrap_peft(self.model)) == "eager":  # an encoder without SDPA (MPNet)
            why.append("eager attention")
        return f"padded ({', '.join(why)})" if why else "padded"

    @property
    def backends(self) -> dict:
        return {"judge_scoring": self.scoring}

    @classmethod
    def load(cls, config: RewardStageConfig, adapter: str | Path | None = None, trainable: bool = True,
             batch_size: int = 8, packed: bool = True) -> "RewardScorer":
        """The judge of a stage-03 config: fresh (to train) or its saved adapter / fine-tuned model."""
        args, kind = judge_spec(config)
        tokenizer = load_tokenizer(args)
        model = load_model(args, kind, adapter=adapter, trainable=trainable, tokenizer=tokenizer)
        return cls(model, tokenizer, config.max_prompt_tokens, config.max_length, batch_size, kind, packed)

    @classmethod
    def from_run(cls, reward_run: str | Path, batch_size: int = 8, packed: bool = True) -> "RewardScorer":
        """Load a finished stage-03 run's judge, frozen, exactly as that run trained it: its backbone
        comes from the run's own config.yaml.
        Refuses the run if the backbone's files differ from the `judge` fingerprint it recorded."""
        reward_run = Path(reward_run)
        trained = load_run_config(reward_run)
        if not isinstance(trained, RewardStageConfig):
            raise RunError(f"{reward_run} is not a Reward run: it has no judge")
        if (reward_run / "rating_scale.json").is_file():  # common/rating_model.py: it rates papers, not replies
            raise RunError(f"{reward_run} is a rating model (a paper -> its rating), not a judge of replies: give it "
                           f"to stage 05 as --rating_run")
        manifest = read_json(reward_run / "manifest.json")
        recorded = manifest.get("judge") or manifest.get("base") or {}
        now = judge_fingerprint(trained)
        for key in sorted(set(now) - {"backbone"}):
            if key in recorded and recorded[key] != now[key]:
                raise RunError(f"judge of reward run {reward_run.name} changed since it was trained: field "
                               f"'{key}' is {now[key]!r} now but {recorded[key]!r} in its manifest")
        scorer = cls.load(trained, adapter=reward_run / "adapter", trainable=False, batch_size=batch_size, packed=packed)
        scorer.name = reward_run.name
        return scorer

    def encode(self, prompt: list[dict], reply: str) -> list[int]:
        if self.kind == ENCODER:
            return self._encode_pair(prompt, reply)
        prompt = self._fit_prompt(prompt)
        reply = fit_reply(self.tokenizer, prompt, reply, self.max_length)
        return token_ids(self.tokenizer.apply_chat_template(prompt + [{"role": "assistant", "content": reply}],
                                                            tokenize=True))

    def visible_reply(self, prompt: list[dict], reply: str) -> str:
        """The part of `reply` the judge reads after its token budget cut it (stage 03's corruptions are made
        of it, so that a reply cut in half differs from the reply where the judge looks)."""
        if self.kind == ENCODER:
            return self._fit_pair(prompt, reply)[1]
        return fit_reply(self.tokenizer, self._fit_prompt(prompt), reply, self.max_length)

    def _fit_prompt(self, prompt: list[dict]) -> list[dict]:
        key = json.dumps(prompt)
        if key not in self._fitted:
            self._fitted[key] = fit_prompt(self.tokenizer, prompt, self.max_prompt_tokens)
        return self._fitted[key]

    def _fit_pair(self, prompt: list[dict], reply: str) -> tuple[str, str]:
        tok = self.tokenizer
        premise = truncate_tokens(tok, "\n\n".join(m["content"] for m in prompt if m["role"] != "system"),
                                  self.max_prompt_tokens)
        n_premise = len(tok(premise, add_special_tokens=False)["input_ids"])
        budget = self.max_length - n_premise - tok.num_special_tokens_to_add(pair=True)
        return premise, truncate_tokens(tok, reply, budget, sentence_boundary=True)

    def _encode_pair(self, prompt: list[dict], reply: str) -> list[int]:
        """Encoder input: the premise (user turns, cut to max_prompt_tokens) and the reply (cut at a
        sentence end to what is left of max_length) as a text pair with the tokenizer's own markers."""
        premise, reply = self._fit_pair(prompt, reply)
        return list(self.tokenizer(premise, reply, truncation="only_second", max_length=self.max_length)["input_ids"])

    @torch.no_grad()
    def score(self, prompts: list[list[dict]], replies: list[str]) -> list[float]:
        """One score per (prompt, reply), in input order. A causal judge runs padding-free, the replies
        to one prompt sharing it (GRPO scores 4 replies to each premise; common/fast/padding_free.py), unless
        `packed` is off; the encoder judge runs right-padded batches of similar lengths."""
        was_training = self.model.training
        self.model.eval()
        # Each distinct input runs once and its copies get its score, bit for bit. GRPO's replies at a low
        # temperature are copies of one reply; run in one FlexAttention row (a GPU) each copy would sit at
        # another place and get a score a few bf16 units off, which GRPO's group scaling would turn into
        # whole advantages, and its all-tied check would miss.
        first: dict[tuple, int] = {}
        index = [first.setdefault(tuple(self.encode(p, r)), len(first)) for p, r in zip(prompts, replies)]
        unique_prompts = [None] * len(first)
        for i, k in enumerate(index):
            unique_prompts[k] = prompts[i]
        encoded = [list(e) for e in first]
        scores = self._packed(unique_prompts, encoded) if self.packed else self._padded(encoded)
        self.model.train(was_training)
        return [scores[k] for k in index]

    def _packed(self, prompts, encoded) -> list[float]:
        """The replies to one prompt share it. FlexAttention (a judge trained padding-free on a GPU) runs
        many groups end to end in one row; SDPA (the CPU, a judge loaded to score) runs one group a row,
        rows padded, since its dense mask costs the square of the row's length."""
        classifier = unwrap_peft(self.model)
        attention = attn_implementation(classifier)
        one_row = attention == "flex_attention"
        groups: dict[str, list[int]] = {}
        for i, prompt in enumerate(prompts):
            groups.setdefault(json.dumps(prompt), []).append(i)
        sequences = [torch.tensor(e) for e in encoded]
        scores = [0.0] * len(encoded)
        budget = self.batch_size * self.max_length  # tokens a forward holds, as the padded batches did
        batch, tokens = [], 0
        for members in [*groups.values(), None]:
            size = sum(len(encoded[i]) for i in members) if members else 0
            if batch and (members is None or tokens + size > budget):
                rows = [[[sequences[i] for i in g] for g in batch]] if one_row else [[[sequences[i] for i in g]]
                                                                                  for g in batch]
                values = fast.packed_rewards(classifier, rows, attention)[:, 0].float().tolist()
                for i, value in zip((i for g in batch for i in g), values):
                    scores[i] = value
                batch, tokens = [], 0
            if members:
                batch.append(members)
                tokens += size
        return scores

    def _padded(self, encoded) -> list[float]:
        # Batches of similar lengths pad less; each score goes back to its input's place.
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
        scores = [0.0] * len(encoded)
        pad, device = self.tokenizer.pad_token_id, next(self.model.parameters()).device
        for start in range(0, len(order), self.batch_size):
            rows = order[start:start + self.batch_size]
            width = max(len(encoded[i]) for i in rows)
            input_ids = torch.tensor([encoded[i] + [pad] * (width - len(encoded[i])) for i in rows])
            attention = torch.tensor([[1] * len(encoded[i]) + [0] * (width - len(encoded[i])) for i in rows])
            logits = self.model(input_ids=input_ids.to(device), attention_mask=attention.to(device)).logits
            for i, value in zip(rows, logits[:, 0].float().tolist()):
                scores[i] = value
        return scores
