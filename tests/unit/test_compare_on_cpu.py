"""``verl-oar compare`` (verl_oar/app/compare.py) on runs written by verl's own file logger
(``verl.utils.tracking.FileLogger``, the writer of ``trainer.logger=[console,file]``): grouping by name and seed,
a paired interval checked by hand, the flags, the outputs, and bad input refused with the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verl_oar.app import compare

STEPS = 8


def curve(first_hit: int) -> list[float]:
    """0 before step ``first_hit``, 1 from it on (steps 1..STEPS)."""
    return [0.0 if s < first_hit else 1.0 for s in range(1, STEPS + 1)]


def write_run(monkeypatch, path: Path, rewards: list[float], val: dict[int, float], seconds: float = 2.0) -> Path:
    """One run as verl logs it: validation at step 0 alone, then a line per step (the last one with validation)."""
    from verl.utils.tracking import FileLogger

    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    logger = FileLogger(project_name="p", experiment_name="e")
    key = "val-core/math/acc/mean@1"
    if 0 in val:
        logger.log({key: val[0], "val-aux/math/reward/mean@1": val[0]}, step=0)
    for step, reward in enumerate(rewards, start=1):
        data = {"critic/score/mean": reward, "timing_s/step": seconds + step, "actor/entropy": 0.5}
        if step in val:
            data[key] = val[step]
        logger.log(data, step=step)
    logger.finish()
    return path


@pytest.fixture()
def two_methods(tmp_path, monkeypatch) -> Path:
    """grpo reaches reward 1 at steps 5 (seed 0) and 6 (seed 1); oar_g at 3 and 5: paired differences -2 and -1."""
    folder = tmp_path / "cmp"
    folder.mkdir()
    for method, hits in (("grpo", (5, 6)), ("oar_g", (3, 5))):
        for seed, hit in enumerate(hits):
            write_run(monkeypatch, folder / f"{method}_seed{seed}.jsonl", curve(hit), {0: 0.2, 4: 0.4, STEPS: 0.6 + 0.1 * seed})
    return folder


def test_steps_to_threshold_and_its_paired_interval_by_hand(two_methods, capsys):
    summary = compare.summarize(compare.parse_args([str(two_methods), "--threshold", "0.5", "--window", "1", "--resamples", "400"]))
    comp = summary["comparison"]
    assert comp["baseline"] == "grpo" and comp["threshold"] == 0.5 and comp["window"] == 1
    assert comp["methods"]["grpo"]["per_seed"]["steps_to_threshold"] == [5.0, 6.0]
    assert comp["methods"]["oar_g"]["per_seed"]["steps_to_threshold"] == [3.0, 5.0]
    # by hand: two paired seeds with differences -2 and -1. A resample of 2 seeds has mean difference -2 (p 1/4),
    # -1.5 (1/2) or -1 (1/4); of 10000 resamples ~2500 are at each end, so the 2.5% and 97.5% nearest ranks are
    # the ends (here of 400 resamples, ~100 at each end): [-2, -1]; the estimate is the mean difference, -1.5
    d = comp["methods"]["oar_g"]["vs_baseline"]["steps_to_threshold"]
    assert (d["estimate"], d["low"], d["high"], d["n"]) == (-1.5, -2.0, -1.0, 2)
    # held-out: verl's val-core key found; AUC of (0, .2), (4, .4), (8, .6): trapezoids (.3*4 + .5*4) / 8 = 0.4
    assert summary["settings"]["val_metric"] == "val-core/math/acc/mean@1"
    assert comp["methods"]["grpo"]["per_seed"]["auc"][0] == pytest.approx(0.4)
    assert comp["methods"]["grpo"]["per_seed"]["final"] == [pytest.approx(0.6), pytest.approx(0.7)]
    # median seconds of steps 2..8 (step 1 warms up): 2 + 5
    assert comp["methods"]["grpo"]["per_seed"]["step_seconds"] == [7.0, 7.0]
    text = compare.table(summary)
    assert "-2.0 [-2.0, -1.0]" not in text and "-1.5 [-2.0, -1.0]" in text and "2 pairs" in text


def test_the_demos_threshold_is_restored_after_a_comparison(two_methods):
    from verl_oar.testbed import comparison

    before = comparison.THRESHOLD, comparison.WINDOW, comparison.RESAMPLES
    compare.summarize(compare.parse_args([str(two_methods), "--threshold", "0.5", "--resamples", "200"]))
    assert (comparison.THRESHOLD, comparison.WINDOW, comparison.RESAMPLES) == before


def test_main_prints_the_table_and_writes_summary_and_figures(two_methods, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "report"
    assert compare.main([str(two_methods), "--baseline", "oar_g", "--resamples", "500", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[3].startswith("oar_g") and "  - oar_g" in text  # the baseline first, grpo minus it
    assert {p.name for p in out.iterdir()} == {"summary.json", "reward.png", "measures.png", "step_time.png"}
    saved = json.loads((out / "summary.json").read_text())
    assert saved["comparison"]["baseline"] == "oar_g" and saved["settings"]["resamples"] == 500
    assert len(saved["runs"]["grpo"]) == 2 and saved["runs"]["grpo"][0]["reward"] == curve(5)


def test_labels_files_and_seeds_from_file_order(tmp_path, monkeypatch):
    """One folder per method with files named without a seed: --labels names them, seeds follow name order."""
    for method, hits in (("a", (4, 7)), ("b", (2, 6))):
        (tmp_path / method).mkdir()
        for i, hit in enumerate(hits):
            write_run(monkeypatch, tmp_path / method / f"run{i}.jsonl", curve(hit), {})
    args = compare.parse_args([str(tmp_path / "a"), str(tmp_path / "b"), "--labels", "GRPO,OAR", "--window", "1",
                               "--resamples", "100"])
    summary = compare.summarize(args)
    assert list(summary["comparison"]["methods"]) == ["GRPO", "OAR"]
    assert summary["comparison"]["methods"]["OAR"]["per_seed"]["steps_to_threshold"] == [2.0, 6.0]
    assert any("no seed in its name" in n for n in summary["notes"])
    assert any("no val-core/ metric" in n for n in summary["notes"])  # no validation: AUC n/a, said so
    # a custom pattern pairs by another part of the name: run<k>
    summary = compare.summarize(compare.parse_args([*args.runs, "--labels", "GRPO,OAR", "--pair-by", r"run(\d+)",
                                                         "--resamples", "100"]))
    assert summary["notes"] == ["no val-core/ metric logged (trainer.test_freq): held-out AUC, final and gain are n/a"]


def test_runs_of_different_length_are_cut_to_the_shortest(tmp_path, monkeypatch):
    write_run(monkeypatch, tmp_path / "x_seed0.jsonl", curve(3), {})
    write_run(monkeypatch, tmp_path / "y_seed0.jsonl", curve(3)[:5], {})
    summary = compare.summarize(compare.parse_args([str(tmp_path), "--resamples", "50"]))
    assert summary["settings"]["steps"] == 5 and len(summary["runs"]["x"][0]["reward"]) == 5
    assert "every run cut to 5 steps (the shortest run's); longest had 8" in summary["notes"]


def test_verls_default_file_logger_path_is_read(tmp_path, monkeypatch):
    """Without VERL_FILE_LOGGER_PATH verl writes <root>/<project_name>/<experiment_name>.jsonl: the folder is the
    argument, the experiment names carry method and seed."""
    from verl.utils.tracking import FileLogger

    monkeypatch.delenv("VERL_FILE_LOGGER_PATH", raising=False)
    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(tmp_path))
    for name, hit in (("grpo_seed1", 4), ("oar_p_seed1", 3)):
        logger = FileLogger(project_name="study", experiment_name=name)
        for step, reward in enumerate(curve(hit), start=1):
            logger.log({"critic/score/mean": reward}, step=step)
        logger.finish()
    summary = compare.summarize(compare.parse_args([str(tmp_path / "study"), "--window", "1", "--resamples", "100"]))
    assert summary["comparison"]["methods"]["oar_p"]["vs_baseline"]["steps_to_threshold"]["estimate"] == -1.0


@pytest.mark.parametrize("make, argv_tail, message", [
    (lambda d: None, ["--metric", "nope/x"], "no step logs 'nope/x'"),
    (lambda d: (d / "m_seed0.jsonl").write_text((d / "grpo_seed0.jsonl").read_text()), [], "two runs of method"),
    (lambda d: None, ["--baseline", "ppo"], "--baseline 'ppo' is not one of the methods"),
    (lambda d: None, ["--pair-by", "seed"], "needs exactly one, around the seed"),
    (lambda d: None, ["--labels", "a,b"], "--labels has 2 name(s) for 1 argument(s)"),
])
def test_bad_input_is_refused_with_the_fix(two_methods, make, argv_tail, message):
    make(two_methods)
    if message == "two runs of method":  # a second method folder holding grpo's seed 0 twice under one label
        argv = [str(two_methods / "grpo_seed0.jsonl"), str(two_methods / "m_seed0.jsonl"), "--labels", "g,g"]
    else:
        argv = [str(two_methods), *argv_tail]
    with pytest.raises(SystemExit) as err:
        compare.summarize(compare.parse_args([*argv, "--resamples", "50"]))
    assert message in str(err.value) and str(err.value).startswith("verl-oar compare: ")


def test_a_resumed_runs_file_is_refused_with_the_fix(tmp_path, monkeypatch):
    path = tmp_path / "g_seed0.jsonl"
    path.write_text("".join(json.dumps({"step": s, "data": {"critic/score/mean": 0.5}}) + "\n" for s in (4, 5, 6)))
    with pytest.raises(SystemExit, match="training steps are not 1, 2, ... .first out of place: 4.*Join the two files"):
        compare.summarize(compare.parse_args([str(path)]))
