"""docs/study.md's result tables are what ``python -m verl_oar.testbed.study_report`` renders from the committed results
JSON (benchmarks/results_study_cpu.json), line for line; and the figures render from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verl_oar.testbed import study_report

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results_study_cpu.json"
PAGE = ROOT / "docs" / "study.md"


@pytest.fixture(scope="module")
def results():
    if not RESULTS.exists():
        pytest.fail(f"{RESULTS} is missing: the study's committed results (benchmarks/study.py collect)")
    return json.loads(RESULTS.read_text())


@pytest.fixture(scope="module")
def analysis(results):
    return study_report.sa.analyse(results)


def test_the_page_quotes_the_rendered_tables(results):
    results_part = PAGE.read_text().split("\n## Results\n", 1)[1]
    for block in study_report.tables(results).strip().split("\n\n"):
        assert block in results_part, f"docs/study.md's Results lack (or differ from) this rendered block:\n{block}"


def test_every_run_of_the_results_is_finished_or_a_recorded_crash(results):
    for run in results["runs"]:
        assert "error" in run or len(run["reward"]) == run["steps"], run
    assert results["machine"]["cores"] and results["commands"]


def test_figures_render(results, analysis, tmp_path):
    written = study_report.figures(results, tmp_path)
    assert written and all(p.stat().st_size > 1000 for p in written)
    done = [t for t, r in analysis.items() if r.get("comparisons")]
    for task in done:  # the plan's figures per evaluated task: curves, across-seed spread, rate grid
        assert {tmp_path / f"{task}_{kind}.png" for kind in ("curves", "spread", "lr_grid")} <= set(written)


def test_the_demo_report_shows_the_study_from_the_committed_results(analysis, tmp_path):
    from verl_oar.testbed.report import study_section

    page = study_section(tmp_path)
    done = [t for t, r in analysis.items() if r.get("comparisons")]
    assert done, "no task of the committed results has evaluation results"
    for task in done:
        assert f"study_{task}_curves.png" in page and (tmp_path / f"study_{task}_curves.png").stat().st_size > 1000
    if len(done) >= 2:
        assert "study_effect_vs_filler.png" in page and (tmp_path / "study_effect_vs_filler.png").stat().st_size > 1000
    missing = study_section(tmp_path, tmp_path / "absent.json")
    assert "not here" in missing and "docs/study.md" in missing


def test_the_curve_band_is_a_percentile_bootstrap_of_the_mean():
    import random

    rng = random.Random(1)
    curves = [[rng.random() for _ in range(6)] for _ in range(9)]
    mean, low, high = study_report._mean_band(curves, resamples=4000)
    for step in range(6):
        column = [c[step] for c in curves]
        assert mean[step] == pytest.approx(sum(column) / 9)
        assert low[step] < mean[step] < high[step]
        # a plain bootstrap of the same column agrees within resampling noise
        from verl_oar.testbed.measures import bootstrap

        plain = bootstrap(column, resamples=4000, seed=3)
        assert low[step] == pytest.approx(plain.low, abs=0.03) and high[step] == pytest.approx(plain.high, abs=0.03)


def test_readme_quotes_the_study_as_rendered(analysis):
    readme = " ".join((ROOT / "README.md").read_text().split())  # lines joined
    cells = [(t, m) for t in ("fill2", "fill8") for m in ("oar_g", "oar_p", "oar_p_chunk16")]
    for task, method in cells + [("fill32", "oar_g"), ("fill32", "oar_p_chunk16")]:  # no exact OAR-P at fill32
        comps = analysis[task]["comparisons"]
        iv = study_report._iv(comps[method]["relative_steps"], pct=True)  # e.g. "+4.0% [-18.0%, +26.0%]"
        estimate, interval = iv.split(" ", 1)
        assert f"{estimate} steps {interval}" in readme or f"{estimate} {interval}" in readme, iv
    for variant, d in analysis["fill32"]["vs_full_oar_g"].items():  # H3's ablations (steps more than full OAR-G)
        if variant.startswith("oar_g_no_"):
            estimate, interval = study_report._iv(d).split(" ", 1)
            assert f"{estimate} steps {interval}" in readme or f"{estimate} {interval}" in readme, (variant, d)


def test_readme_leads_the_study_with_the_replication_as_rendered(results):
    """README's study headline is R1's estimate and interval from the committed JSON, and its first sentence about
    the study says whether the headline replicated."""
    replication = study_report.sa.analyse_replication(results["runs"])
    assert replication, "the committed results have no replication runs"
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert " ".join(study_report.replication_headline(replication).split()) in readme
    first = readme[readme.index("study"):]
    verdict = replication["oar_g"]["verdict"]
    opening = {"inconclusive": "did not replicate", "slower": "reversed", "faster": "replicated"}[verdict]
    assert readme.index(opening) < readme.index("study") + 200, first[:200]


def test_h3_h4_and_h5_tables_render_once_their_runs_exist():
    def run(phase, task, method, lr, seed, reach, steps):
        reward = [0.5] * (reach - 3) + [0.9] * (steps - reach + 3)
        return {"phase": phase, "task": task, "method": method, "lr": lr, "seed": seed, "steps": steps,
                "reward": reward, "val_accuracy": {"0": 0.4, str(steps): 0.9}}

    runs = []
    for task, shrink in (("fill2", 0), ("fill8", 2)):
        runs += [run("tuning", task, m, 0.001, s, 10, 16) for m in ("grpo", "oar_g") for s in range(1000, 1005)]
        for seed in range(2000, 2006):
            runs += [run("eval", task, "grpo", 0.001, seed, 10 + seed % 2, 16),
                     run("eval", task, "oar_g", 0.001, seed, 10 - shrink + seed % 3, 16)]
            if task == "fill8":
                runs.append(run("eval", task, "oar_g_no_suppress", 0.001, seed, 12 + seed % 3, 16))
    text = study_report.tables({"runs": runs})
    assert "H3 and H4, fill8" in text and "| OAR-G without suppression | H3 | +4.00 [+4.00, +4.00] | 6 | supported |" in text
    assert "H3 and H4, fill2" not in text
    assert "H5: slope" in text and "| OAR-G | fill2, fill8 |" in text


def test_replication_runners_and_growth_tables_render_once_their_runs_exist():
    def run(phase, task, method, seed, reach, steps=32, error=False):
        reward = [0.5] * (reach - 3) + [0.9] * (steps - reach + 3)
        out = {"phase": phase, "task": task, "method": method, "lr": 0.001, "seed": seed, "steps": steps,
               "reward": reward, "val_accuracy": {"0": 0.4, str(steps): 0.9}}
        if error:  # stopped at step 5 by a guard: its curve up to the stop
            out.update(error="no-answer guard", reward=reward[:5], val_accuracy={"0": 0.4, "4": 0.5})
        return out

    runs = []
    for task in ("fill32", "fill64"):
        runs += [run("tuning", task, m, s, 12) for m in ("grpo", "oar_g", "oar_p_chunk16") for s in range(1000, 1005)]
    for seed in range(2000, 2006):
        runs += [run("eval", "fill32", "grpo", seed, 14), run("eval", "fill32", "oar_g", seed, 12),
                 run("eval", "fill64", "grpo", seed, 20 + seed % 2), run("eval", "fill64", "oar_g", seed, 14)]
    for seed in range(4000, 4006):
        runs += [run("replication", "fill32", "grpo", seed, 14 + seed % 2),
                 run("replication", "fill32", "oar_g", seed, 13, error=seed == 4000),
                 run("replication", "fill32", "oar_p_chunk16", seed, 14)]
    for seed in range(7000, 7004):
        runs += [run("runners", "fill32", m, seed, 14 + seed % 2) for m in ("grpo", "grpo_main_ppo")]
    text = study_report.tables({"runs": runs})
    assert "Replication, fill32 (seeds 4000-4005, 6 seeds, 32 steps;" in text
    [row] = [line for line in text.splitlines() if line.startswith("| OAR-G (0.001) | ") and "(12 seeds)" in line]
    assert row.endswith("| 17% (0%) | 1 (0) |"), row  # the stopped run is counted: censored and stopped
    assert "The runners over whole runs, fill32 (seeds 7000-7003" in text
    assert "| GRPO (0.001) | 14.50 (14.50) | +0.0% [+0.0%, +0.0%] | +0.00 [+0.00, +0.00] |" in text
    assert "R2, fill64: OAR-G against tuned GRPO" in text
    headline = study_report.replication_headline(study_report.sa.analyse_replication(runs))
    assert headline.startswith("On 6 fresh seeds (4000-4005), OAR-G needs ")
    assert "pooled over both seed blocks (12 seeds)" in headline
    assert any(words in headline for words in study_report.VERDICT_WORDS.values()), headline
