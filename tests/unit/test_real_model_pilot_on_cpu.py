"""benchmarks/real_model_pilot.py's bookkeeping and analysis on synthetic run records (no launch): the metrics it
reads from verl's file logger, the pre-registered endpoints (a stopped run counts as no learning, censored), the
tuning rule, the paired analysis against a hand computation, and the refusal of a seed used by the other phase."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import real_model_pilot as pilot  # noqa: E402

VAL_KEY = f"val-core/verl_oar/arithmetic/acc/mean@{pilot.VAL_SAMPLES}"


def record(method, lr, seed, rewards, held_out, *, steps=4, exit_code=0, phase="eval"):
    train = [{"step": i + 1, "critic/score/mean": r} for i, r in enumerate(rewards)]
    val = [] if held_out is None else [{"step": steps, "accuracy": held_out, "key": VAL_KEY}]
    return {"phase": phase, "method": method, "lr": lr, "seed": seed, "steps": steps, "exit_code": exit_code,
            "seconds": 1, "train": train, "val": val}


def test_metrics_are_read_from_verls_file_logger_format(tmp_path):
    lines = [{"step": 1, "data": {"critic/score/mean": 0.25, "timing_s/step": 3.0, "other": 1}},
             {"step": 2, "data": {"critic/score/mean": 0.5}},
             {"step": 2, "data": {VAL_KEY: 0.31, "val-core/verl_oar/arithmetic/acc/best@4/mean": 0.9,
                                  "val-aux/verl_oar/arithmetic/acc/mean@4": 0.0}}]
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    train, val = pilot.read_metrics(path)
    assert train == [{"step": 1, "critic/score/mean": 0.25, "timing_s/step": 3.0}, {"step": 2, "critic/score/mean": 0.5}]
    assert val == [{"step": 2, "accuracy": 0.31, "key": VAL_KEY}]
    assert pilot.read_metrics(tmp_path / "missing.jsonl") == ([], [])


def test_endpoints_of_a_complete_and_of_a_stopped_run():
    done = pilot.endpoints(record("grpo", 1e-5, 200, [0.0, 0.5, 0.5, 0.5], 0.3))
    assert done["complete"] and done["held_out_after"] == 0.3
    assert done["held_out_gain"] == pytest.approx(0.3 - pilot.START_ACCURACY)
    # trailing mean over 4 steps first reaches 0.25 at step 4 ((0 + .5 + .5 + .5) / 4 = .375)
    assert (done["steps_to_threshold"], done["censored"]) == (4.0, False)
    assert done["mean_train_reward"] == pytest.approx(0.375)

    stopped = pilot.endpoints(record("oar_g", 1e-5, 200, [1.0, 1.0], None, exit_code=1))
    assert not stopped["complete"]
    assert stopped["held_out_after"] == pilot.START_ACCURACY  # counted as no learning
    assert (stopped["steps_to_threshold"], stopped["censored"]) == (5.0, True)  # censored at steps + 1
    never = pilot.endpoints(record("oar_g", 1e-5, 200, [], None, exit_code=1))
    assert (never["steps_to_threshold"], never["mean_train_reward"]) == (5.0, 0.0)


def test_tuning_picks_the_highest_mean_training_reward_ties_to_the_lower_rate():
    runs = [record("grpo", lr, 100, rewards, 0.9, phase="tuning") for lr, rewards in
            [(3e-6, [0.1] * 4), (1e-5, [0.3] * 4), (3e-5, [0.3] * 4)]]
    runs += [record("oar_g", 3e-6, 100, [0.4] * 4, 0.0, phase="tuning"),
             record("oar_g", 3e-5, 100, [0.2] * 4, 1.0, phase="tuning")]
    chosen = pilot.plan(runs)
    assert chosen["grpo"]["lr"] == 1e-5  # tie with 3e-5: the lower rate
    assert chosen["oar_g"]["lr"] == 3e-6  # held-out accuracy is not used to tune


def test_paired_analysis_equals_a_hand_computation():
    base = {200: 0.1, 201: 0.2, 202: 0.15}
    gain = {200: 0.05, 201: -0.02, 202: 0.1}
    runs = [record("grpo", 1e-5, s, [0.2] * 4, base[s]) for s in base]
    runs += [record("oar_g", 3e-6, s, [0.2] * 4, base[s] + gain[s]) for s in base]
    runs.append(record("oar_g", 3e-6, 203, [0.2] * 4, 0.9))  # unpaired: left out of the paired analysis
    out = pilot.analyse(runs)
    assert out["seeds"] == [200, 201, 202] and out["runs"] == 7
    diff = out["oar_g_minus_grpo"]["held_out_after"]
    assert diff["estimate"] == pytest.approx(statistics.fmean(gain.values()))
    assert diff["low"] <= diff["estimate"] <= diff["high"] and diff["n"] == 3
    sd = statistics.stdev(gain.values())
    assert out["sd_paired_difference"] == pytest.approx(sd)
    assert out["seeds_for_0.05"] == -(-((1.960 + 0.842) * sd / 0.05) ** 2 // 1)


def test_methods_and_seeds_parse_and_bad_ones_are_refused():
    assert pilot.parse_seeds("200-202,7") == [200, 201, 202, 7]
    assert pilot.parse_methods("grpo@1e-5,oar_g@3e-6", None) == [("grpo", 1e-5), ("oar_g", 3e-6)]
    assert pilot.parse_methods("grpo", [1e-6, 1e-5]) == [("grpo", 1e-6), ("grpo", 1e-5)]
    with pytest.raises(SystemExit, match="unknown method 'ppo'"):
        pilot.parse_methods("ppo@1e-5", None)
    with pytest.raises(SystemExit, match="no learning rate"):
        pilot.parse_methods("grpo", None)


def test_a_seed_of_the_other_phase_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(pilot, "RUNS", tmp_path)
    (tmp_path / "tuning_grpo_lr1e-05_s100.json").write_text(json.dumps(record("grpo", 1e-5, 100, [0.1], 0.1)))
    with pytest.raises(SystemExit, match=r"seeds \[100\] were used by the other phase"):
        pilot.main(["run", "--phase", "eval", "--methods", "grpo@1e-5", "--seeds", "99-100"])
