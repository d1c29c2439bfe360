"""The pre-registered comparison of methods over seeds (docs/testbed.md, "Measures"), from the runs'
per-step records. Plain Python.

Per run (one method, one seed):

- ``steps_to_threshold``: first step whose 3-step trailing mean of the training reward (= accuracy
  of the step's 64 sampled responses) reaches :data:`THRESHOLD`; a run that never does counts as
  steps + 1 (censored, flagged);
- ``auc``: area under the held-out greedy accuracy curve (trapezoid over the validation points, step 0
  and the last step included: verl validates before training and after the last step) divided by
  the steps between the first and the last point: the mean held-out accuracy over training;
- ``final``: held-out greedy accuracy at the last validation (after the last step); ``gain``: final
  minus the first (step 0);
- ``step_seconds``: median wall-clock seconds per training step (steps 2.., step 1 warms up).

Per method: the mean over seeds of each, with a bootstrap 95% interval over seeds, and its paired
difference to GRPO (same seed = same prompts order and start) with a paired bootstrap 95% interval;
``variance``: run-to-run variance, per step the variance over seeds of the 3-step trailing mean
reward, averaged over steps (its interval: the same statistic on paired resamples of seeds).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

from verl_oar.testbed import dynamics
from verl_oar.testbed.measures import bootstrap, curve_auc, paired_bootstrap, steps_to_threshold_censored

__all__ = ["MEASURES", "THRESHOLD", "WINDOW", "compare", "run_measures"]

THRESHOLD = 0.8
"""training reward to reach (absolute, fixed before any method was compared; docs/testbed.md)"""
WINDOW = 3
"""trailing-mean window (steps) for the threshold and the variance"""
MEASURES = ("steps_to_threshold", "auc", "final", "gain", "step_seconds")
"""per-run scalars, in the report's order; ``variance`` is per method"""
RESAMPLES = 10000


def run_measures(run: Mapping) -> dict:
    """The per-run measures of one run summary (``demo.run_summary``: "reward", "val_accuracy",
    "step_seconds")."""
    steps, censored = steps_to_threshold_censored(run["reward"], THRESHOLD, WINDOW)
    points = sorted((int(s), float(v)) for s, v in run["val_accuracy"].items())
    timed = [s for s in run["step_seconds"][1:] if s is not None]
    return {
        "steps_to_threshold": steps,
        "censored": censored,
        "auc": curve_auc(points) if points else math.nan,
        "final": points[-1][1] if points else math.nan,
        "gain": points[-1][1] - points[0][1] if len(points) > 1 else math.nan,
        "step_seconds": statistics.median(timed) if timed else math.nan,
    }


def _curve_variance(curves: Sequence[Sequence[float]]) -> float:
    if len(curves) < 2:  # the bootstrap counts this resample as skipped; one seed: no estimate
        raise statistics.StatisticsError("run-to-run variance needs at least 2 seeds")
    return dynamics.run_variance(list(curves), WINDOW)


def compare(runs: Mapping[str, Sequence[Mapping]], baseline: str, *, seed: int = 0) -> dict:
    """{"threshold", "window", "baseline", "methods": {method: {"seeds", "per_seed": {measure: [...]},
    "censored": int, "mean": {measure: Interval dict}, "vs_baseline": {measure: Interval dict},
    "variance": Interval dict, "variance_vs_baseline": Interval dict}}}.

    Runs are paired with the baseline's by seed; a method's seeds without a baseline run are left out
    of its differences (and counted in "unpaired")."""
    if baseline not in runs:
        raise ValueError(f"the baseline {baseline!r} has no runs (methods: {sorted(runs)})")
    base = {r["seed"]: r for r in runs[baseline]}
    out = {"threshold": THRESHOLD, "window": WINDOW, "baseline": baseline, "methods": {}}
    for method, method_runs in runs.items():
        measures = [run_measures(r) for r in method_runs]
        seeds = [r["seed"] for r in method_runs]
        row = {
            "seeds": seeds,
            "per_seed": {m: [x[m] for x in measures] for m in MEASURES},
            "censored": sum(x["censored"] for x in measures),
            "mean": {m: bootstrap([x[m] for x in measures], resamples=RESAMPLES, seed=seed).as_dict() for m in MEASURES},
            "variance": bootstrap([r["reward"] for r in method_runs], statistic=_curve_variance, resamples=RESAMPLES,
                                  seed=seed).as_dict(),
        }
        paired = [(x, r, base[r["seed"]]) for x, r in zip(measures, method_runs) if r["seed"] in base]
        row["unpaired"] = len(method_runs) - len(paired)
        base_measures = [run_measures(b) for _, _, b in paired]
        row["vs_baseline"] = {
            m: paired_bootstrap([x[m] for x, _, _ in paired], [b[m] for b in base_measures], resamples=RESAMPLES,
                                seed=seed).as_dict() if paired else None
            for m in MEASURES
        }
        row["variance_vs_baseline"] = paired_bootstrap(
            [r["reward"] for _, r, _ in paired], [b["reward"] for _, _, b in paired], statistic=_curve_variance,
            resamples=RESAMPLES, seed=seed).as_dict() if paired else None
        out["methods"][method] = row
    return out
