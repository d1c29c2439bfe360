"""The OAR advantage estimators ``oar_g`` and ``oar_p``: GRPO's sequence advantage, redistributed
over tokens by OAR importance. Importing this module registers both.

verl extension point: ``verl.trainer.ppo.core_algos.register_adv_est`` (via
``signals.register_token_estimator``). The two estimators compute the same advantage; they differ only
in how the workers measured importance (``importance_signal.IMPORTANCE_METHOD``: OAR-G one gradient
of the outcome w.r.t. the input embeddings, OAR-P occluding tokens and re-scoring the outcome).
"""

from __future__ import annotations

import numpy as np
import torch

from verl_oar.core.config import OARConfig
from verl_oar.core.reshape import importance_to_weights, reshape_advantages, reshape_stats
from verl_oar.integration import importance_signal  # noqa: F401  (registers the token_importance provider)
from verl_oar.integration.signals import current_signals, needed_signals, register_token_estimator


def reshaped_grpo_advantage(
    estimator: str,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    config=None,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A_{i,t} = A_i * w~_{i,t}: GRPO advantage times OAR weights.

    Args:
        estimator: the registered name (for error messages).
        token_level_rewards: (bs, response_len) float; the outcome reward sits on the last token.
        response_mask: (bs, response_len) 0/1; 0 on padding.
        index: (bs,) group ids (verl's ``uid``): rollouts of one prompt share an id.
        config: verl's ``algorithm`` config; OAR reads ``algorithm.oar.*``.

    The base advantage A_i is :func:`grpo_advantage` (grouped by each agent-loop session's final
    output when a session has several outputs); metrics count real rows only (not verl's synthetic
    padding rows).

    Returns:
        (advantages, returns), both (bs, response_len), 0 on padding.
    """
    signals = current_signals(estimator, response_mask)
    oar = OARConfig.from_algorithm(config)
    norm_by_std = bool((config or {}).get("norm_adv_by_std_in_grpo", True))
    grpo_adv = grpo_advantage(token_level_rewards, response_mask, index, epsilon, norm_by_std, signals.session_final)
    mask = response_mask.bool()
    reasoning = signals["oar_reasoning_mask"].bool() & mask
    found = (signals["oar_answer_mask"].bool() & mask).any(dim=1)
    weights = importance_to_weights(signals["oar_importance"], reasoning, oar.reshape_config(), answer_found=found)
    advantages = reshape_advantages(grpo_adv, weights) * response_mask
    signals.metrics.update(
        reshape_stats(
            weights, reasoning, mask, grpo_adv, advantages, oar.reshape_config(), importance=signals["oar_importance"],
            rows=signals.real_rows,
        )
    )
    signals.artifacts.update(
        grpo_advantages=grpo_adv, advantages=advantages, weights=weights.weights, fallback=weights.fallback
    )
    return advantages, advantages


def grpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float,
    norm_adv_by_std_in_grpo: bool,
    session_final: torch.Tensor | None = None,
) -> torch.Tensor:
    """GRPO's token advantages (bs, response_len), 0 on padding: verl's ``compute_grpo_outcome_advantage``.

    With ``session_final`` ((bs,) long: the row of each row's agent-loop session's final output), the
    groups are formed by the final outputs only and every output of a session gets its final output's
    advantage on each of its response tokens, as verl's v1 trainer does for GRPO
    (``compute_advantage_for_multi_trajectories``)."""
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    if session_final is None:
        advantages, _ = compute_grpo_outcome_advantage(
            token_level_rewards=token_level_rewards, response_mask=response_mask, index=index, epsilon=epsilon,
            norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
        )
        return advantages
    finals, local = torch.unique(session_final, sorted=True, return_inverse=True)
    rows = finals.tolist()
    final_adv, _ = compute_grpo_outcome_advantage(
        token_level_rewards=token_level_rewards[rows], response_mask=response_mask[rows], index=np.asarray(index)[rows],
        epsilon=epsilon, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
    )
    first = response_mask[rows].argmax(dim=1)
    scores = final_adv[torch.arange(len(rows)), first]                 # one scalar per session
    return scores[local].unsqueeze(-1) * response_mask


def sequence_values(token_advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(bs,) each row's sequence advantage, read at its first valid token of the (bs, response_len)
    ``token_advantages`` (constant over the row under GRPO); 0 for a row with no valid token."""
    first = mask.float().argmax(dim=1)
    picked = token_advantages[torch.arange(len(token_advantages)), first]
    return torch.where(mask.any(1), picked, torch.zeros_like(picked))


def register_reshaped_grpo(name: str):
    """Register ``name`` in verl's advantage registry as :func:`reshaped_grpo_advantage` over the
    ``token_importance`` signal; returns the registered function (verl's estimator signature)."""

    def estimator(
        token_level_rewards: torch.Tensor,
        response_mask: torch.Tensor,
        index: np.ndarray,
        config=None,
        epsilon: float = 1e-6,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        fields = {f: kwargs[f] for provider in needed_signals(name) for f in provider.fields if f in kwargs}
        if fields:  # a verl with the upstream advantage hooks passes the token fields as keyword arguments
            current_signals(name, response_mask).tensors.update(fields)
        return reshaped_grpo_advantage(name, token_level_rewards, response_mask, index, config, epsilon)

    estimator.__qualname__ = estimator.__name__ = f"compute_{name}_advantage"
    estimator.__doc__ = f"``{name}``: (advantages, returns), both (bs, response_len); see ``reshaped_grpo_advantage``."
    return register_token_estimator(name, needs=("token_importance",))(estimator)


compute_oar_g_advantage = register_reshaped_grpo("oar_g")
compute_oar_p_advantage = register_reshaped_grpo("oar_p")
