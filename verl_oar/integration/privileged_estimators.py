"""The advantage estimators ``cscr`` and ``oppo`` (self-oracle): token credit from re-scoring the
response under privileged prompts (``privileged_signal``). Importing this module registers both.

verl extension point: ``verl.trainer.ppo.core_algos.register_adv_est`` (via
``signals.register_token_estimator``). Math in ``core.cscr`` and ``core.oppo``; this file reads the
signals, GRPO's base advantage and the rewards, and logs ``cscr/*`` and ``oppo/*``.
"""

from __future__ import annotations

import numpy as np
import torch

from verl_oar.core.cscr import CSCRConfig, cscr_advantages, cscr_stats
from verl_oar.core.oppo import OPPOConfig, group_ids, oppo_advantages, oppo_stats
from verl_oar.integration import privileged_signal  # noqa: F401  (registers the cscr_shifts / oppo_evidence providers)
from verl_oar.integration.estimators import grpo_advantage, sequence_values
from verl_oar.integration.signals import keyword_signals, register_token_estimator


def _no_sessions(name: str, signals) -> None:
    if signals.session_final is not None:
        raise RuntimeError(f"algorithm.adv_estimator={name} scores one response per row; this batch has agent-loop "
                           "sessions with several outputs (multi-turn), which it does not support yet. Use grpo or "
                           "oar_g for multi-output sessions.")


def _rows(signals, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s real rows (metrics skip verl's synthetic padding rows)."""
    return tensor if signals.real_rows is None else tensor[signals.real_rows]


@register_token_estimator("cscr", needs=("cscr_shifts",))
def compute_cscr_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: np.ndarray,
                           config=None, epsilon: float = 1e-6, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """``cscr``: GRPO's sequence advantage reallocated over tokens by counterfactual sensitivity
    (``core.cscr``). Rows that were not re-scored keep GRPO's uniform credit (``cscr/broadcast_rows``). Returns
    (advantages, returns), both (bs, response_len), 0 on padding."""
    signals = keyword_signals("cscr", response_mask, kwargs)
    _no_sessions("cscr", signals)
    cfg = CSCRConfig.from_algorithm(config)
    norm_by_std = bool((config or {}).get("norm_adv_by_std_in_grpo", True))
    grpo = grpo_advantage(token_level_rewards, response_mask, index, epsilon, norm_by_std)
    mask = response_mask.bool()
    sequence = sequence_values(grpo, mask)
    scored = signals["cscr_scored"].bool().any(1)
    result = cscr_advantages(sequence, signals["cscr_pos_shift"], signals["cscr_neg_shift"], mask, cfg, scored=scored)
    advantages = result.advantages * response_mask
    stats = cscr_stats(result, sequence, mask, scored) if signals.real_rows is None else cscr_stats(
        type(result)(advantages=_rows(signals, result.advantages), weights=_rows(signals, result.weights),
                     sensitivity=_rows(signals, result.sensitivity), threshold=result.threshold),
        _rows(signals, sequence), _rows(signals, mask), _rows(signals, scored))
    stats["cscr/frac_rows_scored"] = float(_rows(signals, scored).float().mean())
    signals.metrics.update(stats)
    signals.artifacts.update(grpo_advantages=grpo, advantages=advantages, weights=result.weights,
                             sensitivity=result.sensitivity)
    return advantages, advantages


@register_token_estimator("oppo", needs=("oppo_evidence",))
def compute_oppo_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: np.ndarray,
                           config=None, epsilon: float = 1e-6, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """``oppo``: token advantages from the Bayesian value recursion over the oracle evidence (``core.oppo``).
    Rows that were not re-scored keep broadcast credit of their own R - V_0 (``oppo/broadcast_rows``). Returns
    (advantages, returns), both (bs, response_len), 0 on padding."""
    signals = keyword_signals("oppo", response_mask, kwargs)
    _no_sessions("oppo", signals)
    cfg = OPPOConfig.from_algorithm(config)
    rewards = token_level_rewards.sum(dim=-1)
    real = signals.real_rows
    # verl's synthetic padding rows copy a real row's uid: each gets a group of its own (no effect on the prior)
    groups = group_ids([key if real is None or bool(real[i]) else f"verl_oar_padding_{i}" for i, key in enumerate(index)])
    mask = response_mask.bool()
    scored = signals["oppo_scored"].bool().any(1)
    evidence = signals["oppo_evidence"]
    result = oppo_advantages(evidence, rewards, groups, mask, cfg, scored=scored)
    advantages = result.advantages * response_mask
    stats = oppo_stats(result, evidence, rewards, mask, scored) if real is None else oppo_stats(
        type(result)(advantages=result.advantages[real], values=result.values[real], prior=result.prior[real],
                     clipped=result.clipped[real], uniform=result.uniform[real]),
        evidence[real], rewards[real], mask[real], scored[real])
    stats["oppo/frac_rows_scored"] = float(_rows(signals, scored).float().mean())
    signals.metrics.update(stats)
    grpo = grpo_advantage(token_level_rewards, response_mask, index, epsilon,
                          bool((config or {}).get("norm_adv_by_std_in_grpo", True)))
    # w~ for heatmaps and the testbed: each token's credit relative to spreading R - V_0 evenly over the
    # response (1 = GRPO's even credit); 0 on rows with R = V_0 (no direction)
    gap = (rewards - result.prior)[:, None]
    length = response_mask.sum(-1, keepdim=True).float()
    weights = torch.where(gap != 0, advantages * length / torch.where(gap != 0, gap, torch.ones_like(gap)),
                          torch.zeros_like(advantages)) * response_mask
    signals.artifacts.update(grpo_advantages=grpo, advantages=advantages, rewards=rewards, groups=groups,
                             values=result.values, weights=weights)
    return advantages, advantages
