"""ACPO (Adaptive Credit Policy Optimization): GRPO's credit reweighted per token by a mode-local
surrogate entropy, asymmetrically for successful and failed responses.

Specification: docs/algo/acpo.md, a reading of the paper's abstract (no full text or
code was public: every choice below is a [GUESS] behind a key of :class:`ACPOConfig`). Per response,
over its valid tokens ``t`` (``T`` of them), with GRPO's sequence advantage ``A``:

1. surrogate:  H~_t = -log p_max,t, p_max,t = max_v pi_old(v | x, y_<t) at the rollout temperature
               (``surrogate=modal``; ``sampled``: -old_log_prob_t, equal under modal alignment;
               ``shannon``: verl's entropy H_t, not mode-local). Deterministic bounds:
               H~_t <= H_t <= h_b(p_max,t) + (1 - p_max,t) log(|V| - 1)
2. raw score:  g_t = H~_t if A > 0 (uncertain decisions of a success get more credit),
               g_t = exp(-H~_t) = p_max,t if A < 0 (overconfident tokens of a failure get more blame)
3. weight:     w_t = (1 - beta) + beta * g_t / mean_s g_s        (mean 1 over the valid tokens)
4. clipping:   w_t <- clip(w_t, w_min, w_max); ``renormalize``: then w_t <- w_t * T / sum_s w_s
5. advantage:  A_t = A * w_t                                     (weights detached: no gradient)

Before clipping ``sum_t A_t = T * A`` (GRPO's per-sequence credit budget); ``w_min > 0`` keeps every
weight positive, so ``sign(A_t) = sign(A)``. ``A = 0`` (a group with one reward) gives 0, as GRPO.
A response whose scores are all 0 (mean 0) keeps weight 1. Computed in float64, returned as float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from verl_oar.core.config import NodeConfig

__all__ = ["ACPOConfig", "ACPOResult", "SURROGATES", "acpo_advantages", "acpo_stats", "acpo_weights", "entropy_bounds"]

SURROGATES = ("modal", "sampled", "shannon")
"""where H~ comes from: the top-1 log-prob of verl's old-log-prob pass, the sampled token's, verl's entropy"""


@dataclass(frozen=True)
class ACPOConfig(NodeConfig):
    """Everything ACPO's advantage reads from ``algorithm.acpo`` (docs/algo/acpo.md; all [GUESS])."""

    NODE = "acpo"
    DOCS = "docs/algo/acpo.md"

    surrogate: str = "modal"
    """[GUESS] H~: ``modal`` -log p_max (the abstract's "mode-local surrogate", computed inside verl's
    old-log-prob pass), ``sampled`` -old_log_prob (its value under modal alignment; no engine change,
    works in rollout-correction bypass mode), or ``shannon`` (verl's entropy; not mode-local)"""
    beta: float = 0.5
    """[GUESS] mixing strength in [0, 1]: 0 = GRPO, 1 = weights proportional to the raw scores"""
    w_min: float = 0.5
    """[GUESS] smallest weight after mixing (> 0: keeps the verifier's sign)"""
    w_max: float = 2.0
    """[GUESS] largest weight after mixing"""
    renormalize: bool = False
    """[GUESS] rescale the clipped weights to mean 1 again (exact budget; may push a weight past the clip)"""

    def __post_init__(self) -> None:
        self.check_choice("surrogate", SURROGATES)
        self.check_finite("beta", "w_min", "w_max")
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"algorithm.acpo.beta={self.beta} is invalid: in [0, 1] (0 = plain GRPO).")
        if not 0.0 < self.w_min <= 1.0 <= self.w_max:
            raise ValueError(f"algorithm.acpo.w_min={self.w_min}, w_max={self.w_max} are invalid: need "
                             "0 < w_min <= 1 <= w_max (a positive floor keeps every token's sign).")
        self.check_flags("renormalize")


@dataclass(frozen=True)
class ACPOResult:
    advantages: Tensor
    """(bs, T) float32: A * w on valid tokens, 0 elsewhere"""
    weights: Tensor
    """(bs, T) float32: w (1 on rows with A = 0), 0 on padding"""
    clipped: Tensor
    """(bs, T) bool: the weight was clipped"""


def entropy_bounds(probs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(H~, H, upper) of distributions ``probs`` (..., V): the surrogate -log p_max, the Shannon entropy and
    the Fano-type bound h_b(p_max) + (1 - p_max) log(V - 1); H~ <= H <= upper (nats)."""
    p = probs.double()
    p_max = p.max(dim=-1).values
    shannon = -(p * torch.log(torch.where(p > 0, p, torch.ones_like(p)))).sum(-1)
    q = (1 - p_max).clamp(min=0)
    binary = -(p_max * torch.log(p_max)) - torch.where(q > 0, q * torch.log(torch.where(q > 0, q, torch.ones_like(q))), q)
    return -torch.log(p_max), shannon, binary + q * math.log(max(p.shape[-1] - 1, 1))


def acpo_weights(surrogate: Tensor, sequence_advantage: Tensor, mask: Tensor, cfg: ACPOConfig) -> tuple[Tensor, Tensor]:
    """Steps 2-4: (weights (bs, T) float64, clipped (bs, T) bool). ``surrogate``: (bs, T) H~ in nats
    (>= 0 on valid tokens); ``sequence_advantage``: (bs,) GRPO's A; ``mask``: (bs, T) valid tokens."""
    if surrogate.shape != mask.shape or sequence_advantage.shape != mask.shape[:1]:
        raise ValueError(f"ACPO: surrogate {tuple(surrogate.shape)}, mask {tuple(mask.shape)} and sequence advantage "
                         f"{tuple(sequence_advantage.shape)} must be (bs, T), (bs, T) and (bs,)")
    valid = mask.bool()
    h = surrogate.double()
    if not torch.isfinite(h[valid]).all():
        raise ValueError("ACPO: the surrogate entropy is not finite on a response token (a -inf log-prob in the "
                         "old-log-prob pass); check the pass's dtype, or use algorithm.acpo.surrogate=shannon")
    h = torch.where(valid, h.clamp(min=0.0), torch.zeros_like(h))  # -log p >= 0; rounding can leave -1e-7
    a = sequence_advantage.double()[:, None]
    g = torch.where(a > 0, h, torch.exp(-h))
    g = torch.where(valid, g, torch.zeros_like(g))
    count = valid.sum(-1, keepdim=True).clamp(min=1)
    mean = g.sum(-1, keepdim=True) / count
    ratio = torch.where(mean > 0, g / torch.where(mean > 0, mean, torch.ones_like(mean)), torch.ones_like(g))
    w = (1.0 - cfg.beta) + cfg.beta * ratio
    w = torch.where((a != 0) & valid, w, valid.double())     # A = 0: GRPO's 0 either way; weight 1 for the record
    clipped = valid & ((w < cfg.w_min) | (w > cfg.w_max))
    w = torch.where(valid, w.clamp(cfg.w_min, cfg.w_max), torch.zeros_like(w))
    if cfg.renormalize:
        w = w * count / w.sum(-1, keepdim=True).clamp(min=1e-12)
    return w, clipped


def acpo_advantages(surrogate: Tensor, sequence_advantage: Tensor, mask: Tensor, cfg: ACPOConfig) -> ACPOResult:
    """Step 5: token advantages A * w (detached). Shapes as :func:`acpo_weights`."""
    with torch.no_grad():
        w, clipped = acpo_weights(surrogate.detach(), sequence_advantage.detach(), mask, cfg)
        advantages = sequence_advantage.double()[:, None] * w
    return ACPOResult(advantages=advantages.float(), weights=w.float(), clipped=clipped)


def acpo_stats(result: ACPOResult, surrogate: Tensor, sequence_advantage: Tensor, mask: Tensor,
               shannon: Tensor | None = None) -> dict[str, float]:
    """Metrics under ``acpo/``: weight statistics by outcome sign, the fraction clipped, the budget error
    (|sum_t A_t - T A| / T, mean over rows), sign violations (must be 0), and with ``shannon`` (bs, T) the
    surrogate's gap to verl's entropy (mean H - H~ on valid tokens; >= 0 for the modal surrogate).

    Masked reductions over the (bs, T) tensors (no boolean-indexed copies: at 2^25 tokens those cost seconds);
    means are float64 sums, min/max exact."""
    valid = mask.bool()
    a = sequence_advantage.double()
    out: dict[str, float] = {}
    w = result.weights
    count = valid.sum(-1).double()
    # per row over its valid tokens, once; the outcome groups below are sets of rows
    w_sum = torch.where(valid, w, 0).sum(-1, dtype=torch.float64)
    w_max = torch.where(valid, w, -math.inf).amax(-1)
    w_min = torch.where(valid, w, math.inf).amin(-1)
    for name, rows in (("success", a > 0), ("failure", a < 0)):
        sel = rows & (count > 0)
        if sel.any():
            out[f"acpo/weight/{name}/mean"] = float(w_sum[sel].sum() / count[sel].sum())
            out[f"acpo/weight/{name}/max"] = float(w_max[sel].amax())
            out[f"acpo/weight/{name}/min"] = float(w_min[sel].amin())
    n = int(valid.count_nonzero())
    out["acpo/frac_clipped"] = int((result.clipped & valid).count_nonzero()) / n if n else 0.0
    budget = (result.advantages * valid).sum(-1, dtype=torch.float64) - count * a
    rows = count > 0
    out["acpo/budget_error/mean"] = float((budget[rows].abs() / count[rows]).mean()) if rows.any() else 0.0
    adv = result.advantages
    sign = torch.sign(a).to(adv.dtype)[:, None]  # +-1, 0 (or NaN): adv * sign < 0 iff the signs oppose
    out["acpo/sign_violations"] = float((((adv * sign) < 0) & valid).count_nonzero())
    out["acpo/surrogate/mean"] = float(torch.where(valid, surrogate, 0).sum(dtype=torch.float64)) / n if n else 0.0
    if shannon is not None and n:
        gap = shannon.to(torch.float64, copy=True).sub_(surrogate)  # float64 difference per token, as before
        out["acpo/entropy_gap/mean"] = float(gap.masked_fill_(~valid, 0).sum()) / n
    return out
