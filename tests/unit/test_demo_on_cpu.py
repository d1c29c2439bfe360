"""The testbed demo (verl_oar.testbed.demo): its dynamics math on hand-checked curves, the run
configuration against verl's config and validation, its flags. The shortened demo through verl's
real trainer is tests/e2e/test_testbed_demo_on_cpu.py."""

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


def test_auto_threshold_and_variance_hand_checked():
    curves = {"grpo": [[0.0, 0.2, 0.4], [0.0, 0.4, 0.4]], "oar_g": [[0.1, 0.1, 0.1], [0.1, 0.2, 0.1]]}
    t = dynamics.auto_threshold(curves, "grpo", window=1)
    assert t.start == pytest.approx(0.05)  # mean of step 1 over all four runs
    assert t.best == pytest.approx(0.4)  # GRPO mean curve 0, .3, .4
    assert t.value == pytest.approx(0.225)
    assert dynamics.auto_threshold({"grpo": [[0.3, 0.2, 0.1]]}, "grpo", 1) is None  # never rises
    with pytest.raises(ValueError, match="baseline"):
        dynamics.auto_threshold(curves, "missing", 1)
    # per-step sample variances (window 1): 0, .02, 0 -> mean .02/3
    assert dynamics.run_variance(curves["grpo"], 1) == pytest.approx(0.02 / 3)
    assert math.isnan(dynamics.run_variance([[0.1, 0.2]], 1))
    with pytest.raises(ValueError, match="same"):
        dynamics.mean_and_spread([[0.1, 0.2], [0.1]])


def test_ratio_is_nan_when_undefined():
    assert dynamics.ratio(2.0, 4.0) == 0.5
    for value, base in ((None, 1.0), (1.0, None), (1.0, 0.0), (math.nan, 1.0)):
        assert math.isnan(dynamics.ratio(value, base))


def test_method_dynamics_counts_runs_that_never_reach_the_threshold():
    from verl_oar.testbed.demo import method_dynamics

    def run(seed, reward, step_s):
        return {"seed": seed, "reward": reward, "step_seconds": step_s, "importance_seconds": [None] * len(reward),
                "val_accuracy": {"0": 0.1, str(len(reward)): 0.2}, "response_length": [1] * len(reward)}

    runs = {
        "grpo": [run(0, [0.0, 0.2, 0.4, 0.4], [9, 2, 2, 4]), run(1, [0.0, 0.4, 0.4, 0.4], [9, 2, 2, 2])],
        "oar_g": [run(0, [0.0, 0.0, 0.0, 0.0], [9, 3, 3, 3]), run(1, [0.0, 0.4, 0.4, 0.4], [9, 3, 3, 3])],
    }
    d = method_dynamics(runs, baseline="grpo", window=1, threshold=None)
    assert d["threshold"] == pytest.approx(0.2)  # start 0, GRPO best .4
    assert d["methods"]["grpo"]["steps_to_threshold"] == [2, 2]
    assert d["methods"]["oar_g"]["steps_to_threshold"] == [None, 2]
    assert d["methods"]["oar_g"]["censored"] == 1
    assert d["methods"]["oar_g"]["mean_steps_to_threshold"] == 3.5  # (steps + 1 = 5, 2)
    assert d["methods"]["oar_g"]["steps_ratio"] == pytest.approx(3.5 / 2)
    assert d["methods"]["grpo"]["median_step_seconds"] == 2  # step 1 (warm-up) left out
    assert d["methods"]["oar_g"]["step_seconds_ratio"] == pytest.approx(1.5)
    assert d["methods"]["grpo"]["val_accuracy_end"] == pytest.approx(0.2)
    given = method_dynamics(runs, baseline="grpo", window=1, threshold=0.5)
    assert given["methods"]["grpo"]["steps_to_threshold"] == [None, None]
    assert math.isnan(given["methods"]["oar_g"]["steps_ratio"]) is False  # both censored: 5 / 5
    assert given["methods"]["oar_g"]["steps_ratio"] == 1.0


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

    settings = RunSettings(steps=3)
    configs = {}
    for method in ("grpo", "oar_g", "oar_p"):
        for seed in (0, 1):
            overrides = run_overrides(tiny_bed, method, seed, settings, neutral_id=32, name="x", val_file=tmp_path / "v.parquet")
            config = compose_ppo_config(overrides)
            validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
            configs[method, seed] = _flat(OmegaConf.to_container(config, resolve=False))
    grpo = configs["grpo", 0]
    assert grpo["actor_rollout_ref.model.use_remove_padding"] is False
    assert grpo["trainer.v1.sampler.custom_sampler.name"] == "QuickPollReplayBuffer"
    assert grpo["trainer.test_freq"] == 3 and grpo["trainer.val_before_train"] is True
    assert grpo["actor_rollout_ref.rollout.val_kwargs.do_sample"] is False
    assert configs["oar_p", 0]["algorithm.oar.perturb_token_id"] == 32
    assert configs["oar_p", 0]["algorithm.oar.perturb_mode"] == "exact"
    for method in ("oar_g", "oar_p"):  # methods differ from GRPO only in algorithm.*
        diff = {k for k in set(grpo) | set(configs[method, 0]) if grpo.get(k) != configs[method, 0].get(k)}
        assert diff and all(k.startswith("algorithm.") for k in diff), diff
    seed_keys = {"data.seed", "actor_rollout_ref.rollout.seed", "actor_rollout_ref.actor.fsdp_config.seed",
                 "algorithm.oar.seed"}
    for method in ("grpo", "oar_g", "oar_p"):  # seeds differ only in seeds
        a, b = configs[method, 0], configs[method, 1]
        diff = {k for k in set(a) | set(b) if a.get(k) != b.get(k)}
        assert diff and diff <= seed_keys, diff


def test_quick_poll_replay_buffer_is_verls_with_a_short_poll():
    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer
    from verl.utils.import_utils import load_extern_type

    cls = load_extern_type("pkg://verl_oar.cpu.replay_buffer", "QuickPollReplayBuffer")
    buffer = cls(trainer_mode="sync", trainer_config=OmegaConf.create({}), max_off_policy_threshold=8,
                 max_off_policy_strategy="drop", sampler_kwargs=OmegaConf.create({}), refill_fn=None)
    assert isinstance(buffer, ReplayBuffer) and buffer.poll_interval == 0.05


def test_bad_flags_are_refused_with_the_fix():
    from verl_oar.testbed.demo import parse_args

    for argv, needle in ((["--methods", "grpo,ppo"], "unknown"), (["--seeds", "0,0"], "distinct"),
                         (["--k-range", "5,3"], "k-range"), (["--fracs", "0,0.5"], "fracs"), (["--steps", "0"], "steps")):
        with pytest.raises(SystemExit):
            parse_args(argv)
    args = parse_args(["--k-range", "2,4", "--fillers", "1,3", "--seeds", "3,4"])
    assert args.spec.k_range == (2, 4) and args.spec.fillers == (1, 3) and args.seed_list == [3, 4]
