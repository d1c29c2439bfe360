"""How well a token ranking finds the tokens an answer depends on (pure torch, no verl).

A *ranking* is a score per token, higher = more important: OAR-G or OAR-P importance, or a baseline
(:func:`entropy_scores`, :func:`random_scores`). Over the *candidates* (the reasoning tokens of a
response, R of them) its top fraction ``frac`` is the top ``k = clamp(ceil(frac * R), 1, R)``
candidates; ties are broken by a random permutation drawn from a ``torch.Generator``, so a constant
score is a random ranking, reproducible with the generator's seed.

Two measures, per ``frac``:

1. recall of an oracle set O of causal tokens (``verl_oar.testbed.pick_max``):
   ``|top_k ∩ O| / |O|``, averaged over the responses that have an oracle;
2. counterfactual accuracy drop: occlude (replace by a neutral id) or delete the top-k tokens,
   greedily decode the answer after the modified reasoning and the answer marker (``\\boxed{``), and
   report ``accuracy(original) - accuracy(modified)``. A ranking that finds the pivotal tokens
   should drop the accuracy more than the random and entropy rankings at the same ``frac``.

Model callables map ``(1, L)`` long ids to ``(1, L, V)`` logits (a tensor or anything with
``.logits``, so a plain transformers model works). Sequences are scored one at a time without a KV
cache: meant for tiny models and short answers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "CounterfactualExample",
    "DropSummary",
    "RecallSummary",
    "accuracy_drop",
    "answer_accuracy",
    "answer_is_correct",
    "delete",
    "entropy_scores",
    "greedy_answer",
    "mean_recall",
    "occlude",
    "random_scores",
    "rank_candidates",
    "recall_at",
    "top_count",
    "top_fraction_mask",
]

ModelFn = Callable[[Tensor], Any]
"""(1, L) long ids -> (1, L, V) float logits, or an object with ``.logits`` of that shape"""
Decode = Callable[[Sequence[int]], str]
"""token ids -> text (e.g. ``tokenizer.decode``)"""


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
# 3. Counterfactual: remove the top tokens, re-score the answer
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


def _logits(model_fn: ModelFn, ids: Tensor) -> Tensor:
    out = model_fn(ids)
    return getattr(out, "logits", out)


@torch.no_grad()
def greedy_answer(model_fn: ModelFn, ids: Tensor, decode: Decode, max_new_tokens: int = 8) -> str | None:
    """Greedy continuation of ``ids`` ((L,) long) up to the first ``}``: the boxed content, or None
    if no ``}`` came within ``max_new_tokens`` tokens."""
    generated: list[int] = []
    for _ in range(max_new_tokens):
        logits = _logits(model_fn, torch.cat([ids, ids.new_tensor(generated)])[None])
        generated.append(int(logits[0, -1].argmax()))
        text = decode(generated)
        if "}" in text:
            return text[: text.index("}")]
    return None


def answer_is_correct(
    model_fn: ModelFn,
    prompt_ids: Tensor,
    reasoning_ids: Tensor,
    answer_marker_ids: Sequence[int],
    truth: str,
    decode: Decode,
    max_new_tokens: int = 8,
) -> bool:
    """Whether the greedy answer after ``prompt + reasoning + marker`` equals ``truth`` (whitespace
    removed, as the CPU workspace's reward compares). prompt_ids: (P,) long; reasoning_ids: (R,) long."""
    marker = prompt_ids.new_tensor(list(answer_marker_ids))
    answer = greedy_answer(model_fn, torch.cat([prompt_ids, reasoning_ids, marker]), decode, max_new_tokens)
    return answer is not None and "".join(answer.split()) == "".join(truth.split())


def answer_accuracy(
    model_fn: ModelFn,
    prompt_ids: Tensor,
    reasoning_ids_list: Sequence[Tensor],
    answer_marker_ids: Sequence[int],
    truth: str,
    decode: Decode,
    max_new_tokens: int = 8,
) -> float:
    """Fraction of the reasonings (each (R_i,) long, after one prompt (P,) long) whose greedy answer
    is ``truth`` (see :func:`answer_is_correct`); NaN for an empty list."""
    if not reasoning_ids_list:
        return math.nan
    correct = sum(
        answer_is_correct(model_fn, prompt_ids, r, answer_marker_ids, truth, decode, max_new_tokens)
        for r in reasoning_ids_list
    )
    return correct / len(reasoning_ids_list)


@dataclass(frozen=True)
class CounterfactualExample:
    """One response to perturb."""

    prompt_ids: Tensor
    """(P,) long"""
    reasoning_ids: Tensor
    """(R,) long, the response's tokens before the answer marker"""
    truth: str
    """the ground-truth answer"""


@dataclass(frozen=True)
class DropSummary:
    """Accuracy before and after removing each ranking's top tokens, over a batch."""

    original: float
    modified: dict[float, float]
    drop: dict[float, float]
    """{frac: original - modified}"""
    count: int


def accuracy_drop(
    model_fn: ModelFn,
    examples: Sequence[CounterfactualExample],
    scores: Sequence[Tensor],
    fracs: Sequence[float],
    *,
    perturb: str,
    answer_marker_ids: Sequence[int],
    decode: Decode,
    neutral_id: int | None = None,
    candidates: Sequence[Tensor] | None = None,
    generator: torch.Generator | None = None,
    max_new_tokens: int = 8,
) -> DropSummary:
    """Counterfactual test of one ranking over a batch.

    Args:
        examples: the responses; ``scores[i]``: (R_i,) float ranking of ``examples[i].reasoning_ids``.
        perturb: "occlude" (needs ``neutral_id``) or "delete".
        candidates: (R_i,) bool per example, the tokens that may be removed; None = all reasoning tokens.
        generator: tie-breaking (see :func:`rank_candidates`); one ranking per example for all fracs.
    """
    if perturb not in ("occlude", "delete"):
        raise ValueError(f"perturb={perturb!r} must be 'occlude' or 'delete'")
    if perturb == "occlude" and neutral_id is None:
        raise ValueError("perturb='occlude' needs neutral_id")
    if not examples:
        raise ValueError("accuracy_drop: no examples")

    def correct(example: CounterfactualExample, reasoning: Tensor) -> bool:
        return answer_is_correct(
            model_fn, example.prompt_ids, reasoning, answer_marker_ids, example.truth, decode, max_new_tokens
        )

    original, modified = 0, dict.fromkeys(fracs, 0)
    for i, example in enumerate(examples):
        ids = example.reasoning_ids
        allowed = torch.ones(ids.shape[0], dtype=torch.bool) if candidates is None else candidates[i]
        ranked = rank_candidates(scores[i], allowed, generator)
        original += correct(example, ids)
        for frac in fracs:
            mask = torch.zeros(ids.shape[0], dtype=torch.bool)
            mask[ranked[: top_count(frac, ranked.numel())]] = True
            changed = occlude(ids, mask, neutral_id) if perturb == "occlude" else delete(ids, mask)
            modified[frac] += correct(example, changed)
    n = len(examples)
    accuracy = {frac: count / n for frac, count in modified.items()}
    return DropSummary(original / n, accuracy, {f: original / n - a for f, a in accuracy.items()}, n)
