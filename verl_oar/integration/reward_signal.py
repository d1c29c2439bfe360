"""Signal provider ``verifier_scores``: verl's verifier score of every response (``rm_scores``, before any KL
penalty), handed to the estimators that read a response's outcome as right or wrong (CoDaPO's accuracy).

verl's ``_compute_advantage`` hands a registered estimator ``token_level_rewards``; with
``algorithm.use_kl_in_reward=true`` that is ``rm_scores - beta * KL`` on every token (``apply_kl_penalty``), so a
right response no longer sums to 1.0. ``rm_scores`` (nested (bs, response_len) float32, the score on the last
response token) stays in TransferQueue, where verl's DAPO filter (``filter_groups.metric=reward``) and CoDaSampling
read it too. This provider computes nothing: it names the field, so that the trainer fetches it for the estimator
(``signals``; checked against verl 0.9.1 ``trainer/ppo/v1/trainer_base.py``).
"""

from __future__ import annotations

import torch

from verl_oar.integration.signals import register_token_signal

VERIFIER_FIELD = "rm_scores"


@register_token_signal("verifier_scores", fields=(VERIFIER_FIELD,))
def use_verifier_scores(trainer, batch, metrics: dict) -> None:
    """Nothing to compute: verl's reward step wrote the field."""


def verifier_rewards(signals, response_mask: torch.Tensor) -> torch.Tensor:
    """(bs,) float32: each response's verifier score (sum of its ``rm_scores`` over valid tokens), KL-free."""
    return (signals[VERIFIER_FIELD].float() * response_mask).sum(dim=-1)
