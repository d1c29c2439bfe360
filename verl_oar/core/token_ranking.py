"""Token rankings and how to use them (pure torch): the top fraction of a ranking, the baseline rankings
(entropy, random), recall of a set of known tokens, and the two ways to remove tokens (occlude, delete).

A *ranking* is a score per token, higher = more important: OAR-G or OAR-P importance, or a baseline
(:func:`entropy_scores`, :func:`random_scores`). Over the *candidates* (the reasoning tokens of a
response, R of them) its top fraction ``frac`` is the top ``k = clamp(ceil(frac * R), 1, R)``
candidates; ties are broken by a random permutation drawn from a ``torch.Generator``, so a constant
score is a random ranking, reproducible with the generator's seed. Used by the testbed's quality
measures (``testbed.importance_quality``) and the real model's counterfactual test
(``real_model.counterfactual``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "RecallSummary",
    "delete",
    "entropy_scores",
    "mean_recall",
    "occlude",
    "random_scores",
    "rank_candidates",
    "recall_at",
    "top_count",
    "top_fraction_mask",
]


# ---------------------------------------------------------------------------------------------
# 1. Rankings and their top fraction
# ---------------------------------------------------------------------------------------------


def top_count(frac: float, candidates: int) -> int:
    """k = ceil(frac * R) clamped to [1, R] (0 when R = 0); ``frac`` in (0, 1].

    ``frac * R`` is rounded to 9 decimals first, so ``0.1 * 30`` is 3, not 4.
    """
    if not 0.0 < frac <= 1.0:
        raise ValueError(f"frac={frac!r} must be in (0, 1]")
    if candidates == 0:
        return 0
    return min(candidates, max(1, math.ceil(round(frac * candidates, 9))))


def rank_candidates(scores: Tensor, candidates: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Candidate positions, best first.

    Args:
        scores: (T,) float, higher = more important; NaN ranks last. Non-candidates are ignored.
        candidates: (T,) bool.
        generator: breaks ties (a random permutation before a stable sort); None uses torch's global RNG.

    Returns:
        (R,) long positions into T, on CPU.
    """
    where = candidates.detach().cpu().to(torch.bool).nonzero().squeeze(1)
    values = scores.detach().cpu().float()[where].nan_to_num(nan=-math.inf)
    shuffle = torch.randperm(where.numel(), generator=generator)
    order = torch.sort(values[shuffle], descending=True, stable=True).indices
    return where[shuffle[order]]


def top_fraction_mask(
    scores: Tensor, candidates: Tensor, frac: float, generator: torch.Generator | None = None
) -> Tensor:
    """(T,) bool on CPU: the top ``frac`` of the candidates by score (see :func:`rank_candidates`).

    Args:
        scores: (T,) float.  candidates: (T,) bool.  frac: in (0, 1]; at least one position is
        chosen when there are candidates.
    """
    ranked = rank_candidates(scores, candidates, generator)
    mask = torch.zeros(candidates.shape[0], dtype=torch.bool)
    mask[ranked[: top_count(frac, ranked.numel())]] = True
    return mask


def entropy_scores(logits: Tensor) -> Tensor:
    """Entropy (nats) of the policy's distribution over each token, as a ranking baseline.

    Args:
        logits: (..., L, V) float, the model's logits over a sequence of L tokens (position t
            predicts token t + 1).

    Returns:
        (..., L) float32: ``out[..., t] = H(softmax(logits[..., t - 1, :]))``, the entropy of the
        next-token distribution that produced token t; ``out[..., 0] = 0`` (nothing predicted it).
    """
    probs = torch.softmax(logits.detach().float(), dim=-1)
    entropy = torch.special.entr(probs).sum(-1)
    return torch.cat([torch.zeros_like(entropy[..., :1]), entropy[..., :-1]], dim=-1)


def random_scores(shape: Sequence[int] | torch.Size, generator: torch.Generator | None = None) -> Tensor:
    """Uniform [0, 1) float32 scores of ``shape`` on CPU: the random-ranking baseline."""
    return torch.rand(tuple(shape), generator=generator)


# ---------------------------------------------------------------------------------------------
# 2. Recall of the oracle
# ---------------------------------------------------------------------------------------------


def recall_at(
    scores: Tensor,
    candidates: Tensor,
    oracle: Tensor,
    fracs: Sequence[float],
    generator: torch.Generator | None = None,
) -> dict[float, float]:
    """{frac: |top_k ∩ O| / |O|} for one response; one ranking for all fracs, so the tops are nested.

    Args:
        scores: (T,) float.  candidates: (T,) bool.
        oracle: (T,) bool, non-empty and within the candidates (ValueError otherwise).
    """
    oracle = oracle.detach().cpu().to(torch.bool)
    candidates = candidates.detach().cpu().to(torch.bool)
    size = int(oracle.sum())
    if size == 0:
        raise ValueError("recall_at: the oracle is empty")
    if bool((oracle & ~candidates).any()):
        raise ValueError("recall_at: the oracle has positions outside the candidates")
    ranked = rank_candidates(scores, candidates, generator)
    hits = oracle[ranked].cumsum(0)  # hits[k - 1]: oracle positions among the top k
    return {frac: float(hits[top_count(frac, ranked.numel()) - 1]) / size for frac in fracs}


@dataclass(frozen=True)
class RecallSummary:
    """Recall averaged over the responses of a batch that have an oracle."""

    recall: dict[float, float]
    """{frac: mean recall}; NaN when no response counted"""
    counted: int
    skipped: int
    """responses without an oracle (unreadable, or an empty oracle)"""


def mean_recall(
    scores: Tensor,
    candidates: Tensor,
    oracle: Tensor,
    found: Tensor | None,
    fracs: Sequence[float],
    generator: torch.Generator | None = None,
) -> RecallSummary:
    """:func:`recall_at` averaged over rows.

    Args:
        scores: (B, T) float.  candidates: (B, T) bool (e.g. reasoning tokens; False on padding).
        oracle: (B, T) bool.  found: (B,) bool, rows that have an oracle; None = all rows.
    """
    totals, counted = dict.fromkeys(fracs, 0.0), 0
    for row in range(scores.shape[0]):
        if (found is not None and not bool(found[row])) or not bool(oracle[row].any()):
            continue
        for frac, value in recall_at(scores[row], candidates[row], oracle[row], fracs, generator).items():
            totals[frac] += value
        counted += 1
    recall = {frac: total / counted if counted else math.nan for frac, total in totals.items()}
    return RecallSummary(recall, counted, scores.shape[0] - counted)


# ---------------------------------------------------------------------------------------------
# 3. Removing tokens
# ---------------------------------------------------------------------------------------------


def occlude(ids: Tensor, mask: Tensor, neutral_id: int) -> Tensor:
    """``ids`` with the masked tokens replaced by ``neutral_id``; any shape, same shape and dtype."""
    return torch.where(mask.to(device=ids.device, dtype=torch.bool), torch.full_like(ids, neutral_id), ids)


def delete(ids: Tensor, mask: Tensor) -> Tensor:
    """(T,) -> (T - mask.sum(),): the masked tokens dropped. The shorter sequence is fed as is, so the
    tokens after a deleted one move up (position ids re-counted from 0)."""
    if ids.dim() != 1:
        raise ValueError(f"delete: ids must be 1-D, got shape {tuple(ids.shape)}")
    return ids[~mask.to(device=ids.device, dtype=torch.bool)]

