"""The pick_max testbed: the committed start (its statistics are what testbed.json and docs say, measured
again here on 64 held-out prompts), the build script on a tiny spec (files, rows, cache, reward), and
the importance-quality CLI end to end. Checks shapes, ranges and the sanity rows (oracle, random),
not whether any estimator is good."""

from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
import torch

from verl_oar.testbed.pick_max import DATA_SOURCE, ORACLES
from verl_oar.testbed.quality import ESTIMATORS, main
from verl_oar.testbed.workspace import TestbedSpec, build_testbed, committed_testbed, sample_statistics, split_problems

FRACS = (0.1, 0.5)
DOCS = Path(__file__).resolve().parents[2] / "docs" / "testbed.md"

SMALL = TestbedSpec(n_train=200, n_val=24, warm_start_steps=60, warm_start_batch_size=8, stats_samples=8)
"""a few seconds of warm start: the build's mechanics, not a useful model"""


def test_the_committed_start_is_what_testbed_json_and_the_docs_say():
    from transformers import AutoModelForCausalLM

    from verl_oar.cpu.workspace import build_tokenizer

    bed = committed_testbed()
    recorded = bed.manifest["val_samples"]
    assert bed.manifest["machine"]["cpu"] and bed.manifest["machine"]["torch"]
    assert bed.manifest["num_parameters"] < 1_000_000
    _, val = split_problems(bed.spec)
    assert pd.read_parquet(bed.val_file)["extra_info"].iloc[0]["question"] == val[0].prompt   # data = the script's
    model = AutoModelForCausalLM.from_pretrained(bed.model_dir, dtype=torch.float32).eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        measured = sample_statistics(model, build_tokenizer(), val[: bed.spec.stats_samples], bed.spec)
    finally:
        torch.set_num_threads(threads)
    assert measured["samples"] == 64
    # the requirements on the start
    assert 0.3 <= measured["sampled_accuracy"] <= 0.6
    assert measured["filler_entropy"] >= 1.0
    # the same numbers as recorded at the build (another CPU may sample a few responses differently)
    for key, tolerance in (("sampled_accuracy", 0.1), ("greedy_accuracy", 0.05), ("filler_entropy", 0.05),
                           ("pick_entropy", 0.1), ("copies_picks", 0.1)):
        assert measured[key] == pytest.approx(recorded[key], abs=tolerance), key
    text = DOCS.read_text()
    for key in ("sampled_accuracy", "greedy_accuracy", "filler_entropy", "pick_entropy", "copies_picks"):
        assert f"{key} {recorded[key]:.2f}" in text, f"docs/testbed.md should state {key} {recorded[key]:.2f}"


@pytest.fixture(scope="module")
def testbed(tmp_path_factory):
    return build_testbed(tmp_path_factory.mktemp("testbed"), SMALL)


def test_files_rows_and_manifest(testbed):
    for path in (testbed.model_dir / "config.json", testbed.train_file, testbed.val_file, testbed.reward_file):
        assert path.exists(), path
    train, val = pd.read_parquet(testbed.train_file), pd.read_parquet(testbed.val_file)
    assert (len(train), len(val)) == (SMALL.n_train, SMALL.n_val)
    assert set(train["data_source"]) == {DATA_SOURCE}
    pairs = lambda frame: {tuple(map(tuple, r["pairs"])) for r in frame["extra_info"]}
    assert not pairs(train) & pairs(val), "train and val share a prompt"
    for row in val["extra_info"]:
        assert len(row["pairs"]) == SMALL.pairs
        assert row["answer"] == "".join(str(max(a, b)) for a, b in row["pairs"])
    manifest = json.loads((testbed.root / "testbed.json").read_text())
    assert manifest["spec"]["warm_start_steps"] == SMALL.warm_start_steps
    assert math.isfinite(manifest["warm_start"]["final_loss"]) and manifest["machine"]["cpu"]
    for key in ("sampled_accuracy", "greedy_accuracy", "answer_rate", "copies_picks", "pick_max_rate"):
        assert 0.0 <= manifest["val_samples"][key] <= 1.0


def test_rebuild_is_cached(testbed):
    again = build_testbed(testbed.root, SMALL)
    assert again.manifest["fingerprint"] == testbed.manifest["fingerprint"]
    assert again.manifest["build_seconds"] == testbed.manifest["build_seconds"]  # not rebuilt
    assert replace(SMALL, seed=1).fingerprint() != SMALL.fingerprint()


@pytest.mark.parametrize(
    "text, truth, score",
    [
        ("qzt 7 abx 5 kle \\boxed{75}", "75", 1.0),
        ("qzt 7 abx 5 kle \\boxed{ 75 }", "75", 1.0),
        ("qzt 3 abx 5 kle \\boxed{35}", "75", 0.0),
        ("qzt 7 \\boxed{1} abx 5 \\boxed{75}", "75", 1.0),   # the last box counts
        ("qzt 7 abx 5 kle \\boxed{75", "75", 0.0),            # unclosed
        ("qzt 7 abx 5 kle 75", "75", 0.0),                    # no box, no format bonus
    ],
)
def test_reward_file(testbed, text, truth, score):
    spec = importlib.util.spec_from_file_location("testbed_reward", testbed.reward_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.compute_score(DATA_SOURCE, text, truth) == score


def test_quality_cli(tmp_path, capsys):
    out = tmp_path / "results.json"
    report = main(["--samples", "6", "--seed", "0", "--fracs", ",".join(map(str, FRACS)), "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert "oar_p_exact" in capsys.readouterr().out
    counted = report["samples"]["counted"]
    assert counted + report["samples"]["skipped"] == 6 and counted >= 1
    assert set(report["estimators"]) == set(ESTIMATORS)
    for name, row in report["estimators"].items():
        for oracle in ORACLES:
            for frac in FRACS:
                assert 0.0 <= row["recall"][oracle][str(frac)] <= 1.0, (name, oracle, frac)
        for frac in FRACS:
            assert -1.0 <= row["accuracy_drop"][str(frac)] <= 1.0
        assert row["counted"] == counted
    # the oracle row ranks the two picks first: 10% of ~28 reasoning tokens is 3 tokens, which hold both
    assert report["estimators"]["oracle"]["recall"]["causal"]["0.1"] == 1.0
    got = report["estimators"]["random"]["recall"]["causal"]["0.5"]
    assert abs(got - report["expected_random_recall"]["0.5"]) < 0.45   # loose: a handful of samples


def test_quality_cli_refuses_a_folder_without_a_testbed(tmp_path):
    with pytest.raises(SystemExit, match="no pick_max testbed"):
        main(["--testbed", str(tmp_path), "--samples", "2"])


def test_a_missing_committed_testbed_names_the_restore_and_rebuild_commands(tmp_path, monkeypatch):
    from verl_oar.testbed import workspace

    monkeypatch.setattr(workspace, "COMMITTED", tmp_path / "start")
    with pytest.raises(FileNotFoundError, match="git checkout.*python -m verl_oar.testbed.workspace"):
        workspace.committed_testbed()
