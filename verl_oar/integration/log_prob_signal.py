"""Signal provider ``old_log_probs``: verl's own old log-probs, handed to a token estimator (CoDaPO's confidence).

verl's old-log-prob step already writes ``old_log_probs`` (nested (bs, response_len) float32, at the rollout
temperature; the rollout's log-probs in rollout-correction bypass mode) into TransferQueue; verl's
``compute_advantage`` just does not pass it to a registered estimator. This provider computes nothing: it
names the field, so the trainer fetches it for the estimator (``signals``; checked against verl 0.9.1).
"""

from __future__ import annotations

from verl_oar.integration.signals import register_token_signal


@register_token_signal("old_log_probs", fields=("old_log_probs",))
def use_old_log_probs(trainer, batch, metrics: dict) -> None:
    """Nothing to compute: verl's old-log-prob step wrote the field."""
