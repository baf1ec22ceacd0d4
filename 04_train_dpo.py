"""Stage 04 (preference): DPO or ORPO from the SFT adapter, for either task.

    python 04_train_dpo.py --config configs/smol/04_train_dpo.yaml --sft_run runs/Nov30_SFT_Run1
    python 04_train_dpo.py --config configs/smol/review/04_train_dpo.yaml --sft_run runs/Nov30_SFT_Run2
    ... --rejected_from base   # review: the rejected review is the untrained base's (default: sft)
    ... --loss orpo            # ORPO instead of DPO: the run is named <Mon><DD>_ORPO_RunN

Pairs: the train split of the pairs run the SFT run was trained on (the first `max_pairs`). A row
that carries a `rejected` reply (ChangeMyView: winner vs loser, length-balanced by stage 01) is used
as it is. A row without one (review: `chosen` is the real structured review) gets a rejected reply
made here (greedy, or as the decoding fields say, as in stage 05) by the model `rejected_from` names: `base` (the same 4-bit model with the
adapter switched off) or `sft` (the SFT adapter on). Those replies are kept in rejected.jsonl with
the model that made them (a resumed run reads them back instead of generating again). Prompts are
cut to `max_prompt_tokens` (for a paper: its head, the first window), replies at a sentence end so
that prompt + reply fit `max_length`.

Without --sft_run (give --pairs_run) the policy is a fresh adapter on the base, and the reference is
the base; the manifest's `started_from` says which.

loss dpo: TRL's DPOTrainer (sigmoid loss, `beta`). The policy is the SFT adapter, trained further.
The reference is the SFT policy itself: TRL adds a frozen copy of the SFT adapter (named `ref`) to
the same 4-bit base, so no second base model is in memory; the copy is dropped before saving.
loss orpo: trl.experimental.orpo's ORPOTrainer (no reference model; `beta` is ORPO's lambda).

Writes the adapter (adapter/), rejected.jsonl (when replies were generated) and metrics.json: TRL's
rewards/chosen, rewards/rejected, rewards/margins and rewards/accuracies per logged step
(`log_history`) and their last logged values (`preference`).
"""
from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from datasets import Dataset
from transformers import set_seed

from common import fast
from common.cli import cli
from common.config import DPOStageConfig
from common.data import DataError, fit_prompt, fit_reply, load_split, read_jsonl, write_jsonl
from common.generation import decoder_backends, generate_replies
from common.model import CAUSAL_LM, fingerprint, load_model, load_tokenizer
from common.provenance import sha256_file
from common.runs import Run, RunError, settle
from common.training import save_adapter, train, trainer_args

log = logging.getLogger("pipeline")
PREFERENCE_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")


def rejected_replies(run, config: DPOStageConfig, model, tokenizer, rows, prompts) -> list[str | None]:
    """The rejected reply generated for each row that has none (None for the others), by the model
    `rejected_from` names; saved in rejected.jsonl, and read back from there when the run resumes."""
    todo = [i for i, row in enumerate(rows) if not row.get("rejected")]
    out: list[str | None] = [None] * len(rows)
    if not todo:
        return out
    if config.rejected_from == "sft" and not config.sft_run:
        raise RunError(f"{len(todo)} pairs have no rejected reply and rejected_from is sft, but no --sft_run was "
                       f"given: give one, or --rejected_from base")
    path = run.dir / "rejected.jsonl"
    # A resumed run trains on the very replies its earlier steps had, or it stops.
    recorded = run.manifest.get("rejected_sha256")
    if recorded and (not path.is_file() or sha256_file(path) != recorded):
        raise RunError(f"{path} is missing or changed since this run wrote it (sha256 differs): its earlier "
                       f"steps trained on other rejected replies; start a new run")
    saved = []
    for where, s in read_jsonl(path) if path.is_file() else ():
        if not isinstance(s, dict) or not all(isinstance(s.get(k), str) for k in ("id", "model", "rejected")):
            raise DataError(f"{where}: expected an object with the strings 'id', 'model' and 'rejected'")
        saved.append(s)
    same_model = {s["model"] for s in saved} == {config.rejected_from}
    if same_model and [s["id"] for s in saved] == [rows[i]["id"] for i in todo]:
        log.info("rejected replies read back from %s", path)
        texts = [s["rejected"] for s in saved]
    else:
        log.info("generating %d rejected replies with the %s model", len(todo), config.rejected_from)
        # base: the same 4-bit weights with every LoRA layer switched off; sft: the adapter on.
        with model.disable_adapter() if config.rejected_from == "base" else contextlib.nullcontext():
            texts = generate_replies(model, tokenizer, [prompts[i] for i in todo], config.max_new_tokens,
                                     config.generation_batch_size, **config.decoding())
        tokenizer.padding_side = "right"  # generation pads on the left; training on the right
        if run.is_main:  # written whole, then renamed: a crash never leaves half a file
            made_by = {"model": config.rejected_from,
                       "sft_run": str(Path(config.sft_run).resolve()) if config.sft_run else None}
            tmp = path.with_suffix(".jsonl.tmp")
            write_jsonl(tmp, [{"id": rows[i]["id"], "rejected": text, **made_by} for i, text in zip(todo, texts)])
            tmp.replace(path)
            run.manifest["rejected_sha256"] = sha256_file(path)
            run.save_manifest()
    for i, text in zip(todo, texts):
        out[i] = text
    return out


def preference_dataset(rows, prompts, rejected, tokenizer, config: DPOStageConfig) -> Dataset:
    """Conversational preference examples (prompt, chosen, rejected) that fit the token budget."""
    def reply(prompt, text):
        return [{"role": "assistant", "content": fit_reply(tokenizer, prompt, text, config.max_length,
                                                           config.max_reply_tokens)}]
    return Dataset.from_list([{"prompt": p, "chosen": reply(p, row["chosen"]),
                               "rejected": reply(p, row.get("rejected") or made)}
                              for row, p, made in zip(rows, prompts, rejected)])


def build_trainer(config: DPOStageConfig, run, model, tokenizer, dataset: Dataset):
    # memory_levers fit: what this GPU needs, for the data's longest pair
    levers, run.manifest["memory_plan"] = fast.fit_memory(config, model, dataset, tokenizer)
    settle(run, config, levers)  # on the config before the trainer is built, and in config.yaml: what ran
    if config.loss == "orpo":
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer  # experimental: common/trl_compat.py
        args = trainer_args(ORPOConfig, config, run, max_length=config.max_length, beta=config.beta)
        trainer = ORPOTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    else:
        from trl import DPOConfig, DPOTrainer
        args = trainer_args(DPOConfig, config, run, max_length=config.max_length, beta=config.beta,
                            loss_type=["sigmoid"], precompute_ref_log_probs=config.precompute_ref_log_probs)
        collator, attention = fast.one_sequence_collator(model, tokenizer, config)  # None: TRL's own
        if attention:
            run.manifest["one_sequence_attention"] = attention
        # On a PeftModel TRL adds the frozen `ref` copy of the SFT adapter as the reference.
        trainer = DPOTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                             data_collator=collator)
    run.manifest["patches"] = fast.apply(trainer, config)
    generated = decoder_backends(model, config.fast_paths, config.generation_weights) if "decoding" in run.manifest \
        else {}
    run.manifest["backends"] = fast.backends(config, run.manifest["patches"], **generated)
    return trainer


def last_logged(log_history: list[dict], keys) -> dict:
    """The last logged value of each key (None when it was never logged)."""
    return {key: next((entry[key] for entry in reversed(log_history) if key in entry), None) for key in keys}


def main(config: DPOStageConfig, overrides: dict) -> None:
    # 1. Seed and run directory (named by the loss: DPO or ORPO); the SFT run must be finished and
    #    built on this base.
    set_seed(config.seed)
    inputs = {"sft_run": config.sft_run, "pairs_run": config.pairs_run}
    run = Run(config.stage, config, overrides, inputs={k: v for k, v in inputs.items() if v}, base=fingerprint(config))
    run.manifest["started_from"] = "sft" if config.sft_run else "base"
    run.start_tracking()

    # 2. Pairs: the train split of the pairs run the SFT adapter was trained on (or of --pairs_run).
    rows = load_split(run.pairs_run, "train")[: config.max_pairs]
    if not rows:
        raise DataError(f"{run.pairs_run}: no train pairs to train on")
    tokenizer = load_tokenizer(config)
    prompts = [fit_prompt(tokenizer, row["prompt"], config.max_prompt_tokens) for row in rows]

    # 3. Model: the 4-bit base with the SFT adapter, trainable (or a fresh adapter on the base).
    model = load_model(config, CAUSAL_LM, adapter=Path(config.sft_run) / "adapter" if config.sft_run else None,
                       trainable=True)

    # 4. Rejected replies for the rows that have none (review), by the model rejected_from names.
    rejected = rejected_replies(run, config, model, tokenizer, rows, prompts)
    n_generated = sum(text is not None for text in rejected)
    run.manifest["rejected_from"] = config.rejected_from if n_generated else "pairs_run"
    if n_generated:
        run.manifest["decoding"] = config.decoding()
    run.save_manifest()
    dataset = preference_dataset(rows, prompts, rejected, tokenizer, config)
    log.info("%s on %d pairs (%d rejected replies generated)", config.stage, len(dataset), n_generated)

    # 5. Train (resuming this run's last checkpoint if any), save the policy adapter only.
    trainer = build_trainer(config, run, model, tokenizer, dataset)
    metrics = train(trainer, run)
    if "ref" in model.peft_config:
        model.delete_adapter("ref")
    save_adapter(model, tokenizer, run)
    generated = [(text, row["chosen"]) for text, row in zip(rejected, rows) if text is not None]
    metrics.update(preference=last_logged(metrics["log_history"], PREFERENCE_METRICS),
                   n_pairs=len(dataset), n_rejected_generated=n_generated,
                   rejected_from=run.manifest["rejected_from"],
                   n_rejected_empty=sum(not text.strip() for text, _ in generated),
                   n_rejected_equals_chosen=sum(text.strip() == chosen.strip() for text, chosen in generated))
    run.finish(metrics)


if __name__ == "__main__":
    cli(main, DPOStageConfig, __doc__)
