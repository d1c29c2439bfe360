"""The study's pre-registered analysis (docs/study.md, "Endpoints" and "Analysis") over its results JSON.

Input: the JSON written by ``benchmarks/study.py collect``: ``runs``, each ``{phase, task, method, lr, seed, steps,
reward: [per-step training reward], val_accuracy: {step: greedy held-out accuracy}}`` or ``{..., steps, error}``.
Plain Python; every number of the study's tables comes from :func:`analyse`.

Per run: ``steps`` = first step whose trailing 3-step mean training reward reaches 0.8, else the run's steps + 1
(censored; a run stopped by a guard or an error is censored too); ``auc`` = trapezoid mean of held-out accuracy over
training; ``final`` = the last held-out accuracy. No run is dropped (docs/study.md, "Stopped runs"): a stopped run
keeps the held-out points it recorded, and every planned point after its stop counts 0.

Per task: the tuned rate of each method (lowest mean steps over the tuning seeds, ties to the higher mean AUC, then
the smaller rate), the evaluation length (twice tuned GRPO's median steps, rounded up to a multiple of 4, within
[12, 64]), and on the evaluation seeds each method at its tuned rate against GRPO at its tuned rate: the relative
change of mean steps with a paired bootstrap interval (Bonferroni level for the H1 family, 95% otherwise), the AUC
and final differences, the across-seed standard-deviation ratios and the censored fraction; the same primary
effect against GRPO at every grid rate (the step-size alternative). Methods with no tuning runs take the tuned rate
of the method ``RATE_FROM`` names (OAR-G's ablations and tau variants OAR-G's, the other registered methods GRPO's).
H3 and H4 (at the task with ablation / tau runs): each variant's mean steps minus full OAR-G's on their common seeds
(paired bootstrap, 95%). Across tasks, H5: per H1 method, the least-squares slope of the primary effect over
log2(filler words), its interval from resampling each task's seeds independently.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections.abc import Mapping, Sequence

from verl_oar.testbed.measures import (
    bootstrap,
    curve_auc,
    paired_bootstrap,
    resample_indices,
    steps_to_threshold_censored,
)

THRESHOLD, WINDOW = 0.8, 3
VAL_EVERY = 4
"""the study's validation interval (steps): held-out accuracy at step 0, every 4 steps and the last step"""
RESAMPLES, RNG_SEED = 10000, 0
H1_METHODS = ("oar_g", "oar_p_chunk16", "oar_p")
"""the OAR methods of H1's family (x 3 tasks = 9 comparisons)"""
H1_FAMILY = 9
H1_LEVEL = 1 - 0.05 / H1_FAMILY
PAPER_H1 = -0.18
"""the paper's smallest claimed relative change of steps (18% fewer)"""
PAPER_H2 = 0.6
"""the paper's claimed standard-deviation ratio (about 40% lower)"""
BASELINE = "grpo"
ABLATIONS = ("oar_g_no_amplify", "oar_g_no_suppress", "oar_g_no_preserve_mass")
"""H3: OAR-G without one part each"""
TAUS = {"oar_g_tau0.25": 0.25, "oar_g_tau0.75": 0.75}
"""H4: OAR-G at the other quantile levels (its default run is tau 0.5)"""
MAIN_PPO_ONLY = ("cscr", "oppo", "oppo_teacher", "acpo", "codapo", "oar_g_codapo")
"""the registered methods the fast runner does not carry: evaluated through main_ppo on 5 seeds at GRPO's rate"""
MAIN_PPO_CONTROL = "grpo_main_ppo"
"""GRPO through main_ppo on those seeds: their same-runner control (docs/study.md, "Same-runner control")"""
MAIN_PPO_TWINS = {"grpo": MAIN_PPO_CONTROL, "oar_g": "oar_g_main_ppo"}
"""phase ``runners``: a fast-runner method -> the same method through main_ppo, on the same seeds"""
RATE_FROM = {**dict.fromkeys((*ABLATIONS, *TAUS), "oar_g"),
             **dict.fromkeys((*MAIN_PPO_ONLY, MAIN_PPO_CONTROL), BASELINE), "oar_g_main_ppo": "oar_g"}
"""a method evaluated without tuning runs -> the method whose tuned rate it runs at (docs/study.md)"""
FULL = "oar_g"
"""the full method H3's ablations and H4's tau variants are compared with"""
FILLER_WORDS = {"fill2": 2, "fill8": 8, "fill32": 32, "fill64": 64}
"""H5's x axis: filler words per gap of each task"""
H1_TASKS = ("fill2", "fill8", "fill32")
"""the tasks of H1's Bonferroni family; fill64 (pre-registered later, R2) is tested at 95%"""
REPLICATION_TASK, REPLICATION_METHODS = "fill32", ("oar_g", "oar_p_chunk16")
"""R1 (docs/study.md, pre-registered 2026-12-06): OAR-G is the one confirmatory comparison, OAR-P chunk secondary"""
GROWTH_TASK = "fill64"
"""R2: the longer task whose OAR-G effect is compared with the replication's fill32 effect"""
POWER_EFFECT, Z_TWO_SIDED_95, Z_POWER_80 = 0.10, 1.959964, 0.841621


def planned_val_steps(steps: int) -> list[int]:
    """The steps at which a run of ``steps`` steps validates: 0, every ``VAL_EVERY``, and the last."""
    return sorted({*range(0, steps + 1, VAL_EVERY), steps})


def run_endpoints(run: Mapping, steps: int) -> dict:
    """One run's endpoints; ``steps``: the phase's run length. A stopped run (``error``: a guard or a crash) counts
    ``steps + 1``, censored; its held-out curve is what it recorded before the stop (none if the store kept none)
    followed by 0 at every planned validation step after the stop, so it enters every comparison."""
    if "error" in run:
        recorded = sorted((int(s), float(v)) for s, v in run.get("val_accuracy", {}).items())
        last = recorded[-1][0] if recorded else -1
        points = recorded + [(s, 0.0) for s in planned_val_steps(steps) if s > last]
        return {"steps": float(steps + 1), "censored": True, "auc": curve_auc(points), "final": points[-1][1],
                "error": True}
    reached, censored = steps_to_threshold_censored(run["reward"], THRESHOLD, WINDOW)
    points = sorted((int(s), float(v)) for s, v in run["val_accuracy"].items())
    return {"steps": reached, "censored": censored, "auc": curve_auc(points), "final": points[-1][1], "error": False}


def _cells(runs: Sequence[Mapping], phase: str, task: str) -> dict[tuple[str, float], dict[int, Mapping]]:
    out: dict[tuple[str, float], dict[int, Mapping]] = {}
    for r in runs:
        if r["phase"] == phase and r["task"] == task:
            out.setdefault((r["method"], float(r["lr"])), {})[int(r["seed"])] = r
    return out


def _phase_steps(cell: Mapping[int, Mapping]) -> int:
    """The cell's run length: each run's configured ``steps`` (a finished run's curve must have that many)."""
    lengths = {int(r["steps"]) for r in cell.values()}
    if len(lengths) != 1:
        raise ValueError(f"runs of one cell differ in length: {sorted(lengths)}")
    for r in cell.values():
        if "error" not in r and len(r["reward"]) != int(r["steps"]):
            raise ValueError(f"run seed {r['seed']} has {len(r['reward'])} steps of reward, configured {r['steps']}")
    return lengths.pop()


def tune(runs: Sequence[Mapping], task: str) -> dict[str, dict]:
    """Per method: every grid rate's mean steps / mean AUC on the tuning seeds and the chosen rate."""
    by_method: dict[str, dict[float, dict]] = {}
    for (method, lr), cell in _cells(runs, "tuning", task).items():
        steps = _phase_steps(cell)
        ends = [run_endpoints(cell[s], steps) for s in sorted(cell)]
        by_method.setdefault(method, {})[lr] = {
            "seeds": sorted(cell), "mean_steps": statistics.fmean(e["steps"] for e in ends),
            "mean_auc": statistics.fmean(e["auc"] for e in ends), "stopped": sum(e["error"] for e in ends),
            "censored": sum(e["censored"] for e in ends), "steps": [e["steps"] for e in ends], "run_steps": steps}
    out = {}
    for method, grid in by_method.items():
        chosen = min(grid, key=lambda lr: (grid[lr]["mean_steps"], -grid[lr]["mean_auc"], lr))
        out[method] = {"grid": {f"{lr:g}": v for lr, v in sorted(grid.items())}, "lr": chosen}
    return out


def eval_steps(tuning: Mapping[str, dict]) -> int:
    """Evaluation run length: twice tuned GRPO's median steps on the tuning seeds, up to a multiple of 4, in [12, 64]."""
    grpo = tuning[BASELINE]
    median = statistics.median(grpo["grid"][f"{grpo['lr']:g}"]["steps"])
    return int(min(64, max(12, 4 * math.ceil(2 * median / 4))))


def _paired_endpoints(method: Mapping[int, Mapping], base: Mapping[int, Mapping]):
    """(common seeds, the method's endpoints, the baseline's endpoints), one per common seed."""
    seeds = sorted(set(method) & set(base))
    if len(seeds) < 2:
        raise ValueError(f"need >= 2 paired seeds, got {seeds}")
    m_len, b_len = _phase_steps(method), _phase_steps(base)
    return seeds, [run_endpoints(method[s], m_len) for s in seeds], [run_endpoints(base[s], b_len) for s in seeds]


def _relative_steps_statistic(ms: Sequence[float], bs: Sequence[float]):
    def rel(idx: Sequence[int]) -> float:
        base_mean = statistics.fmean(bs[i] for i in idx)
        return (statistics.fmean(ms[i] for i in idx) - base_mean) / base_mean
    return rel


def relative_steps(method: Mapping[int, Mapping], base: Mapping[int, Mapping], *, level: float) -> dict:
    """The primary endpoint alone: relative change of mean steps, method vs baseline (paired), interval at
    ``level``; the same numbers as ``compare_cells(...)["relative_steps"]`` at that level, without its other
    bootstraps (the comparison against every GRPO rate needs only this)."""
    seeds, m, b = _paired_endpoints(method, base)
    rel = _relative_steps_statistic([e["steps"] for e in m], [e["steps"] for e in b])
    return bootstrap(list(range(len(seeds))), statistic=rel, resamples=RESAMPLES, seed=RNG_SEED, level=level).as_dict()


_SQRT_BITS = 2 * sys.float_info.mant_dig + 3
"""the guard bits of ``statistics``' correctly rounded square root of a fraction (Python 3.11's ``_sqrt_bit_width``)"""


def _sqrt_of_fraction(n: int, m: int) -> float:
    """sqrt(n / m) correctly rounded to a float (n >= 0, m > 0): round-to-odd on an integer square root with
    ``_SQRT_BITS`` guard bits, as ``statistics.stdev`` takes it (Python >= 3.11, ``_float_sqrt_of_frac``)."""
    q = (n.bit_length() - m.bit_length() - _SQRT_BITS) // 2
    if q >= 0:
        m <<= 2 * q
        a = math.isqrt(n // m)
        return ((a | (a * a * m != n)) << q) / 1
    n <<= -2 * q
    a = math.isqrt(n // m)
    return (a | (a * a * m != n)) / (1 << -q)


def _resampled_stdev(values: Sequence[float]):
    """``idx -> statistics.stdev(values[i] for i in idx)``, bit for bit, in integer arithmetic. ``stdev`` (Python >=
    3.11) is the correctly rounded square root of the exact sample variance, which it sums in fractions; here every
    value is an integer multiple of one power of 2 (its exact ratio, scaled once), so a resample's variance is a
    ratio of two integers, reduced as ``Fraction`` reduces it. The SD ratios' bootstraps spent most of the study
    analysis's time in ``stdev``'s fractions. Non-finite values: ``statistics.stdev`` itself."""
    if not all(math.isfinite(v) for v in values):
        return lambda idx: statistics.stdev(values[i] for i in idx)
    ratios = [float(v).as_integer_ratio() for v in values]  # (numerator, power-of-2 denominator)
    scale = max(d for _, d in ratios)
    ints = [n * (scale // d) for n, d in ratios]
    squares = [x * x for x in ints]

    def stdev(idx: Sequence[int]) -> float:
        n = len(idx)
        if n < 2:
            raise statistics.StatisticsError("stdev requires at least two data points")
        sx, sxx = sum(map(ints.__getitem__, idx)), sum(map(squares.__getitem__, idx))
        num, den = n * sxx - sx * sx, n * (n - 1) * scale * scale  # variance = num / den, exactly
        g = math.gcd(num, den)
        return _sqrt_of_fraction(num // g, den // g)

    return stdev


def compare_cells(method: Mapping[int, Mapping], base: Mapping[int, Mapping], *, level: float) -> dict:
    """Method vs baseline on their common seeds (paired; every pair, stopped runs included): relative change of mean
    steps (interval at ``level``), AUC and final differences (95%), SD ratios of AUC and of steps (95%), censored
    fractions, stopped runs per arm (``errors``, ``baseline_errors``)."""
    seeds, m, b = _paired_endpoints(method, base)
    ms, bs = [e["steps"] for e in m], [e["steps"] for e in b]
    rel = _relative_steps_statistic(ms, bs)

    def sd_ratio(values_m: Sequence[float], values_b: Sequence[float]):
        stdev_m, stdev_b = _resampled_stdev(values_m), _resampled_stdev(values_b)

        def stat(idx: Sequence[int]) -> float:
            sb = stdev_b(idx)
            if sb == 0:
                raise statistics.StatisticsError("baseline standard deviation 0 in this resample")
            return stdev_m(idx) / sb
        return bootstrap(list(range(len(values_m))), statistic=stat, resamples=RESAMPLES, seed=RNG_SEED).as_dict()

    index = list(range(len(seeds)))
    usable = [(x["auc"], y["auc"], x["final"], y["final"]) for x, y in zip(m, b)]
    return {
        "seeds": seeds,
        "mean_steps": statistics.fmean(ms), "baseline_mean_steps": statistics.fmean(bs),
        "relative_steps": bootstrap(index, statistic=rel, resamples=RESAMPLES, seed=RNG_SEED, level=level).as_dict(),
        "relative_steps_95": bootstrap(index, statistic=rel, resamples=RESAMPLES, seed=RNG_SEED).as_dict(),
        "auc_diff": paired_bootstrap([p[0] for p in usable], [p[1] for p in usable], resamples=RESAMPLES,
                                     seed=RNG_SEED).as_dict(),
        "final_diff": paired_bootstrap([p[2] for p in usable], [p[3] for p in usable], resamples=RESAMPLES,
                                       seed=RNG_SEED).as_dict(),
        "sd_ratio_auc": sd_ratio([p[0] for p in usable], [p[1] for p in usable]),
        "sd_ratio_steps": sd_ratio(ms, bs),
        "censored": sum(e["censored"] for e in m) / len(m), "baseline_censored": sum(e["censored"] for e in b) / len(b),
        "errors": sum(e["error"] for e in m), "baseline_errors": sum(e["error"] for e in b),
    }


def interval_verdict(interval: Mapping, below: tuple[float, str], above: tuple[float, str]) -> str:
    """Every verdict's rule: ``below``'s word when the interval lies below ``below``'s value (checked first),
    ``above``'s when it lies above ``above``'s value, "inconclusive" otherwise or when the interval has no ends."""
    low, high = interval["low"], interval["high"]
    if low is None or high is None:
        return "inconclusive"
    if high < below[0]:
        return below[1]
    if low > above[0]:
        return above[1]
    return "inconclusive"


def h1_verdict(interval: Mapping) -> str:
    """supported: the (Bonferroni) interval of the relative change lies below 0; not supported: it excludes the
    paper's -18% (lies above it); inconclusive otherwise."""
    return interval_verdict(interval, (0, "supported"), (PAPER_H1, "not supported"))


def steps_difference(method: Mapping[int, Mapping], full: Mapping[int, Mapping]) -> dict:
    """H3 / H4: mean steps of ``method`` minus ``full``'s on their common seeds (paired bootstrap, 95%)."""
    seeds, m, f = _paired_endpoints(method, full)
    return {"seeds": seeds, **paired_bootstrap([e["steps"] for e in m], [e["steps"] for e in f], resamples=RESAMPLES,
                                               seed=RNG_SEED).as_dict()}


def slower_verdict(interval: Mapping) -> str:
    """H3 and H4 (a variant is slower than full OAR-G at tau 0.5; the paper gives no size): supported when the
    interval of the steps difference lies above 0, not supported when it lies below 0 (the variant is faster),
    inconclusive otherwise."""
    return interval_verdict(interval, (0, "not supported"), (0, "supported"))


def h4_verdict(variants: Mapping[str, Mapping]) -> str | None:
    """tau 0.5 is best: supported when both other taus are slower (supported), not supported when either is faster;
    None until both tau variants have been compared."""
    verdicts = [variants[m]["verdict"] for m in TAUS if m in variants]
    if len(verdicts) < len(TAUS):
        return None
    if all(v == "supported" for v in verdicts):
        return "supported"
    return "not supported" if "not supported" in verdicts else "inconclusive"


def _slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def h5_slopes(cells_by_task: Mapping[str, Mapping[str, tuple]]) -> dict:
    """Per H1 method present at >= 2 tasks: the slope of the primary effect (relative change of mean steps vs tuned
    GRPO) over log2(filler words), with a 95% percentile interval from ``RESAMPLES`` resamples, each drawing every
    task's seed indices independently (``random.Random(RNG_SEED)``, tasks in ``FILLER_WORDS`` order); a negative
    slope means the gain grows with filler. ``cells_by_task``: task -> {method: (method cell, GRPO cell)}."""
    import random

    out = {}
    for method in H1_METHODS:
        tasks = [t for t in FILLER_WORDS if method in cells_by_task.get(t, {})]
        if len(tasks) < 2:
            continue
        xs = [math.log2(FILLER_WORDS[t]) for t in tasks]
        series = []  # per task: (method steps, GRPO steps), on the common seeds
        for t in tasks:
            _, m, b = _paired_endpoints(*cells_by_task[t][method])
            series.append(([e["steps"] for e in m], [e["steps"] for e in b]))

        def effect(ms, bs, idx):
            base = statistics.fmean(bs[i] for i in idx)
            return (statistics.fmean(ms[i] for i in idx) - base) / base

        estimate = _slope(xs, [effect(ms, bs, range(len(ms))) for ms, bs in series])
        rng, slopes = random.Random(RNG_SEED), []
        for _ in range(RESAMPLES):
            ys = []
            for ms, bs in series:
                n = len(ms)
                ys.append(effect(ms, bs, resample_indices(rng, n)))
            slopes.append(_slope(xs, ys))
        slopes.sort()
        a, last = 0.025, len(slopes) - 1
        low, high = slopes[math.floor(a * last)], slopes[math.ceil((1 - a) * last)]
        out[method] = {"tasks": tasks, "log2_filler": xs, "estimate": estimate, "low": low, "high": high,
                       "level": 0.95, "verdict": interval_verdict({"low": low, "high": high}, (0, "supported"),
                                                                  (0, "not supported"))}
    return out


def h2_verdict(interval: Mapping) -> str:
    """supported: the SD ratio's interval lies below 1; not supported: it lies above the paper's 0.6."""
    return interval_verdict(interval, (1, "supported"), (PAPER_H2, "not supported"))


def analyse_task(runs: Sequence[Mapping], task: str) -> dict:
    """Tuning, evaluation length and (when the evaluation phase has runs) every pre-registered comparison."""
    tuning = tune(runs, task)
    out: dict = {"tuning": tuning}
    if BASELINE not in tuning:
        return out
    out["eval_steps"] = eval_steps(tuning)
    cells = _cells(runs, "eval", task)
    if not cells:
        return out
    lr_of = {m: t["lr"] for m, t in tuning.items()}
    for method, source in RATE_FROM.items():
        if method not in lr_of and source in lr_of:
            lr_of[method] = lr_of[source]
    base = cells.get((BASELINE, lr_of[BASELINE]))
    full = cells.get((FULL, lr_of.get(FULL, math.nan)))
    comparisons, step_size, variants = {}, {}, {}
    control = cells.get((MAIN_PPO_CONTROL, lr_of.get(MAIN_PPO_CONTROL, math.nan)))
    for method in sorted({m for m, _ in cells} - {BASELINE}):
        cell = cells.get((method, lr_of.get(method, math.nan)))
        if cell is None or base is None:
            continue
        in_h1 = method in H1_METHODS and task in H1_TASKS
        level = H1_LEVEL if in_h1 else 0.95
        # the main_ppo-only methods against GRPO through main_ppo when that control exists; else against the fast
        # runner's GRPO, flagged: two runners, not comparable
        same_runner = method not in MAIN_PPO_ONLY or control is not None
        c = compare_cells(cell, control if method in MAIN_PPO_ONLY and control is not None else base, level=level)
        c["lr"], c["baseline_lr"] = lr_of[method], lr_of[BASELINE]
        c["baseline"] = MAIN_PPO_CONTROL if method in MAIN_PPO_ONLY and control is not None else BASELINE
        c["same_runner"] = same_runner
        if in_h1:  # H1 and H2 are claims about OAR; the other rows are exploratory numbers only
            c["h1_verdict"] = h1_verdict(c["relative_steps"])
            c["h2_verdict_auc"] = h2_verdict(c["sd_ratio_auc"])
        comparisons[method] = c
        step_size[method] = {f"{lr:g}": relative_steps(cell, other, level=0.95)
                             for (m, lr), other in sorted(cells.items()) if m == BASELINE}
        if (method in ABLATIONS or method in TAUS) and full is not None:
            d = steps_difference(cell, full)
            d["verdict"] = slower_verdict(d)
            variants[method] = d
    out["comparisons"], out["against_every_grpo_rate"] = comparisons, step_size
    if variants:
        out["vs_full_oar_g"] = variants
    return out


def _h1_cells(runs: Sequence[Mapping], task: str, analysis: Mapping) -> dict:
    """{H1 method: (its cell, GRPO's cell)} at their tuned rates, for the methods the task compared."""
    cells = _cells(runs, "eval", task)
    tuning = analysis.get("tuning", {})
    out = {}
    for method, c in analysis.get("comparisons", {}).items():
        if method in H1_METHODS:
            out[method] = (cells[(method, c["lr"])], cells[(BASELINE, tuning[BASELINE]["lr"])])
    return out


def replication_verdict(interval: Mapping) -> str:
    """R1 and R2's rule: the 95% interval of the relative change lies below 0 (the method is faster), above 0
    (slower), or covers 0."""
    return interval_verdict(interval, (0, "faster"), (0, "slower"))


def seeds_for_effect(method_steps: Sequence[float], base_steps: Sequence[float], effect: float = POWER_EFFECT) -> dict:
    """Seeds a relative change of ``effect`` needs at 80% power, two-sided 5%, at the observed spread of the paired
    differences: n = ceil(((1.960 + 0.842) * sd(d) / (effect * mean(baseline)))^2)."""
    d = [m - b for m, b in zip(method_steps, base_steps, strict=True)]
    sd, base = statistics.stdev(d), statistics.fmean(base_steps)
    n = math.ceil(((Z_TWO_SIDED_95 + Z_POWER_80) * sd / (effect * base)) ** 2)
    return {"effect": effect, "sd_paired_difference": sd, "baseline_mean_steps": base, "seeds": n}


def analyse_replication(runs: Sequence[Mapping], task: str = REPLICATION_TASK) -> dict:
    """R1 (docs/study.md): each replication method against GRPO on the replication seeds at the task's tuned rates
    (95%, every pair), with the original evaluation's interval beside it (at the level the study reported it), the
    pooled estimate over both seed blocks (secondary), and the seeds a 10% effect needs. Empty without runs."""
    cells = _cells(runs, "replication", task)
    if not cells:
        return {}
    lr_of = {m: t["lr"] for m, t in tune(runs, task).items()}
    base = cells.get((BASELINE, lr_of[BASELINE]))
    original = _cells(runs, "eval", task)
    original_base = original.get((BASELINE, lr_of[BASELINE]))
    out = {}
    for method in REPLICATION_METHODS:
        cell = cells.get((method, lr_of.get(method, math.nan)))
        if cell is None or base is None:
            continue
        seeds, m, b = _paired_endpoints(cell, base)
        c = compare_cells(cell, base, level=0.95)
        c.update(lr=lr_of[method], baseline_lr=lr_of[BASELINE], verdict=replication_verdict(c["relative_steps"]),
                 power=seeds_for_effect([e["steps"] for e in m], [e["steps"] for e in b]))
        first = original.get((method, lr_of[method]))
        if first is not None and original_base is not None:
            if set(first) & set(cell):
                overlap = sorted(set(first) & set(cell))
                raise ValueError(f"{task}: the replication's seeds overlap the evaluation's: {overlap}")
            level = H1_LEVEL if method in H1_METHODS and task in H1_TASKS else 0.95
            c["original"] = relative_steps(first, original_base, level=level)
            estimate = c["original"]["estimate"]
            c["original_inside"] = c["relative_steps"]["low"] <= estimate <= c["relative_steps"]["high"]
            pooled, pooled_base = {**first, **cell}, {**original_base, **base}
            c["pooled"] = relative_steps(pooled, pooled_base, level=0.95)
            c["pooled_seeds"] = len(set(pooled) & set(pooled_base))
        out[method] = c
    return out


def effect_difference(longer: tuple, shorter: tuple) -> dict:
    """R2's growth: (relative change of mean steps at the longer task) minus (at the shorter), each a (method cell,
    GRPO cell) pair; a 95% percentile interval from ``RESAMPLES`` resamples drawing each task's seeds independently
    (``random.Random(RNG_SEED)``, the longer task first); negative = the gain grows."""
    import random

    series = []
    for method_cell, base_cell in (longer, shorter):
        _, m, b = _paired_endpoints(method_cell, base_cell)
        series.append(([e["steps"] for e in m], [e["steps"] for e in b]))

    def effect(ms, bs, idx):
        base = statistics.fmean(bs[i] for i in idx)
        return (statistics.fmean(ms[i] for i in idx) - base) / base

    (ml, bl), (mshort, bshort) = series
    estimate = effect(ml, bl, range(len(ml))) - effect(mshort, bshort, range(len(mshort)))
    rng, diffs = random.Random(RNG_SEED), []
    for _ in range(RESAMPLES):
        draws = [resample_indices(rng, len(ms)) for ms, _ in series]
        diffs.append(effect(ml, bl, draws[0]) - effect(mshort, bshort, draws[1]))
    diffs.sort()
    last = len(diffs) - 1
    low, high = diffs[math.floor(0.025 * last)], diffs[math.ceil(0.975 * last)]
    verdict = "grows" if high < 0 else "shrinks" if low > 0 else "inconclusive"
    return {"estimate": estimate, "low": low, "high": high, "level": 0.95, "verdict": verdict}


def analyse_growth(results: Mapping, method: str = "oar_g") -> dict:
    """R2: at ``GROWTH_TASK`` (its own tuned rates, evaluation seeds) the method against tuned GRPO (95%) and the
    growth of its effect over the replication's fill32 effect. Empty until both exist. Reads the memoised
    :func:`analyse` of ``results`` (its bootstraps are not run again)."""
    runs = results["runs"]
    replication = analyse_replication(runs)
    analysis = analyse(results).get(GROWTH_TASK, {})
    if method not in replication or method not in analysis.get("comparisons", {}):
        return {}
    lr_of = {m: t["lr"] for m, t in analysis["tuning"].items()}
    cells, rep_cells = _cells(runs, "eval", GROWTH_TASK), _cells(runs, "replication", REPLICATION_TASK)
    c = analysis["comparisons"][method]
    rep = replication[method]
    longer = (cells[(method, lr_of[method])], cells[(BASELINE, lr_of[BASELINE])])
    shorter = (rep_cells[(method, rep["lr"])], rep_cells[(BASELINE, rep["baseline_lr"])])
    effect = c["relative_steps_95"]
    return {"task": GROWTH_TASK, "effect": effect, "verdict": replication_verdict(effect),
            "growth": effect_difference(longer, shorter)}


def analyse_runners(runs: Sequence[Mapping], task: str = REPLICATION_TASK) -> dict:
    """Phase ``runners``: per fast-runner method, its main_ppo twin's steps to threshold against the fast runner's on
    the same seeds (relative change of mean steps, 95% paired bootstrap; the paired steps difference too), at the
    task's tuned rate. Empty without runs."""
    cells = _cells(runs, "runners", task)
    if not cells:
        return {}
    lr_of = {m: t["lr"] for m, t in tune(runs, task).items()}
    out = {}
    for fast, twin in MAIN_PPO_TWINS.items():
        lr = lr_of.get(fast, math.nan)
        if (fast, lr) not in cells or (twin, lr) not in cells:
            continue
        c = compare_cells(cells[(twin, lr)], cells[(fast, lr)], level=0.95)
        c["steps_difference"] = steps_difference(cells[(twin, lr)], cells[(fast, lr)])
        c["lr"] = lr
        out[fast] = c
    return out


_ANALYSED: dict[str, dict] = {}


def analyse(results: Mapping) -> dict:
    """Every task with runs in ``results`` (memoised on the runs' content: the bootstraps take seconds, and the
    tables, the figures and the demo's report each ask; treat the returned dict as read-only)."""
    key = json.dumps(results["runs"], sort_keys=True)
    if key not in _ANALYSED:
        tasks = sorted({r["task"] for r in results["runs"]})
        _ANALYSED[key] = {task: analyse_task(results["runs"], task) for task in tasks}
    return _ANALYSED[key]


def analyse_h5(results: Mapping) -> dict:
    """H5 across the tasks of ``results`` (empty until two tasks have evaluation comparisons)."""
    per_task = analyse(results)
    return h5_slopes({t: _h1_cells(results["runs"], t, a) for t, a in per_task.items()})
