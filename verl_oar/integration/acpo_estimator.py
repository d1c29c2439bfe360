"""The advantage estimator ``acpo``: GRPO's sequence advantage reweighted per token by the surrogate entropy
(``core.acpo``), from the ``acpo_surrogate`` signal (``modal_signal``). Importing this module registers it.

verl extension point: ``verl.trainer.ppo.core_algos.register_adv_est`` (via ``token_estimator.register_estimator``).
The weights are detached (an advantage, not a loss term): the paper's loss-level reading is not built
(docs/algo/acpo.md says why).
"""

from __future__ import annotations

from verl_oar.core.acpo import ACPOConfig, acpo_advantages, acpo_stats
from verl_oar.integration import modal_signal  # noqa: F401  (registers the acpo_surrogate provider)
from verl_oar.integration.token_estimator import TokenEstimator, register_estimator


class ACPO(TokenEstimator):
    """A_t = A^GRPO * w_t (``core.acpo``)."""

    name, needs, config = "acpo", ("acpo_surrogate",), ACPOConfig

    def advantages(self, b):
        result = acpo_advantages(b["acpo_surrogate"], b.sequence, b.mask, b.cfg)
        b.keep(weights=result.weights)
        return result.advantages, result

    def stats(self, b, result):
        entropy = b["acpo_entropy"]
        entropy = None if bool((entropy == 0).all()) else b.real(entropy)  # all 0: bypass mode, verl computed none
        masked = b.real(type(result)(advantages=b.advantages, weights=result.weights, clipped=result.clipped))
        return acpo_stats(masked, b.real(b["acpo_surrogate"]), b.real(b.sequence), b.real(b.mask), entropy)


compute_acpo_advantage = register_estimator(ACPO)
