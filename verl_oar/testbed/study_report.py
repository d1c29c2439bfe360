"""Render the study's tables and figures from its committed results JSON (never re-runs anything).

    python -m verl_oar.testbed.study_report benchmarks/results_study_cpu.json [--figures docs/figures/study]

Prints the markdown tables that docs/study.md's "Results" quotes (tests/unit/test_study_report_on_cpu.py keeps the
page equal to this output) and, with ``--figures DIR``, writes per task: ``TASK_curves.png`` (mean training reward per
step on the evaluation seeds, each method at its tuned rate, with a 95% bootstrap band of the mean) and
``TASK_lr_grid.png`` (mean steps to threshold on the tuning seeds against the learning rate, per method) and, once
two or more tasks have evaluation results, ``effect_vs_filler.png`` (H1's relative change against filler words per
gap, Bonferroni intervals). ``TASK_spread.png`` shows the across-seed spread: every evaluation seed's steps to
threshold and held-out AUC per method at its tuned rate (the SD ratios with intervals are in the evaluation table).
Once the confirmatory replication has runs: its table (and ``replication_fill32_curves.png``), and once fill64's
evaluation exists, R2's table. Stopped runs are drawn and counted: their reward after the stop counts 0.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from verl_oar.testbed import study_analysis as sa

FILLER_WORDS = sa.FILLER_WORDS
LABELS = {"grpo": "GRPO", "oar_g": "OAR-G", "oar_p": "OAR-P exact", "oar_p_chunk16": "OAR-P chunk K=16",
          "oar_g_no_amplify": "OAR-G without amplification", "oar_g_no_suppress": "OAR-G without suppression",
          "oar_g_no_preserve_mass": "OAR-G without mass preservation", "oar_g_tau0.25": "OAR-G, tau 0.25",
          "oar_g_tau0.75": "OAR-G, tau 0.75", "cscr": "CSCR", "oppo": "OPPO, self-oracle",
          "oppo_teacher": "OPPO, teacher oracle", "acpo": "ACPO", "codapo": "CoDaPO", "oar_g_codapo": "OAR-G x CoDaPO",
          "grpo_main_ppo": "GRPO through main_ppo", "oar_g_main_ppo": "OAR-G through main_ppo"}
ORDER = ["grpo", "oar_g", "oar_p_chunk16", "oar_p", *sa.ABLATIONS, *sa.TAUS, *(m for m in LABELS if m in sa.RATE_FROM
                                                                            and m not in (*sa.ABLATIONS, *sa.TAUS))]
"""table rows: the primary methods, OAR-G's variants, then the other registered methods (unknown names last)"""


def _label(method: str) -> str:
    return LABELS.get(method, method)


def _iv(iv: dict, pct: bool = False, digits: int = 2) -> str:
    def f(x):
        return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else (
            f"{100 * x:+.1f}%" if pct else f"{x:+.{digits}f}")
    return f"{f(iv['estimate'])} [{f(iv['low'])}, {f(iv['high'])}]"


def _ratio(iv: dict) -> str:
    def f(x):
        return "n/a" if x is None else f"{x:.2f}"
    return f"{f(iv['estimate'])} [{f(iv['low'])}, {f(iv['high'])}]"


def _stops(c: dict) -> str:
    """A comparison's last two columns: censored fraction and stopped runs, the method's (the baseline's)."""
    return (f"{100 * c['censored']:.0f}% ({100 * c['baseline_censored']:.0f}%) | "
            f"{c['errors']} ({c['baseline_errors']})")


def tuning_table(task: str, tuning: dict) -> str:
    rates = sorted({lr for t in tuning.values() for lr in t["grid"]}, key=float)
    lines = [f"Tuning, {task} (seeds {_seed_span(tuning)}; mean steps to threshold, censored runs in brackets "
             "(of which stopped by a guard or an error, after s), mean held-out AUC of every run (a stopped run counts "
             "0 after its stop); * = chosen)", "",
             "| method | " + " | ".join(f"lr {r}" for r in rates) + " |", "|---|" + "---|" * len(rates)]
    for method in _order(tuning):
        cells = []
        for r in rates:
            g = tuning[method]["grid"].get(r)
            if g is None:
                cells.append("-")
                continue
            star = "*" if float(r) == tuning[method]["lr"] else ""
            stopped = f", {g['stopped']} s" if g["stopped"] else ""
            cells.append(f"{g['mean_steps']:.1f} ({g['censored']}{stopped}) / {g['mean_auc']:.3f}{star}")
        lines.append(f"| {_label(method)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def eval_table(task: str, result: dict) -> str:
    comps = result.get("comparisons", {})
    lines = [f"Evaluation, {task} ({result['eval_steps']} steps; each method at its tuned rate against GRPO at its "
             "tuned rate, paired over seeds; every pair counted: a stopped run is censored and scores 0 after its "
             "stop)", "",
             "| method (lr) | mean steps (GRPO) | relative change of steps [interval] | H1 | AUC diff [95%] | "
             "final diff [95%] | SD ratio, AUC [95%] | H2 | SD ratio, steps [95%] | censored (GRPO) | "
             "stopped (GRPO) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    most = max((len(c["seeds"]) for c in comps.values()), default=0)
    for method in _order(comps):
        c = comps[method]
        level = c["relative_steps"]["level"]
        fewer = f", {len(c['seeds'])} seeds" if len(c["seeds"]) < most else ""  # the main_ppo-only methods' 5
        if c.get("baseline", sa.BASELINE) != sa.BASELINE:
            fewer += f"; vs {_label(c['baseline'])}"
        elif not c.get("same_runner", True):
            fewer += "; main_ppo vs the fast runner's GRPO: not comparable"
        lines.append(
            f"| {_label(method)} ({c['lr']:g}{fewer}) | {c['mean_steps']:.2f} ({c['baseline_mean_steps']:.2f}) | "
            f"{_iv(c['relative_steps'], pct=True)} ({100 * level:.2f}%) | {c.get('h1_verdict', '-')} | "
            f"{_iv(c['auc_diff'], digits=3)} | {_iv(c['final_diff'], digits=3)} | {_ratio(c['sd_ratio_auc'])} | "
            f"{c.get('h2_verdict_auc', '-')} | {_ratio(c['sd_ratio_steps'])} | "
            f"{_stops(c)} |")
    return "\n".join(lines)


def step_size_table(task: str, result: dict) -> str:
    rows = result.get("against_every_grpo_rate", {})
    rates = sorted({r for v in rows.values() for r in v}, key=float)
    lines = [f"The step-size alternative, {task}: relative change of steps against GRPO at every grid rate [95%]", "",
             "| method | " + " | ".join(f"GRPO lr {r}" for r in rates) + " |", "|---|" + "---|" * len(rates)]
    for method in _order(rows):
        lines.append(f"| {_label(method)} | " + " | ".join(_iv(rows[method][r], pct=True) if r in rows[method] else "-"
                                                           for r in rates) + " |")
    return "\n".join(lines)


def variants_table(task: str, result: dict) -> str:
    rows = result["vs_full_oar_g"]
    lines = [f"H3 and H4, {task}: each variant's mean steps minus full OAR-G's (tau 0.5), paired over seeds [95%]; "
             "supported = the variant is slower", "",
             "| variant | hypothesis | steps difference [95%] | seeds | verdict |", "|---|---|---|---|---|"]
    for method in sorted(rows, key=lambda m: (m not in sa.ABLATIONS, m)):
        d = rows[method]
        lines.append(f"| {_label(method)} | {'H3' if method in sa.ABLATIONS else 'H4'} | {_iv(d)} | {len(d['seeds'])} "
                     f"| {d['verdict']} |")
    h4 = sa.h4_verdict(rows)
    if h4 is not None:
        lines += ["", f"H4 (tau 0.5 the best of 0.25, 0.5, 0.75), {task}: {h4}."]
    return "\n".join(lines)


def h5_table(h5: dict) -> str:
    lines = ["H5: slope of the relative change of steps (vs tuned GRPO) over log2(filler words) [95%, each task's "
             "seeds resampled]; negative = the gain grows with filler", "",
             "| method | tasks | slope [95%] | verdict |", "|---|---|---|---|"]
    for method in _order(h5):
        lines.append(f"| {_label(method)} | {', '.join(h5[method]['tasks'])} | {_iv(h5[method], digits=3)} | "
                     f"{h5[method]['verdict']} |")
    return "\n".join(lines)


def replication_table(rep: dict) -> str:
    """R1: each replication method against GRPO on the fresh seeds, the original evaluation and the pooled estimate."""
    first = next(iter(rep.values()))
    seeds = first["seeds"]
    lines = [f"Replication, {sa.REPLICATION_TASK} (seeds {seeds[0]}-{seeds[-1]}, {len(seeds)} "
             f"seeds, 32 steps; each method at its tuned rate against GRPO at its tuned rate, paired, every pair "
             "counted; 95%)", "",
             "| method (lr) | mean steps (GRPO) | relative change of steps [95%] | verdict | original (20 seeds) "
             "[its interval] | original inside | pooled [95%] | seeds for a 10% effect | AUC diff [95%] | "
             "final diff [95%] | censored (GRPO) | stopped (GRPO) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for method in _order(rep):
        c = rep[method]
        original = (f"{_iv(c['original'], pct=True)} ({100 * c['original']['level']:.2f}%)" if "original" in c
                    else "-")
        pooled = f"{_iv(c['pooled'], pct=True)} ({c['pooled_seeds']} seeds)" if "pooled" in c else "-"
        inside = "-" if "original_inside" not in c else "yes" if c["original_inside"] else "no"
        lines.append(
            f"| {_label(method)} ({c['lr']:g}) | {c['mean_steps']:.2f} ({c['baseline_mean_steps']:.2f}) | "
            f"{_iv(c['relative_steps'], pct=True)} | {c['verdict']} | {original} | {inside} | {pooled} | "
            f"{c['power']['seeds']} | {_iv(c['auc_diff'], digits=3)} | {_iv(c['final_diff'], digits=3)} | "
            f"{_stops(c)} |")
    return "\n".join(lines)


VERDICT_WORDS = {"faster": "replicated (faster than GRPO)", "slower": "reversed (slower than GRPO)",
                 "inconclusive": "not replicated (the interval covers 0)"}
"""R1's pre-registered decision words (docs/study.md) for ``replication_verdict``'s verdicts"""


def replication_headline(rep: dict, method: str = "oar_g") -> str:
    """README's study headline, rendered from R1's analysis (a test keeps README equal to it): the replication's
    estimate and interval, its verdict, the original figure and the pooled one."""
    c = rep[method]
    seeds = c["seeds"]
    text = (f"On {len(seeds)} fresh seeds ({seeds[0]}-{seeds[-1]}), {_label(method)} needs "
            f"{_iv(c['relative_steps'], pct=True)} steps to the threshold against tuned GRPO (95%, paired): "
            f"{VERDICT_WORDS[c['verdict']]}.")
    if "original" in c:
        text += (f" The original evaluation's {_iv(c['original'], pct=True)} ({100 * c['original']['level']:.2f}%) "
                 f"was the best of many cells; pooled over both seed blocks ({c['pooled_seeds']} seeds), "
                 f"{_iv(c['pooled'], pct=True)}.")
    return text


def runners_table(runners: dict) -> str:
    """The two runners over whole runs: main_ppo against the fast runner, same method, seeds and rate."""
    first = next(iter(runners.values()))
    lines = [f"The runners over whole runs, {sa.REPLICATION_TASK} (seeds {first['seeds'][0]}-{first['seeds'][-1]}, 32 "
             "steps): main_ppo against the fast runner, same method, seeds and rate, paired [95%]", "",
             "| method (lr) | mean steps, main_ppo (fast runner) | relative change of steps [95%] | steps difference "
             "[95%] | AUC diff [95%] | censored (fast) | stopped (fast) |", "|---|---|---|---|---|---|---|"]
    for method in _order(runners):
        c = runners[method]
        lines.append(f"| {_label(method)} ({c['lr']:g}) | {c['mean_steps']:.2f} ({c['baseline_mean_steps']:.2f}) | "
                     f"{_iv(c['relative_steps'], pct=True)} | {_iv(c['steps_difference'])} | "
                     f"{_iv(c['auc_diff'], digits=3)} | {_stops(c)} |")
    return "\n".join(lines)


def growth_table(growth: dict) -> str:
    """R2: OAR-G at the longer task against its tuned GRPO, and the change of the effect from fill32's replication."""
    return "\n".join([
        f"R2, {growth['task']}: OAR-G against tuned GRPO (95%) and the growth of the effect over the fill32 "
        "replication's (each task's seeds resampled independently; negative = the gain grows)", "",
        "| relative change of steps [95%] | verdict | fill64 minus fill32 replication [95%] | growth |",
        "|---|---|---|---|",
        f"| {_iv(growth['effect'], pct=True)} | {growth['verdict']} | {_iv(growth['growth'], pct=True)} | "
        f"{growth['growth']['verdict']} |"])


def tables(results: dict) -> str:
    analysis = sa.analyse(results)
    parts = []
    for task in sorted(analysis, key=lambda t: FILLER_WORDS.get(t, 0)):
        result = analysis[task]
        parts.append(tuning_table(task, result["tuning"]))
        if "eval_steps" in result:
            parts.append(f"Evaluation length, {task}: {result['eval_steps']} steps (twice tuned GRPO's median steps "
                         "on the tuning seeds, rounded up to a multiple of 4, within [12, 64]).")
        if result.get("comparisons"):
            parts += [eval_table(task, result), step_size_table(task, result)]
        if result.get("vs_full_oar_g"):
            parts.append(variants_table(task, result))
    h5 = sa.analyse_h5(results)
    if h5:
        parts.append(h5_table(h5))
    replication = sa.analyse_replication(results["runs"])
    if replication:
        parts.append(replication_table(replication))
    runners = sa.analyse_runners(results["runs"])
    if runners:
        parts.append(runners_table(runners))
    growth = sa.analyse_growth(results)
    if growth:
        parts.append(growth_table(growth))
    return "\n\n".join(parts) + "\n"


def _order(mapping) -> list[str]:
    return [m for m in ORDER if m in mapping] + sorted(m for m in mapping if m not in ORDER)


def _seed_span(tuning: dict) -> str:
    seeds = sorted({s for t in tuning.values() for g in t["grid"].values() for s in g["seeds"]})
    return f"{seeds[0]}-{seeds[-1]}" if seeds else "-"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _mean_band(curves: list[list[float]], resamples: int = 2000, seed: int = 0):
    """Per step: the mean over runs and a 95% percentile-bootstrap band of it (runs resampled, the same resample of
    runs at every step)."""
    import numpy as np

    values = np.asarray(curves, dtype=np.float64)  # (runs, steps)
    picks = np.random.default_rng(seed).integers(0, len(values), size=(resamples, len(values)))
    means = values[picks].mean(axis=1)  # (resamples, steps)
    return values.mean(axis=0), np.quantile(means, 0.025, axis=0), np.quantile(means, 0.975, axis=0)


def _eval_runs(results: dict, task: str, method: str, lr: float, phase: str = "eval") -> list[dict]:
    """The runs of one (phase, task, method, rate) cell, stopped ones included."""
    return [r for r in results["runs"] if r["phase"] == phase and r["task"] == task and r["method"] == method
            and r["lr"] == lr]


def reward_curve(run: dict) -> list[float]:
    """A run's training reward per step over its planned length; a stopped run's steps after its stop count 0 (the
    rule the tables apply to its held-out points), so that no run leaves the mean."""
    recorded = list(run.get("reward", []))
    return recorded + [0.0] * (int(run["steps"]) - len(recorded))


def plot_curves(results: dict, task: str, analysis: dict, path: Path, phase: str = "eval") -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for method in _order(analysis["tuning"]):
        lr = analysis["tuning"][method]["lr"]
        runs = _eval_runs(results, task, method, lr, phase)
        if not runs:
            continue
        curves = [reward_curve(r) for r in runs]
        stopped = sum("error" in r for r in runs)
        steps = range(1, len(curves[0]) + 1)
        mean, low, high = _mean_band(curves)
        note = f", {stopped} stopped: 0 after the stop" if stopped else ""
        ax.plot(steps, mean, label=f"{_label(method)} (lr {lr:g}, {len(curves)} seeds{note})")
        ax.fill_between(steps, low, high, alpha=0.2)
    ax.axhline(sa.THRESHOLD, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("training step")
    ax.set_ylabel("training reward (accuracy of the step's 64 samples)")
    ax.set_title(f"pick_max {task}: mean over {'replication' if phase == 'replication' else 'evaluation'} seeds, "
                 "95% band")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_spread(results: dict, task: str, analysis: dict, path: Path) -> None:
    """One point per evaluation seed (steps to threshold, held-out AUC), each method at its tuned rate; hollow
    points are censored runs (never reached the threshold, or stopped), drawn at steps + 1; the bar is mean +- SD."""
    import numpy as np

    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.5))
    methods = _order(analysis["tuning"])
    jitter = np.random.default_rng(0)
    for i, method in enumerate(methods):
        lr = analysis["tuning"][method]["lr"]
        ends = [sa.run_endpoints(r, int(r["steps"])) for r in _eval_runs(results, task, method, lr)]
        for ax, key in zip(axes, ("steps", "auc")):
            values = [(e[key], e["censored"]) for e in ends]
            x = i + jitter.uniform(-0.15, 0.15, size=len(values))
            y = np.array([v for v, _ in values])
            hollow = np.array([c for _, c in values])
            ax.scatter(x[~hollow], y[~hollow], s=12, color=f"C{i}")
            ax.scatter(x[hollow], y[hollow], s=12, facecolors="none", edgecolors=f"C{i}")
            ax.errorbar([i + 0.3], [y.mean()], yerr=[y.std(ddof=1) if len(y) > 1 else 0.0], color=f"C{i}",
                        marker="_", capsize=3)
    for ax, ylabel in zip(axes, ("steps to threshold (hollow: censored)", "held-out AUC")):
        ax.set_xticks(range(len(methods)))
        ax.set_xticklabels([_label(m) for m in methods], rotation=20, fontsize=7, ha="right")
        ax.set_ylabel(ylabel)
    fig.suptitle(f"pick_max {task}: every evaluation seed, each method at its tuned rate (bar: mean +- SD)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_lr_grid(task: str, analysis: dict, path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for method in _order(analysis["tuning"]):
        grid = analysis["tuning"][method]["grid"]
        rates = sorted(grid, key=float)
        ax.plot([float(r) for r in rates], [grid[r]["mean_steps"] for r in rates], marker="o", label=_label(method))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("learning rate")
    ax.set_ylabel("mean steps to threshold (tuning seeds)")
    ax.set_title(f"pick_max {task}: learning-rate grid")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_effect_vs_filler(analysis: dict, path: Path) -> bool:
    done = [t for t in analysis if analysis[t].get("comparisons")]
    if len(done) < 2:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for k, method in enumerate(sa.H1_METHODS):
        pts = [(FILLER_WORDS[t], analysis[t]["comparisons"][method]["relative_steps"]) for t in done
               if method in analysis[t]["comparisons"]]
        if pts:
            x = [p[0] * 2 ** (0.08 * (k - 1)) for p in pts]  # methods side by side at each task
            y = [100 * p[1]["estimate"] for p in pts]
            err = [[100 * (p[1]["estimate"] - p[1]["low"]) for p in pts], [100 * (p[1]["high"] - p[1]["estimate"])
                                                                            for p in pts]]
            ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=_label(method))
    ax.axhline(0, color="grey", lw=0.8)
    ax.axhline(100 * sa.PAPER_H1, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ticks = sorted(FILLER_WORDS[t] for t in done)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("filler words per gap (dotted: the paper's -18%)")
    ax.set_ylabel("steps to threshold vs tuned GRPO (%)")
    ax.set_title("H1's effect against filler length (Bonferroni intervals)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def figures(results: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    analysis = sa.analyse(results)
    written = []
    for task, result in analysis.items():
        plot_lr_grid(task, result, out / f"{task}_lr_grid.png")
        written.append(out / f"{task}_lr_grid.png")
        if result.get("comparisons"):
            plot_curves(results, task, result, out / f"{task}_curves.png")
            plot_spread(results, task, result, out / f"{task}_spread.png")
            written += [out / f"{task}_curves.png", out / f"{task}_spread.png"]
    if sa.analyse_replication(results["runs"]):
        task = sa.REPLICATION_TASK
        plot_curves(results, task, analysis[task], out / f"replication_{task}_curves.png", phase="replication")
        written.append(out / f"replication_{task}_curves.png")
    if plot_effect_vs_filler(analysis, out / "effect_vs_filler.png"):
        written.append(out / "effect_vs_filler.png")
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", type=Path)
    p.add_argument("--figures", type=Path, default=None)
    args = p.parse_args(argv)
    results = json.loads(args.results.read_text())
    print(tables(results), end="")
    if args.figures is not None:
        for path in figures(results, args.figures):
            print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
