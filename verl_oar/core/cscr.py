"""CSCR (Counterfactual Sensitivity Credit Reallocation): GRPO's credit taken from tokens whose
likelihood the privileged prompts move most, and given back to the rest of the sequence.

Specification: docs/algo/cscr.md (the paper's full text was not public; every
[GUESS] there is a key of :class:`CSCRConfig`). Per response, over its valid tokens ``t``
(``T`` of them), with GRPO's sequence advantage ``A``:

1. shifts:       d+_t = log pi(y_t | x + c+, y_<t) - log pi(y_t | x, y_<t),  d-_t likewise under c-
                 (c+ asserts the response is correct, c- that it is not; the second term is verl's
                 ``old_log_prob_t``, or in rollout-correction bypass mode the plain prompt re-scored in
                 the same pass: ``integration.privileged_signal``)
2. sensitivity:  s_t = max(|d+_t|, |d-_t|)                      (``sensitivity=abs_max``)
3. attenuation:  w_t = 1 if s_t <= tau, else max(exp(-alpha (s_t - tau)), floor)
                 tau: an absolute value in nats, or the ``threshold``-quantile of s over the
                 batch's valid tokens (``threshold_mode=quantile``, default 0.8)
4. budget:       w~_t = w_t * T / sum_s w_s                      (mean 1 over the valid tokens)
5. advantage:    A_t = A * w~_t                                  (w~ > 0: the verifier sets the sign)

So ``sum_t A_t = T * A`` (GRPO's credit budget) and ``sign(A_t) = sign(A)`` on every valid token. A row the
privileged pass could not score (``scored`` False) keeps GRPO's uniform credit ``A`` on every valid token (w~ = 1)
and takes no part in the threshold. Computed in float64, returned as float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from verl_oar.core.config import NodeConfig
from verl_oar.core.privileged_prompt import CSCR_NEGATIVE, CSCR_POSITIVE, OVERFLOWS, check_template
from verl_oar.core.reshape import linear_quantile

__all__ = ["CSCRConfig", "CSCRResult", "attenuation_weights", "cscr_advantages", "cscr_stats", "sensitivity"]

SENSITIVITIES = ("abs_max", "max")
THRESHOLD_MODES = ("quantile", "absolute")


@dataclass(frozen=True)
class CSCRConfig(NodeConfig):
    """Everything CSCR's advantage reads from ``algorithm.cscr`` (docs/algo/cscr.md; [GUESS] = not public)."""

    NODE = "cscr"
    DOCS = "docs/algo/cscr.md"

    threshold_mode: str = "quantile"
    """[GUESS] how ``threshold`` is read: ``quantile`` (a level in [0, 1] of the batch's sensitivities)
    or ``absolute`` (nats)"""
    threshold: float = 0.8
    """tau: tokens at or below it keep full credit (quantile level, or nats when absolute)"""
    alpha: float = 1.0
    """[GUESS] strength of the exponential down-weighting above tau (the paper: moderate works best)"""
    floor: float = 0.3
    """[GUESS] smallest weight before renormalising (0: none); "moderate" down-weighting"""
    sensitivity: str = "abs_max"
    """[GUESS] ``abs_max``: max(|d+|, |d-|) (default); ``max``: max(d+, d-), the signed reading"""
    pos_template: str = CSCR_POSITIVE
    """[GUESS] c+: the user turn asserting the response's outcome is correct (``core.privileged_prompt``)"""
    neg_template: str = CSCR_NEGATIVE
    """[GUESS] c-: the user turn asserting it is incorrect"""
    overflow: str = "truncate"
    """a privileged prompt + response longer than the model's context: ``truncate`` shortens the question from
    its middle until it fits (never the chat header, system prompt or template; a row that does not fit even with
    an empty question is skipped), ``skip`` skips the row (its weights stay 1: GRPO); both counted"""

    def __post_init__(self) -> None:
        self.check_choice("threshold_mode", THRESHOLD_MODES)
        self.check_choice("sensitivity", SENSITIVITIES)
        self.check_finite("threshold", "alpha", "floor")
        if self.threshold_mode == "quantile" and not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"algorithm.cscr.threshold={self.threshold} is invalid with threshold_mode=quantile: "
                             "a quantile level in [0, 1] (or set threshold_mode=absolute for nats).")
        if self.alpha < 0:
            raise ValueError(f"algorithm.cscr.alpha={self.alpha} is invalid: >= 0 (0 = plain GRPO).")
        if not 0.0 <= self.floor <= 1.0:
            raise ValueError(f"algorithm.cscr.floor={self.floor} is invalid: a weight in [0, 1] (0 = no floor).")
        check_template(self.pos_template, "algorithm.cscr.pos_template")
        check_template(self.neg_template, "algorithm.cscr.neg_template")
        self.check_choice("overflow", OVERFLOWS)


@dataclass(frozen=True)
class CSCRResult:
    advantages: Tensor
    """(bs, T) float32: A * w~ on valid tokens, 0 elsewhere"""
    weights: Tensor
    """(bs, T) float32: w~ (mean 1 over each row's valid tokens), 0 on padding"""
    sensitivity: Tensor
    """(bs, T) float32: s, 0 on padding"""
    threshold: float
    """tau in nats (the quantile resolved on this batch)"""


def sensitivity(pos_shift: Tensor, neg_shift: Tensor, mask: Tensor, kind: str = "abs_max") -> Tensor:
    """(bs, T) float64 sensitivity of every token, 0 on padding. ``pos_shift``/``neg_shift``: (bs, T)
    log-prob shifts in nats under the two conditions."""
    if pos_shift.shape != neg_shift.shape or pos_shift.shape != mask.shape:
        raise ValueError(f"CSCR: shifts {tuple(pos_shift.shape)}, {tuple(neg_shift.shape)} and mask "
                         f"{tuple(mask.shape)} must have one (bs, T) shape")
    pos, neg = pos_shift.double(), neg_shift.double()
    s = torch.maximum(pos.abs(), neg.abs()) if kind == "abs_max" else torch.maximum(pos, neg)
    valid = mask.bool()
    if not torch.isfinite(s[valid]).all():
        raise ValueError("CSCR: a log-prob shift is not finite on a response token (NaN or inf log-probs "
                         "under a privileged prompt); check the re-scoring pass's dtype and the prompt's length")
    return torch.where(valid, s, torch.zeros_like(s))


def resolve_threshold(sens: Tensor, mask: Tensor, cfg: CSCRConfig) -> float:
    """tau in nats: ``cfg.threshold`` itself, or its quantile over the valid tokens' sensitivities
    (torch.quantile's linear interpolation, at any batch size: ``core.reshape.linear_quantile``; +inf for a
    batch without valid tokens: nothing attenuated)."""
    if cfg.threshold_mode == "absolute":
        return float(cfg.threshold)
    values = sens[mask.bool()]
    return float(linear_quantile(values, cfg.threshold)) if values.numel() else math.inf


def attenuation_weights(sens: Tensor, mask: Tensor, tau: float, cfg: CSCRConfig) -> Tensor:
    """(bs, T) float64 w~: steps 3-4 of the module docstring; rows without valid tokens are all 0."""
    valid = mask.bool()
    above = valid & (sens > tau)
    w = torch.ones_like(sens)
    if above.any():
        w[above] = torch.clamp(torch.exp(-cfg.alpha * (sens[above] - tau)), min=cfg.floor)
    w = torch.where(valid, w, torch.zeros_like(w))
    count = valid.sum(-1, keepdim=True).double()
    total = w.sum(-1, keepdim=True)
    # total > 0 whenever count > 0 unless floor == 0 and every weight underflowed: keep GRPO's then
    uniform = valid.double()
    return torch.where(total > 0, w * count / total.clamp_min(torch.finfo(torch.float64).tiny), uniform)


def cscr_advantages(sequence_advantages: Tensor, pos_shift: Tensor, neg_shift: Tensor, mask: Tensor,
                    cfg: CSCRConfig, scored: Tensor | None = None) -> CSCRResult:
    """CSCR's token advantages. ``sequence_advantages``: (bs,) GRPO's A per response; shifts and
    ``mask``: (bs, T); ``scored``: (bs,) bool, False on rows the privileged pass could not score (they keep
    GRPO's uniform credit; None: every row was scored)."""
    if sequence_advantages.shape != mask.shape[:1]:
        raise ValueError(f"CSCR: sequence advantages {tuple(sequence_advantages.shape)} must be (bs,) for a "
                         f"(bs, T) = {tuple(mask.shape)} mask")
    if scored is not None and scored.shape != mask.shape[:1]:
        raise ValueError(f"CSCR: scored {tuple(scored.shape)} must be (bs,) for a (bs, T) = {tuple(mask.shape)} mask")
    response = mask.bool()
    valid = response if scored is None else response & scored.bool()[:, None]
    sens = sensitivity(pos_shift, neg_shift, valid, cfg.sensitivity)
    tau = resolve_threshold(sens, valid, cfg)
    w = attenuation_weights(sens, valid, tau, cfg)
    if scored is not None:
        w = torch.where(scored.bool()[:, None], w, response.double())
    adv = sequence_advantages.double()[:, None] * w
    return CSCRResult(advantages=adv.float(), weights=w.float(), sensitivity=sens.float(), threshold=tau)


def cscr_stats(result: CSCRResult, sequence_advantages: Tensor, mask: Tensor,
               scored: Tensor | None = None) -> dict[str, float]:
    """Per-step metrics (``cscr/...``): sensitivity, fraction attenuated and weights over the scored rows' tokens
    (``scored`` (bs,) bool, None: all), the budget error ``max |sum_t A_t - T A|`` and the sign violations (must
    be 0) over every valid token, and ``cscr/broadcast_rows``: rows that kept GRPO's credit, not scored.

    Masked reductions over the (bs, T) tensors (no boolean-indexed copies: at 2^25 tokens those cost seconds);
    means are float64 sums, min/max exact."""
    response = mask.bool()
    rows = torch.ones(len(response), dtype=torch.bool) if scored is None else scored.bool()
    valid = response & rows[:, None]
    broadcast = {"cscr/broadcast_rows": float((response.any(-1) & ~rows).sum())}
    n = int(valid.count_nonzero())
    if n == 0:
        return {"cscr/valid_tokens": 0.0, **broadcast}
    s, w = result.sensitivity, result.weights

    def mean(x: Tensor) -> float:
        return float(torch.where(valid, x, 0).sum(dtype=torch.float64)) / n

    count = response.sum(-1).double()
    budget = (result.advantages.sum(-1, dtype=torch.float64) - count * sequence_advantages.double()).abs().max()
    adv = result.advantages
    sign = torch.sign(sequence_advantages.double()).to(adv.dtype)[:, None]  # +-1, 0 (or NaN): exact in any float
    violations = (((adv * sign) < 0) | ((sign == 0) & (adv != 0))) & response
    return {**broadcast,
        "cscr/sensitivity/mean": mean(s),
        "cscr/sensitivity/max": float(torch.where(valid, s, -math.inf).amax()),
        "cscr/threshold": float(result.threshold),  # finite: the batch has valid tokens
        "cscr/frac_attenuated": int(((s.double() > result.threshold) & valid).count_nonzero()) / n,
        "cscr/weight/mean": mean(w),
        "cscr/weight/min": float(torch.where(valid, w, math.inf).amin()),
        "cscr/weight/max": float(torch.where(valid, w, -math.inf).amax()),
        "cscr/budget_error": float(budget),
        "cscr/sign_violations": float(violations.count_nonzero()),
        "cscr/valid_tokens": float(n),
    }
