"""``oar_g``: GRPO's sequence advantage, redistributed over tokens by OAR-G importance
(one gradient of the outcome w.r.t. the input embeddings).

verl extension point: ``verl.trainer.ppo.core_algos.register_adv_est`` (via
``verl_oar.signals.register_token_estimator``); checked against verl 0.9.1.
"""

from __future__ import annotations

import numpy as np
import torch

from verl_oar.estimators.reshaped_grpo import reshaped_grpo_advantage
from verl_oar.signals import register_token_estimator
from verl_oar.signals_importance import IMPORTANCE_FIELDS  # noqa: F401  (registers the provider)


@register_token_estimator("oar_g", needs=("token_importance",))
def compute_oar_g_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    config=None,
    epsilon: float = 1e-6,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both (bs, response_len); see ``reshaped_grpo_advantage``."""
    return reshaped_grpo_advantage("oar_g", token_level_rewards, response_mask, index, config, epsilon)
