"""Which tokens each occlusion covers, per mode, and how ``hierarchical`` mode's two rounds combine.

A span tensor is (L,) long: the occlusion each token belongs to, ids 0..S-1 in position order, -1 on tokens
never occluded (off reasoning). Every token of a span gets the span's importance.

* ``exact``: one span per reasoning token (R spans for R reasoning tokens: the paper's OAR-P);
* ``chunk``: the reasoning tokens split into ``min(K, R)`` contiguous chunks of near-equal size (K >= R: exact);
* ``line``: reasoning steps ending at line breaks, merged into at most K groups of adjacent steps;
* ``hierarchical`` (K = ``budget``, m = ``refine_top``, u = ``refine_unit``), per sequence:

  1. **coarse round**: ``chunk`` mode's ``K' = min(K, R)`` chunks (:func:`coarse_spans`), each occluded once:
     importance ``I_c``;
  2. **selection**: the ``m' = min(m, K')`` chunks with the largest ``I_c`` (:func:`select_refined`; ties to
     the earlier chunk, NaN last);
  3. **refined round**: each selected chunk of n tokens cut into ``ceil(n / u)`` consecutive units of u tokens
     (the last shorter), each occluded on its own (:func:`refined_spans`); a selected chunk with ``n <= u`` is
     one unit already and keeps ``I_c``, at no cost;
  4. **combination** (:func:`combine`): a refined token carries its unit's importance, a token of an unrefined
     chunk ``I_c / n`` (``fill="share"``, the default): its additive share of the chunk's importance.
     Occlusion importance is close to additive over tokens whose effects do not interact (for a small change
     of the outcome logits the KL is quadratic in the change and the changes of separate tokens add), so
     ``I_c / n`` is on one token's scale, the scale of the refined tokens it is ranked against; ``I_c``
     itself (``fill="span"``, what ``chunk`` mode gives every token) would rank every token of a fairly
     important chunk above nearly all refined tokens. ``docs/method.md`` ("OAR-P hierarchical mode") has the
     measurement behind the choice, with the alternatives ``span``, ``calibrated`` (``I_c / n`` times the
     sequence's measured ratio of the refined chunks' summed unit importances to their coarse importances)
     and ``after`` (every unrefined token ranked below every refined one, by ``I_c / n``).

  Cost in occluded copies (the clean pass not counted): ``K' + sum over the selected chunks with n > u of
  ceil(n / u)`` (:func:`hierarchical_cost`). With ``m >= K`` and ``u = 1`` every token is scored by its own
  occlusion: the result is exact mode's, token for token. The rounds are run by
  ``importance.hierarchical_importance``.

Pure torch, no model: nothing here calls one.
"""

from __future__ import annotations

import torch
from torch import Tensor

from verl_oar.core.perturbation.config import MODES, PerturbationConfig

__all__ = ["FILLS", "coarse_spans", "combine", "hierarchical_cost", "occlusion_spans", "refined_spans",
           "select_refined", "span_values"]

FILLS = ("share", "span", "calibrated", "after")
"""How the tokens of an unrefined chunk are scored (module docstring, 4); ``share`` is the default."""


def occlusion_spans(reasoning: Tensor, mode: str, budget: int, line_end: Tensor | None = None) -> Tensor:
    """Which occlusion each reasoning token belongs to, in one round (``exact``, ``chunk`` or ``line``).

    Args:
        reasoning: (L,) bool, the reasoning tokens of one sequence.
        mode: one of :data:`MODES` but ``hierarchical`` (its rounds: :func:`coarse_spans`, :func:`refined_spans`).
        budget: K, the most spans in ``chunk`` / ``line`` modes.
        line_end: (L,) bool, tokens that contain a line break (``line`` mode only): a reasoning step
            ends with one. Steps are grouped into at most K spans of near-equal step counts.

    Returns:
        (L,) long span id in [0, S), numbered in position order; -1 outside reasoning tokens.
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is invalid: must be one of {MODES}")
    if mode == "hierarchical":
        raise ValueError("mode='hierarchical' builds its spans in two rounds (verl_oar.core.perturbation."
                         "score_samples); occlusion_spans gives its first round with mode='chunk'")
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
    (``HierarchicalStats.occlusions``, over the chunks selected) is this or at most m' less."""
    r = reasoning_tokens
    k = min(cfg.budget, r)
    if k == 0:
        return 0
    sizes = torch.bincount(torch.arange(r) * k // r, minlength=k).tolist()
    largest = sorted(sizes, reverse=True)[: min(cfg.refine_top, k)]
    return k + sum(-(-n // cfg.refine_unit) for n in largest if n > cfg.refine_unit)
