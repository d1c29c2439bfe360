"""Pre-registered measures of a training comparison between methods (GRPO, OAR-G, OAR-P, ...) over
seeds, with bootstrap 95% intervals. Plain Python, standard library only.

- *Steps to threshold* (censored): :func:`verl_oar.testbed.dynamics.steps_to_threshold` on a run's
  per-step training reward; a run that never gets there counts as ``len(curve) + 1`` and is flagged.
- *Held-out AUC*: trapezoid area under (step, accuracy) points over ``last - first`` step, i.e. the
  mean accuracy level over training, in the units of accuracy.
- *Paired bootstrap*: seeds are paired (index i of both lists is one seed). Each resample draws n
  indices with replacement (``rng.randrange(n)`` n times, ``rng = random.Random(seed)``, resamples in
  order) and takes ``statistic(method[idx]) - statistic(baseline[idx])``. With the R used resampled
  values sorted as ``d`` and ``a = (1 - level) / 2``, the interval is
  ``(d[floor(a * (R - 1))], d[ceil((1 - a) * (R - 1))])`` (nearest rank, rounded outwards).
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from verl_oar.testbed.dynamics import steps_to_threshold

__all__ = ["Interval", "bootstrap", "curve_auc", "paired_bootstrap", "resample_indices", "steps_to_threshold_censored"]

Statistic = Callable[[Sequence[float]], float]


def steps_to_threshold_censored(curve: Sequence[float], threshold: float, window: int) -> tuple[float, bool]:
    """(first step whose trailing mean over a full ``window`` reaches ``threshold``, False), or
    ``(len(curve) + 1, True)`` if the run never does (censored). ``curve``: reward per step, step 1 first."""
    if not curve:
        raise ValueError("empty reward curve")
    step = steps_to_threshold(curve, threshold, window)
    return (float(len(curve) + 1), True) if step is None else (float(step), False)


def curve_auc(points: Sequence[tuple[int, float]]) -> float:
    """Mean accuracy over training: trapezoid area under (step, accuracy) points, sorted by strictly
    increasing step (step 0 = before training), divided by (last step - first step). One point: its value."""
    if not points:
        raise ValueError("no (step, accuracy) points")
    for (s0, _), (s1, _) in zip(points, points[1:]):
        if s1 == s0:
            raise ValueError(f"duplicate step {s1} in held-out accuracy points")
        if s1 < s0:
            raise ValueError(f"held-out accuracy points not sorted by step: {s1} after {s0}")
    if len(points) == 1:
        return float(points[0][1])
    area = sum((a0 + a1) / 2 * (s1 - s0) for (s0, a0), (s1, a1) in zip(points, points[1:]))
    return area / (points[-1][0] - points[0][0])


@dataclass(frozen=True)
class Interval:
    estimate: float | None
    """statistic on all seeds (a difference for the paired bootstrap); None if the statistic is undefined"""
    low: float | None
    """lower bound; None if no resample was usable (or fewer than 2 seeds)"""
    high: float | None
    """upper bound; None like ``low``"""
    n: int
    """number of seeds"""
    resamples: int
    """resamples used (requested minus skipped)"""
    skipped: int
    """resamples skipped because the statistic raised ``statistics.StatisticsError``"""
    level: float
    """confidence level, e.g. 0.95"""

    def as_dict(self) -> dict:
        """Plain dict for JSON (None stays None)."""
        return dataclasses.asdict(self)


def paired_bootstrap(
    method: Sequence[float], baseline: Sequence[float], *, statistic: Statistic = statistics.fmean,
    resamples: int = 10000, seed: int = 0, level: float = 0.95,
) -> Interval:
    """Interval for ``statistic(method) - statistic(baseline)`` over paired seeds (see module docstring)."""
    if len(method) != len(baseline):
        raise ValueError(f"paired bootstrap needs one value per seed in both lists; got {len(method)} and {len(baseline)}")
    return _bootstrap(lambda idx: statistic([method[i] for i in idx]) - statistic([baseline[i] for i in idx]),
                      len(method), resamples, seed, level)


def bootstrap(
    values: Sequence[float], *, statistic: Statistic = statistics.fmean,
    resamples: int = 10000, seed: int = 0, level: float = 0.95,
) -> Interval:
    """Interval for ``statistic(values)`` over seeds (one method, no baseline); same rng and rule."""
    return _bootstrap(lambda idx: statistic([values[i] for i in idx]), len(values), resamples, seed, level)


def resample_indices(rng: random.Random, n: int) -> list[int]:
    """``[rng.randrange(n) for _ in range(n)]``, draw for draw (n >= 1): ``Random.randrange(n)`` is
    ``getrandbits(n.bit_length())`` drawn again until below n (``Random._randbelow``, CPython 3.10-3.12), and this is
    that loop without ``randrange``'s argument handling per draw, which took a third of the study analysis's time
    (tests/unit/test_measures_on_cpu.py checks the draws equal ``randrange``'s)."""
    getrandbits, k, out = rng.getrandbits, n.bit_length(), []
    for _ in range(n):
        r = getrandbits(k)
        while r >= n:
            r = getrandbits(k)
        out.append(r)
    return out


def _bootstrap(measure: Callable[[Sequence[int]], float], n: int, resamples: int, seed: int, level: float) -> Interval:
    if n == 0:
        raise ValueError("no seeds: cannot bootstrap empty lists")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    try:
        estimate = measure(range(n))
    except statistics.StatisticsError:
        estimate = None
    if n < 2:
        return Interval(estimate, None, None, n, 0, 0, level)
    rng, diffs, skipped = random.Random(seed), [], 0
    for _ in range(resamples):
        idx = resample_indices(rng, n)
        try:
            diffs.append(measure(idx))
        except statistics.StatisticsError:
            skipped += 1
    if not diffs:
        return Interval(estimate, None, None, n, 0, skipped, level)
    diffs.sort()
    a, last = (1 - level) / 2, len(diffs) - 1
    low, high = diffs[math.floor(a * last)], diffs[math.ceil((1 - a) * last)]
    return Interval(estimate, low, high, n, len(diffs), skipped, level)
