"""The review task's judge: a model that reads a paper and says its mean reviewer rating (one number).

Stage 03 on a review pairs run trains it (the task's `train_judge` hook, common/tasks/review.py); stage
05 reads it back with `RatingModel.from_run` (`--rating_run`). Two backbones, as for any judge
(`judge_backbone`):
- `lora_4bit`: the pipeline's 4-bit base + rank-64 rsLoRA + a score head (the SEQ_CLS path of
  common/model.py). A paper is read as windows (the review prompt over `max_length` templated tokens of
  the paper, `rating_window_overlap` shared by neighbours, at most `rating_max_windows` of them, spread
  over the paper), and the windows' scores are pooled into one (`rating_pooling`): `mean`, or
  `attention`, where the head has a second output, a window's attention logit, and the paper's score is
  the softmax-weighted sum of its windows' scores (the head is linear, so this is attention pooling of
  the windows' last hidden states).
- `encoder`: a plain encoder (MiniLM, mpnet), fully fine-tuned, on one input: the title, the abstract
  and the introduction, cut to `max_length`; the cheap baseline.
The target is the paper's mean reviewer rating, standardised with the train split's mean and sd
(saved in `rating_scale.json`), so the head learns offsets from the mean; the loss is `rating_loss`
(huber or mse). The dev split (`audit_split`) is predicted at the end (MAE, RMSE, Pearson, Spearman in
metrics.json, `<split>_ratings.jsonl`) and, with `early_stopping_patience`, chooses the epoch.
"""
from __future__ import annotations

import logging
import math
import re
from pathlib import Path

import numpy as np
import torch

from common.data import DataError, load_split, one_per_group, read_json, token_ids, write_json, write_jsonl
from common.model import ENCODER
from common.runs import RunError, settle

log = logging.getLogger("pipeline")

SCALE_FILE = "rating_scale.json"
HEADS = {"mean": 1, "attention": 2}  # rating_pooling -> the head's outputs: the score (and the attention logit)


def gold(row: dict) -> float | None:
    """A paper's mean reviewer rating (unrounded), or None when none of its reviews has one."""
    ratings = [r for r in row.get("human_ratings") or [] if r is not None]
    return float(np.mean(ratings)) if ratings else None


def papers(pairs_run, split: str, limit: int | None = None) -> list[dict]:
    """One row per paper of a split (per_review targets have one per review), those with a rating."""
    rows = [r for r in one_per_group(load_split(pairs_run, split)) if gold(r) is not None]
    return rows[:limit] if limit else rows


# --- what the model reads ---------------------------------------------------------------------------

_INTRO = re.compile(r"^#+\s*(?:\d+\.?\s*)?introduction\b.*$", re.IGNORECASE | re.MULTILINE)
_HEADING = re.compile(r"^#+\s", re.MULTILINE)


def encoder_text(row: dict) -> str:
    """Title, abstract and introduction of a paper (its `paper` text: "# title", "## Abstract", body).
    The introduction runs to the next heading after it; without one, the paper from its start (cut to
    max_length by the tokenizer either way)."""
    paper = row["paper"]
    intro = _INTRO.search(paper)
    if intro:
        after = _HEADING.search(paper, intro.end())
        return (paper[:intro.start()].rstrip() + "\n\n" + paper[intro.start():after.start() if after else None]).strip()
    return paper


def spread(items: list, n: int) -> list:
    """At most n of items, evenly spread, the first and the last kept."""
    if len(items) <= n:
        return items
    if n == 1:
        return items[:1]
    return [items[round(i * (len(items) - 1) / (n - 1))] for i in range(n)]


def paper_inputs(row: dict, tokenizer, config, kind: str) -> list[list[int]]:
    """The token ids the model reads of one paper: one per window (lora_4bit), or one (encoder)."""
    if kind == ENCODER:
        return [list(tokenizer(encoder_text(row), truncation=True, max_length=config.max_length)["input_ids"])]
    from common.tasks.review_text import reading_windows
    # never a writer's hint: the rating model is where that number comes from
    prompts = reading_windows({**row, "rating_hint": None}, tokenizer, config.max_length, config.rating_window_overlap)
    return [token_ids(tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True))
            for p in spread(prompts, config.rating_max_windows)]


# --- pooling and the loss -------------------------------------------------------------------------

def pool(logits: torch.Tensor, paper_index: torch.Tensor, n_papers: int, pooling: str) -> torch.Tensor:
    """Windows' head outputs [n_windows, 1 or 2] -> one score per paper [n_papers]. mean: the mean of
    its windows' scores; attention: softmax over its windows of the second output, weighting the first."""
    score = logits[:, 0].float()
    if pooling == "mean":
        total = torch.zeros(n_papers, dtype=score.dtype, device=score.device).index_add(0, paper_index, score)
        count = torch.zeros_like(total).index_add(0, paper_index, torch.ones_like(score))
        return total / count
    attn = logits[:, 1].float()
    top = torch.full((n_papers,), -math.inf, dtype=attn.dtype, device=attn.device).scatter_reduce(
        0, paper_index, attn, reduce="amax")
    weight = torch.exp(attn - top[paper_index])
    norm = torch.zeros_like(top).index_add(0, paper_index, weight)
    return torch.zeros_like(top).index_add(0, paper_index, weight * score) / norm


def rating_loss(pred: torch.Tensor, target: torch.Tensor, kind: str) -> torch.Tensor:
    """huber (delta 1 standard deviation: robust to a paper whose reviewers disagree wildly) or mse."""
    if kind == "huber":
        return torch.nn.functional.huber_loss(pred, target.float(), delta=1.0)
    return torch.nn.functional.mse_loss(pred, target.float())


class PaperCollator:
    """Papers -> every window of the batch right-padded in one tensor, `paper_index` naming each
    window's paper, `labels` the papers' standardised ratings."""

    def __init__(self, pad_token_id: int):
        self.pad = pad_token_id

    def __call__(self, examples: list[dict]) -> dict:
        windows = [(i, w) for i, e in enumerate(examples) for w in e["windows"]]
        width = max(len(w) for _, w in windows)
        return {"input_ids": torch.tensor([w + [self.pad] * (width - len(w)) for _, w in windows]),
                "attention_mask": torch.tensor([[1] * len(w) + [0] * (width - len(w)) for _, w in windows]),
                "paper_index": torch.tensor([i for i, _ in windows]),
                "labels": torch.tensor([float(e["label"]) for e in examples])}


def _trainer_class():
    from transformers import Trainer

    class RatingTrainer(Trainer):
        """transformers' Trainer with the pooled regression loss (the windows of a micro-batch's papers)."""

        def __init__(self, *args, pooling: str, loss: str, **kwargs):
            super().__init__(*args, **kwargs)
            self.pooling, self.loss_kind = pooling, loss
            self.model_accepts_loss_kwargs = False  # a mean per micro-batch; the Trainer divides by accumulation

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels, index = inputs["labels"], inputs["paper_index"]
            out = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
            pred = pool(out.logits, index, len(labels), self.pooling)
            loss = rating_loss(pred, labels, self.loss_kind)
            return (loss, {"logits": pred}) if return_outputs else loss

    return RatingTrainer


# --- stage 03 -------------------------------------------------------------------------------------

def train(config, run) -> dict:
    """Stage 03 on a review pairs run: train the rating model on `train_split`'s papers, choose and
    measure it on `audit_split`'s, save it as a judge run (adapter/, rating_scale.json, metrics)."""
    from transformers import EarlyStoppingCallback, TrainingArguments

    from common import fast
    from common.judges import write_train_posts
    from common.model import load_model, load_tokenizer
    from common.rewards import judge_spec, set_up_like_reward_trainer
    from common.training import save_adapter, trainer_args
    from common.training import train as run_training

    # 0. What only a judge of winner-vs-loser pairs uses is refused, not ignored.
    unused = [f for f in ("corruptions", "hard_negatives", "topic_gate") if getattr(config, f)]
    if unused:
        raise RunError(f"field '{unused[0]}' is for a judge of winner-vs-loser pairs; {config.pairs_run} is a review "
                       f"pairs run, whose judge is a rating model: leave it out")

    # 1. Papers with a rating; the target standardised by the train split's mean and sd.
    train_rows = papers(config.pairs_run, config.train_split, config.max_train_examples)
    dev_rows = papers(config.pairs_run, config.audit_split, config.max_eval_examples)
    if len(train_rows) < 2:
        raise DataError(f"{config.pairs_run}: {len(train_rows)} rated {config.train_split} papers; a rating model "
                        f"needs at least 2 (their sd standardises the target)")
    targets = np.array([gold(r) for r in train_rows])
    scale = {"mean": float(targets.mean()), "sd": float(targets.std()) or 1.0, "n_train_papers": len(train_rows),
             "pooling": config.rating_pooling, "loss": config.rating_loss}
    write_json(run.dir / SCALE_FILE, scale)
    write_train_posts(run.dir, config.train_split, train_rows)  # 05 refuses it on a paper it trained on
    log.info("rating model (%s, %s pooling, %s loss) on %d %s papers (mean %.3f, sd %.3f), %d %s papers",
             config.judge_backbone, config.rating_pooling, config.rating_loss, len(train_rows), config.train_split,
             scale["mean"], scale["sd"], len(dev_rows), config.audit_split)

    # 2. The model: the score head of 1 output (mean pooling) or 2 (attention pooling).
    args, kind = judge_spec(config)
    tokenizer = load_tokenizer(args)
    model = load_model(args, kind, tokenizer=tokenizer, num_labels=HEADS[config.rating_pooling])
    levers, run.manifest["memory_plan"] = fast.fit_memory(config, model)  # memory_levers fit: what this GPU needs
    settle(run, config, levers)  # before the model is set up for checkpointing, and in config.yaml: what ran
    set_up_like_reward_trainer(model, config.gradient_checkpointing)

    def examples(rows):
        return [{"windows": paper_inputs(r, tokenizer, config, kind), "label": (gold(r) - scale["mean"]) / scale["sd"]}
                for r in rows]

    # 3. Train; with early stopping the dev loss after every epoch keeps the best epoch.
    stopping = dict(eval_strategy="epoch", save_strategy="epoch", load_best_model_at_end=True,
                    metric_for_best_model="eval_loss", greater_is_better=False) if config.early_stopping_patience else {}
    if stopping and not dev_rows:
        raise RunError(f"early_stopping_patience: no rated {config.audit_split} papers to stop on")
    trainer = _trainer_class()(
        model=model, args=trainer_args(TrainingArguments, config, run, remove_unused_columns=False,
                                       prediction_loss_only=True, **stopping),
        train_dataset=examples(train_rows), eval_dataset=examples(dev_rows) if stopping else None,
        processing_class=tokenizer, data_collator=PaperCollator(tokenizer.pad_token_id),
        callbacks=[EarlyStoppingCallback(config.early_stopping_patience)] if stopping else None,
        pooling=config.rating_pooling, loss=config.rating_loss)
    run.manifest["patches"] = fast.apply(trainer, config)
    run.manifest["backends"] = fast.backends(config, run.manifest["patches"], judge_scoring="padded")
    metrics = run_training(trainer, run)
    if stopping:
        metrics["early_stopping"] = {"best_step": trainer.state.best_global_step,
                                     f"best_{config.audit_split}_loss": trainer.state.best_metric,
                                     "epochs_trained": trainer.state.epoch}
    save_adapter(model, tokenizer, run)

    # 4. The dev papers, predicted as stage 05 predicts: MAE, RMSE, Pearson, Spearman, and the MAE against the
    #    train mean's (paired interval); then each of audit_extra_splits (test), reported, never chosen on.
    rater = RatingModel(model, tokenizer, config, kind, scale)
    dev = _measure(rater, dev_rows, config.audit_split, scale["mean"], config.seed, run.dir)
    metrics.update(dev, metrics_split=config.audit_split, judge_objective="rating", train_split=config.train_split,
                   rating_scale=scale, n_train_papers=len(train_rows))
    seen = {config.train_split, config.audit_split, *config.train_also}
    extra = {s: papers(config.pairs_run, s, config.max_eval_examples) for s in config.audit_extra_splits
             if s not in seen and (Path(config.pairs_run) / f"{s}.jsonl").is_file()}
    metrics["other_splits"] = {split: _measure(rater, rows, split, scale["mean"], config.seed, run.dir)
                               for split, rows in extra.items()}
    # 5. What the words alone predict, beside it (as the judge audit's bag of words).
    metrics["baselines"] = {"bag_of_words": bag_of_words(train_rows, {config.audit_split: dev_rows, **extra},
                                                         config.audit_split, config.seed)}
    return metrics


def _measure(rater: "RatingModel", rows: list[dict], split: str, train_mean: float, seed: int, out: Path) -> dict:
    """The rating model on one split's papers: `<split>_ratings.jsonl` and the split's rating metrics."""
    from common.metrics import rating_source_metrics
    predicted = rater.predict(rows)
    write_jsonl(out / f"{split}_ratings.jsonl",
                [{"id": r["group_id"], "predicted": p, "human_rating": gold(r)} for r, p in zip(rows, predicted)])
    result = rating_source_metrics(predicted, [gold(r) for r in rows], train_mean, seed)
    log.info("%s: %s", split, {k: v for k, v in result.items() if not k.endswith("_ci")})
    return result


BOW_ALPHAS = (0.3, 1.0, 3.0, 10.0, 30.0)
# What the bag of words reads: the encoder's text (title, abstract, introduction) or the whole paper.
BOW_TEXTS = {"introduction": encoder_text, "paper": lambda row: row["paper"]}


class BagOfWords:
    """What the words alone predict: tf-idf unigrams (min_df 2) of each paper's `text` (BOW_TEXTS) -> ridge
    regression on the train papers' mean rating, one fit per strength of `alphas`. Deterministic: stage 05
    refits it from the rating run's train papers."""

    def __init__(self, train_rows: list[dict], text: str = "introduction", alphas=BOW_ALPHAS):
        from sklearn.linear_model import Ridge

        from common.features import word_tfidf
        self.text, self.read = text, BOW_TEXTS[text]
        self.vectorizer = word_tfidf()
        x = self.vectorizer.fit_transform([self.read(r) for r in train_rows])
        y = np.array([gold(r) for r in train_rows])
        self.vocabulary, self.train_mean = x.shape[1], float(y.mean())
        self.models = {alpha: Ridge(alpha=alpha).fit(x, y) for alpha in alphas}

    def predict(self, rows: list[dict], alpha: float) -> list[float]:
        if not rows:  # 05 without --rating_dev_run has no dev papers to rate (sklearn refuses an empty matrix)
            return []
        return self.models[alpha].predict(self.vectorizer.transform([self.read(r) for r in rows])).tolist()

    @classmethod
    def of_run(cls, run_dir: str | Path) -> tuple["BagOfWords", float] | None:
        """A rating run's bag of words, refitted on its train papers, and the strength it chose on dev; None for
        a run from before it had one (a run from before the text was chosen read the introduction)."""
        from common.config import load_run_config
        chosen = read_json(Path(run_dir) / "metrics.json").get("baselines", {}).get("bag_of_words")
        if not chosen:
            return None
        config = load_run_config(run_dir)
        alpha, text = chosen["alpha"], chosen.get("text", "introduction")
        return cls(papers(config.pairs_run, config.train_split, config.max_train_examples), text, (alpha,)), alpha


def bag_of_words(train_rows: list[dict], splits: dict[str, list[dict]], choose_on: str, seed: int) -> dict:
    """BagOfWords on the train papers, its text (BOW_TEXTS) and strength (BOW_ALPHAS) chosen by MAE on
    `choose_on` (dev); each split's metrics as a rating source's, against the train mean."""
    from common.metrics import rating_source_metrics
    fitted = {text: BagOfWords(train_rows, text) for text in BOW_TEXTS}
    golds = {split: [gold(r) for r in rows] for split, rows in splits.items() if rows}
    mae = lambda choice: np.abs(np.array(fitted[choice[0]].predict(splits[choose_on], choice[1]))  # noqa: E731
                                - golds[choose_on]).mean()
    grid = [(text, alpha) for text in BOW_TEXTS for alpha in BOW_ALPHAS]
    text, alpha = min(grid, key=mae) if choose_on in golds else grid[0]
    bow = fitted[text]
    return {"model": f"tf-idf unigrams (min_df 2) + ridge regression, the text ({', '.join(BOW_TEXTS)}) and alpha "
                     f"chosen on {choose_on} by MAE", "text": text, "alpha": alpha, "vocabulary": bow.vocabulary,
            **{split: rating_source_metrics(bow.predict(splits[split], alpha), golds[split], bow.train_mean, seed)
               for split in golds}}


# --- stage 05 -------------------------------------------------------------------------------------

class RatingModel:
    """A trained rating model: `predict(rows)` -> each paper's rating on the reviewers' scale."""

    def __init__(self, model, tokenizer, config, kind: str, scale: dict, batch_windows: int = 8):
        self.model, self.tokenizer, self.config, self.kind, self.scale = model, tokenizer, config, kind, scale
        self.batch_windows = batch_windows
        self.name = "rating_model"

    @classmethod
    def from_run(cls, run_dir: str | Path, batch_windows: int = 8) -> "RatingModel":
        """A finished stage-03 run of the review task, frozen, with its backbone and scale."""
        from common.config import RewardStageConfig, load_run_config
        from common.model import load_model, load_tokenizer
        from common.rewards import judge_spec
        run_dir = Path(run_dir)
        config = load_run_config(run_dir)
        if not isinstance(config, RewardStageConfig) or not (run_dir / SCALE_FILE).is_file():
            raise RunError(f"{run_dir} is not a rating model run (stage 03 on a review pairs run: it has no "
                           f"{SCALE_FILE})")
        scale = read_json(run_dir / SCALE_FILE)
        args, kind = judge_spec(config)
        tokenizer = load_tokenizer(args)
        model = load_model(args, kind, adapter=run_dir / "adapter", trainable=False, tokenizer=tokenizer,
                           num_labels=HEADS[scale["pooling"]])
        rater = cls(model, tokenizer, config, kind, scale, batch_windows)
        rater.name = run_dir.name
        return rater

    @torch.no_grad()
    def predict(self, rows: list[dict]) -> list[float]:
        """Each paper's rating: its windows' pooled score, un-standardised."""
        was_training = self.model.training
        self.model.eval()
        device = next(self.model.parameters()).device
        collate = PaperCollator(self.tokenizer.pad_token_id)
        out, batch, n_windows = [], [], 0
        inputs = [{"windows": paper_inputs(r, self.tokenizer, self.config, self.kind), "label": 0.0} for r in rows]
        for example in inputs + [None]:
            if batch and (example is None or n_windows + len(example["windows"]) > self.batch_windows):
                b = collate(batch)
                logits = self.model(input_ids=b["input_ids"].to(device), attention_mask=b["attention_mask"].to(device)).logits
                scores = pool(logits, b["paper_index"].to(device), len(batch), self.scale["pooling"])
                out += [self.scale["mean"] + self.scale["sd"] * float(s) for s in scores]
                batch, n_windows = [], 0
            if example is not None:
                batch.append(example)
                n_windows += len(example["windows"])
        self.model.train(was_training)
        return out
