"""Training-dynamics summaries of several runs per method: mean/spread curves, steps to a reward
threshold, run-to-run variance (``testbed.comparison`` builds the pre-registered measures on them).
Plain Python, no torch.

A *curve* is a list of per-step values (step 1 first), one per run (seed); runs of one method have
the same length. Smoothing is a trailing mean over ``window`` steps, so step s uses steps
max(1, s - window + 1)..s and nothing from the future.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

__all__ = ["mean_and_spread", "run_variance", "smooth", "steps_to_threshold"]


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over ``window`` steps (``window`` >= 1); same length as ``values``."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def mean_and_spread(curves: Sequence[Sequence[float]]) -> tuple[list[float], list[float], list[float], list[float]]:
    """Per step over runs: (mean, standard deviation (0 for one run), min, max)."""
    _check_same_length(curves)
    columns = list(zip(*curves))
    mean = [statistics.fmean(c) for c in columns]
    std = [statistics.stdev(c) if len(c) > 1 else 0.0 for c in columns]
    return mean, std, [min(c) for c in columns], [max(c) for c in columns]


def steps_to_threshold(curve: Sequence[float], threshold: float, window: int) -> int | None:
    """First step (1-based) whose trailing mean over a full ``window`` reaches ``threshold`` (so the
    earliest answer is step ``window``: one lucky step is not a run reaching it); None if none does."""
    for step, value in enumerate(smooth(curve, window), start=1):
        if step >= window and value >= threshold:
            return step
    return None


def run_variance(curves: Sequence[Sequence[float]], window: int) -> float:
    """Run-to-run variance: per step, the sample variance over runs of the smoothed curves; averaged
    over steps. NaN with fewer than 2 runs."""
    if len(curves) < 2:
        return math.nan
    smoothed = [smooth(c, window) for c in curves]
    _check_same_length(smoothed)
    return statistics.fmean(statistics.variance(column) for column in zip(*smoothed))


def _check_same_length(curves: Sequence[Sequence[float]]) -> None:
    if not curves:
        raise ValueError("no runs")
    lengths = {len(c) for c in curves}
    if len(lengths) != 1 or 0 in lengths:
        raise ValueError(f"runs of one method must have the same, non-zero number of steps; got lengths {sorted(lengths)}")
