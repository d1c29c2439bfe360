"""The OAR advantage estimators ``oar_g`` and ``oar_p``: GRPO's sequence advantage, redistributed
over tokens by OAR importance (``core.reshape``). Importing this module registers both.

verl extension point: ``verl.trainer.ppo.core_algos.register_adv_est`` (via ``token_estimator.register_estimator``).
The two estimators compute the same advantage; they differ only in how the workers measured importance
(``importance_signal.IMPORTANCE_METHOD``: OAR-G one gradient of the outcome w.r.t. the input embeddings, OAR-P
occluding tokens and re-scoring the outcome).
"""

from __future__ import annotations

from verl_oar.core.config import OARConfig
from verl_oar.core.reshape import importance_to_weights, reshape_advantages, reshape_stats
from verl_oar.integration import importance_signal  # noqa: F401  (registers the token_importance provider)
from verl_oar.integration.token_estimator import (  # noqa: F401  (grpo_advantage, sequence_values: re-exported)
    TokenEstimator, grpo_advantage, register_estimator, sequence_values,
)


class OAR(TokenEstimator):
    """A_{i,t} = A_i * w~_{i,t}: GRPO's advantage times OAR's weights from the ``token_importance`` signal (reasoning
    tokens reshaped; the answer and later tokens keep weight 1; rows without a located answer, or whose importance
    cannot be reshaped, keep GRPO's credit and are counted in ``fallback/*``). Metrics: ``reshape_stats``."""

    needs = ("token_importance",)
    config = OARConfig

    def advantages(self, b):
        reasoning = b["oar_reasoning_mask"].bool() & b.mask
        found = (b["oar_answer_mask"].bool() & b.mask).any(dim=1)
        weights = importance_to_weights(b["oar_importance"], reasoning, b.cfg.reshape_config(), answer_found=found)
        b.keep(weights=weights.weights, fallback=weights.fallback)
        return reshape_advantages(b.grpo, weights), (weights, reasoning)

    def stats(self, b, state):
        weights, reasoning = state
        return reshape_stats(weights, reasoning, b.mask, b.grpo, b.advantages, b.cfg.reshape_config(),
                             importance=b["oar_importance"], rows=b.signals.real_rows)


compute_oar_g_advantage = register_estimator(OAR, "oar_g")
compute_oar_p_advantage = register_estimator(OAR, "oar_p")
