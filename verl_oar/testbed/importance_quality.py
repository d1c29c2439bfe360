"""The testbed's counterfactual accuracy drop of a token ranking (pure torch, no verl): occlude (replace
by a neutral id) or delete a ranking's top-k reasoning tokens (``core.token_ranking``), greedily decode
the answer after the modified reasoning and the answer marker (``\\boxed{``), and report
``accuracy(original) - accuracy(modified)``. A ranking that finds the pivotal tokens should drop the
accuracy more than the random and entropy rankings at the same ``frac``. Recall of the oracle set of
causal tokens (``verl_oar.testbed.pick_max``) is ``core.token_ranking.mean_recall``.

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

from verl_oar.core.token_ranking import delete, occlude, rank_candidates, top_count

__all__ = [
    "CounterfactualExample",
    "DropSummary",
    "accuracy_drop",
    "answer_accuracy",
    "answer_is_correct",
    "greedy_answer",
]

ModelFn = Callable[[Tensor], Any]
"""(1, L) long ids -> (1, L, V) float logits, or an object with ``.logits`` of that shape"""
Decode = Callable[[Sequence[int]], str]
"""token ids -> text (e.g. ``tokenizer.decode``)"""


# ---------------------------------------------------------------------------------------------
# Counterfactual: remove the top tokens, re-score the answer
# ---------------------------------------------------------------------------------------------


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
