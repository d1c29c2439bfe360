"""benchmarks/study_diagnostics.py: what it keeps of verl's metric files, its per-run summary (worked out by hand
here), and that the committed diagnostics agree with the committed run store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _benchmarks import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def diag():
    return load_benchmark("study_diagnostics")


def _write(path: Path, rewards: list[float], lengths: list[float], entropy: list[float]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [{"step": 0, "data": {"val-core/verl_oar/pick_max/acc/mean@1": 0.5}}]
    for i, (r, n, e) in enumerate(zip(rewards, lengths, entropy), start=1):
        lines.append({"step": i, "data": {"critic/score/mean": r, "response_length/mean": n, "actor/entropy": e,
                                          "response_length/clip_ratio": 0.0, "actor/grad_norm": 0.01,
                                          "critic/advantages/min": -1.0, "critic/advantages/max": 1.0}})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_summary_and_what_is_kept(diag, tmp_path):
    _write(tmp_path / "eval/fill32/oppo/lr0.001_seed2000.jsonl", [0.4, 0.2, 0.0, 0.1, 0.0, 0.0], [400, 410, 415, 415,
           415, 415], [2.0, 2.1, 2.2, 2.3, 2.4, 2.5])
    _write(tmp_path / "eval/fill32/grpo/lr0.001_seed2000.jsonl", [0.4, 0.6, 0.9], [400, 380, 390], [2.0, 1.9, 1.8])
    _write(tmp_path / "eval/fill32/grpo/lr0.002_seed2000.jsonl", [0.4], [400], [2.0])  # another rate: left out
    (tmp_path / "eval/fill32/grpo/lr0.001_seed2001.jsonl").write_text('{"step": 0, "data": {}}\n')  # no step yet
    runs = diag.collect(tmp_path, "fill32", 0.001)
    assert set(runs) == {"oppo", "grpo"} and set(runs["grpo"]) == {2000}
    oppo = runs["oppo"][2000]
    # the reward is 0 at step 3 but not after it; it stays 0 from step 5 on
    assert oppo["summary"] == {"zero_from": 5, "length_first": 400, "length_last": 415, "length_min": 400,
                               "entropy_first": 2.0, "entropy_last": 2.5}
    assert runs["grpo"][2000]["summary"]["zero_from"] is None and runs["grpo"][2000]["summary"]["length_min"] == 380
    assert "oppo/evidence/mean" not in oppo["series"]  # a metric the run did not log is left out, not filled
    out = tmp_path / "d.json"
    diag.main(["--task", "fill32", "--lr", "0.001", "--out", str(out), "--runs-dir", str(tmp_path)])
    assert json.loads(out.read_text())["runs"]["oppo"]["2000"]["summary"]["zero_from"] == 5
    with pytest.raises(SystemExit, match="no finished evaluation run of fill8"):
        diag.main(["--task", "fill8", "--lr", "0.001", "--out", str(out), "--runs-dir", str(tmp_path)])


def test_committed_diagnostics_match_the_run_store(diag):
    """Each kept run's training reward equals its store line's (to the 5 digits kept): the same runs, not others."""
    kept = json.loads((ROOT / "benchmarks" / "results_study_diagnostics_fill32_cpu.json").read_text())
    store = {}
    for line in (ROOT / "benchmarks" / "study_runs" / "eval_fill32.jsonl").read_text().splitlines():
        run = json.loads(line)
        store[(run["method"], run["lr"], run["seed"])] = run
    n = 0
    for method, runs in kept["runs"].items():
        for seed, run in runs.items():
            stored = store[(method, kept["lr"], int(seed))]
            if "error" in stored:  # stopped by a guard: the store keeps the error, the metric file its steps so far
                assert len(run["series"]["critic/score/mean"]) < stored["steps"]
            else:
                assert run["series"]["critic/score/mean"] == pytest.approx(stored["reward"], abs=1e-4)
            n += 1
    assert n == sum(1 for (m, lr, s) in store if lr == kept["lr"]), \
        "a stored run at this rate has no diagnostics"


def test_the_page_quotes_the_rendered_table(diag):
    kept = json.loads((ROOT / "benchmarks" / "results_study_diagnostics_fill32_cpu.json").read_text())
    results = json.loads((ROOT / "benchmarks" / "results_study_cpu.json").read_text())
    rendered = diag.table(kept, results)
    assert rendered.count("\n") == 10  # header, rule, GRPO, OAR-G, the six methods evaluated on 5 seeds, their control
    assert rendered in (ROOT / "docs" / "study.md").read_text(), f"docs/study.md lacks (or differs from):\n{rendered}"
