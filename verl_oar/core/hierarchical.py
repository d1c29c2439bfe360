"""OAR-P ``hierarchical`` mode: K coarse chunks, then the top m of them refined into small units.

Per sequence with R reasoning tokens (K = ``cfg.budget``, m = ``cfg.refine_top``, u = ``cfg.refine_unit``):

1. **coarse round**: the reasoning tokens are split into ``K' = min(K, R)`` contiguous chunks, exactly
   ``occlusion_spans(reasoning, "chunk", K)``; each chunk is occluded once and gets its importance
   ``I_c`` (every token of the chunk carries it).
2. **selection**: the ``m' = min(m, K')`` chunks with the largest ``I_c`` are refined (ties broken by
   position: the earlier chunk first; NaN ranks last).
3. **refined round**: every selected chunk of n tokens is split into ``ceil(n / u)`` consecutive units of
   u tokens (the last one shorter), each occluded on its own; its tokens get that unit's importance.
   A selected chunk with ``n <= u`` is already one unit: its coarse importance is its unit importance
   and it costs nothing more.
4. **combination**: a token of a refined chunk carries its unit's importance; a token of an unrefined
   chunk carries ``I_c / n`` (``fill="share"``, the default): its additive share of the chunk's
   importance. Occlusion importance is close to additive over tokens whose effects do not interact
   (for a small change of the outcome logits the KL is quadratic in the change and the changes of
   separate tokens add), so ``I_c / n`` is on the scale of one token's own importance, the scale of the
   refined tokens it is ranked against; ``I_c`` itself (``fill="span"``, what ``chunk`` mode gives every
   token) would rank every token of a fairly important chunk above nearly all refined tokens.
   ``docs/method.md`` ("OAR-P hierarchical mode") has the measurement behind the choice, with the
   alternatives ``span``, ``calibrated`` (``I_c / n`` times the sequence's measured ratio of the
   refined chunks' summed unit importances to their coarse importances) and ``after`` (every unrefined
   token ranked below every refined one, by ``I_c / n``).

Cost per sequence, in occluded copies (the clean pass not counted): ``K' + sum over the selected
chunks with n > u of ceil(n / u)``. With ``m >= K`` and ``u = 1`` every chunk is refined into single
tokens, so every token is scored by its own occlusion: the result is exact mode's, token for token.

The caller scores occlusions: ``score_spans(spans)`` takes one (L_i,) long span-id tensor per sequence
(-1 = not occluded, ids 0..S_i-1 in position order; a sequence with nothing to score has all -1) and
returns each sequence's (L_i,) float32 importance, every token of a span carrying the span's importance,
which is what :func:`verl_oar.core.perturbation.perturbation_importance` returns for such a tensor.
:func:`hierarchical_importance` calls it at most twice, each time for all sequences (so the caller can
batch across them): once for the coarse round and once for the refined round, which is skipped when no
sequence has a chunk to split. Pure torch: no verl or transformers import.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from verl_oar.core.perturbation import PerturbationConfig, occlusion_spans

__all__ = [
    "FILLS",
    "HierarchicalStats",
    "ScoreSpans",
    "coarse_spans",
    "combine",
    "hierarchical_cost",
    "hierarchical_importance",
    "refined_spans",
    "select_refined",
    "span_values",
]

ScoreSpans = Callable[[list[Tensor]], list[Tensor]]
"""one (L_i,) long span-id tensor per sequence -> one (L_i,) float32 importance per sequence"""

FILLS = ("share", "span", "calibrated", "after")
"""How the tokens of an unrefined chunk are scored (module docstring, 4); ``share`` is the default."""


@dataclass
class HierarchicalStats:
    """What one :func:`hierarchical_importance` call did, per sequence (lists in input order)."""

    reasoning: list[int] = field(default_factory=list)
    """R, reasoning tokens"""
    coarse: list[int] = field(default_factory=list)
    """K' = min(K, R), coarse chunks scored"""
    refined_chunks: list[int] = field(default_factory=list)
    """m' = min(m, K'), chunks selected for refinement (those with n <= u included)"""
    refined_units: list[int] = field(default_factory=list)
    """units scored in the refined round"""
    calls: int = 0
    """``score_spans`` calls (0, 1 or 2)"""

    @property
    def occlusions(self) -> list[int]:
        """occluded copies per sequence: coarse chunks + refined units (the stated cost)"""
        return [c + u for c, u in zip(self.coarse, self.refined_units)]


def coarse_spans(reasoning: Tensor, budget: int) -> Tensor:
    """(L,) bool reasoning -> (L,) long chunk id in [0, min(K, R)), -1 off reasoning: ``chunk`` mode's spans."""
    return occlusion_spans(reasoning, "chunk", budget)


def span_values(importance: Tensor, span: Tensor) -> tuple[Tensor, Tensor]:
    """Per-span importance and length.

    Args:
        importance: (L,) float, every token of a span carrying the span's importance.
        span: (L,) long span ids in [0, S), -1 elsewhere.

    Returns:
        (S,) float32 importance (the value at each span's tokens) and (S,) long token count.
    """
    num = int(span.max()) + 1 if span.numel() else 0
    inside = span >= 0
    ids = span[inside]
    value = torch.zeros(num, dtype=torch.float32, device=span.device)
    value[ids] = importance[inside].float()  # all tokens of a span hold the same value
    length = torch.bincount(ids, minlength=num)
    return value, length


def select_refined(coarse_importance: Tensor, refine_top: int) -> Tensor:
    """(S,) bool: the ``refine_top`` spans of largest importance; ties go to the earlier span, NaN last."""
    num = coarse_importance.numel()
    chosen = torch.zeros(num, dtype=torch.bool, device=coarse_importance.device)
    if num == 0:
        return chosen
    key = torch.nan_to_num(coarse_importance.double().cpu(), nan=float("-inf"))
    order = sorted(range(num), key=lambda s: (-float(key[s]), s))  # descending, position order among ties
    chosen[torch.tensor(order[: min(refine_top, num)], dtype=torch.long, device=chosen.device)] = True
    return chosen


def refined_spans(coarse: Tensor, chosen: Tensor, refine_unit: int) -> tuple[Tensor, int]:
    """The refined round's spans of one sequence.

    Args:
        coarse: (L,) long coarse chunk ids (-1 off reasoning).
        chosen: (S,) bool, the chunks to refine (:func:`select_refined`).
        refine_unit: u, tokens per unit.

    Returns:
        (L,) long unit ids in [0, U) in position order, -1 on every token not re-scored (off reasoning,
        unrefined chunks, and selected chunks of at most u tokens, which are one unit already), and U.
    """
    out = torch.full_like(coarse, -1)
    _, length = span_values(torch.zeros(coarse.shape, device=coarse.device), coarse)
    next_id = 0
    for s in chosen.nonzero().squeeze(1).tolist():  # ascending chunk id = position order
        n = int(length[s])
        if n <= refine_unit:
            continue
        where = (coarse == s).nonzero().squeeze(1)
        out[where] = next_id + torch.arange(n, device=coarse.device) // refine_unit
        next_id += -(-n // refine_unit)
    return out, next_id


def combine(coarse_importance: Tensor, coarse: Tensor, chosen: Tensor, refined_importance: Tensor, refined: Tensor,
            fill: str = "share") -> Tensor:
    """Token importance of one sequence from its two rounds.

    Args:
        coarse_importance: (L,) float, the coarse round's output (every token of a chunk carries ``I_c``).
        coarse: (L,) long chunk ids (-1 off reasoning).
        chosen: (S,) bool, the refined chunks.
        refined_importance: (L,) float, the refined round's output (0 where ``refined`` is -1).
        refined: (L,) long unit ids (:func:`refined_spans`).
        fill: how unrefined chunks' tokens are scored, one of :data:`FILLS` (module docstring, 4).

    Returns:
        (L,) float32: unit importance on refined tokens (a selected chunk of at most u tokens keeps
        ``I_c``), the ``fill`` score on unrefined tokens, 0 off reasoning.
    """
    if fill not in FILLS:
        raise ValueError(f"fill={fill!r} is invalid: must be one of {FILLS}")
    value, length = span_values(coarse_importance, coarse)
    out = torch.zeros(coarse.shape, dtype=torch.float32, device=coarse.device)
    if value.numel() == 0:
        return out
    inside = coarse >= 0
    ids = coarse[inside]
    is_chosen = chosen[ids]
    share = value / length.clamp(min=1).float()
    if fill == "span":
        unrefined = value
    elif fill == "calibrated":
        # this sequence's ratio of the split chunks' summed unit importances to their coarse importances
        scored = refined >= 0
        split = torch.zeros_like(chosen)
        split[coarse[scored].unique()] = True
        denom = float(value[split].sum())
        ratio = float(refined_importance[scored].float().sum()) / denom if denom > 0 else 1.0
        unrefined = share * (ratio if ratio > 0 else 1.0)
    else:
        unrefined = share
    out[inside] = torch.where(is_chosen, value[ids], unrefined[ids]).float()
    scored = refined >= 0
    out[scored] = refined_importance[scored].float()
    if fill == "after":
        # every unrefined token below every refined one, ordered among themselves by the share
        in_chosen = torch.zeros_like(inside)
        in_chosen[inside] = is_chosen
        rest = inside & ~in_chosen
        if in_chosen.any() and rest.any():
            floor = float(out[in_chosen].min())
            shift = floor - float(out[rest].max())
            out[rest] += min(shift - 1e-6 * (abs(floor) + 1.0), 0.0)
    return out


def hierarchical_cost(reasoning_tokens: int, cfg: PerturbationConfig) -> int:
    """The most occluded copies for a sequence of R reasoning tokens: ``K' + sum ceil(n / u)`` over the m'
    largest chunks with n > u. Chunk sizes differ by at most one token, so the actual cost
    (:attr:`HierarchicalStats.occlusions`, over the chunks selected) is this or at most m' less."""
    r = reasoning_tokens
    k = min(cfg.budget, r)
    if k == 0:
        return 0
    sizes = torch.bincount(torch.arange(r) * k // r, minlength=k).tolist()
    largest = sorted(sizes, reverse=True)[: min(cfg.refine_top, k)]
    return k + sum(-(-n // cfg.refine_unit) for n in largest if n > cfg.refine_unit)


def hierarchical_importance(
    score_spans: ScoreSpans, reasoning: Sequence[Tensor], cfg: PerturbationConfig, *, fill: str = "share"
) -> tuple[list[Tensor], HierarchicalStats]:
    """OAR-P importance in ``hierarchical`` mode (module docstring) for a batch of sequences.

    Args:
        score_spans: the caller's occlusion scorer (see the module docstring); called at most twice.
        reasoning: one (L_i,) bool per sequence, its reasoning tokens.
        cfg: ``budget`` (K), ``refine_top`` (m), ``refine_unit`` (u); ``outcome`` etc. are the scorer's.
        fill: how unrefined chunks' tokens are scored (:data:`FILLS`; ``share``: ``I_c / n``).

    Returns:
        one (L_i,) float32 importance per sequence (0 off reasoning), and what it cost.
    """
    if fill not in FILLS:
        raise ValueError(f"fill={fill!r} is invalid: must be one of {FILLS}")
    stats = HierarchicalStats()
    coarse = [coarse_spans(r.to(torch.bool), cfg.budget) for r in reasoning]
    for r, c in zip(reasoning, coarse):
        stats.reasoning.append(int(r.to(torch.bool).sum()))
        stats.coarse.append(int(c.max()) + 1 if c.numel() else 0)
    if not any(stats.coarse):
        stats.refined_chunks = [0] * len(coarse)
        stats.refined_units = [0] * len(coarse)
        return [torch.zeros(c.shape, dtype=torch.float32, device=c.device) for c in coarse], stats

    coarse_importance = _checked(score_spans(coarse), coarse)
    stats.calls += 1
    chosen, refined = [], []
    for c, imp in zip(coarse, coarse_importance):
        value, _ = span_values(imp, c)
        pick = select_refined(value, cfg.refine_top)
        units, count = refined_spans(c, pick, cfg.refine_unit)
        chosen.append(pick)
        refined.append(units)
        stats.refined_chunks.append(int(pick.sum()))
        stats.refined_units.append(count)
    if any(stats.refined_units):
        refined_importance = _checked(score_spans(refined), refined)
        stats.calls += 1
    else:
        refined_importance = [torch.zeros(c.shape, dtype=torch.float32, device=c.device) for c in coarse]
    out = [combine(ci, c, pick, ri, units, fill)
           for ci, c, pick, ri, units in zip(coarse_importance, coarse, chosen, refined_importance, refined)]
    return out, stats


def _checked(result: Sequence[Tensor], spans: Sequence[Tensor]) -> list[Tensor]:
    result = list(result)
    if len(result) != len(spans) or any(r.shape != s.shape for r, s in zip(result, spans)):
        raise ValueError("score_spans must return one importance tensor per sequence, shaped like its span tensor")
    return result
