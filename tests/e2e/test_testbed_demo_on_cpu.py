"""The testbed demo (verl_oar.testbed.demo) shortened -- one seed, two steps, GRPO and OAR-G through verl's
real trainer, one after the other in the session's Ray cluster -- must produce every figure, with numbers
equal to the runs' metric files. Its parts, every method's run configuration included, are checked in
tests/unit/test_demo_on_cpu.py; OAR-P trains end to end in test_recipes_on_cpu.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

FIGURES = ("reward.png", "ratios.png", "step_time.png", "recall.png", "counterfactual.png")


def _png_ok(path: Path) -> bool:
    return path.exists() and path.stat().st_size > 2000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------------------
# the shortened demo through verl's real trainer (slow: two main_ppo runs)
# ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_shortened_demo_produces_every_figure_from_its_runs(tiny_bed, tmp_path, capsys):
    from verl_oar.testbed.demo import main
    from verl_oar.testbed.training_runs import REWARD, read_records, train_records

    out = tmp_path / "report"
    # one run at a time: runs cannot overlap in the session's shared Ray cluster (verl's TransferQueue
    # controller is one named actor per cluster)
    summary = main(["--out", str(out), "--workdir", str(tiny_bed.root), "--seeds", "0", "--steps", "2",
                    "--methods", "grpo,oar_g", "--quality-samples", "6", "--heatmaps", "2", "--val-prompts", "8",
                    "--parallel", "1", "--run-timeout", "400"], spec=tiny_bed.spec)
    for name in FIGURES + ("heatmap_0.png",):
        assert _png_ok(out / name), name
    page = (out / "index.html").read_text()
    for name in FIGURES + ("heatmap_0.png",):
        assert f'src="{name}"' in page
    assert json.loads((out / "summary.json").read_text())["seeds"] == [0]
    # the summary's curves are the runs' metric files, step for step
    assert set(summary["runs"]) == {"grpo", "oar_g"}
    for method in ("grpo", "oar_g"):
        records = train_records(read_records(out / "metrics" / f"{method}_seed0.jsonl"))
        assert [r["data"][REWARD] for r in records] == summary["runs"][method][0]["reward"]
        assert len(records) == 2
        assert set(summary["runs"][method][0]["val_accuracy"]) == {"0", "2"}  # before and after training
    assert all(s is not None for s in summary["runs"]["oar_g"][0]["importance_seconds"])
    assert math.isnan(summary["dynamics"]["methods"]["oar_g"]["variance_ratio"])  # one seed: no variance
    logged = capsys.readouterr().out
    assert "oar_g/seed0: step 2/2" in logged and "open " in logged
