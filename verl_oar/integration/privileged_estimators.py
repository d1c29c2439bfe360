"""The advantage estimators ``cscr`` and ``oppo``: token credit from re-scoring the response under privileged
prompts (``privileged_signal``). Importing this module registers both.

verl extension point: ``verl.trainer.ppo.core_algos.register_adv_est`` (via ``token_estimator.register_estimator``).
Math in ``core.cscr`` and ``core.oppo``; metrics under ``cscr/*`` and ``oppo/*``. A row the pass could not score
(past the context) keeps broadcast credit of its own sequence quantity: GRPO's A (CSCR), R - V_0 (OPPO).
"""

from __future__ import annotations

import torch

from verl_oar.core.cscr import CSCRConfig, cscr_advantages, cscr_stats
from verl_oar.core.oppo import OPPOConfig, oppo_advantages, oppo_stats
from verl_oar.integration import privileged_signal  # noqa: F401  (registers the cscr_shifts / oppo_evidence providers)
from verl_oar.integration.token_estimator import TokenEstimator, register_estimator


class CSCR(TokenEstimator):
    """GRPO's sequence advantage reallocated over tokens by counterfactual sensitivity (``core.cscr``)."""

    name, needs, config, sessions = "cscr", ("cscr_shifts",), CSCRConfig, False

    def advantages(self, b):
        scored = b["cscr_scored"].bool().any(1)
        result = cscr_advantages(b.sequence, b["cscr_pos_shift"], b["cscr_neg_shift"], b.mask, b.cfg, scored=scored)
        b.keep(weights=result.weights, sensitivity=result.sensitivity)
        return result.advantages, (result, scored)

    def stats(self, b, state):
        result, scored = b.real(*state)
        return {**cscr_stats(result, b.real(b.sequence), b.real(b.mask), scored),
                "cscr/frac_rows_scored": float(scored.float().mean())}


class OPPO(TokenEstimator):
    """Token advantages from the Bayesian value recursion over the oracle evidence (``core.oppo``)."""

    name, needs, config, sessions = "oppo", ("oppo_evidence",), OPPOConfig, False

    def advantages(self, b):
        scored = b["oppo_scored"].bool().any(1)
        result = oppo_advantages(b["oppo_evidence"], b.rewards, b.groups, b.mask, b.cfg, scored=scored)
        # w~ for heatmaps and the testbed: each token's credit relative to spreading R - V_0 evenly over the
        # response (1 = GRPO's even credit); 0 on rows with R = V_0 (no direction)
        gap = (b.rewards - result.prior)[:, None]
        length = b.response_mask.sum(-1, keepdim=True).float()
        advantages = result.advantages * b.response_mask
        weights = torch.where(gap != 0, advantages * length / torch.where(gap != 0, gap, torch.ones_like(gap)),
                              torch.zeros_like(advantages)) * b.response_mask
        b.keep(rewards=b.rewards, groups=b.groups, values=result.values, weights=weights, grpo_advantages=b.grpo)
        return result.advantages, (result, scored)

    def stats(self, b, state):
        result, scored = b.real(*state)
        return {**oppo_stats(result, b.real(b["oppo_evidence"]), b.real(b.rewards), b.real(b.mask), scored),
                "oppo/frac_rows_scored": float(scored.float().mean())}


compute_cscr_advantage = register_estimator(CSCR)
compute_oppo_advantage = register_estimator(OPPO)
