"""The testbed demo (verl_oar.testbed.demo): its dynamics and comparison math on hand-checked curves,
the credit measures on hand-made dumps, the run configuration against verl's config and validation,
its flags, README's table against the committed results. The shortened demo through verl's real
trainer is tests/e2e/test_testbed_demo_on_cpu.py."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from verl_oar.testbed import dynamics

# ---------------------------------------------------------------------------------------------------
# dynamics: hand-checked and against plain loops
# ---------------------------------------------------------------------------------------------------


def test_smooth_is_a_trailing_mean():
    assert dynamics.smooth([0, 1, 2, 3], 2) == [0.0, 0.5, 1.5, 2.5]
    assert dynamics.smooth([4, 0, 2], 1) == [4, 0, 2]
    rng = random.Random(0)
    values = [rng.random() for _ in range(30)]
    for window in (1, 3, 7, 40):
        expected = [statistics.fmean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]
        assert dynamics.smooth(values, window) == pytest.approx(expected, abs=1e-12)
    with pytest.raises(ValueError, match="window"):
        dynamics.smooth([1.0], 0)


def test_steps_to_threshold_hand_checked():
    curve = [0.0, 0.0, 1.0, 1.0, 0.0]
    assert dynamics.steps_to_threshold(curve, 1.0, 1) == 3
    assert dynamics.steps_to_threshold(curve, 0.5, 2) == 3  # smoothed: 0, 0, .5, 1, .5
    assert dynamics.steps_to_threshold(curve, 0.9, 2) == 4
    assert dynamics.steps_to_threshold(curve, 1.1, 1) is None
    # a lucky first step is not reaching it: the window must be full
    assert dynamics.steps_to_threshold([1.0, 0.0, 0.0, 1.0, 1.0], 0.6, 2) == 5
    assert dynamics.steps_to_threshold([1.0, 1.0], 0.9, 3) is None


def test_variance_hand_checked():
    curves = [[0.0, 0.2, 0.4], [0.0, 0.4, 0.4]]
    # per-step sample variances (window 1): 0, .02, 0 -> mean .02/3
    assert dynamics.run_variance(curves, 1) == pytest.approx(0.02 / 3)
    assert math.isnan(dynamics.run_variance([[0.1, 0.2]], 1))
    with pytest.raises(ValueError, match="same"):
        dynamics.mean_and_spread([[0.1, 0.2], [0.1]])


def _run(seed, reward, step_s, val):
    return {"seed": seed, "reward": reward, "step_seconds": step_s, "val_accuracy": val}


def test_comparison_on_hand_checked_runs(monkeypatch):
    from verl_oar.testbed import comparison

    monkeypatch.setattr(comparison, "WINDOW", 1)
    monkeypatch.setattr(comparison, "THRESHOLD", 0.4)
    # 1000 resamples, not 10,000 (pure-Python bootstraps, ~6 s): the intervals checked below are the extremes of
    # two seeds' resamples, which 1000 resamples reach as surely
    monkeypatch.setattr(comparison, "RESAMPLES", 1000)
    runs = {
        "grpo": [_run(0, [0.0, 0.2, 0.4, 0.4], [9, 2, 2, 4], {"0": 0.2, "2": 0.4, "4": 0.6}),
                 _run(1, [0.0, 0.4, 0.4, 0.4], [9, 2, 2, 2], {"0": 0.2, "2": 0.6, "4": 0.6})],
        "oar_g": [_run(1, [0.0, 0.4, 0.4, 0.4], [9, 3, 3, 3], {"0": 0.2, "2": 0.2, "4": 1.0}),
                  _run(0, [0.0, 0.0, 0.0, 0.0], [9, 3, 3, 3], {"0": 0.2, "2": 0.2, "4": 0.2})],
    }
    c = comparison.compare(runs, "grpo")
    grpo, oar = c["methods"]["grpo"], c["methods"]["oar_g"]
    assert grpo["per_seed"]["steps_to_threshold"] == [3.0, 2.0]
    assert oar["per_seed"]["steps_to_threshold"] == [2.0, 5.0] and oar["censored"] == 1   # never: steps + 1
    assert grpo["per_seed"]["auc"] == pytest.approx([0.4, 0.5])       # (.3*2 + .5*2) / 4, (.4*2 + .6*2) / 4
    assert grpo["per_seed"]["step_seconds"] == [2.0, 2.0]              # step 1 (warm-up) left out
    assert oar["per_seed"]["gain"] == pytest.approx([0.8, 0.0])
    assert oar["vs_baseline"]["steps_to_threshold"]["estimate"] == pytest.approx(1.0)
    assert oar["vs_baseline"]["step_seconds"]["estimate"] == pytest.approx(1.0)
    assert grpo["vs_baseline"]["auc"]["estimate"] == 0.0
    # paired by seed, not by position: oar seed 1 (2 steps) - grpo seed 1 (2) = 0, oar seed 0 (5) - grpo
    # seed 0 (3) = 2; by position the differences would be -1 and 3
    low, high = oar["vs_baseline"]["steps_to_threshold"]["low"], oar["vs_baseline"]["steps_to_threshold"]["high"]
    assert low == pytest.approx(0.0) and high == pytest.approx(2.0)   # resamples of the per-seed diffs {0, 2}
    # variance: per step over seeds (window 1) of the rewards, averaged: grpo 0, .02, 0, 0 -> .005
    assert grpo["variance"]["estimate"] == pytest.approx(0.02 / 4)
    one_seed = comparison.compare({"grpo": runs["grpo"][:1]}, "grpo")["methods"]["grpo"]
    assert one_seed["variance"]["estimate"] is None and one_seed["mean"]["auc"]["low"] is None   # no NaN
    with pytest.raises(ValueError, match="baseline"):
        comparison.compare({"oar_g": runs["oar_g"]}, "grpo")


def test_credit_concentration_and_recall_from_a_hand_made_dump(tmp_path):
    import torch

    from verl_oar.cpu.workspace import build_tokenizer
    from verl_oar.testbed.credit import concentration, run_credit

    tok = build_tokenizer()
    text = "ab 7 cd 5 ef \\boxed{75}"
    texts = [text, text, text, "ab 7 cd 5 ef", "ab cd \\boxed{75}", "75\\boxed{75}"]
    rows = [tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] for t in texts]
    width = max(map(len, rows)) + 3
    responses = torch.full((len(rows), width), tok.pad_token_id)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for r, ids in enumerate(rows):
        responses[r, : len(ids)], mask[r, : len(ids)] = torch.tensor(ids), 1
    advantages = torch.ones(len(rows), width) * 0.5
    picks = [text.index("7"), text.index("5")]
    advantages[0, picks] = 2.0          # 4x the other reasoning tokens
    advantages[1] = 0.0                  # a group with one reward: skipped, counted
    importance = torch.zeros(len(rows), width)
    importance[0, picks[0]] = 1.0        # top 10% of 13 reasoning tokens = 2 tokens: one of the two picks
    importance[0, 0] = 0.5
    real = torch.tensor([True, True, False, True, True, True])   # row 2: verl's padding row
    torch.save({"responses": responses, "response_mask": mask, "advantages": advantages, "oar_importance": importance,
                "real_rows": real}, tmp_path / "step_1.pt")
    credit = run_credit(tmp_path, tok, "oar_importance")
    assert credit.concentrations == [pytest.approx(4.0)] and credit.responses == 5 and credit.steps == 1
    assert credit.skipped == {"no_answer": 1, "zero_advantage": 1, "no_causal": 1, "no_other": 1}
    assert credit.recalls[:1] == [0.5] and len(credit.recalls) == 3   # rows with causal tokens: 0, 1, 5
    reasoning = torch.ones(4, dtype=torch.bool)
    assert concentration(torch.ones(4), torch.tensor([True, False, False, False]), reasoning) == 1.0
    assert concentration(torch.ones(4), torch.zeros(4, dtype=torch.bool), reasoning) is None


def test_methods_registry_and_the_committed_results():
    import json
    from pathlib import Path

    from verl_oar.testbed.methods import BASELINE, METHODS, method
    from verl_oar.testbed.report import readme_section

    assert BASELINE in METHODS and all(m.name == k for k, m in METHODS.items())
    with pytest.raises(ValueError, match="testbed knows"):
        method("ppo")
    root = Path(__file__).resolve().parents[2]
    results = json.loads((root / "benchmarks" / "results_testbed_long_run_cpu.json").read_text())
    assert results["machine"]["cpu"] and results["machine"]["torch"]
    assert len(results["seeds"]) >= 5 and set(results["methods"]) == set(METHODS)
    assert readme_section(results)  # rendered into docs/testbed.md: tests/unit/test_readme_on_cpu.py


# ---------------------------------------------------------------------------------------------------
# run configuration
# ---------------------------------------------------------------------------------------------------


def _flat(config, prefix=""):
    """{dotted key: value} of a plain container (interpolations left as written)."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_run_overrides_compose_validate_and_differ_only_where_they_should(tiny_bed, tmp_path):
    from _verl_config import compose_ppo_config
    from omegaconf import OmegaConf
    from verl.trainer.main_ppo import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from verl_oar.testbed.training_runs import RunSettings, run_overrides

    settings = RunSettings(steps=3, val_every=2, mini_batch_size=4)
    configs = {}
    from verl_oar.testbed.methods import METHODS

    for method in METHODS:
        for seed in (0, 1):
            overrides = run_overrides(tiny_bed, method, seed, settings, neutral_id=32, name="x", val_file=tmp_path / "v.parquet",
                                      dump_dir=tmp_path / "dumps")
            config = compose_ppo_config(overrides)
            validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
            configs[method, seed] = _flat(OmegaConf.to_container(config, resolve=False))
    grpo = configs["grpo", 0]
    assert grpo["actor_rollout_ref.model.use_remove_padding"] is False
    assert grpo["trainer.v1.sampler.custom_sampler.name"] == "QuickPollReplayBuffer"
    assert grpo["trainer.test_freq"] == settings.val_every and grpo["trainer.val_before_train"] is True
    assert grpo["actor_rollout_ref.actor.optim.lr"] == settings.lr
    # --mini-batch-size 4: two PPO mini-batches per step
    assert grpo["data.train_batch_size"] == 2 * grpo["actor_rollout_ref.actor.ppo_mini_batch_size"] == 2 * settings.mini_batch_size
    assert grpo["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"] == settings.mini_batch_size * settings.n
    assert grpo["actor_rollout_ref.rollout.val_kwargs.do_sample"] is False
    assert configs["oar_p", 0]["algorithm.oar.perturb_token_id"] == 32
    # the testbed's small models score every token (the paper's OAR-P), not the plugin's default chunk K=16
    assert configs["oar_p", 0]["algorithm.oar.perturb_mode"] == "exact"
    assert configs["oar_g", 0]["algorithm.oar.dump_dir"] == str(tmp_path / "dumps")
    assert configs["cscr", 0]["algorithm.oar.dump_dir"] == configs["oppo", 0]["algorithm.oar.dump_dir"] == str(tmp_path / "dumps")
    for method in set(METHODS) - {"grpo"}:  # methods differ from GRPO only in algorithm.*
        diff = {k for k in set(grpo) | set(configs[method, 0]) if grpo.get(k) != configs[method, 0].get(k)}
        assert diff and all(k.startswith("algorithm.") for k in diff), diff
    seed_keys = {"data.seed", "actor_rollout_ref.rollout.seed", "actor_rollout_ref.actor.fsdp_config.seed",
                 "algorithm.oar.seed"}
    for method in METHODS:  # seeds differ only in seeds
        a, b = configs[method, 0], configs[method, 1]
        diff = {k for k in set(a) | set(b) if a.get(k) != b.get(k)}
        assert diff and diff <= seed_keys, diff


def test_run_overrides_on_two_ranks_split_each_mini_batch_over_them(tiny_bed, tmp_path):
    """``RunSettings.ranks``: the testbed's runs on several FSDP2 ranks (tests/e2e/test_two_ranks_on_cpu.py has the
    launches), each rank's micro-batch its share of a mini-batch; a split that cannot be even is refused."""
    from _verl_config import compose_ppo_config

    from verl_oar.testbed.training_runs import RunSettings, run_overrides

    def compose(settings):
        return compose_ppo_config(run_overrides(tiny_bed, "oar_g", 0, settings, neutral_id=32, name="x",
                                                val_file=tmp_path / "v.parquet"))

    one, two = compose(RunSettings(mini_batch_size=4)), compose(RunSettings(mini_batch_size=4, ranks=2))
    assert two.trainer.n_gpus_per_node == 2 and two.ray_kwargs.ray_init.num_gpus in (2, None)  # None: a joined cluster
    micro = (c.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu for c in (one, two))
    assert next(micro) == 2 * next(micro)
    with pytest.raises(ValueError, match="rows per PPO mini-batch do not split evenly over ranks=3"):
        compose(RunSettings(batch_size=6, mini_batch_size=2, n=4, ranks=3))


def test_quick_poll_replay_buffer_is_verls_with_a_short_poll():
    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer
    from verl.utils.import_utils import load_extern_type

    cls = load_extern_type("pkg://verl_oar.cpu.replay_buffer", "QuickPollReplayBuffer")
    buffer = cls(trainer_mode="sync", trainer_config=OmegaConf.create({}), max_off_policy_threshold=8,
                 max_off_policy_strategy="drop", sampler_kwargs=OmegaConf.create({}), refill_fn=None)
    assert isinstance(buffer, ReplayBuffer) and buffer.poll_interval == 0.05


def test_bad_flags_are_refused_with_the_fix(capsys):
    from verl_oar.testbed.demo import parse_args

    for argv, needle in ((["--methods", "grpo,ppo"], "unknown"), (["--methods", "oar_g"], "must include grpo"),
                         (["--seeds", "0,0"], "distinct"), (["--fracs", "0.2,0.5"], "0.1 among them"),
                         (["--steps", "0"], "steps"), (["--batch-size", "8", "--mini-batch-size", "3"], "must divide")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert needle in capsys.readouterr().err
    args = parse_args(["--seeds", "3,4"])
    assert args.seed_list == [3, 4] and args.method_list == ["grpo", "oar_g", "oar_p"]


def test_reuse_copies_the_matching_runs_of_a_finished_folder_and_refuses_other_settings(tiny_bed, tmp_path):
    import json

    from verl_oar.testbed.reuse import reuse_runs
    from verl_oar.testbed.training_runs import RunSettings, make_runs

    settings = RunSettings(steps=2)
    old = tmp_path / "old"
    for label in ("grpo_seed0", "oar_g_seed0"):
        (old / "metrics").mkdir(parents=True, exist_ok=True)
        (old / "logs").mkdir(exist_ok=True)
        (old / "metrics" / f"{label}.jsonl").write_text(json.dumps({"step": 1, "data": {"x": 1.0}}) + "\n")
        (old / "logs" / f"{label}.log").write_text("log\n")
    (old / "dumps" / "oar_g_seed0").mkdir(parents=True)
    (old / "dumps" / "oar_g_seed0" / "step_1.pt").write_bytes(b"x")
    summary = {"command": "python -m verl_oar.testbed.demo ...", "settings": {**vars(settings), "quality_samples": 16},
               "testbed": {"spec": tiny_bed.manifest["spec"]},
               "runs": {"grpo": [{"seed": 0, "seconds": 120.0}], "oar_g": [{"seed": 0, "seconds": 130.0}]}}
    (old / "summary.json").write_text(json.dumps(summary))
    runs = make_runs(tiny_bed, ["grpo", "oar_g", "cscr"], [0, 1], settings, neutral_id=32, out_dir=tmp_path / "new",
                     val_file=tmp_path / "v.parquet")
    reused, earlier = reuse_runs(runs, old, settings, tiny_bed)
    assert reused["runs"] == ["grpo/seed0", "oar_g/seed0"] and reused["from"] == str(old.resolve())
    assert reused["files"] is True and earlier is None
    by_label = {r.label: r for r in runs}
    assert by_label["oar_g/seed0"].returncode == 0 and by_label["oar_g/seed0"].finished == 130.0
    assert by_label["oar_g/seed0"].records == [{"step": 1, "data": {"x": 1.0}}]
    assert (tmp_path / "new" / "dumps" / "oar_g_seed0" / "step_1.pt").exists()
    assert by_label["cscr/seed0"].returncode is None and by_label["grpo/seed1"].returncode is None  # to train
    with pytest.raises(SystemExit, match="settings or testbed differ"):
        reuse_runs(runs, old, RunSettings(steps=3), tiny_bed)


def test_reuse_from_a_summary_file_takes_its_entries_and_merges_the_same_response_rows(tiny_bed, tmp_path):
    import json

    import torch

    from verl_oar.cpu.workspace import build_tokenizer
    from verl_oar.testbed.demo import measured
    from verl_oar.testbed.reuse import merge_same_response, reuse_runs
    from verl_oar.testbed.training_runs import RunSettings, make_runs

    settings = RunSettings(steps=2)
    entry = {"seed": 0, "reward": [0.2, 0.9], "response_length": [30, 30], "step_seconds": [3.0, 2.0],
             "importance_seconds": [None, None], "val_accuracy": {"0": 0.4, "2": 0.8}, "credit": None, "seconds": 99.0}
    summary = {"command": "python -m verl_oar.testbed.demo --seeds 0", "settings": {**vars(settings), "quality_samples": 16},
               "testbed": {"spec": tiny_bed.manifest["spec"]}, "reused": {"from": "/gone", "command": "first", "runs": []},
               "runs": {"grpo": [entry], "oar_g": [{**entry, "credit": {"concentration": 2.0}}]},
               "concentration_quartiles": {"grpo": {"median": None}, "oar_g": {"median": 2.0, "responses": 7}},
               "same_response": [{"tokens": ["a", "7"], "weights": {"grpo": [1.0, 1.0], "oar_g": [0.5, 1.5]}},
                                 {"tokens": ["b", "3"], "weights": {"grpo": [1.0, 1.0], "oar_g": [0.9, 1.1]}}]}
    path = tmp_path / "long_run.json"
    path.write_text(json.dumps(summary))
    runs = make_runs(tiny_bed, ["grpo", "oar_g"], [0], settings, neutral_id=32, out_dir=tmp_path / "new", val_file=tmp_path / "v")
    reused, earlier = reuse_runs(runs, path, settings, tiny_bed)
    assert reused["files"] is False and reused["earlier"]["command"] == "first" and earlier == summary
    assert all(r.summary == summary["runs"][r.method][0] and r.returncode == 0 for r in runs)
    out = measured(runs, ["grpo", "oar_g"], earlier)
    assert out["runs"]["oar_g"][0]["credit"] == {"concentration": 2.0}
    assert out["concentration_quartiles"]["oar_g"] == {"median": 2.0, "responses": 7}
    assert out["same_response"] == summary["same_response"]  # no run trained here: the rows as they were

    tokenizer = build_tokenizer()  # a run trained here adds its weights where it has the same step-1 response
    ids = [tokenizer.encode(t, add_special_tokens=False)[0] for t in ("b", "3")]
    dump = {"responses": torch.tensor([[ids[0], ids[1], 0]]), "response_mask": torch.tensor([[1, 1, 0]]),
            "weights": torch.tensor([[0.25, 1.75, 1.0]])}
    merged = merge_same_response(summary["same_response"], {"cscr": dump}, tokenizer)
    assert [r["tokens"] for r in merged] == [["b", "3"]] and merged[0]["weights"]["cscr"] == [0.25, 1.75]
    assert "cscr" not in summary["same_response"][1]["weights"]  # the earlier rows are not changed

    mixed = make_runs(tiny_bed, ["grpo", "oar_g"], [0, 1], settings, neutral_id=32, out_dir=tmp_path / "m", val_file=tmp_path / "v")
    _, earlier = reuse_runs(mixed, path, settings, tiny_bed)  # seed 1 is not in the summary: it would train here
    with pytest.raises(SystemExit, match="reuse all of its seeds or none"):
        measured(mixed, ["grpo", "oar_g"], earlier)
