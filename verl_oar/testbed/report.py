"""Render the demo's ``summary.json`` as an HTML page with PNG figures (matplotlib, Agg backend).

    python -m verl_oar.testbed.report DIR      # re-render DIR/index.html from DIR/summary.json

Figures (file names in the report folder):

- ``reward.png``: training reward (= accuracy of the step's sampled responses) vs step per method,
  mean over seeds with the min-max band, and the threshold; held-out greedy accuracy before/after;
- ``ratios.png``: steps to the threshold and run-to-run variance, as ratios OAR / GRPO;
- ``step_time.png``: median wall-clock seconds per training step per method (importance part hatched);
- ``recall.png``: recall of the oracle causal tokens at top-K% per estimator (direct and chain oracles);
- ``counterfactual.png``: accuracy drop and answer-flip rate when the top-K% tokens are occluded;
- ``heatmap_<i>.png``: token importance of sample traces (OAR-G, OAR-P) with the oracle underneath.
"""

from __future__ import annotations

import html
import json
import math
import sys
from pathlib import Path

COLORS = {"grpo": "#555555", "oar_g": "#1f77b4", "oar_p": "#d62728"}
ESTIMATOR_STYLE = {
    "oar_g_noisy_kl": ("OAR-G (noisy KL)", "#1f77b4", "-"),
    "oar_g_loglik": ("OAR-G (loglik)", "#6baed6", "--"),
    "oar_p_exact": ("OAR-P exact", "#d62728", "-"),
    "oar_p_chunk8": ("OAR-P chunk K=8", "#fc9272", "--"),
    "entropy": ("entropy", "#2ca02c", ":"),
    "random": ("random", "#7f7f7f", ":"),
    "oracle": ("oracle (sanity)", "#000000", "-."),
}
LABELS = {"grpo": "GRPO", "oar_g": "OAR-G", "oar_p": "OAR-P"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _fmt(value, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:.{digits}f}"


def plot_reward(summary: dict, path: Path) -> None:
    from verl_oar.testbed.dynamics import mean_and_spread

    plt = _plt()
    fig, (ax, ax_val) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2.2, 1]})
    for method, runs in summary["runs"].items():
        mean, _, low, high = mean_and_spread([r["reward"] for r in runs])
        steps = list(range(1, len(mean) + 1))
        color = COLORS.get(method)
        ax.plot(steps, mean, color=color, label=f"{LABELS.get(method, method)} (mean of {len(runs)})")
        ax.fill_between(steps, low, high, color=color, alpha=0.15)
    threshold = summary["dynamics"]["threshold"]
    if threshold is not None:
        ax.axhline(threshold, color="k", lw=0.8, ls="--", label=f"threshold {threshold:.3f}")
    ax.set(xlabel="training step", ylabel="reward = accuracy of sampled responses",
           title="Training reward (band: min-max over seeds)")
    ax.legend(fontsize=8)
    for i, (method, runs) in enumerate(summary["runs"].items()):
        for r in runs:
            points = sorted((int(s), v) for s, v in r["val_accuracy"].items())
            if points:
                ax_val.plot([p[0] + 0.15 * i for p in points], [p[1] for p in points], "o-", color=COLORS.get(method),
                            alpha=0.7, label=LABELS.get(method, method) if r is runs[0] else None)
    ax_val.set(xlabel="training step", ylabel="greedy accuracy", title="Held-out accuracy (each seed)")
    ax_val.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ratios(summary: dict, path: Path) -> None:
    plt = _plt()
    methods = [m for m in summary["dynamics"]["methods"] if m != summary["dynamics"]["baseline"]]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, key, title in ((axes[0], "steps_ratio", "Steps to threshold, OAR / GRPO"),
                           (axes[1], "variance_ratio", "Run-to-run variance, OAR / GRPO")):
        values = [summary["dynamics"]["methods"][m][key] for m in methods]
        shown = [0.0 if v is None or math.isnan(v) else v for v in values]
        bars = ax.bar([LABELS.get(m, m) for m in methods], shown, color=[COLORS.get(m) for m in methods])
        for bar, v in zip(bars, values):
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), _fmt(v), ha="center", va="bottom")
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set(title=title + " (below 1: OAR better)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_step_time(summary: dict, path: Path) -> None:
    plt = _plt()
    rows = summary["dynamics"]["methods"]
    methods = list(rows)
    total = [rows[m]["median_step_seconds"] or 0.0 for m in methods]
    importance = [rows[m]["median_importance_seconds"] or 0.0 for m in methods]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = [LABELS.get(m, m) for m in methods]
    ax.bar(names, total, color=[COLORS.get(m) for m in methods], alpha=0.6, label="whole step")
    ax.bar(names, importance, color="none", edgecolor="k", hatch="//", label="token importance")
    for i, t in enumerate(total):
        ax.text(i, t, f"{t:.1f} s", ha="center", va="bottom")
    ax.set(ylabel="seconds (median over steps 2..)", title="Wall-clock per training step")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _estimator_curves(ax, quality: dict, values) -> None:
    """One line per estimator over the top-K% fractions; ``values(row, frac)`` gives the y value."""
    fracs = quality["config"]["fracs"]
    for name, row in quality["estimators"].items():
        label, color, style = ESTIMATOR_STYLE.get(name, (name, None, "-"))
        ax.plot([100 * f for f in fracs], [values(row, str(f)) for f in fracs], style, marker="o", color=color,
                label=label)


def plot_recall(summary: dict, path: Path) -> None:
    plt = _plt()
    q = summary["quality"]
    fracs = q["config"]["fracs"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, oracle in zip(axes, ("direct", "chain")):
        _estimator_curves(ax, q, lambda row, f, oracle=oracle: row["recall"][oracle][f])
        ax.plot([100 * f for f in fracs], [q["expected_random_recall"][str(f)] for f in fracs], color="#bbbbbb",
                lw=3, alpha=0.5, label="E[random]")
        ax.set(xlabel="top K% of reasoning tokens", ylabel="recall", ylim=(0, 1.05),
               title=f"Recall of the '{oracle}' oracle tokens")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_counterfactual(summary: dict, path: Path) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "accuracy_drop", "Accuracy drop (truth: the sum)"),
                           (axes[1], "answer_flip", "Answer flip (truth: the model's own answer)")):
        _estimator_curves(ax, summary["quality"], lambda row, f, key=key: row[key][f])
        ax.set(xlabel="top K% of reasoning tokens occluded", ylabel="rate", title=title)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_heatmaps(summary: dict, out: Path) -> list[str]:
    """One PNG per example (``heatmap_render.render_png``); returns the file names."""
    from verl_oar.tools.heatmap_render import render_png

    names = []
    for i, ex in enumerate(summary["heatmaps"]):
        name = f"heatmap_{i}.png"
        rows = [(ESTIMATOR_STYLE.get(k, (k,))[0], v) for k, v in ex["scores"].items()]
        masks = [(f"oracle: {k}", v) for k, v in ex["masks"].items()]
        render_png(out / name, ex["tokens"], rows, masks, title=f"{ex['prompt']}  (sum {ex['truth']})")
        names.append(name)
    return names


def _headline_table(summary: dict) -> str:
    d = summary["dynamics"]
    head = ("<tr><th>method</th><th>steps to threshold (per seed)</th><th>ratio to GRPO</th><th>variance ratio</th>"
            "<th>mean reward</th><th>mean reward per seed</th><th>final reward (smoothed)</th><th>held-out acc. before &rarr; after</th>"
            "<th>s / step</th><th>importance s / step</th></tr>")
    rows = []
    for m, r in d["methods"].items():
        reached = ", ".join("never" if s is None else str(s) for s in r["steps_to_threshold"])
        per_seed = ", ".join(_fmt(sum(run["reward"]) / len(run["reward"]), 3) for run in summary["runs"][m])
        rows.append(
            f"<tr><td>{LABELS.get(m, m)}</td><td>{reached}</td><td>{_fmt(r['steps_ratio'])}</td>"
            f"<td>{_fmt(r['variance_ratio'])}</td><td>{_fmt(r['mean_reward'], 3)}</td><td>{per_seed}</td><td>{_fmt(r['final_reward'], 3)}</td>"
            f"<td>{_fmt(r['val_accuracy_start'])} &rarr; {_fmt(r['val_accuracy_end'])}</td>"
            f"<td>{_fmt(r['median_step_seconds'], 1)}</td><td>{_fmt(r['median_importance_seconds'], 2)}</td></tr>"
        )
    return f"<table>{head}{''.join(rows)}</table>"


def _quality_table(summary: dict) -> str:
    q = summary["quality"]
    fracs = q["config"]["fracs"]
    cols = "".join(f"<th>direct @{100 * f:g}%</th>" for f in fracs)
    head = f"<tr><th>estimator</th>{cols}<th>chain @10%</th><th>acc. drop @10%</th><th>answer flip @10%</th><th>seconds</th></tr>"
    rows = []
    for name, row in q["estimators"].items():
        cells = "".join(f"<td>{_fmt(row['recall']['direct'][str(f)])}</td>" for f in fracs)
        rows.append(
            f"<tr><td>{ESTIMATOR_STYLE.get(name, (name,))[0]}</td>{cells}<td>{_fmt(row['recall']['chain'].get('0.1'))}</td>"
            f"<td>{_fmt(row['accuracy_drop'].get('0.1'))}</td><td>{_fmt(row['answer_flip'].get('0.1'))}</td>"
            f"<td>{_fmt(row['seconds'])}</td></tr>"
        )
    return f"<table>{head}{''.join(rows)}</table>"


def write_report(out: Path, summary: dict) -> Path:
    """Write every figure and ``index.html`` into ``out``; return the page's path."""
    out = Path(out)
    figures = {
        "reward.png": plot_reward,
        "ratios.png": plot_ratios,
        "step_time.png": plot_step_time,
        "recall.png": plot_recall,
        "counterfactual.png": plot_counterfactual,
    }
    for name, plot in figures.items():
        plot(summary, out / name)
    heatmaps = plot_heatmaps(summary, out)

    d, q, tb = summary["dynamics"], summary["quality"], summary["testbed"]
    s = q["samples"]
    threshold = (f"{d['threshold']:.3f} ({html.escape(d['threshold_rule'])}; start {_fmt(d['start_reward'], 3)}, "
                 f"GRPO best {_fmt(d['baseline_best'], 3)})" if d["threshold"] is not None else html.escape(d["threshold_rule"]))
    img = lambda name, alt: f'<p><img src="{name}" alt="{alt}" style="max-width:100%"></p>'
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>OAR on the chain_sum testbed</title>
<style>body{{font-family:sans-serif;max-width:1150px;margin:auto;padding:1em}} table{{border-collapse:collapse;margin:0.5em 0}}
td,th{{border:1px solid #ccc;padding:3px 7px;font-size:13px}} code{{background:#f4f4f4}}</style></head><body>
<h1>OAR vs GRPO on the chain_sum testbed (CPU, verl's trainer)</h1>
<p>Command: <code>{html.escape(summary['command'])}</code><br>Seeds: {summary['seeds']}; methods: {summary['methods']};
settings: <code>{html.escape(json.dumps(summary['settings']))}</code>; total {summary['seconds']} s.
Every number below is computed from this run's metric files (<code>metrics/</code>) and <code>summary.json</code>.</p>
<p>Task: <code>sum: a b c ...</code> &rarr; a running-sum trace padded with filler words, then <code>\\boxed{{sum}}</code>.
Testbed: {tb['num_parameters']:,}-parameter Qwen2, warm start {html.escape(json.dumps(tb['warm_start']))};
sampled accuracy at the start {_fmt(tb['val_samples']['accuracy'])} (parse rate {_fmt(tb['val_samples']['parse_rate'])}).
Reward = 1 for the right sum, else 0, so the training reward is the accuracy of the step's sampled responses.</p>
<h2>Training dynamics</h2>
<p>Threshold: {threshold}; smoothing window {d['window']} steps. A run that never reaches it counts as
steps + 1 in the mean (a lower bound). Variance: per step, the variance over seeds of the smoothed reward, averaged
over steps. With {len(summary['seeds'])} seed(s) these ratios are noisy: compare the methods' differences with the
spread of each method's per-seed mean reward before reading an effect into them.</p>
{_headline_table(summary)}
{img('reward.png', 'reward vs step')}{img('ratios.png', 'ratios')}{img('step_time.png', 'wall-clock per step')}
<h2>Importance quality (warm-started model, {s['counted']} of {s['total']} sampled responses with an oracle)</h2>
<p>Oracle: <b>direct</b> = the tokens of the last running total (the answer copies it); <b>chain</b> = every number of
the trace. Counterfactual: occlude the top-K% reasoning tokens with a space and greedily re-decode the answer.
Sampled accuracy {_fmt(s['sampled_accuracy'])}; mean reasoning tokens {_fmt(s['mean_reasoning_tokens'], 1)}, of which
direct {_fmt(s['mean_direct_tokens'], 1)}, chain {_fmt(s['mean_chain_tokens'], 1)}. Seeds: {html.escape(json.dumps(q['config']['seeds']))}.</p>
{_quality_table(summary)}
{img('recall.png', 'recall at K')}{img('counterfactual.png', 'counterfactual')}
<h2>Token-importance heatmaps (warm-started model)</h2>
<p>Each row is normalised to its maximum over the response; the oracle masks are underneath.</p>
{''.join(img(h, h) for h in heatmaps)}
</body></html>"""
    index = out / "index.html"
    index.write_text(page)
    return index


if __name__ == "__main__":
    from verl_oar.tools.heatmap_render import MissingMatplotlib, require_matplotlib

    try:
        require_matplotlib("the report's figures")
    except MissingMatplotlib as error:
        raise SystemExit(f"verl_oar.testbed.report: {error}") from None
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "oar_demo")
    print(write_report(folder, json.loads((folder / "summary.json").read_text())))
