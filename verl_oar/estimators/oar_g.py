"""``oar_g``: GRPO's sequence advantage, redistributed over tokens by OAR-G importance
(one gradient of the outcome w.r.t. the input embeddings).

verl extension point: ``verl.trainer.ppo.core_algos.register_adv_est`` (via
``verl_oar.signals.register_token_estimator``); checked against verl 0.9.1. The workers measure the
importance (``verl_oar.signals_importance.IMPORTANCE_METHOD``); the advantage is the same for every
OAR estimator (``reshaped_grpo``).
"""

from verl_oar.estimators.reshaped_grpo import register_reshaped_grpo
from verl_oar.signals_importance import IMPORTANCE_FIELDS  # noqa: F401  (registers the provider)

compute_oar_g_advantage = register_reshaped_grpo("oar_g")
