"""OAR-P's plain reference, what the tests (and the benchmarks' reference rows) check ``verl_oar.core.perturbation``
against: one whole-sequence forward per occlusion span, no cache, no batching, no truncation after the answer."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from verl_oar.core.outcome import outcome_divergence, outcome_statistic


def _outcome(logits: Tensor, targets: Tensor, outcome: str) -> Tensor:
    """(1, k, V) logits at the predicting positions -> the outcome statistic, (1, V) log P_final or (1,) phi."""
    _, k, v = logits.shape
    return outcome_statistic(logits.reshape(k, v), targets, torch.zeros(k, dtype=torch.long, device=logits.device), 1,
                             outcome)


def naive_perturbation_importance(logits_fn: Callable[[Tensor], Tensor], ids: Tensor, span: Tensor, predict: Tensor,
                                  neutral_id: int, outcome: str, temperature: float = 1.0) -> Tensor:
    """OAR-P importance of one sequence, the plain way.

    Args:
        logits_fn: (1, L) long ids -> (1, L, V) logits (e.g. a transformers model's ``.logits``).
        ids: (L,) long, prompt + response tokens.
        span: (L,) long, the occlusion of each token (``occlusion_spans``), -1 if none.
        predict: (L,) bool, positions whose logits predict an answer token (the next token).
        neutral_id: the token id an occluded token is replaced by.
        outcome: "single" | "mean" | "joint".
        temperature: logits are divided by it.

    Returns:
        (L,) float32 importance on ``ids``' device: each span's divergence on its tokens, 0 where ``span`` is -1
        (and everywhere without a predicting position).
    """
    importance = torch.zeros(ids.shape[0], dtype=torch.float32, device=ids.device)
    keep = predict.to(torch.bool).nonzero().squeeze(1)
    if keep.numel() == 0 or not (span >= 0).any():
        return importance
    targets = ids[keep + 1]
    with torch.no_grad():
        clean = _outcome(logits_fn(ids[None])[:, keep].float() / temperature, targets, outcome)
        for s in range(int(span.max()) + 1):
            copy = ids.clone()
            copy[span == s] = neutral_id
            perturbed = _outcome(logits_fn(copy[None])[:, keep].float() / temperature, targets, outcome)
            importance[span == s] = outcome_divergence(clean, perturbed, outcome).float()
    return importance
