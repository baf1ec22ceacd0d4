"""What stage 05 writes beside eval.json: one replies.jsonl row a premise (every model's reply with its
scores), the report's sections and opening lines, and the decoding in words."""
from __future__ import annotations

import math
from pathlib import Path

from common import eval_inputs
from common.judges import gain_lines
from common.report import judges_section, md
from common.verdict import family_lines, fluency_model_line, model_family, verdict_lines


def _finite(value: float) -> float | None:
    """A reply too short to score has a nan log-probability: null in replies.jsonl, as JSON has no NaN."""
    return None if math.isnan(value) else value


def reply_rows(task, premises: list[dict], replies: dict, scores, candidates, per_reply: dict,
               cut: dict | None = None, candidate_cut: list | None = None) -> list[dict]:
    """replies.jsonl: a premise, its reference and, by model, the reply with whether max_new_tokens cut it,
    the training judge's reward, every judge's score, the task's fields (`per_reply`), its fluency and, for
    best_of_n, every candidate with its score, log-probability, whether it passed the fluency gate and whether
    it was cut."""
    cut = cut or {}
    rows = []
    for i, p in enumerate(premises):
        row = {"id": p["id"], "premise": task.display(p)[:2000], "reference": p["chosen"]}
        for name in replies:
            row[name] = {"reply": replies[name][i], **({"cut": cut[name][i]} if name in cut else {}),
                         **({"reward": scores.rewards[name][i]} if scores.rewards else {}),
                         **({"by_judge": {j: scores.every_judge[j][name][i] for j in scores.every_judge}}
                            if scores.every_judge else {}),
                         **per_reply.get(name, [{}] * len(premises))[i],
                         **({"fluency_log_prob": _finite(scores.log_probs[name][i])} if scores.log_probs else {}),
                         **(_candidates(scores, candidates, i) if name == "best_of_n" and candidates else {}),
                         **({"candidate_cut": candidate_cut[i]} if name == "best_of_n" and candidate_cut else {})}
        rows.append(row)
    return rows


def _candidates(scores, candidates: list[list[str]], i: int) -> dict:
    return {"candidates": candidates[i], "candidate_scores": scores.candidate_scores[i],
            **({"candidate_log_probs": list(map(_finite, scores.candidate_lps[i]))} if scores.candidate_lps else {}),
            **({"candidate_passed": scores.passed[i]} if scores.passed else {})}


def report_sections(config, manifest: dict, task, results: dict, judges: dict, task_sections: list[str],
                    other_sft: dict, crossfit: bool) -> list[str]:
    """report.md's sections after its table: the policies compared with an SFT run they did not start from,
    what was scored (when not the split), the task's own, and the judges' (with more than one judge)."""
    sections = task_sections + (judges_section(results, judges, family_lines(judges) + gain_lines(results, judges))
                                if config.judge_runs or crossfit else [])
    sections = eval_inputs.report_lines(manifest, task.NOUNS) + sections
    return [part for line in eval_inputs.other_sft_lines(other_sft, config.sft_run) for part in ("", line)] + sections


def headline(config, manifest: dict, results: dict, judges: dict, fluency_measured: bool) -> list[str]:
    """The report's opening lines: each model's verdict, the run each model came from, the judges' families,
    and the fluency model's."""
    runs = [model_line(name, r) for name, r in results.items() if isinstance(r, dict) and r.get("run")]
    return verdict_lines(results, judges, {n: r["verdict"] for n, r in results.items() if "verdict" in r}) + \
        (["Models: " + "; ".join(runs) + "."] if runs else []) + \
        family_lines(judges) + (fluency_model_line(manifest.get("fluency", {}).get("fluency_family"),
                                                   model_family(config.model_name_or_path),
                                                   config.fluency_model_name_or_path,
                                                   manifest.get("fluency", {}).get("human_replies"))
                                if judges or fluency_measured else [])


def kept_step(metrics: dict) -> dict | None:
    """From a run's metrics.json: for a GRPO run whose adapter was chosen on dev (stage 04's
    checkpoint_eval_steps), the step kept and the steps it was chosen among; None for any other run."""
    choice = metrics.get("checkpoint_choice")
    return {"step": choice["chosen_step"], "of": [c["step"] for c in choice["curve"]]} if choice else None


def model_line(name: str, result: dict) -> str:
    """`name = run`, with the step a dev choice kept. Step 0 is the adapter the run started from: its rows
    against SFT then compare two decodes of one model (when it started from SFT), not practice."""
    kept = result.get("checkpoint_kept")
    if not kept:
        return f"{name} = {md(result['run'])}"
    steps = ", ".join(map(str, kept["of"]))
    started = ": the adapter it started from" if kept["step"] == 0 else ""
    return f"{name} = {md(result['run'])} (step {kept['step']} of {steps} kept on dev{started})"


def describe_decoding(config, manifest: dict) -> str:
    """The decoding in words, for the report: this run's, or, with --replies_from, the source run's (its
    decoding fields are this config's; its best-of-n is the manifest's, copied from the source)."""
    parts = ["greedy" if config.temperature == 0 else f"sampled (temperature {config.temperature:g}, seed {config.seed})"]
    if config.repetition_penalty != 1:
        parts.append(f"repetition penalty {config.repetition_penalty:g}")
    if config.no_repeat_ngram_size:
        parts.append(f"no repeated {config.no_repeat_ngram_size}-gram")
    best = manifest.get("best_of_n")
    if best:
        parts.append(f"best_of_n: {best['n']} replies of {best['from']} sampled at temperature {best['temperature']:g}"
                     + (" and its greedy reply" if best.get("with_greedy") else ""))
    said = ", ".join(parts)
    if config.replies_from:
        return f"read back from {Path(config.replies_from).name} (nothing generated here), written {said}"
    return said
