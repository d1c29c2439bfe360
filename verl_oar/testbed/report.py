"""Render the demo's ``summary.json``: an HTML page with PNG figures (matplotlib, Agg backend), the
console headline, the plain-language summary and README's results table -- all from the numbers.

    python -m verl_oar.testbed.report DIR              # re-render DIR/index.html from DIR/summary.json
    python -m verl_oar.testbed.report --readme FILE    # print README's results (paragraph, tables) from a summary JSON

Figures (file names in the report folder):

- ``reward.png``: training reward vs step per method (mean over seeds, min-max band) with the
  threshold; held-out greedy accuracy vs step (mean, and each seed);
- ``measures.png``: each pre-registered measure, method minus GRPO, with its paired bootstrap 95% interval;
- ``credit.png``: credit concentration per method (per response, median and quartiles; each run's
  median) and recall@10% of each method's token signal (each run);
- ``step_time.png``: median wall-clock seconds per training step per method;
- ``recall.png``, ``counterfactual.png``: importance quality on the warm-started model;
- ``heatmap_<i>.png``: every method's token weights on the same response, the oracle underneath.
"""

from __future__ import annotations

import html
import json
import math
import sys
from pathlib import Path

from verl_oar.testbed.comparison import MEASURES
from verl_oar.testbed.methods import METHODS

ESTIMATOR_STYLE = {
    "oar_g_noisy_kl": ("OAR-G (noisy KL)", "#1f77b4", "-"),
    "oar_g_loglik": ("OAR-G (loglik)", "#6baed6", "--"),
    "oar_p_exact": ("OAR-P exact", "#d62728", "-"),
    "oar_p_chunk8": ("OAR-P chunk K=8", "#fc9272", "--"),
    "entropy": ("entropy", "#2ca02c", ":"),
    "random": ("random", "#7f7f7f", ":"),
    "oracle": ("oracle (sanity)", "#000000", "-."),
}
MEASURE_TEXT = {
    "steps_to_threshold": ("steps to threshold", "steps", "fewer is better"),
    "auc": ("held-out accuracy AUC", "accuracy", "higher is better"),
    "final": ("final held-out accuracy", "accuracy", "higher is better"),
    "gain": ("held-out accuracy gain", "accuracy", "higher is better"),
    "step_seconds": ("wall-clock per step", "s", "lower is better"),
    "variance": ("run-to-run variance", "reward^2", "lower is better"),
}


def _label(m: str) -> str:
    return METHODS[m].label if m in METHODS else m


def _color(m: str) -> str | None:
    return METHODS[m].color if m in METHODS else None


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _nan(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _fmt(value, digits: int = 2) -> str:
    return "n/a" if _nan(value) else f"{value:.{digits}f}"


def _interval(iv: dict | None, digits: int = 2) -> str:
    """``0.12 [0.05, 0.20]``; ``0.12`` alone without an interval (one seed)."""
    if iv is None or _nan(iv.get("estimate")):
        return "n/a"
    if _nan(iv.get("low")) or _nan(iv.get("high")):
        return _fmt(iv["estimate"], digits)
    return f"{iv['estimate']:.{digits}f} [{iv['low']:.{digits}f}, {iv['high']:.{digits}f}]"


def _rows(summary: dict, method: str) -> dict:
    c = summary["comparison"]["methods"][method]
    return {**{m: c["mean"][m] for m in MEASURES}, "variance": c["variance"]}


def _diffs(summary: dict, method: str) -> dict:
    c = summary["comparison"]["methods"][method]
    return {**(c["vs_baseline"] or {}), "variance": c["variance_vs_baseline"]}


# ---------------------------------------------------------------------------------------------------
# figures
# ---------------------------------------------------------------------------------------------------


def plot_reward(summary: dict, path: Path) -> None:
    from verl_oar.testbed.dynamics import mean_and_spread

    plt = _plt()
    fig, (ax, ax_val) = plt.subplots(1, 2, figsize=(11, 4))
    for method, runs in summary["runs"].items():
        mean, _, low, high = mean_and_spread([r["reward"] for r in runs])
        steps = list(range(1, len(mean) + 1))
        ax.plot(steps, mean, color=_color(method), label=f"{_label(method)} (mean of {len(runs)})")
        ax.fill_between(steps, low, high, color=_color(method), alpha=0.15)
        curves = [sorted((int(s), v) for s, v in r["val_accuracy"].items()) for r in runs]
        for curve in curves:
            ax_val.plot([s for s, _ in curve], [v for _, v in curve], color=_color(method), alpha=0.25, lw=0.8)
        if curves and all(len(c) == len(curves[0]) for c in curves):
            ax_val.plot([s for s, _ in curves[0]], [sum(c[i][1] for c in curves) / len(curves) for i in range(len(curves[0]))],
                        "o-", color=_color(method), label=_label(method))
    ax.axhline(summary["comparison"]["threshold"], color="k", lw=0.8, ls="--",
               label=f"threshold {summary['comparison']['threshold']}")
    ax.set(xlabel="training step", ylabel="reward = accuracy of sampled responses", ylim=(0, 1.02),
           title="Training reward (band: min-max over seeds)")
    ax.legend(fontsize=8)
    ax_val.set(xlabel="training step", ylabel="greedy accuracy", ylim=(0, 1.02),
               title="Held-out accuracy (thin: each seed)")
    ax_val.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_measures(summary: dict, path: Path) -> None:
    plt = _plt()
    base = summary["comparison"]["baseline"]
    methods = [m for m in summary["comparison"]["methods"] if m != base]
    names = [*MEASURES, "variance"]
    fig, axes = plt.subplots(1, len(names), figsize=(3 * len(names), 3.2))
    for ax, name in zip(axes, names):
        for i, m in enumerate(methods):
            iv = _diffs(summary, m).get(name)
            if iv is None or _nan(iv.get("estimate")):
                continue
            lo = iv["estimate"] - iv["low"] if not _nan(iv.get("low")) else 0.0
            hi = iv["high"] - iv["estimate"] if not _nan(iv.get("high")) else 0.0
            ax.errorbar([i], [iv["estimate"]], yerr=[[lo], [hi]], fmt="o", color=_color(m), capsize=4)
        ax.axhline(0.0, color="k", lw=0.8, ls="--")
        ax.set_xticks(range(len(methods)), [_label(m) for m in methods])
        text, unit, better = MEASURE_TEXT[name]
        ax.set_title(f"{text}\n(- {_label(base)}; {better})", fontsize=9)
        ax.set_ylabel(unit, fontsize=8)
        ax.set_xlim(-0.6, len(methods) - 0.4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_credit(summary: dict, path: Path) -> None:
    plt = _plt()
    methods = list(summary["runs"])
    fig, (ax, ax_r) = plt.subplots(1, 2, figsize=(10, 3.6))
    for i, m in enumerate(methods):
        q = summary["concentration_quartiles"].get(m, {})
        runs = summary["runs"][m]
        if _uniform(m):  # no token signal: uniform credit by construction
            ax.plot([i], [1.0], "s", color=_color(m), ms=8)
            ax.annotate("1 by construction", (i, 1.0), textcoords="offset points", xytext=(0, 8), ha="center", fontsize=7)
            continue
        if not q.get("responses"):
            continue
        ax.errorbar([i], [q["median"]], yerr=[[q["median"] - q["q25"]], [q["q75"] - q["median"]]], fmt="s",
                    color=_color(m), capsize=5, ms=8)
        ax.plot([i + 0.15] * len(runs), [r["credit"]["median_concentration"] for r in runs], ".", color=_color(m))
        recalls = [r["credit"]["mean_recall_at_10"] for r in runs if r["credit"]]
        ax_r.plot([i] * len(recalls), recalls, "o", color=_color(m))
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xticks(range(len(methods)), [_label(m) for m in methods])
    ax.set(title="Credit concentration: mean |A| on causal / on other\nreasoning tokens (square: median, IQR; dots: runs)",
           ylabel="ratio (log)")
    ax.title.set_fontsize(9)
    ax_r.set_xticks(range(len(methods)), [_label(m) for m in methods])
    ax_r.set(ylim=(0, 1.02), ylabel="recall@10%", title="Recall@10% of the oracle by each method's token signal\n(each run; GRPO has none)")
    ax_r.title.set_fontsize(9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_step_time(summary: dict, path: Path) -> None:
    plt = _plt()
    methods = list(summary["runs"])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, m in enumerate(methods):
        iv = _rows(summary, m)["step_seconds"]
        per_seed = summary["comparison"]["methods"][m]["per_seed"]["step_seconds"]
        ax.bar([i], [0.0 if _nan(iv["estimate"]) else iv["estimate"]], color=_color(m), alpha=0.6)
        ax.plot([i] * len(per_seed), per_seed, "k.")
    ax.set_xticks(range(len(methods)), [_label(m) for m in methods])
    ax.set(ylabel="seconds (median over steps 2..)", title="Wall-clock per training step (bar: mean over seeds; dots: runs)")
    ax.title.set_fontsize(9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _estimator_curves(ax, quality: dict, values) -> None:
    fracs = quality["config"]["fracs"]
    for name, row in quality["estimators"].items():
        label, color, style = ESTIMATOR_STYLE.get(name, (name, None, "-"))
        ax.plot([100 * f for f in fracs], [values(row, str(f)) for f in fracs], style, marker="o", color=color, label=label)


def plot_recall(summary: dict, path: Path) -> None:
    plt = _plt()
    q = summary["quality"]
    fracs = q["config"]["fracs"]
    fig, ax = plt.subplots(figsize=(6, 4))
    _estimator_curves(ax, q, lambda row, f: row["recall"]["causal"][f])
    ax.plot([100 * f for f in fracs], [q["expected_random_recall"][str(f)] for f in fracs], color="#bbbbbb", lw=3,
            alpha=0.5, label="E[random]")
    ax.set(xlabel="top K% of reasoning tokens", ylabel="recall", ylim=(0, 1.05), title="Recall of the causal tokens (the picks)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_counterfactual(summary: dict, path: Path) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "accuracy_drop", "Accuracy drop (truth: the right answer)"),
                           (axes[1], "answer_flip", "Answer flip (truth: the model's own answer)")):
        _estimator_curves(ax, summary["quality"], lambda row, f, key=key: row[key][f])
        ax.set(xlabel="top K% of reasoning tokens occluded", ylabel="rate", title=title)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_heatmaps(summary: dict, out: Path) -> list[str]:
    """One PNG per same-response example (``heatmap_render.render_png``); returns the file names."""
    from verl_oar.tools.heatmap_render import render_png

    names = []
    for i, ex in enumerate(summary["same_response"]):
        name = f"heatmap_{i}.png"
        rows = [(f"{_label(m)} weight", w) for m, w in ex["weights"].items()]
        render_png(out / name, ex["tokens"], rows, [("oracle: causal", ex["masks"]["causal"])],
                   title=f"token weights at step 1, same response (GRPO advantage {ex['advantage']:+.2f})")
        names.append(name)
    return names


# ---------------------------------------------------------------------------------------------------
# text: summary paragraph, tables, headline
# ---------------------------------------------------------------------------------------------------


def _verdict(iv: dict | None, lower_is_better: bool) -> str:
    """What a paired difference's interval says, in words."""
    if iv is None or _nan(iv.get("estimate")):
        return "not measured"
    if _nan(iv.get("low")) or _nan(iv.get("high")):
        return "no interval (one seed)"
    if iv["low"] > 0 or iv["high"] < 0:
        better = (iv["high"] < 0) == lower_is_better
        return "better than GRPO" if better else "worse than GRPO"
    return "no difference detected"


def plain_summary(summary: dict) -> str:
    """One paragraph, generated from the numbers (no hand-written verdict that could go stale)."""
    comp = summary["comparison"]
    base = comp["baseline"]
    seeds = len(summary["seeds"])
    b = _rows(summary, base)
    steps = summary["settings"]["steps"]
    parts = [
        f"{seeds} seed{'s' if seeds != 1 else ''}, {steps} steps per run, {len(summary['runs'])} methods, on "
        f"{summary['machine']['cpu']} ({summary['machine']['cores']} cores).",
        f"{_label(base)}'s held-out greedy accuracy went from "
        f"{_fmt(_mean([float(r['val_accuracy']['0']) for r in summary['runs'][base] if '0' in r['val_accuracy']]))} to "
        f"{_fmt(b['final']['estimate'])} (gain {_interval(b['gain'])}), so the task is learnable in this budget."
        if not _nan(b["gain"]["estimate"]) and b["gain"]["estimate"] >= 0.2 else
        f"{_label(base)}'s held-out greedy accuracy gained only {_interval(b['gain'])}: the comparison below cannot "
        "say whether credit assignment speeds learning up.",
    ]
    for m in comp["methods"]:
        if m == base:
            continue
        d = _diffs(summary, m)
        conc = summary["concentration_quartiles"].get(m, {}).get("median")
        measures = (("steps_to_threshold", f"steps to reward {comp['threshold']}", 1), ("auc", "held-out AUC", 2),
                    ("variance", "run-to-run variance", 4), ("step_seconds", "seconds per step", 1))
        said = []
        for name, text, digits in measures:
            iv = d.get(name)
            if iv is None or _nan(iv.get("estimate")):
                continue
            verdict = _verdict(iv, name in ("steps_to_threshold", "step_seconds", "variance"))
            said.append(f"{text} {_signed(iv, digits)}" + ("" if seeds < 2 else f" ({verdict})"))
        parts.append(
            f"{_label(m)} minus {_label(base)}: " + ", ".join(said) + (" (one seed: no intervals)" if seeds < 2 else "")
            + "; " + (f"per token, it gave the causal tokens {_fmt(conc)} times the |advantage| of the others (median "
                      "response; GRPO: 1)." if not _nan(conc) else "its credit concentration was not measured.")
        )
    if seeds < 5:
        parts.append(("With one seed there are no intervals" if seeds == 1 else f"With {seeds} seeds the intervals are wide")
                     + ": this run shows the "
                     "pipeline and the credit each method assigns, not whether one method learns faster; "
                     "README's long run (5 seeds) is the comparison.")
    return " ".join(parts)


def _signed(iv: dict, digits: int) -> str:
    """``+0.12 [-0.05, +0.20]``: a difference with its interval, signs shown."""
    text = f"{iv['estimate']:+.{digits}f}"
    if not _nan(iv.get("low")) and not _nan(iv.get("high")):
        text += f" [{iv['low']:+.{digits}f}, {iv['high']:+.{digits}f}]"
    return text


def _uniform(method: str) -> bool:
    """A method without dumps gives every token of a response the same advantage (GRPO)."""
    return method in METHODS and METHODS[method].dump is None


def _mean(values):
    return sum(values) / len(values) if values else math.nan


def comparison_table_markdown(summary: dict) -> str:
    """README's table: per method the mean over seeds [bootstrap 95% interval] and, below GRPO's, the
    paired difference to GRPO [paired bootstrap 95% interval]."""
    comp = summary["comparison"]
    base = comp["baseline"]
    cols = ["steps_to_threshold", "auc", "final", "variance", "step_seconds"]
    head = "| method | " + " | ".join(MEASURE_TEXT[c][0] for c in cols) + " | credit concentration | recall@10% |"
    lines = [head, "|" + "---|" * (len(cols) + 3)]
    for m in comp["methods"]:
        rows, diffs = _rows(summary, m), _diffs(summary, m)
        digits = {"steps_to_threshold": 1, "variance": 4, "step_seconds": 1}
        cells = []
        censored = comp["methods"][m]["censored"]
        for c in cols:
            cell = _interval(rows[c], digits.get(c, 2))
            if c == "steps_to_threshold" and censored:
                cell += f" ({censored} of {len(comp['methods'][m]['seeds'])} never)"
            if m != base:
                cell += f"<br>diff {_interval(diffs.get(c), digits.get(c, 2))}"
            cells.append(cell)
        q = summary["concentration_quartiles"].get(m, {})
        conc = ("1 (by construction)" if _uniform(m) else "n/a" if not q.get("responses")
                else f"{_fmt(q['median'])} (IQR {_fmt(q['q25'])}-{_fmt(q['q75'])})")
        recalls = [r["credit"]["mean_recall_at_10"] for r in summary["runs"][m] if r.get("credit")]
        recall = _fmt(_mean(recalls)) if recalls else "n/a"
        lines.append(f"| {_label(m)} | " + " | ".join(cells) + f" | {conc} | {recall} |")
    return "\n".join(lines)


def quality_table_markdown(summary: dict) -> str:
    """README's importance-quality table: per estimator, recall@K% of the causal tokens and the
    answer-flip rate when its top 10% is occluded, on the starting model."""
    q = summary["quality"]
    fracs = [f for f in q["config"]["fracs"] if f in (0.05, 0.1, 0.3)]
    head = "| estimator | " + " | ".join(f"recall@{100 * f:g}%" for f in fracs) + " | answer flip, top 10% occluded |"
    lines = [head, "|" + "---|" * (len(fracs) + 2)]
    for name, row in q["estimators"].items():
        label = ESTIMATOR_STYLE.get(name, (name,))[0]
        cells = " | ".join(_fmt(row["recall"]["causal"][str(f)]) for f in fracs)
        lines.append(f"| {label} | {cells} | {_fmt(row['answer_flip'].get('0.1'))} |")
    random_row = " | ".join(_fmt(q["expected_random_recall"][str(f)]) for f in fracs)
    lines.append(f"| E[random] | {random_row} | |")
    return "\n".join(lines)


def readme_section(summary: dict) -> str:
    """What README's "Testbed results" shows of a summary: the generated paragraph and both tables."""
    return "\n\n".join([plain_summary(summary), comparison_table_markdown(summary), quality_table_markdown(summary)])


def headline(summary: dict) -> list[str]:
    """The report's headline as console lines."""
    return [plain_summary(summary), *comparison_table_markdown(summary).splitlines()]


def _html_table(summary: dict) -> str:
    lines = comparison_table_markdown(summary).splitlines()
    cells = lambda line: [c.strip() for c in line.strip("|").split("|")]
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cells(lines[0]))
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c).replace('&lt;br&gt;', '<br>')}</td>" for c in cells(line)) + "</tr>"
                   for line in lines[2:])
    return f"<table><tr>{head}</tr>{body}</table>"


STUDY_RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results_study_cpu.json"
"""the study's committed results (docs/study.md), in a checkout of the repository (not shipped in the package)"""


def study_section(out: Path, results_path: Path = STUDY_RESULTS) -> str:
    """HTML for the study's main figure, rendered from its committed results (nothing is re-run): per task with
    evaluation results, the learning curves of each method at its tuned rate, and once two tasks have them, the
    primary effect against filler length (``study_report``)."""
    from verl_oar.testbed import study_analysis, study_report

    head = "<h2>The study: token credit against a tuned GRPO (committed results, not re-run)</h2>"
    if not results_path.exists():
        return (f"{head}<p>The study's results are not here ({html.escape(str(results_path))}): they are committed in "
                "the repository's benchmarks/ folder, not shipped with the package; see docs/study.md.</p>")
    results = json.loads(results_path.read_text())
    analysis = study_analysis.analyse(results)
    parts = [head, f"<p>From <code>{html.escape(str(results_path))}</code>; hypotheses, endpoints and verdicts: "
                   "docs/study.md. Each method at its own tuned learning rate, evaluation seeds only.</p>"]
    if study_report.plot_effect_vs_filler(analysis, out / "study_effect_vs_filler.png"):
        parts.append('<p><img src="study_effect_vs_filler.png" alt="study effect against filler length" '
                     'style="max-width:100%"></p><p>The primary endpoint against filler length (H1 and H5).</p>')
    for task, result in analysis.items():
        if not result.get("comparisons"):
            continue
        name = f"study_{task}_curves.png"
        study_report.plot_curves(results, task, result, out / name)
        verdicts = "; ".join(f"{html.escape(study_report._label(m))}: steps to threshold "
                             f"{html.escape(study_report._iv(c['relative_steps'], pct=True))} vs tuned GRPO "
                             f"({c.get('h1_verdict', '-')})" for m, c in result["comparisons"].items())
        parts.append(f'<p><img src="{name}" alt="study curves {task}" style="max-width:100%"></p><p>{task}: {verdicts}.</p>')
    if len(parts) == 2:
        parts.append("<p>No task of the study has evaluation results yet.</p>")
    return "".join(parts)


def write_report(out: Path, summary: dict) -> Path:
    """Write every figure and ``index.html`` into ``out``; return the page's path."""
    out = Path(out)
    figures = {"reward.png": plot_reward, "measures.png": plot_measures, "credit.png": plot_credit,
               "step_time.png": plot_step_time, "recall.png": plot_recall, "counterfactual.png": plot_counterfactual}
    for name, plot in figures.items():
        plot(summary, out / name)
    heatmaps = plot_heatmaps(summary, out)

    comp, q, tb = summary["comparison"], summary["quality"], summary["testbed"]
    s, vs = q["samples"], tb["val_samples"]
    img = lambda name, alt: f'<p><img src="{name}" alt="{alt}" style="max-width:100%"></p>'
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>Credit assignment on the pick_max testbed</title>
<style>body{{font-family:sans-serif;max-width:1150px;margin:auto;padding:1em}} table{{border-collapse:collapse;margin:0.5em 0}}
td,th{{border:1px solid #ccc;padding:3px 7px;font-size:13px}} code{{background:#f4f4f4}}</style></head><body>
<h1>Token credit assignment on the pick_max testbed (CPU, verl's trainer)</h1>
<p><b>Summary.</b> {html.escape(plain_summary(summary))}</p>
<p>Command: <code>{html.escape(summary['command'])}</code><br>Seeds: {summary['seeds']}; methods: {summary['methods']};
settings: <code>{html.escape(json.dumps(summary['settings']))}</code>; total {summary['seconds']} s.<br>
Machine: <code>{html.escape(json.dumps(summary['machine']))}</code>.
Every number below is computed from this run's metric files (<code>metrics/</code>), dumps (<code>dumps/</code>) and
<code>summary.json</code>.</p>
<p>Task: <code>max: 3 7 | 2 5</code> &rarr; random filler words, the larger digit of each pair, then the picks boxed:
<code>qzt kdm 7 abx fod 5 kle pqa \\boxed{{75}}</code>. Reward 1 for the right answer, else 0. The oracle causal tokens are
the picks (read from the text). Start (committed, {tb['num_parameters']:,}-parameter Qwen2): sampled accuracy
{_fmt(vs['sampled_accuracy'])}, greedy {_fmt(vs['greedy_accuracy'])}, filler entropy {_fmt(vs['filler_entropy'])} nats/token over
{_fmt(vs['filler_tokens'], 0)} non-causal reasoning tokens, pick entropy {_fmt(vs['pick_entropy'])} (docs/testbed.md).</p>
<h2>Pre-registered measures</h2>
<p>Per method: mean over seeds [bootstrap 95% interval]; under it, the paired difference to GRPO (same seed: same
prompt order and start) [paired bootstrap 95% interval]. Threshold: training reward {comp['threshold']} (3-step trailing
mean), fixed before any comparison; a run that never reaches it counts as steps + 1 (censored:
{', '.join(f"{_label(m)} {r['censored']}" for m, r in comp['methods'].items())}). AUC: mean held-out greedy accuracy
over training (trapezoid over the validation points). Variance: per step, the variance over seeds of the trailing-mean
reward, averaged over steps. Credit concentration: per response, mean |token advantage| on causal tokens / on the other
reasoning tokens, from every dumped step.</p>
{_html_table(summary)}
{img('reward.png', 'reward vs step')}{img('measures.png', 'differences to GRPO')}
<h2>The credit each method assigned</h2>
{img('credit.png', 'credit concentration and recall')}
<p>Token weights each method gave the same responses at step 1 (every run of a seed samples the same responses at step 1),
the oracle underneath.</p>
{''.join(img(h, h) for h in heatmaps) or '<p>(no dumped run: no heatmap)</p>'}
{img('step_time.png', 'wall-clock per step')}
<h2>Importance quality on the starting model ({s['counted']} of {s['total']} sampled responses with an answer)</h2>
<p>Recall of the causal tokens among each estimator's top K% reasoning tokens; counterfactual: occlude the top K% with a
space and greedily re-decode the answer. Sampled accuracy {_fmt(s['sampled_accuracy'])}; mean reasoning tokens
{_fmt(s['mean_reasoning_tokens'], 1)}, of which causal {_fmt(s['mean_causal_tokens'], 1)}.</p>
{img('recall.png', 'recall at K')}{img('counterfactual.png', 'counterfactual')}
{study_section(out)}
</body></html>"""
    index = out / "index.html"
    index.write_text(page)
    return index


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--readme"]:
        print(readme_section(json.loads(Path(args[1]).read_text())))
        raise SystemExit(0)
    if args[:1] == ["--reward-figure"]:  # README's figure: --reward-figure SUMMARY.json OUT.png
        plot_reward(json.loads(Path(args[1]).read_text()), Path(args[2]))
        raise SystemExit(0)
    from verl_oar.tools.heatmap_render import MissingMatplotlib, require_matplotlib

    try:
        require_matplotlib("the report's figures")
    except MissingMatplotlib as error:
        raise SystemExit(f"verl_oar.testbed.report: {error}") from None
    folder = Path(args[0] if args else "oar_demo")
    print(write_report(folder, json.loads((folder / "summary.json").read_text())))
