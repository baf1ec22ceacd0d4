"""Stage 05's other inputs: premises from files of the task's source rows (`--eval_data`), scored in
place of the pairs run's test split, and the replies of a finished eval run read back to be scored
again by other judges (`--replies_from`).

Files are read as stage 01 reads its rows, with the pairs run's own settings (premise_words,
review_target, ...), so that a post or paper it holds gets the same premise text here: the reader
(common/data.read_jsonl), the bad-row policy (`--skip_bad_rows`), the drop reasons and the counts
are stage 01's. A row whose post or paper is in the pairs run's train, dev or dev_later split, by id,
by the digest of its normalised premise text (common/data.normalise_text), or as a near duplicate
(word-shingle Jaccard >= NEAR_DUPLICATE_JACCARD), was trained on (or picked a checkpoint or a judge):
it is refused, or dropped and counted with `--skip_overlap true`.
"""
from __future__ import annotations

import dataclasses
import hashlib
from collections import Counter
from pathlib import Path

from common.config import ConfigError, load_run_config
from common.data import (
    DataError,
    NearDuplicates,
    SeenRows,
    load_split,
    one_per_group,
    premise_digest,
    read_json,
    read_jsonl,
)
from common.report import md, md_code
from common.runs import RunError, check_input
from common.tasks.protocol import options as task_options
from common.verdict import UNKNOWN, scorer_families

# What made a finished eval run's replies and what they answer: --replies_from takes them from that
# run, so that the replies are scored against the premises and references they were written for.
REPLY_FIELDS = ("split", "max_premises", "max_prompt_tokens", "max_new_tokens", "evaluate_base", "reading",
                "window_overlap", "skip_overlap", "skip_bad_rows", "repetition_penalty", "no_repeat_ngram_size",
                "temperature", "generation_weights", "seed")
OVERLAP = "overlap_train_dev"  # the drop reason of a row whose post or paper the pairs run trained on


def input_files(config) -> dict:
    """The run's inputs besides the model runs: each --eval_data file (recorded with its sha256) and
    the --replies_from run."""
    return {**{f"eval_data[{i}]": path for i, path in enumerate(config.eval_data)},
            **({"replies_from": config.replies_from} if config.replies_from else {})}


def source_settings(config, overrides: dict):
    """With --replies_from: the config with the source run's REPLY_FIELDS, pairs run and data files;
    one given on the command line that differs is refused, naming it. Without: the config as it is."""
    if not config.replies_from:
        return config
    manifest = check_input("replies_from", config.replies_from)  # a finished eval run, unchanged
    source = load_run_config(config.replies_from)
    taken = {name: getattr(source, name) for name in REPLY_FIELDS}
    for name, value in taken.items():
        if name in overrides and overrides[name] != value:
            raise ConfigError(f"command line: --{name} {overrides[name]!r}: the replies of --replies_from "
                              f"{config.replies_from} were made with {value!r}; leave it out", name)
    if "eval_data" in overrides:
        raise ConfigError("command line: --eval_data: --replies_from scores the premises of its run, "
                          "give one or the other", "eval_data")
    if not source.evaluate_base:
        raise ConfigError(f"--replies_from {config.replies_from}: that run wrote no base replies (evaluate_base "
                          f"false), and every judge compares a model's replies with the base's", "replies_from")
    files = [manifest["inputs"][f"eval_data[{i}]"]["path"] for i in range(len(source.eval_data))]
    return dataclasses.replace(config, **taken, eval_data=files, pairs_run=config.pairs_run or manifest["pairs_run"])


def premises_from_files(config, task, run=None) -> tuple[list[dict], dict]:
    """--eval_data: one premise per post or paper of the files (its real replies or reviews as
    references, as stage 01 builds them), the first max_premises of them, and the accounting:
    per file n_input_rows, n_rows_used, dropped (reason -> count, `overlap_train_dev` among them),
    renamed_ids, input_units; n_premises (all) and n_scored. With `run`, each file's input record
    takes the sha256 of the bytes read here (the file may have changed since the run started)."""
    pairs = load_run_config(config.pairs_run)  # its rows are read as the pairs run read its own
    if getattr(pairs, "split_by", None) == "period":  # new posts need no period: none of them is split here
        pairs = dataclasses.replace(pairs, split_by="post", test_fraction=0.1)
    options = task_options(task, pairs.task_options)
    # dev_later too: judges and recipes were chosen on it, so it is no more held out than dev
    trained = [r for split in ("train", "dev", "dev_later") for r in _split_if_any(config.pairs_run, split)]
    posts, texts, near = {r["group_id"] for r in trained}, {premise_digest(r) for r in trained}, NearDuplicates()
    for r in trained:
        near.add(r["group_id"], task.display(r))  # the premise itself, not the instruction around it
    nouns = task.NOUNS["premises"]
    examples, seen, files = [], SeenRows(), []
    for i, path in enumerate(config.eval_data):
        n_rows, n_used, dropped, units, overlap = 0, 0, Counter(), Counter(), []
        renamed_before, digest = seen.renamed, hashlib.sha256()
        for where, row in read_jsonl(path, skip_invalid=config.skip_bad_rows, digest=digest):  # damage always raises
            n_rows += 1
            try:
                made = "bad_row" if row is None and config.skip_bad_rows else task.rows_from(row, where, pairs, options)
            except DataError:
                if not config.skip_bad_rows:
                    raise
                made = "bad_row"
            if isinstance(made, str):
                reason = made
            elif any(e["group_id"] in posts or premise_digest(e) in texts for e in made) or \
                    any(near.find(task.display(e)) for e in made[:1]):
                reason = OVERLAP
                overlap.append(made[0]["group_id"])
            else:
                reason = seen.repeat(made)  # an earlier row's pair, or its premise under another id
            if reason != "bad_row":
                units.update({f"{k}{'' if reason is None else '_in_dropped_rows'}": v
                              for k, v in task.input_units(row).items()})
            if reason is not None:
                dropped[reason] += 1
                continue
            n_used += 1
            seen.add(made)
            examples.extend(made)
        if not n_rows:
            raise DataError(f"{path}: no rows (the file is empty or holds only blank lines): nothing to score")
        if overlap and not config.skip_overlap:
            raise DataError(f"{path}: {len(overlap)} of its {n_rows} rows are {nouns} of the pairs run's train, "
                            f"dev or dev_later split (by id, by normalised premise text, or a near duplicate of "
                            f"one; e.g. {overlap[0]}): the models trained on them, or were chosen on them. "
                            f"Give other {nouns}, or --skip_overlap true to drop those rows")
        if run is not None:
            run.manifest["inputs"][f"eval_data[{i}]"]["sha256"] = digest.hexdigest()
        files.append({"path": str(Path(path).resolve()), "n_input_rows": n_rows, "n_rows_used": n_used,
                      "dropped": dict(sorted(dropped.items())), "renamed_ids": seen.renamed - renamed_before,
                      "input_units": dict(sorted(units.items()))})
    premises = one_per_group(examples)
    if not premises:
        raise DataError(f"{', '.join(config.eval_data)}: no {nouns} left to score (dropped: "
                        f"{'; '.join(str(f['dropped']) for f in files)})")
    return premises[: config.max_premises], {"files": files, "n_premises": len(premises),
                                             "n_scored": min(len(premises), config.max_premises)}


def _split_if_any(pairs_run, split: str) -> list[dict]:
    """A split's rows; none where the pairs run has no such file (dev_later: split by period only)."""
    return load_split(pairs_run, split) if (Path(pairs_run) / f"{split}.jsonl").is_file() else []


def read_replies(run, premises: list[dict], task) -> tuple[dict, dict, dict, dict]:
    """--replies_from: (replies, readouts, generation speed, which were cut at max_new_tokens) per model, as the
    source run wrote them (a source from before replies.jsonl held `cut` has none);
    its artifacts were checked unchanged when the run started. Its replies must answer `premises`
    (rebuilt from its settings) one for one, and its data files must be the ones recorded there.
    The manifest records the source run, its decoding and its generation backends."""
    source = Path(run.config.replies_from)
    manifest = run.inputs["replies_from"]
    for name, entry in run.manifest["inputs"].items():
        if name.startswith("eval_data") and entry["sha256"] != manifest["inputs"][name]["sha256"]:
            raise RunError(f"--replies_from {source}: {entry['path']} changed since that run scored it (sha256 "
                           f"differs): its replies answer other {task.NOUNS['premises']}")
    rows = [row for _, row in read_jsonl(source / "replies.jsonl")]
    if [(r["id"], r["premise"]) for r in rows] != [(p["id"], task.display(p)[:2000]) for p in premises]:
        raise RunError(f"--replies_from {source}: its replies.jsonl does not answer the {len(premises)} "
                       f"{task.NOUNS['premises']} that its settings rebuild from its pairs run and data")
    models = [name for name, value in rows[0].items() if isinstance(value, dict) and "reply" in value]
    replies = {name: [row[name]["reply"] for row in rows] for name in models}
    readouts = {name: [row[name]["readout"] for row in rows] for name in models if "readout" in rows[0][name]}
    cut = {name: [row[name]["cut"] for row in rows] for name in models if all("cut" in row[name] for row in rows)}
    results = read_json(source / "eval.json")
    speed = {name: results.get(name, {}).get("generation") for name in models}
    backends = manifest.get("backends") or {}
    if manifest.get("best_of_n"):  # how the source picked its best_of_n replies: its provenance, kept
        run.manifest["best_of_n"] = manifest["best_of_n"]
    run.manifest.update(replies_from={"path": str(source.resolve()), "run_name": source.name, "models": models},
                        decoding=manifest.get("decoding"),
                        backends={"replies_from": {k: v for k, v in backends.items() if k != "judge_scoring"},
                                  "judge_scoring": {}})
    return replies, readouts, speed, cut


def other_sft_starts(run, adapters: dict) -> dict[str, str]:
    """{model: the SFT run it started from} for each policy that started from another SFT run than
    --sft_run (by the digest its manifest recorded): its "vs SFT" compares it with a model it never
    started from. eval.json flags it (`vs_sft_started_from`) and report.md says so."""
    ours = (run.manifest["inputs"].get("sft_run") or {}).get("sha256")
    out = {}
    for i, path in enumerate(run.config.policy_runs):
        manifest = run.inputs[f"policy_runs[{i}]"]
        theirs = (manifest.get("inputs") or {}).get("sft_run")
        model = next(name for name, folder in adapters.items() if folder == Path(path) / "adapter")
        if ours and theirs and theirs.get("sha256") != ours:
            out[model] = theirs.get("run_name") or theirs.get("path")
    return out


def judges_trained_against(run) -> dict[str, list[str]]:
    """{judge run name: the evaluated policies that trained against it}, from each policy's manifest (its
    `reward_run` input's digest against each judge's): a judge a policy trained against is not held
    out for it, whichever field it was given in."""
    fields = {**({"reward_run": run.config.reward_run} if run.config.reward_run else {}),
              **{f"judge_runs[{j}]": p for j, p in enumerate(run.config.judge_runs)}}
    digests = {Path(path).name: run.manifest["inputs"][field]["sha256"] for field, path in fields.items()}
    out = {name: [] for name in digests}
    for i, path in enumerate(run.config.policy_runs):
        theirs = (run.inputs[f"policy_runs[{i}]"].get("inputs") or {}).get("reward_run") or {}
        for name, digest in digests.items():
            if theirs.get("sha256") == digest:
                out[name].append(Path(path).name)
    return out


def practised_against(run, adapters: dict, judges: dict, best_of_n_scorer: str | None) -> dict[str, list[str]]:
    """{model: the families of the judges it practised against}: a GRPO policy's reward run (by its path, or
    by digest among this run's judges: `trained_against_by`), a RAFT model's picker (its targets' best-of-n
    scorer) and best_of_n's (`best_of_n_scorer`). The verdict does not count held-out judges of those
    families for it (common/verdict.py)."""
    out = {}
    for i, path in enumerate(run.config.policy_runs):
        recorded = run.inputs[f"policy_runs[{i}]"]
        model = next(name for name, folder in adapters.items() if folder == Path(path) / "adapter")
        reward_run = ((recorded.get("inputs") or {}).get("reward_run") or {}).get("path")
        out[model] = scorer_families(reward_run) | scorer_families((recorded.get("targets_from") or {}).get("scorer"))
    for info in judges.values():
        for name in info.get("trained_against_by", []):
            for model, folder in adapters.items():
                if folder.parent.name == name:
                    out[model] = out.get(model, set()) | {info.get("family", UNKNOWN)}
    if best_of_n_scorer:
        out["best_of_n"] = scorer_families(best_of_n_scorer)
    if run.config.replies_from:  # the source's record, for what this run cannot trace (its models' runs)
        for model, r in read_json(Path(run.config.replies_from) / "eval.json").items():
            recorded = (r.get("verdict") or {}).get("practised_against") if isinstance(r, dict) else None
            out[model] = out.get(model, set()) | set(recorded or ())
    return {model: sorted(families - {UNKNOWN}) for model, families in out.items() if families - {UNKNOWN}}


def other_sft_lines(others: dict, sft_run) -> list[str]:
    """report.md's line for each policy that started from another SFT run than the one compared with."""
    return [f"**{md(model)} started from SFT run {md(their)}, not from --sft_run {md(Path(sft_run).name)}**: its win "
            f"rate vs SFT compares it with a model it never started from." for model, their in others.items()]


def report_lines(manifest: dict, nouns: dict) -> list[str]:
    """report.md's account of what was scored when it is not the pairs run's test split: the files
    (sha256, rows read, used and dropped), and the eval run whose replies were read back."""
    lines = []
    data = manifest.get("eval_data")
    if data:
        files = "; ".join(f"{md_code(f['path'])} (sha256 {manifest['inputs'][f'eval_data[{i}]']['sha256'][:12]}: "
                          f"{f['n_input_rows']} rows, {f['n_rows_used']} used, dropped: {_counts(f['dropped'])})"
                          for i, f in enumerate(data["files"]))
        lines += [f"The {nouns['premises']} scored are {data['n_scored']} of the {data['n_premises']} in --eval_data, "
                  f"not the pairs run's test split: {files}. A row whose {nouns['premise']} is in the pairs run's "
                  f"train or dev split is `{OVERLAP}`."]
    source = manifest.get("replies_from")
    if source:
        lines += [f"Nothing was generated: the replies are those of eval run {md(source['run_name'])} "
                  f"({md_code(source['path'])}), read back and scored by this run's judges."]
    return ["", "## Data", *(part for line in lines for part in ("", line))] if lines else []


def _counts(counts: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items()) or "none"
