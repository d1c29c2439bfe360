"""The study's pre-registered analysis (verl_oar/testbed/study_analysis.py) on hand-built runs whose answers are
worked out by hand here: endpoints, the tuning rule and its tie-breaks, the evaluation length rule, the paired
comparison and the verdict rules."""

from __future__ import annotations

import math
import random

import pytest

from verl_oar.testbed import study_analysis as sa


def _curve(reach: int | None, steps: int) -> list[float]:
    """A reward curve whose trailing-3 mean first reaches 0.8 at step ``reach`` (None: never)."""
    if reach is None:
        return [0.5] * steps
    return [0.5] * (reach - 3) + [0.9] * (steps - reach + 3)


def _run(phase, task, method, lr, seed, reach, steps=32, auc=0.5):
    return {"phase": phase, "task": task, "method": method, "lr": lr, "seed": seed, "steps": steps,
            "reward": _curve(reach, steps), "val_accuracy": {"0": auc, str(steps): auc}}


def test_endpoints_reached_censored_and_crashed():
    assert sa.run_endpoints(_run("t", "x", "m", 1, 0, 7), 32)["steps"] == 7
    never = sa.run_endpoints(_run("t", "x", "m", 1, 0, None), 32)
    assert never["steps"] == 33 and never["censored"]
    crashed = sa.run_endpoints({"error": "boom"}, 24)  # the store kept no curve: 0 at every planned point
    assert crashed["steps"] == 25 and crashed["censored"] and crashed["error"]
    assert crashed["auc"] == 0.0 and crashed["final"] == 0.0


def test_a_stopped_run_keeps_its_recorded_points_and_scores_0_after_its_stop():
    stopped = {"error": "no-answer guard", "reward": [0.5] * 10, "val_accuracy": {"0": 0.4, "4": 0.6, "8": 0.8}}
    e = sa.run_endpoints(stopped, 16)
    # points (0, .4), (4, .6), (8, .8), (12, 0), (16, 0): trapezoids 2 + 2.8 + 1.6 + 0 = 6.4 over 16 steps
    assert e["auc"] == pytest.approx(6.4 / 16) and e["final"] == 0.0 and e["steps"] == 17 and e["censored"]
    assert sa.planned_val_steps(30) == [0, 4, 8, 12, 16, 20, 24, 28, 30]


def test_tuning_picks_lowest_mean_steps_then_auc_then_smaller_rate():
    runs = []
    for seed in range(1000, 1005):
        runs += [_run("tuning", "fill2", "grpo", 0.001, seed, 12), _run("tuning", "fill2", "grpo", 0.002, seed, 9),
                 _run("tuning", "fill2", "grpo", 0.004, seed, None)]
        # oar_g: 0.001 and 0.002 tie on steps; 0.002 has the higher AUC
        runs += [_run("tuning", "fill2", "oar_g", 0.001, seed, 8, auc=0.6),
                 _run("tuning", "fill2", "oar_g", 0.002, seed, 8, auc=0.7)]
        # oar_p: full tie -> the smaller rate
        runs += [_run("tuning", "fill2", "oar_p", 0.001, seed, 10), _run("tuning", "fill2", "oar_p", 0.004, seed, 10)]
    tuned = sa.tune(runs, "fill2")
    assert tuned["grpo"]["lr"] == 0.002 and tuned["grpo"]["grid"]["0.004"]["censored"] == 5
    assert tuned["oar_g"]["lr"] == 0.002
    assert tuned["oar_p"]["lr"] == 0.001
    assert sa.eval_steps(tuned) == 20  # 2 x 9 = 18 -> 20


@pytest.mark.parametrize("median,expected", [(3, 12), (9, 20), (10, 20), (11, 24), (40, 64)])
def test_eval_steps_rule(median, expected):
    tuning = {"grpo": {"lr": 0.001, "grid": {"0.001": {"steps": [median] * 5}}}}
    assert sa.eval_steps(tuning) == expected


def test_relative_change_matches_a_hand_computation_and_a_plain_bootstrap():
    rng = random.Random(3)
    seeds = list(range(2000, 2020))
    base_steps = {s: rng.randint(8, 20) for s in seeds}
    meth_steps = {s: max(4, base_steps[s] - rng.randint(0, 6)) for s in seeds}
    base = {s: _run("eval", "x", "grpo", 1, s, base_steps[s], steps=24) for s in seeds}
    meth = {s: _run("eval", "x", "oar_g", 1, s, meth_steps[s], steps=24) for s in seeds}
    c = sa.compare_cells(meth, base, level=sa.H1_LEVEL)
    mb, mm = sum(base_steps.values()) / 20, sum(meth_steps.values()) / 20
    assert c["relative_steps"]["estimate"] == pytest.approx((mm - mb) / mb, abs=1e-12)
    # the same resampling rule written out plainly
    r = random.Random(sa.RNG_SEED)
    values = []
    for _ in range(sa.RESAMPLES):
        idx = [r.randrange(20) for _ in range(20)]
        b = sum(base_steps[seeds[i]] for i in idx) / 20
        values.append((sum(meth_steps[seeds[i]] for i in idx) / 20 - b) / b)
    values.sort()
    a = (1 - sa.H1_LEVEL) / 2
    assert c["relative_steps"]["low"] == values[math.floor(a * (len(values) - 1))]
    assert c["relative_steps"]["high"] == values[math.ceil((1 - a) * (len(values) - 1))]
    assert c["relative_steps"]["level"] == pytest.approx(1 - 0.05 / 9)
    # the primary endpoint alone (the comparison against every GRPO rate) gives the same numbers
    assert sa.relative_steps(meth, base, level=sa.H1_LEVEL) == c["relative_steps"]
    assert sa.relative_steps(meth, base, level=0.95) == c["relative_steps_95"]


def test_verdict_rules():
    assert sa.h1_verdict({"low": -0.4, "high": -0.05}) == "supported"
    assert sa.h1_verdict({"low": -0.1, "high": 0.2}) == "not supported"  # excludes -18%
    assert sa.h1_verdict({"low": -0.3, "high": 0.1}) == "inconclusive"
    assert sa.h1_verdict({"low": None, "high": None}) == "inconclusive"
    assert sa.h2_verdict({"low": 0.3, "high": 0.9}) == "supported"
    assert sa.h2_verdict({"low": 0.7, "high": 1.4}) == "not supported"
    assert sa.h2_verdict({"low": 0.5, "high": 1.2}) == "inconclusive"


def test_analyse_task_compares_each_method_at_its_tuned_rate_and_grpo_at_every_rate():
    runs = []
    for seed in range(1000, 1005):
        for lr, reach in ((0.001, 10), (0.002, 8)):
            runs += [_run("tuning", "fill2", "grpo", lr, seed, reach), _run("tuning", "fill2", "oar_g", lr, seed, reach + 1)]
    for seed in range(2000, 2006):
        for lr, reach in ((0.001, 10), (0.002, 8)):
            runs.append(_run("eval", "fill2", "grpo", lr, seed, reach + seed % 2, steps=16))
        runs.append(_run("eval", "fill2", "oar_g", 0.002, seed, 6 + seed % 3, steps=16))
    out = sa.analyse_task(runs, "fill2")
    assert out["eval_steps"] == 16
    c = out["comparisons"]["oar_g"]
    assert c["lr"] == 0.002 and c["baseline_lr"] == 0.002 and c["seeds"] == list(range(2000, 2006))
    # GRPO at 0.002 reaches at 8 (even seeds) / 9 (odd); oar_g at 6, 7, 8 by seed % 3: mean 7 vs 8.5
    assert c["relative_steps"]["estimate"] == pytest.approx((7 - 8.5) / 8.5)
    assert c["h1_verdict"] in ("supported", "not supported", "inconclusive")
    assert set(out["against_every_grpo_rate"]["oar_g"]) == {"0.001", "0.002"}


def test_mismatched_run_lengths_in_a_cell_are_refused():
    cell = {1: _run("eval", "x", "grpo", 1, 1, 5, steps=16), 2: _run("eval", "x", "grpo", 1, 2, 5, steps=20)}
    with pytest.raises(ValueError, match="differ in length"):
        sa._phase_steps(cell)
    short = _run("eval", "x", "grpo", 1, 3, 5, steps=16)
    short["reward"] = short["reward"][:10]
    with pytest.raises(ValueError, match="has 10 steps of reward, configured 16"):
        sa._phase_steps({3: short})


def test_a_cell_whose_runs_all_crashed_counts_every_run_censored():
    runs = [{"phase": "tuning", "task": "x", "method": "grpo", "lr": 0.004, "seed": s, "steps": 32, "error": "x"}
            for s in range(1000, 1005)]
    runs += [_run("tuning", "x", "grpo", 0.001, s, 10) for s in range(1000, 1005)]
    tuned = sa.tune(runs, "x")
    assert tuned["grpo"]["grid"]["0.004"]["mean_steps"] == 33 and tuned["grpo"]["grid"]["0.004"]["censored"] == 5
    assert tuned["grpo"]["lr"] == 0.001


def test_a_stopped_run_is_counted_in_every_comparison():
    seeds = list(range(2000, 2008))
    base = {s: _run("eval", "x", "grpo", 1, s, 8 + s % 3, steps=16, auc=0.5 + (s % 4) / 10) for s in seeds}
    meth = {s: _run("eval", "x", "oar_g", 1, s, 7 + s % 2, steps=16, auc=0.6 + (s % 3) / 10) for s in seeds}
    meth[2003] = {"phase": "eval", "task": "x", "method": "oar_g", "lr": 1, "seed": 2003, "steps": 16, "error": "x"}
    c = sa.compare_cells(meth, base, level=0.95)
    assert c["errors"] == 1 and c["censored"] == 1 / 8 and c["mean_steps"] == pytest.approx(
        (sum(7 + s % 2 for s in seeds if s != 2003) + 17) / 8)
    assert c["auc_diff"]["n"] == 8 and c["final_diff"]["n"] == 8 and c["sd_ratio_auc"]["n"] == 8
    assert c["sd_ratio_steps"]["n"] == 8 and c["baseline_errors"] == 0
    # the stopped run's AUC is 0 (no stored curve), so the mean AUC difference is the plain one with it at 0
    ends = {s: sa.run_endpoints(r, 16) for s, r in meth.items()}
    want = sum(ends[s]["auc"] - sa.run_endpoints(base[s], 16)["auc"] for s in seeds) / 8
    assert ends[2003]["auc"] == 0.0 and c["auc_diff"]["estimate"] == pytest.approx(want)


def test_stopped_runs_in_one_arm_only_are_counted_and_lower_that_arm():
    """The bias the old rule had: dropping pairs with a stopped run kept GRPO's collapsed runs and lost the method's.
    Here the method's 3 stopped runs stay, with their recorded points, and pull its AUC down."""
    seeds = list(range(2000, 2010))
    base = {s: _run("eval", "x", "grpo", 1, s, None, steps=16, auc=0.3) for s in seeds}  # GRPO never gets there
    meth = {s: _run("eval", "x", "oar_g", 1, s, 8, steps=16, auc=0.9) for s in seeds}
    for s in seeds[:3]:
        meth[s] = {"phase": "eval", "task": "x", "method": "oar_g", "lr": 1, "seed": s, "steps": 16,
                   "error": "no-answer guard", "reward": [0.5] * 5, "val_accuracy": {"0": 0.9, "4": 0.9}}
    c = sa.compare_cells(meth, base, level=0.95)
    assert c["seeds"] == seeds and c["errors"] == 3 and c["baseline_errors"] == 0
    assert c["censored"] == 0.3 and c["baseline_censored"] == 1.0
    stopped_auc = (0.9 * 4 + 0.45 * 4) / 16  # (0, .9), (4, .9), (8, 0), (12, 0), (16, 0)
    assert c["auc_diff"]["estimate"] == pytest.approx((7 * 0.9 + 3 * stopped_auc) / 10 - 0.3)
    assert c["final_diff"]["estimate"] == pytest.approx((7 * 0.9 + 3 * 0.0) / 10 - 0.3)
    assert c["auc_diff"]["n"] == 10


def _tuned(task: str) -> list[dict]:
    """Tuning runs that tune GRPO and OAR-G to 0.002 at ``task``."""
    runs = []
    for seed in range(1000, 1005):
        for lr, reach in ((0.001, 10), (0.002, 8)):
            runs += [_run("tuning", task, "grpo", lr, seed, reach), _run("tuning", task, "oar_g", lr, seed, reach)]
    return runs


def test_h3_h4_variants_run_at_oar_gs_rate_and_are_compared_with_full_oar_g():
    runs = _tuned("fill32")
    for seed in range(2000, 2006):
        runs.append(_run("eval", "fill32", "grpo", 0.002, seed, 9, steps=16))
        runs.append(_run("eval", "fill32", "oar_g", 0.002, seed, 6 + seed % 2, steps=16))
        runs.append(_run("eval", "fill32", "oar_g_no_amplify", 0.002, seed, 9 + seed % 2, steps=16))   # 3 slower
        runs.append(_run("eval", "fill32", "oar_g_no_amplify", 0.001, seed, 4, steps=16))  # not its rate: ignored
        runs.append(_run("eval", "fill32", "oar_g_tau0.25", 0.002, seed, 4 + seed % 2, steps=16))      # 2 faster
        runs.append(_run("eval", "fill32", "oar_g_tau0.75", 0.002, seed, 6 + (seed + 1) % 2, steps=16))  # +-1
    out = sa.analyse_task(runs, "fill32")
    v = out["vs_full_oar_g"]
    assert set(v) == {"oar_g_no_amplify", "oar_g_tau0.25", "oar_g_tau0.75"}
    assert v["oar_g_no_amplify"]["estimate"] == 3 and v["oar_g_no_amplify"]["low"] == pytest.approx(3)
    assert v["oar_g_no_amplify"]["verdict"] == "supported"
    assert v["oar_g_tau0.25"]["estimate"] == -2 and v["oar_g_tau0.25"]["verdict"] == "not supported"
    assert v["oar_g_tau0.75"]["estimate"] == 0 and v["oar_g_tau0.75"]["verdict"] == "inconclusive"
    assert out["comparisons"]["oar_g_no_amplify"]["lr"] == 0.002  # OAR-G's tuned rate, against tuned GRPO
    # H1 and H2 are claims about OAR: a variant's row carries numbers, no verdict
    assert "h2_verdict_auc" in out["comparisons"]["oar_g"]
    assert not {"h1_verdict", "h2_verdict_auc"} & set(out["comparisons"]["oar_g_no_amplify"])
    assert sa.slower_verdict({"low": None, "high": None}) == "inconclusive"
    assert sa.h4_verdict(v) == "not supported"  # tau 0.25 is faster
    assert sa.h4_verdict({"oar_g_tau0.25": {"verdict": "supported"}}) is None
    both = {"oar_g_tau0.25": {"verdict": "supported"}, "oar_g_tau0.75": {"verdict": "supported"}}
    assert sa.h4_verdict(both) == "supported"
    assert sa.h4_verdict({**both, "oar_g_tau0.75": {"verdict": "inconclusive"}}) == "inconclusive"


def test_h5_slope_over_log2_filler_with_each_tasks_seeds_resampled_independently():
    rng = random.Random(7)
    runs, steps = [], {}
    for task, shrink in (("fill2", 0), ("fill8", 2), ("fill32", 4)):
        runs += _tuned(task)
        for seed in range(2000, 2012):
            b = rng.randint(10, 14)
            m = max(4, b - shrink - rng.randint(0, 2))
            steps.setdefault(task, []).append((m, b))
            runs.append(_run("eval", task, "grpo", 0.002, seed, b, steps=20))
            runs.append(_run("eval", task, "oar_g", 0.002, seed, m, steps=20))
    results = {"runs": runs}
    h5 = sa.analyse_h5(results)
    assert set(h5) == {"oar_g"} and h5["oar_g"]["tasks"] == ["fill2", "fill8", "fill32"]
    xs = [1.0, 3.0, 5.0]

    def effect(pairs):
        b = sum(p[1] for p in pairs) / len(pairs)
        return (sum(p[0] for p in pairs) / len(pairs) - b) / b

    def slope(ys):  # least squares by hand
        mx, my = sum(xs) / 3, sum(ys) / 3
        return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)

    full = [effect(steps[t]) for t in ("fill2", "fill8", "fill32")]
    assert h5["oar_g"]["estimate"] == pytest.approx(slope(full), abs=1e-12) and h5["oar_g"]["estimate"] < 0
    r, values = random.Random(sa.RNG_SEED), []  # the resampling rule written out plainly
    for _ in range(sa.RESAMPLES):
        values.append(slope([effect([steps[t][r.randrange(12)] for _ in range(12)]) for t in ("fill2", "fill8", "fill32")]))
    values.sort()
    assert h5["oar_g"]["low"] == pytest.approx(values[math.floor(0.025 * (len(values) - 1))], abs=1e-12)
    assert h5["oar_g"]["high"] == pytest.approx(values[math.ceil(0.975 * (len(values) - 1))], abs=1e-12)
    assert h5["oar_g"]["verdict"] == ("supported" if h5["oar_g"]["high"] < 0 else "inconclusive")
    one_task = {"runs": [r for r in runs if r["task"] == "fill2"]}
    assert sa.analyse_h5(one_task) == {}  # H5 needs two tasks


def test_power_statement_is_the_normal_approximation_worked_by_hand():
    # d = +1, -1, +1, -1: sd = sqrt(4/3); GRPO's mean 10; n = ceil((2.801585 * 1.154701 / (0.1 * 10))^2) = 11
    power = sa.seeds_for_effect([11, 9, 11, 9], [10, 10, 10, 10])
    assert power["seeds"] == 11 and power["sd_paired_difference"] == pytest.approx(math.sqrt(4 / 3))
    assert sa.seeds_for_effect([11, 9, 11, 9], [10, 10, 10, 10], effect=0.2)["seeds"] == 3


def _replication_runs(effect_steps: int, *, overlap: bool = False) -> list[dict]:
    """fill32 tuned to 0.001 for all three methods, an evaluation on 2000-2009 (OAR-G 2 steps sooner) and a
    replication on 4000-4009 (OAR-G ``effect_steps`` sooner, OAR-P chunk equal to GRPO)."""
    runs = []
    for seed in range(1000, 1005):
        runs += [_run("tuning", "fill32", m, 0.001, seed, 12) for m in ("grpo", "oar_g", "oar_p_chunk16")]
    for seed in range(2000, 2010):
        runs += [_run("eval", "fill32", "grpo", 0.001, seed, 14 + seed % 3),
                 _run("eval", "fill32", "oar_g", 0.001, seed, 12 + seed % 3),
                 _run("eval", "fill32", "oar_p_chunk16", 0.001, seed, 14 + seed % 3)]
    for seed in (range(2005, 2015) if overlap else range(4000, 4010)):
        runs += [_run("replication", "fill32", "grpo", 0.001, seed, 14 + seed % 4),
                 _run("replication", "fill32", "oar_g", 0.001, seed, 14 - effect_steps + seed % 4),
                 _run("replication", "fill32", "oar_p_chunk16", 0.001, seed, 14 + seed % 4)]
    return runs


def test_replication_is_judged_on_its_own_seeds_with_the_original_and_pooled_beside_it():
    rep = sa.analyse_replication(_replication_runs(1))
    g, p = rep["oar_g"], rep["oar_p_chunk16"]
    grpo = [14 + s % 4 for s in range(4000, 4010)]
    assert g["seeds"] == list(range(4000, 4010)) and g["relative_steps"]["level"] == 0.95
    assert g["relative_steps"]["estimate"] == pytest.approx(-10 / sum(grpo))
    assert g["verdict"] == "faster" and p["verdict"] == "inconclusive"  # a constant -1 step: every resample < 0
    assert g["original"]["estimate"] == pytest.approx(-20 / sum(14 + s % 3 for s in range(2000, 2010)))
    assert g["original"]["level"] == pytest.approx(sa.H1_LEVEL) and g["original_inside"] is False
    assert g["pooled_seeds"] == 20
    assert g["pooled"]["estimate"] == pytest.approx(-30 / (sum(grpo) + sum(14 + s % 3 for s in range(2000, 2010))))
    assert g["power"]["seeds"] == 0  # no spread in the paired differences: any n detects it (reported as is)
    assert sa.analyse_replication(_replication_runs(-1))["oar_g"]["verdict"] == "slower"
    with pytest.raises(ValueError, match="overlap"):
        sa.analyse_replication(_replication_runs(1, overlap=True))
    assert sa.analyse_replication([r for r in _replication_runs(1) if r["phase"] != "replication"]) == {}


def test_growth_resamples_each_task_independently_and_reads_the_sign():
    def cells(method_steps, base_steps, first_seed):
        def cell(method, steps):
            return {first_seed + i: _run("eval", "t", method, 1, first_seed + i, s, steps=64) for i, s in enumerate(steps)}
        return cell("oar_g", method_steps), cell("grpo", base_steps)

    longer = cells([10, 12, 10, 12, 11], [20, 20, 21, 19, 20], 2000)    # -45%
    shorter = cells([18, 19, 18, 19, 18], [20, 20, 21, 19, 20], 4000)   # -8%
    d = sa.effect_difference(longer, shorter)
    assert d["estimate"] == pytest.approx(55 / 100 - 92 / 100) and d["verdict"] == "grows"
    assert sa.effect_difference(shorter, longer)["verdict"] == "shrinks"
    same = sa.effect_difference(shorter, shorter)
    assert same["estimate"] == 0.0 and same["verdict"] == "inconclusive" and same["low"] < 0 < same["high"]


def test_main_ppo_methods_are_compared_with_grpo_through_main_ppo_when_it_ran_and_flagged_otherwise():
    runs = _tuned("fill32")
    for seed in range(2000, 2005):
        runs += [_run("eval", "fill32", "grpo", 0.002, seed, 10), _run("eval", "fill32", "cscr", 0.002, seed, 12)]
    alone = sa.analyse_task(runs, "fill32")["comparisons"]["cscr"]
    assert alone["same_runner"] is False and alone["baseline"] == "grpo" and alone["baseline_mean_steps"] == 10
    runs += [_run("eval", "fill32", "grpo_main_ppo", 0.002, seed, 11) for seed in range(2000, 2005)]
    comps = sa.analyse_task(runs, "fill32")["comparisons"]
    assert comps["cscr"]["same_runner"] is True and comps["cscr"]["baseline"] == "grpo_main_ppo"
    assert comps["cscr"]["baseline_mean_steps"] == 11 and comps["cscr"]["relative_steps"]["estimate"] == 1 / 11
    # the control itself is compared with the fast runner's GRPO: the two runners on the same seeds
    assert comps["grpo_main_ppo"]["baseline"] == "grpo" and comps["grpo_main_ppo"]["mean_steps"] == 11


def test_runners_phase_compares_each_method_with_its_main_ppo_twin_on_the_same_seeds():
    runs = _tuned("fill32")
    for seed in range(7000, 7006):
        runs += [_run("runners", "fill32", "grpo", 0.002, seed, 10 + seed % 2),
                 _run("runners", "fill32", "grpo_main_ppo", 0.002, seed, 10 + seed % 3),
                 _run("runners", "fill32", "oar_g", 0.002, seed, 9)]
    out = sa.analyse_runners(runs)
    assert set(out) == {"grpo"}  # OAR-G has no main_ppo twin here
    c = out["grpo"]
    fast, twin = [10 + s % 2 for s in range(7000, 7006)], [10 + s % 3 for s in range(7000, 7006)]
    assert c["seeds"] == list(range(7000, 7006)) and c["lr"] == 0.002
    assert c["steps_difference"]["estimate"] == pytest.approx((sum(twin) - sum(fast)) / 6)
    assert c["relative_steps"]["estimate"] == pytest.approx((sum(twin) - sum(fast)) / sum(fast))
    assert sa.analyse_runners(_tuned("fill32")) == {}


def test_the_sd_ratios_stdev_is_statistics_stdev_bit_for_bit():
    """The SD ratios' bootstraps take each resample's standard deviation in integer arithmetic
    (``_resampled_stdev``); it must be ``statistics.stdev`` of the same values, bit for bit, or the committed tables
    would move: steps (integers, censored ones too), AUCs and finals (fractions of a held-out set), values far apart in
    scale, a constant resample (0), and non-finite values (left to ``statistics.stdev``)."""
    import statistics

    rng = random.Random(5)
    lists = [
        [float(rng.randrange(4, 65)) for _ in range(18)],
        [rng.randrange(200) / 200 for _ in range(12)],
        [rng.random() * 10 ** rng.randrange(-8, 9) for _ in range(9)],
        [0.1, 0.1, 0.1, 0.30000000000000004, 1e-300, 3.5, 7],
        [2.0, 2.0, 2.0],
    ]
    for values in lists:
        stdev = sa._resampled_stdev(values)
        for _ in range(2000):
            idx = [rng.randrange(len(values)) for _ in values]
            assert stdev(idx) == statistics.stdev(values[i] for i in idx), (values, idx)

    def outcome(f):
        try:
            return repr(f())
        except Exception as e:  # what stdev does with non-finite values (3.11.7: an AttributeError for NaN)
            return type(e).__name__

    for bad in ([1.0, float("inf"), 2.0], [1.0, float("nan"), 2.0]):
        assert outcome(lambda: sa._resampled_stdev(bad)([0, 1, 2])) == outcome(lambda: statistics.stdev(bad))
    with pytest.raises(statistics.StatisticsError):
        sa._resampled_stdev([1.0, 2.0])([0])
