"""Bi-level conservative reshaping: token importance -> token weights -> token advantages.

OAR keeps GRPO's sequence advantage ``A_i`` and redistributes it over the response tokens of
rollout ``i``. Per sequence, over its *reasoning* tokens ``t`` (the tokens before the final
answer; ``L`` of them), in the paper's order:

1. normalise:     s_t = log1p(max(I_t, 0)),   n_t = (s_t - min_s s) / (max_s s - min_s s)
2. threshold:     q = quantile_tau(n)          (tau is a quantile *level*, linear interpolation)
3. suppression:   n_t <  q  ->  w_t = max(n_t / q, floor)
4. amplification: n_t >= q  ->  w_t = 1 + beta * (n_t - q) / (1 - q)
5. conservative:  w~_t = w_t * L / sum_s w_s   (so sum_t w~_t = L: the sequence's total token
                  advantage equals GRPO's ``L * A_i``; w~_t > 0, so no token flips sign)
6. reshape:       A_{i,t} = A_i * w~_{i,t},    with w~ = 1 on every non-reasoning token.

Departures from the public reference code, on purpose:

* ``I_t`` is clamped at 0 before ``log1p`` (AS-JOINT importance is signed; log1p(<-1) is NaN).
* ``q`` is computed per row from that row's own ``n`` and the configured level ``tau``; the
  reference overwrote ``tau`` inside its per-sample loop. Here every row is done at once: ``n`` is
  sorted with ``+inf`` in the non-reasoning slots and each row's two order statistics are gathered.
* Reasoning tokens are an arbitrary per-row subset of positions (a mask), not ``[:len]``.
* A row that cannot be reshaped keeps uniform weights (plain GRPO credit) and says why in
  :class:`Fallback`: no located answer, no reasoning token, a non-finite importance, or all
  importances equal (``max s == min s``, which includes a single reasoning token).
* Guards: ``q == 0`` (nothing is suppressed), ``q == 1`` (only ``n_t == 1`` reaches step 4 and gets
  ``1 + beta``, the limit of step 4 as ``q -> 1``).

Everything is computed in float64 internally and returned as float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum

import torch
from torch import Tensor

__all__ = [
    "Fallback",
    "ReshapeConfig",
    "TokenWeights",
    "importance_to_weights",
    "linear_quantile",
    "reshape_advantages",
    "reshape_stats",
]


@dataclass(frozen=True)
class ReshapeConfig:
    """Hyper-parameters of bi-level conservative reshaping (paper symbols tau, beta)."""

    tau: float = 0.5
    """Quantile level in [0, 1] of the threshold q. The paper's ablation found about 0.5 best
    (below 0.3 over-sparsifies, above 0.7 tends back to uniform credit); the reference code used 0.25."""

    beta: float = 1.0
    """Amplification strength, >= 0: the most important token gets weight 1 + beta before step 5."""

    floor: float = 0.1
    """Smallest weight a suppressed token can get before step 5, in (0, 1]. Strictly positive, so
    every token keeps the sign of A_i."""

    amplify: bool = True
    """Step 4 on. Off: tokens with n_t >= q keep weight 1 (paper Table 3, 'w/o amplification')."""

    suppress: bool = True
    """Step 3 on. Off: tokens with n_t < q keep weight 1 (paper Table 3, 'w/o suppression')."""

    preserve_mass: bool = True
    """Step 5 on. Off: the weights of steps 3-4 are used as they are, and the sequence's total
    token advantage is no longer GRPO's (paper Table 3, 'w/o conservative constraint')."""

    def __post_init__(self) -> None:
        ranges = {
            "tau": (lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]"),
            "beta": (lambda v: 0.0 <= v < math.inf, "a finite number >= 0"),
            "floor": (lambda v: 0.0 < v <= 1.0, "a number in (0, 1]"),
        }
        for name, (ok, valid) in ranges.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
                raise ValueError(f"ReshapeConfig.{name}={value!r} is invalid: must be {valid}")
        for name in ("amplify", "suppress", "preserve_mass"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"ReshapeConfig.{name}={value!r} is invalid: must be a bool")  # noqa: TRY004


class Fallback(IntEnum):
    """Why a sequence kept uniform weights (plain GRPO credit). When several apply, the first in
    this order is reported: NO_ANSWER, NO_REASONING, NON_FINITE, ALL_EQUAL."""

    NONE = 0
    """Reshaped."""
    NO_ANSWER = 1
    """No final answer was located in the response: there is no outcome to ground on."""
    NON_FINITE = 2
    """Some reasoning token's importance is NaN or +-inf."""
    ALL_EQUAL = 3
    """All reasoning tokens have the same normalised score (including a single reasoning token)."""
    NO_REASONING = 4
    """The sequence has no reasoning token."""


@dataclass
class TokenWeights:
    """Per-token weights of one batch, and per-sequence fallback reasons."""

    weights: Tensor
    """(B, T) float32: w~ after step 5 (or after step 4 when preserve_mass is off). Exactly 1.0 on
    tokens outside the reasoning mask (answer, end of sequence, padding) and on every token of a
    fallback row."""

    fallback: Tensor
    """(B,) int8: a :class:`Fallback` code per sequence; 0 (NONE) where the row was reshaped."""

    unnormalized: Tensor
    """(B, T) float32: w after step 4, before step 5; same 1.0 conventions as ``weights``.
    Used by :func:`reshape_stats` to count suppressed and amplified tokens."""


def importance_to_weights(
    importance: Tensor,
    reasoning_mask: Tensor,
    cfg: ReshapeConfig,
    answer_found: Tensor | None = None,
) -> TokenWeights:
    """Turn token importance into OAR token weights (steps 1-5 of the module docstring).

    Args:
        importance: (B, T) any float dtype. ``I_t``; may be negative (AS-JOINT) or non-finite.
            Values outside ``reasoning_mask`` are ignored (padding may hold anything, even NaN).
        reasoning_mask: (B, T) bool (or 0/1 integer). True on the reasoning tokens of each row; any
            subset of positions, any count per row (0 allowed).
        cfg: the reshaping hyper-parameters.
        answer_found: (B,) bool, or None meaning True everywhere. Rows with False fall back
            (:attr:`Fallback.NO_ANSWER`).

    Returns:
        :class:`TokenWeights` with (B, T) float32 weights on ``importance``'s device.
    """
    if importance.dim() != 2 or reasoning_mask.shape != importance.shape:
        raise ValueError(
            f"importance {tuple(importance.shape)} and reasoning_mask {tuple(reasoning_mask.shape)} "
            "must both be (B, T)"
        )
    batch, _ = importance.shape
    device = importance.device
    mask = reasoning_mask.to(device=device, dtype=torch.bool)
    imp = importance.detach().to(torch.float64)
    if answer_found is None:
        found = torch.ones(batch, dtype=torch.bool, device=device)
    else:
        found = answer_found.to(device=device, dtype=torch.bool).reshape(batch)

    # --- per-row fallback reasons -------------------------------------------------------------
    length = mask.sum(dim=1)                                              # L, (B,)
    non_finite = (mask & ~torch.isfinite(imp)).any(dim=1)

    # --- step 1: s_t = log1p(max(I_t, 0)); min-max normalise over the row's reasoning tokens ----
    usable = mask & ~non_finite[:, None]
    s = torch.log1p(torch.where(usable, imp, 0.0).clamp(min=0.0))
    s_min = torch.where(usable, s, math.inf).amin(dim=1)
    s_max = torch.where(usable, s, -math.inf).amax(dim=1)
    spread = s_max - s_min
    all_equal = ~(spread > 0)                                             # also True for L <= 1

    fallback = torch.full((batch,), int(Fallback.NONE), dtype=torch.int8, device=device)
    for reason, hit in (
        (Fallback.ALL_EQUAL, all_equal),
        (Fallback.NON_FINITE, non_finite),
        (Fallback.NO_REASONING, length == 0),
        (Fallback.NO_ANSWER, ~found),
    ):  # later assignments win: this loop runs over the four reasons, not over rows
        fallback = torch.where(hit, torch.tensor(int(reason), dtype=torch.int8, device=device), fallback)
    active = fallback == int(Fallback.NONE)                              # (B,)
    tokens = mask & active[:, None]                                      # tokens that get reshaped

    safe_spread = torch.where(active, spread, 1.0)
    n = torch.where(tokens, (s - torch.where(active, s_min, 0.0)[:, None]) / safe_spread[:, None], 0.0)
    n = n.clamp(0.0, 1.0)                                                # rounding guard

    # --- step 2: q = quantile_tau(n) per row, linear interpolation (torch.quantile's rule) -----
    q = _masked_quantile(n, tokens, cfg.tau)                              # (B,)
    q_col = q[:, None]

    # --- steps 3-4: suppression below q, amplification from q up ----------------------------
    below = n < q_col
    if cfg.suppress:
        w_low = (n / torch.where(q_col > 0, q_col, 1.0)).clamp(min=cfg.floor)
    else:
        w_low = torch.ones_like(n)
    if cfg.amplify:
        w_high = torch.where(
            q_col < 1,
            1.0 + cfg.beta * (n - q_col) / torch.where(q_col < 1, 1.0 - q_col, 1.0),
            1.0 + cfg.beta,                      # q == 1: only n_t == 1 can be here
        )
    else:
        w_high = torch.ones_like(n)
    w = torch.where(tokens, torch.where(below, w_low, w_high), 1.0)

    # --- step 5: conservative constraint, sum over reasoning tokens of w~ equals L -------------
    if cfg.preserve_mass:
        total = torch.where(tokens, w, 0.0).sum(dim=1)                    # >= 1 on active rows
        scale = torch.where(active, length.to(torch.float64) / torch.where(active, total, 1.0), 1.0)
        w_tilde = torch.where(tokens, w * scale[:, None], 1.0)
    else:
        w_tilde = w

    return TokenWeights(
        weights=w_tilde.to(torch.float32),
        fallback=fallback,
        unnormalized=w.to(torch.float32),
    )


def linear_quantile(values: Tensor, level: float) -> Tensor:
    """``torch.quantile(values, level)`` (linear interpolation) of a 1-D tensor of any size, as a 0-d tensor of
    ``values``' dtype: torch.quantile refuses more than 2^24 elements (a batch's tokens at cluster sizes).

    The same arithmetic as torch's: rank ``r = level * (n - 1)`` in ``values``' dtype, the order statistics at
    ``floor(r)`` and ``ceil(r)`` (``torch.kthvalue``: two linear-time selections, no full sort), ``torch.lerp``
    between them with weight ``r - floor(r)``; NaN if any value is NaN. Raises on an empty tensor."""
    if values.dim() != 1 or values.numel() == 0:
        raise ValueError(f"linear_quantile: a non-empty 1-D tensor, got shape {tuple(values.shape)}")
    if not 0.0 <= level <= 1.0:
        raise ValueError(f"linear_quantile: level {level} is not in [0, 1]")
    if torch.isnan(values).any():
        return torch.tensor(math.nan, dtype=values.dtype, device=values.device)
    rank = torch.tensor(level, dtype=values.dtype) * (values.numel() - 1)
    lo, hi = int(rank.floor()), int(rank.ceil())
    below = torch.kthvalue(values, lo + 1).values
    above = below if hi == lo else torch.kthvalue(values, hi + 1).values
    return torch.lerp(below, above, (rank - lo).to(values.device))


def _masked_quantile(values: Tensor, mask: Tensor, level: float) -> Tensor:
    """Per-row quantile at ``level`` of ``values[b][mask[b]]``, linear interpolation.

    values: (B, T) float; mask: (B, T) bool. Returns (B,) of values' dtype; 0 for rows with an
    empty mask. Matches ``torch.quantile(values[b][mask[b]], level)`` row by row, without a row loop.
    """
    count = mask.sum(dim=1)
    ordered = torch.where(mask, values, math.inf).sort(dim=1).values      # +inf padding last
    rank = level * (count - 1).clamp(min=0).to(values.dtype)             # position in 0..L-1
    lo = rank.floor().long()
    hi = rank.ceil().long()
    frac = rank - lo.to(values.dtype)
    v_lo = ordered.gather(1, lo[:, None]).squeeze(1)
    v_hi = ordered.gather(1, hi[:, None]).squeeze(1)
    q = torch.lerp(v_lo, v_hi, frac)
    return torch.where(count > 0, q, torch.zeros_like(q))


def reshape_advantages(advantages: Tensor, weights: TokenWeights | Tensor) -> Tensor:
    """Step 6: ``A_{i,t} = A_{i,t}^{GRPO} * w~_{i,t}``.

    Args:
        advantages: (B, T) float, GRPO's token advantages (``A_i`` broadcast over the response,
            0 on padding).
        weights: a :class:`TokenWeights` or its (B, T) ``weights`` tensor (1.0 off the reasoning
            tokens).

    Returns:
        (B, T) of ``advantages``' dtype; padding stays whatever it was (0 stays 0). Mass is
        preserved (when enabled) if ``advantages`` is constant over each row's reasoning tokens.
    """
    w = weights.weights if isinstance(weights, TokenWeights) else weights
    if w.shape != advantages.shape:
        raise ValueError(f"weights {tuple(w.shape)} do not match advantages {tuple(advantages.shape)}")
    return advantages * w.to(device=advantages.device, dtype=advantages.dtype)


def reshape_stats(
    weights: TokenWeights,
    reasoning_mask: Tensor,
    response_mask: Tensor,
    adv_before: Tensor,
    adv_after: Tensor,
    cfg: ReshapeConfig,
    importance: Tensor | None = None,
    rows: Tensor | None = None,
) -> dict[str, float]:
    """Scalar diagnostics of one batch of reshaping, for logging (the caller adds a prefix).

    Args:
        weights: the output of :func:`importance_to_weights`.
        reasoning_mask, response_mask: (B, T) bool or 0/1; response_mask is 0 on padding.
        adv_before, adv_after: (B, T) float, token advantages before and after reshaping.
        cfg: the config the weights were made with (``floor`` is used for ``weight/frac_at_floor``).
        importance: optional (B, T) float; adds ``importance/*`` from its finite reasoning values.
        rows: optional (B,) bool, the rows to count (e.g. not verl's synthetic padding rows); every
            measure below is over these rows only. None: all rows.

    Returns:
        Always present (for B > 0):
          ``fallback/frac_any`` and ``fallback/frac_<reason>`` for every :class:`Fallback` reason
          (``no_answer``, ``non_finite``, ``all_equal``, ``no_reasoning``): fractions of rows;
          ``mass_error/max_abs``: max over rows of |sum_t A'_{i,t} - sum_t A_{i,t}| over response
          tokens (about 0 when preserve_mass is on);
          ``reasoning/frac_of_response``: reasoning tokens / response tokens (0.0 if no response token).
        Present only when some non-fallback row has a reasoning token (omitted, never NaN, otherwise):
          ``weight/min``, ``weight/max``, ``weight/mean``: final weights w~ over those tokens;
          ``weight/frac_suppressed``, ``weight/frac_amplified``, ``weight/frac_at_floor``:
          fractions of those tokens with w < 1, w > 1, and w < 1 clamped at ``floor``, before step 5.
        Present only when ``importance`` is given and has a finite reasoning value:
          ``importance/mean``, ``importance/max``.
    """
    out: dict[str, float] = {}
    if rows is not None and not bool(rows.all()):  # all rows kept: no copies
        keep = rows.to(device=weights.fallback.device, dtype=torch.bool)
        weights = TokenWeights(weights=weights.weights[keep], unnormalized=weights.unnormalized[keep],
                               fallback=weights.fallback[keep])
        reasoning_mask, response_mask = reasoning_mask[keep], response_mask[keep]
        adv_before, adv_after = adv_before[keep], adv_after[keep]
        importance = None if importance is None else importance[keep]
    fallback = weights.fallback
    batch = fallback.numel()
    if batch == 0:
        return out
    reasoning = reasoning_mask.to(device=fallback.device, dtype=torch.bool)
    response = response_mask.to(device=fallback.device, dtype=torch.bool)

    out["fallback/frac_any"] = (fallback != int(Fallback.NONE)).double().mean().item()
    for reason in Fallback:
        if reason is not Fallback.NONE:
            out[f"fallback/frac_{reason.name.lower()}"] = (fallback == int(reason)).double().mean().item()

    # masked reductions over the (B, T) tensors, no boolean-indexed copies (seconds at 2^25 tokens)
    diff = adv_after.double() - adv_before.double()
    out["mass_error/max_abs"] = diff.mul_(response).sum(dim=1).abs().max().item()
    del diff
    n_resp = int(response.count_nonzero())
    out["reasoning/frac_of_response"] = int((reasoning & response).count_nonzero()) / n_resp if n_resp else 0.0

    tokens = reasoning & (fallback == int(Fallback.NONE))[:, None]
    n = int(tokens.count_nonzero())
    if n:
        w = weights.weights
        raw = weights.unnormalized                                        # float32, as stored
        floor = torch.tensor(cfg.floor, dtype=raw.dtype, device=raw.device)
        out["weight/min"] = torch.where(tokens, w, math.inf).amin().double().item()
        out["weight/max"] = torch.where(tokens, w, -math.inf).amax().double().item()
        out["weight/mean"] = torch.where(tokens, w, 0).sum(dtype=torch.float64).item() / n
        below = (raw < 1) & tokens
        out["weight/frac_suppressed"] = int(below.count_nonzero()) / n
        out["weight/frac_amplified"] = int(((raw > 1) & tokens).count_nonzero()) / n
        out["weight/frac_at_floor"] = int((below & (raw <= floor)).count_nonzero()) / n

    if importance is not None:
        imp = importance.detach()
        finite = reasoning.to(imp.device) & torch.isfinite(imp)
        count = int(finite.count_nonzero())
        if count:
            out["importance/mean"] = torch.where(finite, imp, 0).sum(dtype=torch.float64).item() / count
            out["importance/max"] = torch.where(finite, imp, -math.inf).amax().double().item()
    return out
