"""Stage 05's verdict: does a model's gain hold? A check must be independent of what it checks.

A policy trained against a MiniLM judge once "won" under two held-out judges that were MiniLM judges
too, while its replies were word salad (perplexity 3-20x SFT's): judges of one family share blind
spots, and none of them reads for fluency. So a gain holds only when
- held-out judges of at least two model families (the `model_type` of each judge's backbone: bert,
  mpnet, llama, qwen2, gemma3_text, ...) each put the win rate's 95% interval above 0.5, and
- the replies pass the fluency gate against their reference (SFT's replies; for SFT, and without an
  SFT model, the base's): perplexity under a frozen language model of another family
  (`fluency_model_name_or_path`, common/fluency.py) at most `fluency_max_perplexity_ratio` times the
  reference's, distinct-2 within `fluency_max_distinct2_gap` of it, and the looped share at most
  `fluency_max_looped_rise` above it.
A model that practised against a judge (a GRPO policy's reward run, RAFT's and best-of-n's picker) may have
learned that judge's blind spots, which judges of its family share: for that model a held-out judge of that
family is not counted among the two.
Without a fluency model nothing holds: the verdict says fluency was not checked.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

UNKNOWN = "unknown"


def model_family(name_or_path: str | None) -> str:
    """The `model_type` in a model's config.json (a folder, a `pkg:` folder, or a hub name in the local
    cache); "unknown" when it cannot be read."""
    if not name_or_path:
        return UNKNOWN
    from common.model import resolve_model_path
    try:
        folder = Path(resolve_model_path(name_or_path))
        if (folder / "config.json").is_file():
            return json.loads((folder / "config.json").read_text()).get("model_type") or UNKNOWN
        from transformers import AutoConfig
        return AutoConfig.from_pretrained(name_or_path, local_files_only=True).model_type or UNKNOWN
    except (OSError, ValueError):
        return UNKNOWN


def judge_family(config) -> str:
    """A trained judge's family: "features" for the feature judge (no neural model: the base named in its
    config is only the pipeline's), else its backbone's model_type."""
    if config.judge_backbone == "features":
        return "features"
    return model_family(config.judge_model_name_or_path or config.model_name_or_path)


def scorer_families(spec: str | None) -> set[str]:
    """The families of the judge a scorer spec (`run:PATH`, or a run's folder) names: a judge run's, an
    ensemble's members'; none for a function or a run that cannot be read here."""
    path = (spec or "").removeprefix("run:")
    if not path or not (Path(path) / "config.yaml").is_file():
        return set()
    from common.config import RewardStageConfig, load_run_config
    config = load_run_config(path)
    if not isinstance(config, RewardStageConfig):
        return set()
    if config.judge_backbone == "ensemble":
        return set().union(*(scorer_families(member) for member in config.ensemble_of))
    return {judge_family(config)}


def families_of(configs) -> str:
    """A judge made of several trained judges (a cross-fit, an ensemble): their families, sorted and joined by '+'."""
    return "+".join(sorted({judge_family(c) for c in configs})) or UNKNOWN


def reference_of(model: str, names) -> str | None:
    """Whose replies a model's fluency and its gain are measured against: SFT's, for SFT the base's."""
    if model == "base":
        return None
    if model != "sft" and "sft" in names:
        return "sft"
    return "base" if "base" in names else None


def fluency_figures(log_probs: dict[str, list[float]]) -> dict[str, dict]:
    """Per model: mean_log_prob (mean over replies of each reply's mean token log-probability),
    perplexity, and perplexity_vs_sft (the ratio to SFT's, or to the base's where there is no SFT)."""
    from common.fluency import perplexity
    out = {}
    for model, values in log_probs.items():
        kept = [v for v in values if not math.isnan(v)]
        out[model] = {"mean_log_prob": sum(kept) / len(kept) if kept else math.nan, "perplexity": perplexity(values),
                      "n_fluency_scored": len(kept)}
    ref = "sft" if "sft" in out else "base" if "base" in out else None
    for model, figures in out.items():
        figures["perplexity_vs_sft"] = figures["perplexity"] / out[ref]["perplexity"] if ref else None
    return out


def fluency_failures(r: dict, ref: dict, ref_name: str, gate) -> list[str]:
    """The fluency gate's failed checks of a model's results `r` against its reference's, each with its
    figure; `gate` holds the three limits (EvalConfig's fluency_max_* fields)."""
    said = "SFT's" if ref_name == "sft" else "the base's"
    failed = []
    if r.get("perplexity") is not None and ref.get("perplexity"):
        ratio = r["perplexity"] / ref["perplexity"]
        if not ratio <= gate.fluency_max_perplexity_ratio:  # nan fails too
            failed.append(f"fluency, perplexity {ratio:.1f}x {said} (limit {gate.fluency_max_perplexity_ratio:g}x)")
    gap = r["distinct_2"] - ref["distinct_2"]
    if abs(gap) > gate.fluency_max_distinct2_gap:
        failed.append(f"fluency, distinct-2 {r['distinct_2']:.2f} vs {said} {ref['distinct_2']:.2f} (limit "
                      f"±{gate.fluency_max_distinct2_gap:g})")
    if r["looped_share"] > ref["looped_share"] + gate.fluency_max_looped_rise:
        failed.append(f"fluency, looped share {r['looped_share']:.2f} vs {said} {ref['looped_share']:.2f} (limit "
                      f"+{gate.fluency_max_looped_rise:g})")
    return failed


def judged(r: dict, judges: dict, key: str, practised: set[str] = frozenset()) -> dict | None:
    """What the held-out judges say of one comparison (`key`: win_rate_vs_base or win_rate_vs_sft): the
    judges and the families that put its interval above 0.5, and whether two or more families do; the
    families the model `practised` against do not count (`not_counted`)."""
    held_out = {n: j for n, j in judges.items() if j["role"] == "held_out"}
    scored = {n: r.get("by_judge", {}).get(n, {}) for n in held_out}
    if not any(key in s for s in scored.values()):
        return None
    see = [n for n, s in scored.items() if key in s and s[f"{key}_ci95"][0] > 0.5]
    seen = {held_out[n].get("family", UNKNOWN) for n in see} - {UNKNOWN}
    families = sorted(seen - set(practised))
    return {"holds": len(families) >= 2, "judges": see, "families": families,
            **({"not_counted": sorted(seen & set(practised))} if seen & set(practised) else {})}


def decide(results: dict, judges: dict, gate, fluency_checked: bool,
           practised: dict[str, list[str]] | None = None) -> dict[str, dict]:
    """Every model but the base: {"holds", "vs_base", "vs_sft", "reference", "reasons"}. `holds` is the
    gain over its reference (SFT; for SFT and without SFT, the base): held-out judges of two families
    (not counting those of `practised[model]`, the families of the judges it practised against) and the
    fluency gate. `reasons` say, with figures, each check that failed."""
    out = {}
    for model, r in results.items():
        ref = reference_of(model, results)
        if ref is None:
            continue
        mine = set((practised or {}).get(model, ()))
        vs = {other: judged(r, judges, f"win_rate_vs_{other}", mine) if other != model else None
              for other in ("base", "sft")}
        main = vs[ref]
        reasons = []
        if not any(j["role"] == "held_out" for j in judges.values()):
            reasons.append("judges: no held-out judge scored these replies")
        elif main is None:
            reasons.append(f"judges: no held-out judge compared it with {ref}")
        elif not main["judges"]:
            reasons.append(f"judges: no held-out judge puts its win rate over {ref} above 0.5")
        elif not main["holds"]:
            said = (f"only judges of one family ({main['families'][0]}) see it" if main["families"] else
                    "no judge of a family it did not practise against sees it" if main.get("not_counted") else
                    f"only judges of one family ({UNKNOWN}) see it")
            uncounted = (f"; {', '.join(main['not_counted'])} not counted: it practised against a judge of that "
                         f"family" if main.get("not_counted") else "")
            reasons.append(f"judges: {said} ({', '.join(main['judges'])}){uncounted}")
        if fluency_checked:
            reasons += fluency_failures(r, results[ref], ref, gate)
        else:
            reasons.append("fluency not checked (no fluency_model_name_or_path)")
            reasons += fluency_failures({**r, "perplexity": None}, results[ref], ref, gate)
        caveats = weak_witnesses(main, judges) if main and not reasons else []
        out[model] = {"holds": not reasons, "reference": ref, "vs_base": vs["base"], "vs_sft": vs["sft"],
                      "reasons": reasons, **({"caveats": caveats} if caveats else {}),
                      **({"practised_against": sorted(mine)} if mine else {})}
    return out


def weak_witnesses(seen: dict, judges: dict) -> list[str]:
    """The counted judges of a gain that holds whose own accuracy on their audit's pairs is not shown above
    chance (its interval reaches 0.5): the rule is met, but such a judge's preference may not be persuasion.
    A caveat, not a reason: the rule stays the two families and the fluency gate."""
    out = []
    for name in seen["judges"]:
        audit = judges[name].get("audit")
        if judges[name].get("family", UNKNOWN) in seen["families"] and audit and audit["accuracy_ci95"][0] <= 0.5:
            out.append(f"{name} is not shown to pick winners ({_accuracy(audit)})")
    return out


def verdict_head(model: str, v: dict) -> str:
    """A model's verdict in a line, without the judges' figures: whether its gain holds, which check failed, and
    the caveats of a gain that holds."""
    head = f"**{model}** vs {v['reference']}: " + ("holds" if v["holds"] else "rejected: " + "; ".join(
        reason.removeprefix("judges: ") for reason in v["reasons"]))
    return head + (", but " + "; ".join(v["caveats"]) if v.get("caveats") else "")


def verdict_lines(results: dict, judges: dict, verdicts: dict) -> list[str]:
    """report.md's first lines: per model, whether its gain holds, and if not, which check failed; then
    each held-out judge's win rates. Without a held-out judge, one line says a gain under the training
    judge alone is no verdict."""
    held_out = [n for n, j in judges.items() if j["role"] == "held_out"]
    lines = []
    for model, v in verdicts.items():
        head = verdict_head(model, v)
        parts = []
        for name in held_out:
            scored = results[model]["by_judge"].get(name, {})
            said = [f"vs {other} {_ci(scored, key)}" for other, key in (("base", "win_rate_vs_base"),
                                                                       ("SFT", "win_rate_vs_sft")) if key in scored]
            if said:
                parts.append(f"{name} ({judges[name].get('family', UNKNOWN)}): " + ", ".join(said))
        lines.append(head + (". Held-out judges: " + "; ".join(parts) if parts else "") + ".")
    if not held_out and judges:
        lines.append("No held-out judge scored these replies: a gain under the training judge alone may be its "
                     "blind spots.")
    # what each held-out judge's word is worth: how often it picks the real winner on its audit's pairs
    audits = [(n, judges[n]["audit"]) for n in held_out if judges[n].get("audit")]
    if audits:
        lines.append("Held-out judges' own accuracy (the real winner picked, on their audit's pairs): " + "; ".join(
            f"{n} {_accuracy(a)}" for n, a in audits) + "." + ("" if all(a["accuracy_ci95"][0] > 0.5 for _, a in audits)
                                                               else " A judge whose interval reaches 0.5 is not shown "
                                                               "to pick winners: what it prefers may not be persuasion."))
    return lines


def family_lines(judges: dict) -> list[str]:
    """A line when every held-out judge is of the training judge's family: they may share its blind spots."""
    training = next((j for j in judges.values() if j["role"] == "training"), None)
    held_out = [j.get("family", UNKNOWN) for j in judges.values() if j["role"] == "held_out"]
    if training and held_out and set(held_out) == {training.get("family", UNKNOWN)}:
        return [f"**Every held-out judge is of the training judge's family ({training.get('family', UNKNOWN)})**: "
                "they may share its blind spots, so they cannot confirm its gain alone."]
    return []


def fluency_model_line(fluency_family: str | None, policy_family: str, path: str | None,
                       human: dict | None = None) -> list[str]:
    """What the fluency check was, the real replies' figures beside it (`human`: fluency_figures of the
    human replies to the same premises), and a warning when its model is of the policy's family."""
    if not path:
        return ["Fluency was not checked (no fluency_model_name_or_path): no gain can hold."]
    line = (f"Fluency: each reply's mean token log-probability under the frozen `{path}` ({fluency_family}); "
            f"perplexity = exp(-mean), perplexity vs SFT = its ratio to SFT's (to the base's without SFT).")
    if human and human.get("n_fluency_scored"):
        # a yardstick, not a limit: a writer of real replies' fluency can sit well above greedy decoding's
        line += (f" The real replies to the same premises: perplexity {human['perplexity']:.1f}, "
                 f"{human['perplexity_vs_sft']:.2f}x SFT's." if human.get("perplexity_vs_sft") else
                 f" The real replies to the same premises: perplexity {human['perplexity']:.1f}.")
    if fluency_family == policy_family:
        line += (f" **The fluency model is of the policy's family ({policy_family})**: it may find the policy's "
                 f"own habits fluent; a model of another family is the stricter check.")
    return [line]


def _accuracy(audit: dict) -> str:
    """A judge's own accuracy on its audit's pairs, with its interval and the pairs it was read on."""
    return f"{_ci({'a': audit['accuracy'], 'a_ci95': audit['accuracy_ci95']}, 'a')} on {audit['n_pairs']} " \
           f"{audit['split']} pairs"


def _ci(r: dict, key: str) -> str:
    low, high = r[f"{key}_ci95"]
    return f"{r[key]:.2f} [{low:.2f}, {high:.2f}]"
