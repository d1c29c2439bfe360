"""Configurations in which a cluster run would silently train the wrong thing or stop mid-run: each is either
made right or refused at start-up naming the cause and the fix (KL in the reward, the reward's range, OPPO's
degenerate key pair, rollout-correction bypass mode, rows the privileged pass cannot score, privileged prompts
past the context, CoDaSampling beside DAPO's group filter)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _verl_config import compose_ppo_config

from verl_oar.cpu.overrides import cpu_overrides
from verl_oar.integration import codapo_estimator, privileged_estimators  # noqa: F401  (register codapo, cscr, oppo)


def _batch(seed=0, groups=3, n=4, t=6):
    """(rm_scores (bs, t) with a 0/1 score on each row's last token, response mask, uid per row, generator)."""
    g = torch.Generator().manual_seed(seed)
    bs = groups * n
    lengths = torch.randint(2, t + 1, (bs,), generator=g)
    mask = (torch.arange(t)[None] < lengths[:, None]).float()
    scores = torch.zeros(bs, t)
    score = (torch.rand(bs, generator=g) < 0.5).float()
    score[0], score[1] = 1.0, 0.0
    scores[torch.arange(bs), lengths - 1] = score
    index = np.array([f"u{i // n}" for i in range(bs)], dtype=object)
    return scores, mask, index, g


def _startup(estimator, *overrides):
    from verl_oar.integration.validate import check_token_signals_supported

    return check_token_signals_supported(compose_ppo_config(cpu_overrides("/ws", adv_estimator=estimator) + list(overrides)),
                                         "sync")


# --- 2. KL in the reward: CoDaPO reads the verifier's score, OPPO refuses -----------------------------------------


def _kl_folded(scores, mask, g, coef=0.05):
    """token_level_rewards as verl's v1 trainer builds them with algorithm.use_kl_in_reward=true (apply_kl_penalty)."""
    from verl import DataProto
    from verl.trainer.ppo.core_algos import FixedKLController
    from verl.trainer.ppo.ray_trainer import apply_kl_penalty

    old = -torch.rand(mask.shape, generator=g) * mask
    ref = old - 0.3 * torch.rand(mask.shape, generator=g) * mask
    data = DataProto.from_dict({"token_level_scores": scores, "old_log_probs": old, "ref_log_prob": ref,
                                "response_mask": mask})
    data, _ = apply_kl_penalty(data, FixedKLController(coef), kl_penalty="kl")
    return data.batch["token_level_rewards"], old


@pytest.mark.parametrize("compose", [False, True])
def test_codapo_value_reads_the_verifier_score_not_the_kl_folded_reward(compose):
    """With the KL penalty folded into token_level_rewards, no response sums to exactly 1.0: CoDaPO's value must come
    from rm_scores (what CoDaSampling selects on), the GRPO advantage it scales from verl's rewards (KL included)."""
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    from verl_oar.core.codapo import question_values
    from verl_oar.core.oppo import group_ids
    from verl_oar.integration.estimators import grpo_advantage
    from verl_oar.integration.signals import TokenSignals, provide

    scores, mask, index, g = _batch(4)
    rewards, old = _kl_folded(scores, mask, g)
    assert not (rewards.sum(1) == 1.0).any()  # what the value read before: every question at weight_offset
    value, _ = question_values(scores.sum(1), old, mask, group_ids(list(index)), 0.1)
    assert (value > 0.1 + 1e-3).any()
    tensors = {"old_log_probs": old, "rm_scores": scores}
    if compose:  # CoDaPO's value on another token estimator's advantages (ACPO's)
        from verl_oar.integration import acpo_estimator  # noqa: F401

        tensors.update(acpo_surrogate=old.neg(), acpo_entropy=old.neg())
        with provide(TokenSignals(tensors=dict(tensors))):
            inner, _ = get_adv_estimator_fn("acpo")(rewards, mask, index, config={})
        signals = TokenSignals(tensors=dict(tensors))
        with provide(signals):
            adv, _ = get_adv_estimator_fn("acpo")(rewards, mask, index, config={"codapo": {"compose": True}})
        torch.testing.assert_close(adv, value[:, None].float() * inner)
    else:
        signals = TokenSignals(tensors=dict(tensors))
        with provide(signals):
            adv, _ = get_adv_estimator_fn("codapo")(rewards, mask, index, config={})
        grpo = grpo_advantage(rewards, mask, index, 1e-6, True)  # verl's GRPO of the KL-folded rewards
        torch.testing.assert_close(adv, (value[:, None] * grpo).float() * mask)
    assert signals.metrics["codapo/accuracy/mean"] > 0


def test_codapo_and_compose_fetch_the_verifier_score_with_kl_in_the_reward():
    ref = ["algorithm.use_kl_in_reward=true"]
    assert [p.name for p in _startup("codapo", *ref)] == ["old_log_probs", "verifier_scores"]
    assert [p.name for p in _startup("oar_g", *ref, "+algorithm.codapo.compose=true")] == [
        "token_importance", "old_log_probs", "verifier_scores"]


# --- 3. OPPO's reward range, refused at start-up where verl's config tells ------------------------------------


@pytest.mark.parametrize("overrides, needle", [
    (["algorithm.use_kl_in_reward=true"],
     r"use_kl_in_reward=true subtracts the KL penalty .* algorithm.use_kl_in_reward=false actor_rollout_ref.actor.use_kl_loss=true"),
    (["algorithm.use_kl_in_reward=true", "+algorithm.codapo.compose=true"], "use_kl_loss=true"),
    (["reward.reward_model.enable=true", "reward.custom_reward_function.path=null"], r"reward.reward_model.enable=true without a custom reward function .* unbounded"),
    (["reward.reward_manager.name=dapo", "+reward.reward_kwargs.overlong_buffer_cfg.enable=true"],
     "overlong_buffer_cfg.enable=false"),
])
def test_oppo_refuses_rewards_that_are_not_success_probabilities_at_start_up(overrides, needle):
    with pytest.raises(ValueError, match=needle):
        _startup("oppo", *overrides)


def test_oppo_accepts_a_reward_model_behind_a_custom_reward_function_and_checks_each_batch():
    """A custom function may map the model's score into [0, 1]: not knowable at start-up, so each batch is checked."""
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    from verl_oar.integration.signals import TokenSignals, provide

    assert [p.name for p in _startup("oppo", "reward.reward_model.enable=true",
                                     "reward.custom_reward_function.path=/x/score.py")] == ["oppo_evidence"]
    scores, mask, index, g = _batch(5)
    scores[2, int(mask[2].sum()) - 1] = -1.0  # one row scored -1 (as verl's math_dapo scores a wrong answer)
    signals = TokenSignals(tensors={"oppo_evidence": torch.zeros_like(mask), "oppo_scored": torch.ones_like(mask).long()})
    with provide(signals), pytest.raises(ValueError, match=r"success probability, in \[0, 1\]; got \[-1.0\].*math_dapo"):
        get_adv_estimator_fn("oppo")(scores, mask, index, config={})


# --- 4. OPPO's degenerate key pair --------------------------------------------------------------------------------


def test_oppo_group_std_scale_without_zeroing_uniform_groups_is_refused_naming_both_keys():
    from verl_oar.core.oppo import OPPOConfig

    with pytest.raises(ValueError, match=r"scale=group_std with algorithm.oppo.zero_uniform_groups=false .*"
                                         r"zero_uniform_groups=true.*scale=none"):
        OPPOConfig.from_algorithm({"oppo": {"scale": "group_std", "zero_uniform_groups": False}})
    with pytest.raises(ValueError, match="zero_uniform_groups=false"):
        _startup("oppo", "+algorithm.oppo.scale=group_std", "+algorithm.oppo.zero_uniform_groups=false")
    OPPOConfig(scale="group_std")  # with zeroing (the default), and either key alone, are fine
    OPPOConfig(zero_uniform_groups=False)


# --- 5. a row the privileged pass could not score keeps broadcast credit of its own sequence quantity ----------


@pytest.mark.parametrize("scale", ["none", "group_std"])
def test_an_unscored_oppo_row_keeps_its_r_minus_v0_spread_evenly_and_is_counted(scale):
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    from verl_oar.core.oppo import OPPOConfig, group_ids, oppo_advantages
    from verl_oar.integration.signals import TokenSignals, provide

    scores, mask, index, g = _batch(6)
    evidence = torch.randn(mask.shape, generator=g) * mask
    scored = torch.ones_like(mask, dtype=torch.long)
    skipped = [0, 1, 7]  # rows 0 and 1: both outcomes of group u0
    scored[skipped] = 0
    signals = TokenSignals(tensors={"oppo_evidence": evidence, "oppo_scored": scored})
    with provide(signals):
        adv, _ = get_adv_estimator_fn("oppo")(scores, mask, index, config={"oppo": {"scale": scale}})
    r = scores.sum(1).double()
    groups = group_ids(list(index))
    full = oppo_advantages(evidence, scores.sum(1), groups, mask, OPPOConfig(scale=scale))  # every row scored
    for row in range(len(mask)):
        mates = r[groups == groups[row]]
        if row not in skipped:  # the other rows are as if every row had been scored (the prior reads all rewards)
            torch.testing.assert_close(adv[row], full.advantages[row])
            continue
        prior = float(mates.mean().clamp(1e-3, 1 - 1e-3))
        length = float(mask[row].sum())
        std = float(mates.std()) if scale == "group_std" else None
        want = 0.0 if bool((mates == mates[0]).all()) else (float(r[row]) - prior) / length / (1 if std is None else std + 1e-6)
        torch.testing.assert_close(adv[row], (want * mask[row]).float(), atol=1e-6, rtol=1e-5)
        assert adv[row].sum().abs() > 0 or want == 0.0
    assert signals.metrics["oppo/broadcast_rows"] == 3 and signals.metrics["oppo/frac_rows_scored"] == 9 / 12
    assert signals.metrics["oppo/sign_violations"] == 0


def test_an_unscored_cscr_row_keeps_grpos_uniform_credit_and_is_counted():
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    from verl_oar.integration.estimators import grpo_advantage
    from verl_oar.integration.signals import TokenSignals, provide

    scores, mask, index, g = _batch(7)
    pos, neg = torch.randn(mask.shape, generator=g) * mask, torch.randn(mask.shape, generator=g) * mask
    scored = torch.ones_like(mask, dtype=torch.long)
    scored[[0, 5]] = 0
    signals = TokenSignals(tensors={"cscr_pos_shift": pos, "cscr_neg_shift": neg, "cscr_scored": scored})
    with provide(signals):
        adv, _ = get_adv_estimator_fn("cscr")(scores, mask, index, config={})
    grpo = grpo_advantage(scores, mask, index, 1e-6, True)
    torch.testing.assert_close(adv[[0, 5]], grpo[[0, 5]])
    assert signals.metrics["cscr/broadcast_rows"] == 2 and signals.metrics["cscr/budget_error"] < 1e-5
    torch.testing.assert_close(signals.artifacts["weights"][[0, 5]], mask[[0, 5]])
