"""The advantage estimator ``acpo``: GRPO's sequence advantage reweighted per token by the surrogate entropy
(``core.acpo``), from the ``acpo_surrogate`` signal (``modal_signal``). Importing this module registers it.

verl extension point: ``verl.trainer.ppo.core_algos.register_adv_est`` (via ``signals.register_token_estimator``).
The weights are detached (an advantage, not a loss term): the paper's loss-level reading is not built
(docs/algo/acpo.md says why).
"""

from __future__ import annotations

import numpy as np
import torch

from verl_oar.core.acpo import ACPOConfig, acpo_advantages, acpo_stats
from verl_oar.integration import modal_signal  # noqa: F401  (registers the acpo_surrogate provider)
from verl_oar.integration.estimators import grpo_advantage, sequence_values
from verl_oar.integration.signals import keyword_signals, register_token_estimator


@register_token_estimator("acpo", needs=("acpo_surrogate",))
def compute_acpo_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: np.ndarray,
                           config=None, epsilon: float = 1e-6, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """``acpo``: A_t = A^GRPO * w_t (``core.acpo``). Returns (advantages, returns), both (bs, response_len),
    0 on padding."""
    signals = keyword_signals("acpo", response_mask, kwargs)
    cfg = ACPOConfig.from_algorithm(config)
    norm_by_std = bool((config or {}).get("norm_adv_by_std_in_grpo", True))
    grpo = grpo_advantage(token_level_rewards, response_mask, index, epsilon, norm_by_std, signals.session_final)
    mask = response_mask.bool()
    sequence = sequence_values(grpo, mask)
    result = acpo_advantages(signals["acpo_surrogate"], sequence, mask, cfg)
    advantages = result.advantages * response_mask
    rows = signals.real_rows if signals.real_rows is not None else slice(None)
    entropy = signals["acpo_entropy"] if not bool((signals["acpo_entropy"] == 0).all()) else None  # 0: bypass mode
    stats = acpo_stats(type(result)(advantages=advantages[rows], weights=result.weights[rows], clipped=result.clipped[rows]),
                       signals["acpo_surrogate"][rows], sequence[rows], mask[rows],
                       None if entropy is None else entropy[rows])
    signals.metrics.update(stats)
    signals.artifacts.update(grpo_advantages=grpo, advantages=advantages, weights=result.weights)
    return advantages, advantages
