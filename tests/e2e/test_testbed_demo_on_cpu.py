"""The testbed demo (verl_oar.testbed.demo) shortened -- one seed, two steps, GRPO and OAR-P (exact, the testbed's
mode) through verl's real trainer, one after the other in the session's Ray cluster -- must
produce every figure, with curves equal to the runs' metric files and credit measures equal to their
dumps. Its parts, every method's run configuration included, are checked in tests/unit/test_demo_on_cpu.py.
The demo's code is the same for every method with a token signal; OAR-G's run is left out here because four
other launches train it (test_resume, test_bf16_e2e, test_upstream_series, test_acpo_codapo_e2e) and each
launch costs about a minute of the suite's 15."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

FIGURES = ("reward.png", "measures.png", "credit.png", "step_time.png", "recall.png", "counterfactual.png")


def _png_ok(path: Path) -> bool:
    return path.exists() and path.stat().st_size > 2000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_shortened_demo_trains_its_methods_and_produces_every_figure_from_its_runs(tiny_bed, tmp_path, capsys):
    from verl_oar.cpu.workspace import build_tokenizer
    from verl_oar.testbed.credit import run_credit
    from verl_oar.testbed.demo import main, resummarize
    from verl_oar.testbed.methods import DEFAULT_DEMO, METHODS

    # two of the default demo's methods (CSCR's and OPPO's runs: their recipe copies, tests/e2e/test_privileged_e2e_on_cpu.py)
    demo = {m: METHODS[m] for m in ("grpo", "oar_p")}
    assert set(demo) <= set(DEFAULT_DEMO)
    from verl_oar.testbed.training_runs import REWARD, VAL_REWARD, read_records, train_records

    out = tmp_path / "report"
    summary = main(["--out", str(out), "--testbed", str(tiny_bed.root), "--seeds", "0", "--steps", "2",
                    "--quality-samples", "6", "--val-prompts", "8", "--val-every", "0", "--run-timeout", "400",
                    "--methods", ",".join(demo)])
    for name in FIGURES + ("heatmap_0.png",):
        assert _png_ok(out / name), name
    page = (out / "index.html").read_text()
    for name in FIGURES + ("heatmap_0.png",):
        assert f'src="{name}"' in page
    assert "<b>Summary.</b>" in page and "1 seed" in page
    assert json.loads((out / "summary.json").read_text())["seeds"] == [0]
    assert set(summary["runs"]) == set(demo)
    tokenizer = build_tokenizer()
    for method, entry in demo.items():
        records = read_records(out / "metrics" / f"{method}_seed0.jsonl")
        run = summary["runs"][method][0]
        # the summary's curves are the runs' metric files, step for step
        assert [r["data"][REWARD] for r in train_records(records)] == run["reward"] and len(run["reward"]) == 2
        assert run["val_accuracy"] == {str(r["step"]): r["data"][VAL_REWARD] for r in records if VAL_REWARD in r["data"]}
        assert set(run["val_accuracy"]) == {"0", "2"}  # before and after training
        if entry.dump is None:
            assert run["credit"] is None
            continue
        # the credit measures are the run's dumps, read again
        assert sorted(p.name for p in (out / "dumps" / f"{method}_seed0").iterdir()) == ["step_1.pt", "step_2.pt"]
        again = run_credit(out / "dumps" / f"{method}_seed0", tokenizer, entry.signal, seed=0)
        assert run["credit"] == json.loads(json.dumps(again.as_dict()))
        assert run["credit"]["counted_concentration"] > 0
    # the same responses at step 1 in every run of the seed: a heatmap row per method
    example = summary["same_response"][0]
    assert set(example["weights"]) == set(demo) and all(w == 1.0 for w in example["weights"]["grpo"])
    assert summary["comparison"]["methods"]["oar_p"]["vs_baseline"]["auc"]["low"] is None   # one seed: no interval
    logged = capsys.readouterr().out
    assert "oar_p/seed0: step 2/2" in logged and "open " in logged
    # recomputing the measures from the folder's files gives the same summary, strict JSON
    written = json.loads((out / "summary.json").read_text())
    resummarize(out)
    assert json.loads((out / "summary.json").read_text()) == written
