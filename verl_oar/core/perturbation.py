"""OAR-P: token importance by occlusion, one sequence at a time, sharing the clean prefix.

For a sequence x (prompt + response, full-sequence positions 0..L-1) and an occlusion span s (a set
of reasoning positions), the copy x^(s) replaces every token of s by a neutral id. The importance
of every token of s is how much the outcome moved (``verl_oar.core.outcome``):

    I_s = KL(P_final || P_final^(s))   (AS-SINGLE, AS-MEAN)      I_s = phi - phi^(s)   (AS-JOINT)

Spans (``occlusion_spans``): ``exact`` occludes one reasoning token at a time (R copies for R
reasoning tokens: the paper's OAR-P); ``chunk`` splits the reasoning tokens into at most K contiguous
chunks of near-equal size; ``line`` splits them into reasoning steps ending at line breaks, merged
into at most K groups of adjacent steps. With K >= R, ``chunk`` is ``exact``.

Speed (all of it exact, no approximation):

* a copy only differs from x from its span's first position on, so the clean pass's KV cache is
  reused for everything before it and only the rest is recomputed;
* nothing after the last position that predicts an answer token can move the outcome: every pass
  stops there, and only the predicting positions' logits are computed;
* copies are batched: consecutive spans form a group that shares the prefix before the group's first
  span; each group holds at most ``max_tokens // end`` copies of ``end`` tokens (prefix included), a
  token budget like verl's dynamic batch size. A copy whose span starts later than its group's
  first span recomputes those clean tokens; a group closes before that exceeds ``WASTE_FRACTION``
  of its continuation (it matters for long spans, i.e. the budgeted modes).

The model is a callable (see :class:`PrefixModel`), so this file has no transformers or verl import;
``verl_oar.core.hf`` adapts a transformers causal LM. No gradient is computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from verl_oar.core.outcome import OUTCOMES, outcome_divergence, outcome_statistic

__all__ = [
    "MODES",
    "PerturbationConfig",
    "PerturbationCost",
    "PrefixModel",
    "naive_perturbation_importance",
    "occlusion_spans",
    "perturbation_importance",
]

MODES = ("exact", "chunk", "line", "hierarchical")
"""Occlusion units: every reasoning token, K contiguous chunks, K groups of reasoning steps, or K chunks
then the top ``refine_top`` of them split into units of ``refine_unit`` tokens (``core.hierarchical``)."""


@dataclass(frozen=True)
class PerturbationConfig:
    """OAR-P settings."""

    outcome: str = "mean"
    """"single" | "mean" | "joint" (paper's AS-*; AS-MEAN was best)."""
    mode: str = "exact"
    """"exact" | "chunk" | "line": what one occlusion covers (see the module docstring)."""
    budget: int = 16
    """K, the most occlusions per response in ``chunk`` and ``line`` modes; unused by ``exact``."""
    share_prefix: bool = True
    """Reuse the clean pass's KV cache before each span (exact either way; off only to measure)."""
    refine_top: int = 4
    """m, ``hierarchical`` mode: how many of the K coarse chunks (the most important) are refined (default from
    the measured frontier, docs/method.md)."""
    refine_unit: int = 4
    """``hierarchical`` mode: tokens per refined span (1: every token of a refined chunk on its own)."""

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ValueError(f"algorithm.oar.outcome={self.outcome!r} is invalid: must be one of {OUTCOMES}")
        if self.mode not in MODES:
            raise ValueError(f"algorithm.oar.perturb_mode={self.mode!r} is invalid: must be one of {MODES}")
        if not isinstance(self.budget, int) or self.budget < 1:
            raise ValueError(
                f"algorithm.oar.perturb_budget={self.budget!r} is invalid: it is K, the most occlusions per "
                "response in chunk/line modes, an integer >= 1."
            )
        for key, value in (("perturb_refine_top", self.refine_top), ("perturb_refine_unit", self.refine_unit)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"algorithm.oar.{key}={value!r} is invalid: an integer >= 1 (hierarchical mode).")


@dataclass
class PerturbationCost:
    """What a computation cost, to compare with a log-prob pass over the same sequences."""

    forwards: int = 0
    """model calls (the clean pass included)"""
    copies: int = 0
    """perturbed sequences scored"""
    tokens: int = 0
    """tokens fed to the model (cached prefixes not counted)"""
    peak_call_tokens: int = 0
    """the largest model call, in rows x (prefix + new tokens): what the token budget bounds"""

    def add(self, other: "PerturbationCost") -> None:
        self.forwards += other.forwards
        self.copies += other.copies
        self.tokens += other.tokens
        self.peak_call_tokens = max(self.peak_call_tokens, other.peak_call_tokens)


class PrefixModel(Protocol):
    """A causal LM that can continue from a cached prefix of one sequence."""

    def __call__(
        self, ids: Tensor, positions: Tensor, keep: Tensor, past: Any = None, past_len: int = 0, cache: bool = False
    ) -> tuple[Tensor, Any]:
        """Logits of ``m`` rows that all continue the same cached prefix.

        Args:
            ids: (m, n) long, the tokens at sequence positions past_len .. past_len + n - 1.
            positions: (m, n) long, their position ids.
            keep: (k,) long, columns of ``ids`` whose logits are wanted.
            past: ``None``, or the cache returned by an earlier call with ``cache=True`` on one row;
                its first ``past_len`` positions are the prefix of every row.
            cache: return this call's cache (for later calls).

        Returns:
            (m, k, V) float logits, and the cache (or ``None``).
        """
        ...


def occlusion_spans(reasoning: Tensor, mode: str, budget: int, line_end: Tensor | None = None) -> Tensor:
    """Which occlusion each reasoning token belongs to.

    Args:
        reasoning: (L,) bool, the reasoning tokens of one sequence.
        mode: one of :data:`MODES`.
        budget: K, the most spans in ``chunk`` / ``line`` modes.
        line_end: (L,) bool, tokens that contain a line break (``line`` mode only): a reasoning step
            ends with one. Steps are grouped into at most K spans of near-equal step counts.

    Returns:
        (L,) long span id in [0, S), numbered in position order; -1 outside reasoning tokens.
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is invalid: must be one of {MODES}")
    if mode == "hierarchical":
        raise ValueError("mode='hierarchical' builds its spans in two rounds (verl_oar.core.hierarchical); "
                         "occlusion_spans gives its first round with mode='chunk'")
    reasoning = reasoning.to(torch.bool)
    span = torch.full(reasoning.shape, -1, dtype=torch.long, device=reasoning.device)
    where = reasoning.nonzero().squeeze(1)
    r = where.numel()
    if r == 0:
        return span
    if mode == "exact":
        span[where] = torch.arange(r, device=span.device)
    elif mode == "chunk":
        k = min(budget, r)
        span[where] = torch.arange(r, device=span.device) * k // r  # k near-equal contiguous chunks
    else:
        if line_end is None:
            raise ValueError("mode='line' needs line_end, the tokens that contain a line break")
        ends = line_end.to(torch.bool)[where].long()
        step = torch.cumsum(ends, 0) - ends  # a step includes the token that ends it
        steps = int(step[-1]) + 1
        k = min(budget, steps)
        span[where] = step * k // steps
    return span


def _outcome(logits: Tensor, targets: Tensor, copies: int, outcome: str) -> Tensor:
    """(copies, k, V) logits at the predicting positions -> outcome statistic of each copy."""
    m, k, v = logits.shape
    segment = torch.arange(m, device=logits.device).repeat_interleave(k)
    return outcome_statistic(logits.reshape(m * k, v), targets.repeat(m), segment, copies, outcome)


WASTE_FRACTION = 0.25
"""A group of copies closes when its next span starts this fraction of the continuation past the
group's first span: the clean tokens every later copy recomputes stay a bounded share of the work."""


def _groups(spans: list[int], starts: Tensor, end: int, rows: int, share_prefix: bool) -> list[list[int]]:
    """Consecutive spans batched into one model call each: at most ``rows`` copies, and (with prefix
    sharing) starts within ``WASTE_FRACTION`` of the continuation after the group's first span."""
    groups: list[list[int]] = []
    for s in spans:
        if groups and len(groups[-1]) < rows:
            p0 = int(starts[groups[-1][0]])
            if not share_prefix or int(starts[s]) - p0 <= WASTE_FRACTION * (end - p0):
                groups[-1].append(s)
                continue
        groups.append([s])
    return groups


def perturbation_importance(
    model: PrefixModel,
    ids: Tensor,
    positions: Tensor,
    span: Tensor,
    predict: Tensor,
    neutral_id: int,
    cfg: PerturbationConfig,
    max_tokens: int,
    temperature: float = 1.0,
) -> tuple[Tensor, PerturbationCost]:
    """OAR-P importance of one sequence.

    Args:
        model: see :class:`PrefixModel`; called under ``torch.no_grad``.
        ids: (L,) long, prompt + response tokens.
        positions: (L,) long, their position ids.
        span: (L,) long, the occlusion of each token (:func:`occlusion_spans`), -1 if none.
        predict: (L,) bool, positions whose logits predict an answer token (the next token).
        neutral_id: the token id an occluded token is replaced by.
        cfg: outcome and prefix sharing (``mode`` and ``budget`` were used to build ``span``).
        max_tokens: token budget of one model call: rows x (prefix + new tokens), at least one row.
        temperature: the rollout temperature; logits are divided by it.

    Returns:
        (L,) float32 importance (every token of a span gets the span's; 0 where ``span`` is -1,
        and everywhere when there is no predicting position), and the cost.
    """
    importance = torch.zeros(ids.shape[0], dtype=torch.float32, device=ids.device)
    cost = PerturbationCost()
    keep = predict.to(torch.bool).nonzero().squeeze(1)
    num_spans = int(span.max()) + 1 if span.numel() else 0
    if keep.numel() == 0 or num_spans == 0:
        return importance, cost
    end = int(keep[-1]) + 1  # tokens from here on cannot move the logits at the predicting positions
    targets = ids[keep + 1]
    occluded = (span >= 0).nonzero().squeeze(1)
    starts = torch.full((num_spans,), ids.shape[0], dtype=torch.long, device=ids.device)
    starts = starts.scatter_reduce(0, span[occluded], occluded, "amin")  # first position of each span
    live = [s for s in range(num_spans) if int(starts[s]) < end]  # spans after the answer move nothing
    rows_per_call = max(1, max_tokens // end)

    with torch.no_grad():
        logits, past = model(ids[None, :end], positions[None, :end], keep, cache=cfg.share_prefix)
        clean = _outcome(logits.float() / temperature, targets, 1, cfg.outcome)
        cost.add(PerturbationCost(forwards=1, tokens=end, peak_call_tokens=end))
        for group in _groups(live, starts, end, rows_per_call, cfg.share_prefix):
            p0 = int(starts[group[0]]) if cfg.share_prefix else 0
            rows = ids[p0:end].repeat(len(group), 1)
            for j, s in enumerate(group):
                rows[j, (span[p0:end] == s)] = neutral_id
            pos = positions[p0:end].expand(len(group), -1)
            logits, _ = model(rows, pos, keep - p0, past=past if p0 > 0 else None, past_len=p0)
            perturbed = _outcome(logits.float() / temperature, targets, len(group), cfg.outcome)
            divergence = outcome_divergence(clean.expand_as(perturbed), perturbed, cfg.outcome)
            for j, s in enumerate(group):
                importance[span == s] = divergence[j].float()
            cost.add(PerturbationCost(forwards=1, copies=len(group), tokens=rows.numel(),
                                      peak_call_tokens=len(group) * end))
    return importance, cost


def naive_perturbation_importance(
    logits_fn, ids: Tensor, span: Tensor, predict: Tensor, neutral_id: int, outcome: str, temperature: float = 1.0
) -> Tensor:
    """The plain reference: one whole-sequence forward per span, no cache, no batching.

    Args:
        logits_fn: (1, L) long ids -> (1, L, V) logits (e.g. a transformers model's ``.logits``).
        ids, span, predict, neutral_id, outcome, temperature: as in :func:`perturbation_importance`.

    Returns:
        (L,) float32 importance, on ``ids``' device.
    """
    importance = torch.zeros(ids.shape[0], dtype=torch.float32, device=ids.device)
    keep = predict.to(torch.bool).nonzero().squeeze(1)
    if keep.numel() == 0 or not (span >= 0).any():
        return importance
    targets = ids[keep + 1]
    with torch.no_grad():
        clean = _outcome(logits_fn(ids[None])[:, keep].float() / temperature, targets, 1, outcome)
        for s in range(int(span.max()) + 1):
            copy = ids.clone()
            copy[span == s] = neutral_id
            perturbed = _outcome(logits_fn(copy[None])[:, keep].float() / temperature, targets, 1, outcome)
            importance[span == s] = outcome_divergence(clean, perturbed, outcome).float()
    return importance
