"""The advantage estimator ``codapo`` and CoDaPO's composition with every other token estimator: the question
value (``core.codapo``) times GRPO's advantage, or times another estimator's token advantages
(``+algorithm.codapo.compose=true``). Importing this module registers both.

verl extension points: ``verl.trainer.ppo.core_algos.register_adv_est`` (via ``token_estimator.register_estimator``)
and the plugin's composer hook (``signals.register_advantage_composer``), which applies the value to the
advantages of ``oar_g``, ``oar_p``, ``cscr``, ``oppo`` and ``acpo`` after they are computed. The confidence
reads verl's ``old_log_probs`` (``log_prob_signal``), the accuracy the verifier's score (``rm_scores``,
``reward_signal``), never ``token_level_rewards``: with ``algorithm.use_kl_in_reward=true`` those carry the KL
penalty on every token and no response would count as right (every value would be ``weight_offset``). The GRPO
advantage that the value scales is verl's, from ``token_level_rewards`` (KL included, as in verl's GRPO).
CoDaSampling, the batch's second use, is ``codapo_sampling`` (a trainer mixin).

How value and token credit interact: the value ``v_q >= weight_offset >= 0`` is one number per question, so
it scales every token of every response of the question alike: each token keeps the sign the inner
estimator gave it, and each response's summed credit becomes ``v_q`` times the inner estimator's (OAR, CSCR,
ACPO: ``v_q * T * A^GRPO``; OPPO: ``v_q * (V_T - V_0)``). The inner estimator's own metrics (budget error,
sign violations) are of its advantages before the value; ``codapo/*`` are of the value.
"""

from __future__ import annotations

import torch

from verl_oar.core.codapo import CoDaPOConfig, codapo_stats, question_values
from verl_oar.integration import log_prob_signal  # noqa: F401  (registers the old_log_probs provider)
from verl_oar.integration.reward_signal import verifier_rewards
from verl_oar.integration.signals import register_advantage_composer
from verl_oar.integration.token_estimator import EstimatorBatch, TokenEstimator, register_estimator

NEEDS = ("old_log_probs", "verifier_scores")


def question_value(b: EstimatorBatch) -> torch.Tensor:
    """(bs,) float32 v_q of every row's question; logs ``codapo/*`` and keeps ``codapo_value`` for dumps."""
    cfg = CoDaPOConfig.from_algorithm(b.algorithm)
    rewards = verifier_rewards(b.signals, b.response_mask)  # not token_level_rewards: KL-free, so a right answer is 1.0
    value, parts = question_values(rewards, b["old_log_probs"], b.response_mask, b.groups, cfg.weight_offset,
                                   cfg.right_threshold)
    b.signals.metrics.update(codapo_stats(*b.real(value, parts)))
    b.signals.artifacts.update(codapo_value=value.float(), rewards=rewards)
    return value.float()


class CoDaPO(TokenEstimator):
    """A_{i,t} = v_q * A^GRPO_i (the authors' ``compute_codapo_advantage``)."""

    name, needs = "codapo", NEEDS

    def advantages(self, b):
        value = question_value(b)
        b.keep(weights=value[:, None] * b.response_mask.float())  # a per-question weight, flat over tokens
        return value[:, None] * b.grpo, None


compute_codapo_advantage = register_estimator(CoDaPO)


def composing(algorithm) -> bool:
    """Whether the run composes CoDaPO's value with its (non-CoDaPO) token estimator."""
    node = (algorithm or {}).get("codapo", None) or {}
    return bool(node.get("compose", False))


@register_advantage_composer("codapo", active=composing, needs=NEEDS)
def compose_question_value(estimator: str, advantages: torch.Tensor, token_level_rewards: torch.Tensor,
                           response_mask: torch.Tensor, index, config, signals) -> torch.Tensor:
    """The inner estimator's (bs, response_len) advantages times its rows' question values."""
    if estimator == "codapo":  # already applied (and refused at start-up with compose)
        return advantages
    b = EstimatorBatch(estimator, token_level_rewards, response_mask, index, config, 1e-6, signals)
    composed = question_value(b)[:, None] * advantages
    signals.artifacts.update(advantages=composed, inner_advantages=advantages)
    return composed
