"""Measures of a training comparison (verl_oar.testbed.measures): steps to threshold and held-out AUC on
hand-checked curves, the bootstrap against a nested-loop reference, and its behaviour on constructed
effects and bad inputs. Pure Python; well under a second."""

from __future__ import annotations

import json
import math
import random
import statistics

import pytest

from verl_oar.testbed.measures import (
    Interval,
    bootstrap,
    curve_auc,
    paired_bootstrap,
    resample_indices,
    steps_to_threshold_censored,
)


def test_steps_to_threshold_censored_on_hand_checked_curves():
    # window 2 trailing means: [0.1, 0.2, 0.4, 0.6, 0.7] -> first full-window mean >= 0.5 is step 4
    assert steps_to_threshold_censored([0.1, 0.3, 0.5, 0.7, 0.7], 0.5, 2) == (4.0, False)
    # window 1: step 3 is the first >= 0.5
    assert steps_to_threshold_censored([0.1, 0.3, 0.5, 0.7, 0.7], 0.5, 1) == (3.0, False)
    # a single lucky step 1 does not count before a full window of 3: means at steps 3, 4 are 0.6, 0.9 -> 3
    assert steps_to_threshold_censored([0.9, 0.0, 0.9, 1.8], 0.6, 3) == (3.0, False)
    # never reached: censored at len + 1
    assert steps_to_threshold_censored([0.1, 0.2, 0.3], 0.5, 1) == (4.0, True)
    with pytest.raises(ValueError, match="empty"):
        steps_to_threshold_censored([], 0.5, 1)


def test_curve_auc_on_hand_checked_curves():
    # ((0.2+0.4)/2*5 + (0.4+0.8)/2*5) / 10 = (1.5 + 3.0) / 10 = 0.45
    assert curve_auc([(0, 0.2), (5, 0.4), (10, 0.8)]) == pytest.approx(0.45)
    # uneven spacing: ((0.0+0.6)/2*2 + (0.6+0.6)/2*8) / 10 = (0.6 + 4.8) / 10 = 0.54
    assert curve_auc([(0, 0.0), (2, 0.6), (10, 0.6)]) == pytest.approx(0.54)
    # not starting at 0: (0.5+0.7)/2*4 / 4 = 0.6
    assert curve_auc([(3, 0.5), (7, 0.7)]) == pytest.approx(0.6)
    assert curve_auc([(0, 0.37)]) == 0.37
    with pytest.raises(ValueError, match="duplicate step 5"):
        curve_auc([(0, 0.2), (5, 0.4), (5, 0.5)])
    with pytest.raises(ValueError, match="not sorted"):
        curve_auc([(0, 0.2), (10, 0.4), (5, 0.5)])
    with pytest.raises(ValueError, match="no .*points"):
        curve_auc([])


def reference(method, baseline, statistic, resamples, seed, level):
    """Nested loops, the same draws: (estimate, low, high, used, skipped)."""
    n = len(method)
    rng = random.Random(seed)
    diffs, skipped = [], 0
    for _ in range(resamples):
        idx = []
        for _ in range(n):
            idx.append(rng.randrange(n))
        m, b = [], []
        for i in idx:
            m.append(method[i])
            if baseline is not None:
                b.append(baseline[i])
        try:
            d = statistic(m) - (statistic(b) if baseline is not None else 0.0)
        except statistics.StatisticsError:
            skipped += 1
            continue
        diffs.append(d)
    diffs.sort()
    a = (1 - level) / 2
    r = len(diffs) - 1
    low = diffs[math.floor(a * r)]
    high = diffs[math.ceil((1 - a) * r)]
    estimate = statistic(method) - (statistic(baseline) if baseline is not None else 0.0)
    return estimate, low, high, len(diffs), skipped


def distinct_variance(xs):
    """Variance of the distinct values: raises StatisticsError on a resample of one repeated seed."""
    return statistics.variance(sorted(set(xs)))


def first_drawn(xs):
    """Order-sensitive: the value of the first drawn seed, so the reference pins the exact draw order."""
    return xs[0]


@pytest.mark.parametrize("statistic", [statistics.fmean, statistics.variance, distinct_variance, first_drawn])
@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_bootstrap_matches_nested_loop_reference(statistic, n):
    gen = random.Random(1000 + n)
    method = [gen.random() for _ in range(n)]
    baseline = [gen.random() for _ in range(n)]
    for seed, level in [(0, 0.95), (7, 0.9)]:
        got = paired_bootstrap(method, baseline, statistic=statistic, resamples=1000, seed=seed, level=level)
        est, low, high, used, skipped = reference(method, baseline, statistic, 1000, seed, level)
        assert (got.estimate, got.low, got.high, got.resamples, got.skipped) == (est, low, high, used, skipped)
        assert (got.n, got.level) == (n, level) and got.low <= got.high

        one = bootstrap(method, statistic=statistic, resamples=1000, seed=seed, level=level)
        est, low, high, used, skipped = reference(method, None, statistic, 1000, seed, level)
        assert (one.estimate, one.low, one.high, one.resamples, one.skipped) == (est, low, high, used, skipped)
    if statistic is distinct_variance and n == 2:
        assert 300 < got.skipped < 700 and got.resamples + got.skipped == 1000  # half draw one seed twice


def test_constant_shift_gives_a_point_interval():
    baseline = [0.31, 0.42, 0.27, 0.55, 0.48, 0.39]
    method = [b + 0.1 for b in baseline]
    got = paired_bootstrap(method, baseline, resamples=500)
    assert got.estimate == pytest.approx(0.1, abs=1e-12)
    assert got.low == pytest.approx(0.1, abs=1e-12) and got.high == pytest.approx(0.1, abs=1e-12)
    assert (got.resamples, got.skipped) == (500, 0)


def test_clear_effect_excludes_zero_and_no_effect_is_zero():
    gen = random.Random(3)
    baseline = [0.4 + gen.gauss(0, 0.1) for _ in range(8)]
    method = [b + 0.3 + gen.gauss(0, 0.05) for b in baseline]
    got = paired_bootstrap(method, baseline)
    assert 0 < got.low <= got.estimate <= got.high
    assert got.high - got.low < 0.15
    same = paired_bootstrap(baseline, list(baseline))
    assert (same.estimate, same.low, same.high) == (0.0, 0.0, 0.0)


def test_too_few_or_unusable_resamples_give_no_bounds():
    one = paired_bootstrap([0.7], [0.5])
    assert one.estimate == pytest.approx(0.2) and (one.low, one.high, one.resamples, one.skipped) == (None, None, 0, 0)
    undefined = bootstrap([0.7], statistic=statistics.variance)
    assert (undefined.estimate, undefined.low, undefined.high) == (None, None, None)
    all_skipped = bootstrap([0.5, 0.5, 0.5], statistic=distinct_variance, resamples=50)
    assert (all_skipped.estimate, all_skipped.low, all_skipped.high) == (None, None, None)
    assert (all_skipped.resamples, all_skipped.skipped) == (0, 50)


def test_interval_is_frozen_and_serialises():
    got = paired_bootstrap([0.5, 0.6, 0.7], [0.4, 0.5, 0.5], resamples=100)
    assert isinstance(got, Interval)
    with pytest.raises(AttributeError):
        got.low = 0.0
    d = json.loads(json.dumps(got.as_dict()))
    assert set(d) == {"estimate", "low", "high", "n", "resamples", "skipped", "level"}
    assert d["n"] == 3 and d["resamples"] == 100 and d["low"] == got.low
    assert json.loads(json.dumps(paired_bootstrap([0.5], [0.4]).as_dict()))["low"] is None


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="got 3 and 2"):
        paired_bootstrap([0.1, 0.2, 0.3], [0.1, 0.2])
    with pytest.raises(ValueError, match="empty"):
        paired_bootstrap([], [])
    with pytest.raises(ValueError, match="empty"):
        bootstrap([])
    for level in (0.0, 1.0, 1.5, -0.1):
        with pytest.raises(ValueError, match=r"level must be in \(0, 1\)"):
            paired_bootstrap([0.1, 0.2], [0.1, 0.3], level=level)
        with pytest.raises(ValueError, match=r"level must be in \(0, 1\)"):
            bootstrap([0.1, 0.2], level=level)
    with pytest.raises(ValueError, match="resamples"):
        bootstrap([0.1, 0.2], resamples=0)


def test_resample_indices_are_randranges_draws():
    """The bootstrap's resamples (``resample_indices``) are ``rng.randrange(n)`` n times, draw for draw, so the
    intervals stay those the module docstring defines (and the committed results hold): sizes around powers of 2,
    where the rejection loop differs most, and a stream of many resamples (the rng's state carries over)."""
    for n in (1, 2, 3, 5, 7, 8, 9, 16, 17, 18, 31, 33, 100):
        for seed in (0, 1, 12345):
            ours, theirs = random.Random(seed), random.Random(seed)
            for _ in range(200):
                assert resample_indices(ours, n) == [theirs.randrange(n) for _ in range(n)], (n, seed)
            assert ours.getstate() == theirs.getstate()
