"""The chain_sum testbed build (verl_oar.testbed.workspace) and the importance-quality CLI
(verl_oar.testbed.quality) end to end on a tiny spec: a few warm-start steps, a handful of samples.
Checks shapes, ranges and the sanity rows (oracle, random), not whether any estimator is good."""

from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import replace

import pandas as pd
import pytest

from verl_oar.testbed.chain_sum import DATA_SOURCE
from verl_oar.testbed.quality import ESTIMATORS, ORACLES, main
from verl_oar.testbed.workspace import TestbedSpec, build_testbed

FRACS = (0.1, 0.5)

SMALL = TestbedSpec(
    n_train=200, n_val=24, warm_start_steps=150, warm_start_batch_size=8, warm_start_lr=5e-3, stats_samples=8
)
"""a few seconds of warm start: enough that some samples parse; the quality CLI skips the rest"""


@pytest.fixture(scope="module")
def testbed(tmp_path_factory):
    return build_testbed(tmp_path_factory.mktemp("testbed"), SMALL)


def test_files_rows_and_manifest(testbed):
    for path in (testbed.model_dir / "config.json", testbed.train_file, testbed.val_file, testbed.reward_file):
        assert path.exists(), path
    train, val = pd.read_parquet(testbed.train_file), pd.read_parquet(testbed.val_file)
    assert (len(train), len(val)) == (SMALL.n_train, SMALL.n_val)
    assert set(train["data_source"]) == {DATA_SOURCE}
    numbers = lambda frame: {tuple(r["numbers"]) for r in frame["extra_info"]}
    assert not numbers(train) & numbers(val), "train and val share a tuple of numbers"
    for row in val["extra_info"]:
        assert SMALL.k_min <= len(row["numbers"]) <= SMALL.k_max
        assert row["answer"] == str(sum(row["numbers"]))
    manifest = json.loads((testbed.root / "testbed.json").read_text())
    assert manifest["spec"]["warm_start_steps"] == SMALL.warm_start_steps
    assert math.isfinite(manifest["warm_start"]["final_loss"])
    for key in ("parse_rate", "accuracy"):
        assert 0.0 <= manifest["val_samples"][key] <= 1.0


def test_rebuild_is_cached(testbed):
    again = build_testbed(testbed.root, SMALL)
    assert again.manifest["fingerprint"] == testbed.manifest["fingerprint"]
    assert again.manifest["build_seconds"] == testbed.manifest["build_seconds"]  # not rebuilt
    assert replace(SMALL, seed=1).fingerprint() != SMALL.fingerprint()


@pytest.mark.parametrize(
    "text, truth, score",
    [
        ("3 ok +7=10 so \\boxed{10}", "10", 1.0),
        ("3 ok +7=10 so \\boxed{ 10 }", "10", 1.0),
        ("3 ok +7=11 so \\boxed{11}", "10", 0.0),
        ("3 ok +7=10 \\boxed{1} so \\boxed{10}", "10", 1.0),   # the last box counts
        ("3 ok +7=10 so \\boxed{10", "10", 0.0),               # unclosed
        ("3 ok +7=10 so 10", "10", 0.0),                       # no box, no format bonus
    ],
)
def test_reward_file(testbed, text, truth, score):
    spec = importlib.util.spec_from_file_location("testbed_reward", testbed.reward_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.compute_score(DATA_SOURCE, text, truth) == score


def test_quality_cli(testbed, tmp_path, capsys):
    out = tmp_path / "results.json"
    report = main(["--workdir", str(testbed.root), "--samples", "4", "--seed", "0",
                   "--fracs", ",".join(map(str, FRACS)), "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert "oar_p_exact" in capsys.readouterr().out
    counted = report["samples"]["counted"]
    assert counted + report["samples"]["skipped"] == 4 and counted >= 1
    assert set(report["estimators"]) == set(ESTIMATORS)
    for name, row in report["estimators"].items():
        for oracle in ORACLES:
            for frac in FRACS:
                assert 0.0 <= row["recall"][oracle][str(frac)] <= 1.0, (name, oracle, frac)
        for frac in FRACS:
            assert -1.0 <= row["accuracy_drop"][str(frac)] <= 1.0
        assert row["counted"] == counted

    # the oracle row ranks the direct tokens first, so its recall is 1 once K% covers them: the direct
    # tokens are the last total (1-2 digits) and the reasoning also holds the start number and a space
    assert report["estimators"]["oracle"]["recall"]["direct"]["0.5"] == 1.0
    # random is near its expectation on average (loose: a handful of samples)
    for oracle in ORACLES:
        got = report["estimators"]["random"]["recall"][oracle]["0.5"]
        assert abs(got - report["expected_random_recall"]["0.5"]) < 0.45
