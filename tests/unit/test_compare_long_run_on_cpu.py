"""`verl-oar compare` reproduces the testbed report's intervals: the committed long run's curves written as
verl's file logger writes them (one JSON line per step, ``<method>_seed<k>.jsonl``), read back by the command,
give the committed comparison, every interval equal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verl_oar.testbed.training_runs import REWARD, VAL_REWARD

ROOT = Path(__file__).resolve().parents[2]


def _write_run(path: Path, run: dict) -> None:
    val = {int(s): a for s, a in run["val_accuracy"].items()}
    with open(path, "w") as fp:
        for step in sorted({0, *range(1, len(run["reward"]) + 1)}):
            data = {}
            if step >= 1:
                data[REWARD] = run["reward"][step - 1]
                data["timing_s/step"] = run["step_seconds"][step - 1]
            if step in val:
                data[VAL_REWARD] = val[step]
            if data:
                fp.write(json.dumps({"step": step, "data": data}) + "\n")


@pytest.mark.slow  # 10,000-resample bootstraps of every measure in pure Python: about 30-50 s on 2 cores
def test_compare_reproduces_the_committed_long_runs_comparison(tmp_path):
    from verl_oar.app.compare import parse_args, summarize

    results = json.loads((ROOT / "benchmarks" / "results_testbed_long_run_cpu.json").read_text())
    methods = ["grpo", "oar_g"]
    for method in methods:
        for run in results["runs"][method]:
            _write_run(tmp_path / f"{method}_seed{run['seed']}.jsonl", run)
    ours = summarize(parse_args([str(tmp_path), "--baseline", "grpo"]))["comparison"]  # what --out writes, no figures
    committed = results["comparison"]
    assert (ours["threshold"], ours["window"], ours["baseline"]) == (committed["threshold"], committed["window"], "grpo")
    for method in methods:
        for measure in ("steps_to_threshold", "auc", "final"):
            if method != "grpo":
                assert ours["methods"][method]["vs_baseline"][measure] == committed["methods"][method]["vs_baseline"][measure], (method, measure)
        assert ours["methods"][method]["mean"] == committed["methods"][method]["mean"], method
