"""Every rating stage 05 has for a paper, each measured the same way against the paper's mean reviewer
rating (review task; docs/review.md, "Every rating source").

Sources, per generating model M: `M_parsed` (the rating written in its review), `M_readout` (the
model's expected rating read from its next-token distribution, common/readout.py) and `M_blend`;
besides them `rating_model` (stage 03's rating model, `--rating_run`), `bag_of_words` (the words of the
paper alone: the rating run's ridge baseline, refitted on its train papers), `baseline_constant` (the train
split's mean) and `baseline_human` (one reviewer against the mean of the paper's others). Each gets MAE,
RMSE, Pearson and Spearman with 95% bootstrap intervals, `n`, `n_without_rating` (papers without a
prediction or without a human rating: kept out, counted) and `mae_minus_constant`, the paired difference
of its MAE to the constant's on the same papers, with its interval.

The blend is a least-squares line through the model's rating (parsed where written, read out elsewhere),
the rating model's and the bag of words', with an intercept, fitted on the DEV papers of an Eval run on the dev split
(`--rating_dev_run`) and only then applied to the scored papers: the scored papers never enter the fit.
A source that hardly varies on the dev papers is left out of it (MIN_SPREAD; `flat` in the blend says so).

The rating model's rating also steers the written one: `rerank_by_rating` keeps the sampled review whose rating
is nearest it (`rerank_agreement` says how near), and `hinted_premises` puts it in the prompts of a writer trained
to fit a rating there (02's `rating_hint_noise`; `hint_agreement` says how far each model writes it).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from common.config import load_run_config
from common.data import read_json, read_jsonl
from common.metrics import baseline_human, rating_source_metrics
from common.runs import RunError


def _gold(row: dict) -> float | None:
    ratings = [r for r in row.get("human_ratings") or [] if r is not None]
    return float(np.mean(ratings)) if ratings else None


# A source whose ratings of the dev papers spread less than this (sd, rating points) is left out of the
# blend: least squares gives a near-constant feature a huge, unstable weight (a rating model with a dev sd
# of 0.02 got -6.2 and made the blend worse than either source on the test papers).
MIN_SPREAD = 0.1


def fit_blend(features: dict[str, list], gold: list) -> dict:
    """Least squares gold ~ intercept + sum_k w_k * feature_k on the rows where every feature and the gold
    are present, leaving out a feature whose spread there is under MIN_SPREAD. Returns {"intercept",
    "weights": {feature: w}, "n_fit", "n_left_out", "flat": {feature left out: its sd}}."""
    names = list(features)
    rows = [i for i in range(len(gold)) if gold[i] is not None and all(features[k][i] is not None for k in names)]
    if len(rows) < len(names) + 1:
        raise RunError(f"the blend has {len(names) + 1} weights but only {len(rows)} dev papers with every rating "
                       f"({', '.join(names)}): give a dev run of more papers")
    spread = {k: float(np.std([features[k][i] for i in rows])) for k in names}
    kept = [k for k in names if spread[k] >= MIN_SPREAD]
    X = np.array([[1.0] + [features[k][i] for k in kept] for i in rows])
    coef, *_ = np.linalg.lstsq(X, np.array([gold[i] for i in rows], float), rcond=None)
    return {"intercept": float(coef[0]), "weights": dict(zip(kept, map(float, coef[1:]))), "n_fit": len(rows),
            "n_left_out": len(gold) - len(rows), "flat": {k: spread[k] for k in names if k not in kept}}


def apply_blend(blend: dict, features: dict[str, list], scale: tuple[float, float] = (1, 6)) -> list:
    """The blend's rating of each paper, clipped to the rating scale (a line fitted on few dev papers can
    reach past it); None where a feature is missing."""
    n = len(next(iter(features.values())))
    return [None if any(features[k][i] is None for k in blend["weights"]) else
            float(np.clip(blend["intercept"] + sum(w * features[k][i] for k, w in blend["weights"].items()), *scale))
            for i in range(n)]


# --- stage 05's inputs ------------------------------------------------------------------------------

# Fields a dev run must share with this eval for its ratings to be the same model's at the same decoding.
SAME_AS_DEV = ("max_prompt_tokens", "max_new_tokens", "temperature", "repetition_penalty", "no_repeat_ngram_size",
               "reading", "window_overlap", "seed")


def dev_ratings(config, run) -> dict:
    """--rating_dev_run: an Eval run of the dev split (same pairs run, same decoding): {model: {paper id:
    the model's rating there}} for the models it shares with this run (base; sft when both evaluated the
    same SFT run), and the dev papers' rows. Anything else is refused, naming the field."""
    path = Path(config.rating_dev_run)
    dev = load_run_config(path)
    if dev.split != "dev" or dev.eval_data or dev.replies_from:
        raise RunError(f"--rating_dev_run {path}: the blend is fitted on the dev papers; that run scored "
                       f"{'its --eval_data files' if dev.eval_data else 'another run' if dev.replies_from else dev.split}")
    for field in SAME_AS_DEV:
        if getattr(dev, field) != getattr(config, field):
            raise RunError(f"--rating_dev_run {path}: field '{field}' is {getattr(dev, field)!r} there but "
                           f"{getattr(config, field)!r} here; the blend needs the same decoding and reading")
    inputs, ours = read_json(path / "manifest.json").get("inputs", {}), run.manifest.get("inputs", {})
    same_sft = "sft_run" in inputs and "sft_run" in ours and inputs["sft_run"].get("sha256") == ours["sft_run"].get("sha256")
    models = {"base"} | ({"sft"} if same_sft else set())
    out: dict[str, dict] = {}
    for _, row in read_jsonl(path / "replies.jsonl"):
        for name in models & set(row):
            out.setdefault(name, {})[row["id"]] = row[name].get("rating")
    return out


def rating_inputs(config, run, premises: list[dict]) -> dict:
    """Stage 05 with --rating_run (and --rating_dev_run): the rating model's prediction for every scored
    paper and every dev paper of the dev run, and the dev run's ratings; the rating model must not have
    trained on a scored paper."""
    from common.data import load_split, one_per_group, premise_digest
    from common.judges import train_posts
    from common.rating_model import BagOfWords, RatingModel
    out = {"dev": dev_ratings(config, run) if config.rating_dev_run else {}}
    dev_ids = {i for ratings in out["dev"].values() for i in ratings}
    out["dev_rows"] = [r for r in one_per_group(load_split(config.pairs_run, "dev")) if r["id"] in dev_ids]
    if config.rating_run:
        posts, digests = train_posts(config.rating_run)
        seen = [p["group_id"] for p in premises if p["group_id"] in posts or premise_digest(p) in digests]
        if seen:
            raise RunError(f"--rating_run {config.rating_run}: the rating model trained on {len(seen)} of the scored "
                           f"papers (e.g. {seen[0]}); it must not rate papers it was trained on")
        model = RatingModel.from_run(config.rating_run)
        out["rating_model"] = model.predict(premises)
        out["rating_model_dev"] = dict(zip([r["id"] for r in out["dev_rows"]], model.predict(out["dev_rows"])))
        del model
        words = BagOfWords.of_run(config.rating_run)  # on the same train papers, so the check above covers it
        if words:
            bow, alpha = words
            out["bag_of_words"] = bow.predict(premises, alpha)
            out["bag_of_words_dev"] = dict(zip([r["id"] for r in out["dev_rows"]], bow.predict(out["dev_rows"], alpha)))
    return out


def hinted_premises(config, run, premises: list[dict], rating: dict | None) -> list[dict]:
    """An SFT run trained with a rating in its prompts (`rating_hint_noise`) is evaluated with the rating model's
    rating of each paper in its place (review_text.HINT, to one decimal), for every model of the run, so that all
    answer the same prompts; the manifest says so. Any other run: the premises as they are."""
    if not config.sft_run:
        return premises
    from common.config import load_run_config
    noise = getattr(load_run_config(config.sft_run), "rating_hint_noise", None)
    if noise is None:
        return premises
    if not (rating and "rating_model" in rating):
        raise RunError(f"--sft_run {config.sft_run} was trained to write the review that a rating in its prompt fits "
                       f"(rating_hint_noise {noise}): give --rating_run, the rating model whose rating 05 puts there")
    from common.tasks.review_text import as_hint, prompt_for
    run.manifest["rating_hint"] = {"from": config.rating_run, "sft_rating_hint_noise": noise}
    hints = [as_hint(value) for value in rating["rating_model"]]
    return [{**p, "rating_hint": h, "prompt": prompt_for(p["paper"], h)} for p, h in zip(premises, hints)]


def rerank_by_rating(sampled: list[str], n: int, predicted: list[float]) -> tuple[list[str], list[dict]]:
    """n sampled reviews a paper (flat, paper by paper) -> the one whose written rating is nearest the rating
    model's prediction for the paper (the first of equals; the first review when none writes a rating), and
    per paper the candidates' ratings and the index kept."""
    from common.tasks.review_text import parse_review
    kept, info = [], []
    for paper, target in enumerate(predicted):
        candidates = sampled[paper * n:(paper + 1) * n]
        written = [parse_review(c)["overall"] for c in candidates]
        best = min(range(n), key=lambda i: (written[i] is None, abs(written[i] - target) if written[i] is not None else 0))
        kept.append(candidates[best])
        info.append({"candidate_ratings": written, "kept": best, "rating_model": target})
    return kept, info


def _follows(written: list, target: list) -> dict:
    """How far written ratings (None where a review has none) follow the rating model's: their Pearson and
    mean gap over the papers with one."""
    rated = [i for i, w in enumerate(written) if w is not None]
    w = np.array([written[i] for i in rated], dtype=float)
    m = np.array([target[i] for i in rated], dtype=float)
    varies = len(rated) >= 3 and np.std(w) > 0 and np.std(m) > 0
    return {"n": len(rated), "n_without_rating": len(written) - len(rated),
            "pearson_with_rating_model": float(np.corrcoef(w, m)[0, 1]) if varies else None,
            "mean_abs_gap": float(np.mean(np.abs(w - m))) if rated else None}


def rerank_agreement(reranked: list[dict]) -> dict:
    """How far the reranked reviews' written ratings follow the rating model (`rerank_by_rating`'s per-paper
    info): Pearson between the kept rating and the rating model's, their mean gap, and the two spreads that bound
    it. Four candidates that spread more within a paper than the rating model's predictions spread over papers
    leave the nearest one mostly to chance (a Qwen reviewer: candidates sd 0.35, rating model sd 0.18, Pearson 0.07)."""
    spreads = [np.std(c) for c in ([v for v in r["candidate_ratings"] if v is not None] for r in reranked) if len(c) >= 2]
    return {**_follows([r["candidate_ratings"][r["kept"]] for r in reranked], [r["rating_model"] for r in reranked]),
            "candidates_sd_within_paper": float(np.mean(spreads)) if spreads else None,
            "rating_model_sd": float(np.std([r["rating_model"] for r in reranked])) if reranked else None}


def hint_agreement(hints: list[float], parsed: list, readout: list) -> dict:
    """How far a model told the rating model's rating (`hinted_premises`) follows it: its written rating's Pearson
    and mean gap, how many write the hint itself (to its one decimal), and its read-out's Pearson with the hint. A
    Qwen writer trained with hints wrote 4.5 in 30 of 31 reviews while its read-out followed the hint (0.82)."""
    out = {**_follows(parsed, hints), "writes_the_hint": sum(p is not None and abs(p - h) < 0.05
                                                             for p, h in zip(parsed, hints)),
           "written_sd": float(np.std([p for p in parsed if p is not None])) if any(p is not None for p in parsed) else None,
           "hint_sd": float(np.std(hints))}
    read = _follows(readout, hints) if any(r is not None for r in readout) else {}
    return {**out, "readout_pearson_with_hint": read.get("pearson_with_rating_model")}


def _f(value):
    return "n/a" if value is None else f"{value:.2f}"


def agreement_rows(agreement: dict) -> list[str]:
    """report.md's line under the sources: does the rerank's written rating follow the rating model?"""
    a = agreement
    return ["", f"*rerank_by_rating*: its written rating against the rating model's on {a['n']} papers "
            f"({a['n_without_rating']} without one): Pearson {_f(a['pearson_with_rating_model'])}, mean gap "
            f"{_f(a['mean_abs_gap'])}; its candidates spread sd {_f(a['candidates_sd_within_paper'])} within a paper, "
            f"the rating model sd {_f(a['rating_model_sd'])} over papers (where the first is the larger, the nearest "
            "candidate is mostly chance)."]


def hint_rows(agreements: dict[str, dict]) -> list[str]:
    """report.md's lines under the sources of a hinted eval: does each model write the rating it was told?"""
    rows = ["", "*Told the rating model's rating* (in every prompt, to one decimal):"]
    for name, a in agreements.items():
        rows.append(f"- {name}: writes it in {a['writes_the_hint']} of {a['n']} reviews with a rating "
                    f"({a['n_without_rating']} without one); its written rating's Pearson with it "
                    f"{_f(a['pearson_with_rating_model'])}, mean gap {_f(a['mean_abs_gap'])}, sd {_f(a['written_sd'])} "
                    f"against the hints' {_f(a['hint_sd'])}; its read-out's Pearson with it "
                    f"{_f(a['readout_pearson_with_hint'])}.")
    return rows


# --- the sources, the table, the plots ------------------------------------------------------------

def rating_sources(premises: list[dict], per_model: dict[str, dict[str, list]], extra: dict | None,
                   train_mean: float, seed: int) -> dict:
    """{source: metrics} for every source (module docstring). `per_model`: {model: {"parsed": [...],
    "readout": [...], "rating": [...]}} per scored paper (None where a model has none); `extra`: what
    `rating_inputs` returned (or None)."""
    extra = extra or {}
    gold = [_gold(p) for p in premises]
    preds: dict[str, list] = {}
    for model, values in per_model.items():
        preds[f"{model}_parsed"] = values["parsed"]
        if any(v is not None for v in values["readout"]):
            preds[f"{model}_readout"] = values["readout"]
    for source in ("rating_model", "bag_of_words"):
        if source in extra:
            preds[source] = extra[source]
    preds["baseline_constant"] = [train_mean] * len(premises)
    out = {name: rating_source_metrics(pred, gold, train_mean, seed) for name, pred in preds.items()}
    blends = {}
    for model, dev in (extra.get("dev") or {}).items():
        if model not in per_model:
            continue
        dev_rows = [r for r in extra["dev_rows"] if r["id"] in dev]
        features = {f"{model}_rating": [dev[r["id"]] for r in dev_rows]}
        scored = {f"{model}_rating": per_model[model]["rating"]}
        for source in ("rating_model", "bag_of_words"):
            if source in extra:
                features[source] = [extra[f"{source}_dev"][r["id"]] for r in dev_rows]
                scored[source] = extra[source]
        blend = fit_blend(features, [_gold(r) for r in dev_rows])
        preds[f"{model}_blend"] = apply_blend(blend, scored)
        out[f"{model}_blend"] = {**rating_source_metrics(preds[f"{model}_blend"], gold, train_mean, seed), "blend": blend}
        blends[model] = blend
    humans = [p.get("human_ratings") or [] for p in premises]
    out["baseline_human"] = {**baseline_human(humans, seed), "n_without_rating": sum(not h for h in humans)}
    pairs = [(float(r), (sum(h) - r) / (len(h) - 1)) for h in humans if len(h) >= 2 for r in h]
    points = {name: [(p, g) for p, g in zip(pred, gold) if p is not None and g is not None]
              for name, pred in preds.items()}
    points["baseline_human"] = pairs
    return {"sources": out, "points": points}


def table_rows(sources: dict) -> list[str]:
    """report.md's table of every rating source."""
    def ci(r, key):
        value, interval = r.get(key), r.get(f"{key}_ci")
        text = "n/a" if value is None else f"{value:.3f}"
        return text + (f" [{interval[0]:.2f}, {interval[1]:.2f}]" if value is not None and interval else "")
    rows = ["", "## Every rating source", "",
            "Each source against the mean rating of the paper's reviewers, 95% bootstrap intervals over papers; "
            "*MAE - constant*: the paired difference of its MAE to the train-mean constant's on the same papers "
            "(below 0: better than the constant). A paper without a rating from a source (or without a human "
            "rating) is left out of that source's row and counted. *blend*: a least-squares line through the "
            "model's rating, the rating model's and the bag of words', fitted on the dev papers only (its weights "
            "below; a source that hardly varies on them is left out and named). "
            "*baseline_human*: one reviewer against the mean of the paper's others (per reviewer).", "",
            "| source | MAE | RMSE | Pearson r | Spearman rho | MAE - constant | n | without rating |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in sources.items():
        rows.append(f"| {name} | {ci(r, 'rating_mae')} | {ci(r, 'rating_rmse')} | {ci(r, 'rating_pearson')} | "
                    f"{ci(r, 'rating_spearman')} | {ci(r, 'mae_minus_constant')} | {r['n']} | "
                    f"{r.get('n_without_rating', 0)} |")
    for name, r in sources.items():
        if "blend" in r:
            b = r["blend"]
            terms = "".join(f" + {w:.3f} x {k}" for k, w in b["weights"].items())
            flat = "".join(f"; {k} left out, sd {sd:.3f} on dev" for k, sd in b.get("flat", {}).items())
            rows.append(f"\n{name} = {b['intercept']:.3f}{terms} (fitted on {b['n_fit']} dev papers{flat})")
    return rows


def plot_sources(out_dir, points: dict[str, list[tuple[float, float]]]) -> dict:
    """One scatter plot per source, `rating_<source>_scatter.png`: its rating against the human one."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from common.report import save_figure
    plots = {}
    for name, pts in points.items():
        fig, ax = plt.subplots(figsize=(4, 4), dpi=100)
        ax.scatter([g for _, g in pts], [p for p, _ in pts], alpha=0.6, s=14)
        ax.plot([1, 6], [1, 6], color="grey", linewidth=1)
        ax.set_xlim(0.8, 6.2)
        ax.set_ylim(0.8, 6.2)
        ax.set_xlabel("mean of the other reviewers" if name == "baseline_human" else "human rating (reviewers' mean)")
        ax.set_ylabel("one reviewer's rating" if name == "baseline_human" else f"{name}")
        ax.set_title(f"{name} ({len(pts)})")
        path = save_figure(fig, Path(out_dir) / f"rating_{name}_scatter.png")
        plots[f"Rating: {name}"] = path
    return plots
