"""CoDaPO (Confidence and Difficulty-adaptive Policy Optimization): a per-question value from the group's
confidence and difficulty scales GRPO's advantage; CoDaSampling reuses each batch on its top questions.

Specification: docs/algo/codapo.md, read in the authors' public code
(``tmlr-group/CoDaPO``, ``compute_codapo_advantage``). Per question ``q`` with a group of ``G`` responses:

1. accuracy:    acc_q = #{i : R_i is right} / G;  difficulty d_q = 1 - acc_q. Right: ``R_i == 1`` (the authors'
                0/1 verifier; every batch is checked to hold only rewards <= 0 or == 1, else the run stops naming
                ``right_threshold``), or ``R_i >= right_threshold`` when that is set (partial credit, a format bonus)
2. difficulty value: V_d = 1 - 4 (d_q - 1/2)^2   (1 at d = 1/2, 0 at d in {0, 1})
3. confidence:  l_i = mean_t old_log_prob_{i,t} over response i's valid tokens (0 if it has none);
                c_q = exp(mean_i l_i)   (the group's geometric-mean token probability)
4. value:       v_q = c_q * V_d + weight_offset            (in [offset, 1 + offset])
5. advantage:   A_{i,t} = v_q * A^GRPO_i                   (per question; no token-level change)

CoDaSampling (:func:`select_questions`, :func:`refocused_order`): after a batch's first use, the questions
whose value is at least the ``percentile``-quantile of the batch's values (torch's linear interpolation; ties
can select more) are repeated ``repeat_count`` times each, cycling until the batch's size, each copy its own
GRPO group. ``compose``: the value multiplies another token-level estimator's advantages instead of GRPO's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from verl_oar.core.config import NodeConfig
from verl_oar.core.reshape import linear_quantile

__all__ = ["CoDaPOConfig", "codapo_stats", "question_values", "refocused_order", "right_answers", "select_questions"]


@dataclass(frozen=True)
class CoDaPOConfig(NodeConfig):
    """Everything CoDaPO reads from ``algorithm.codapo`` (the authors' defaults, docs/algo/codapo.md)."""

    NODE = "codapo"
    DOCS = "docs/algo/codapo.md"

    weight_offset: float = 0.1
    """added to every question's value: the least weight a question gets (authors: 0.1)"""
    percentile: float = 0.75
    """CoDaSampling: questions at or above this quantile of the batch's values are resampled (authors: 0.75)"""
    repeat_count: int = 4
    """CoDaSampling: copies of each selected question, each its own group (authors: 4, about 1/(1 - percentile))"""
    sampling: bool = True
    """CoDaSampling on (``codapo``): every batch is used twice; false: the weighting alone"""
    compose: bool = False
    """with another token-level estimator (``oar_g``, ``cscr``, ...): multiply its advantages by the value"""
    right_threshold: float | None = None
    """a response is right when its reward is >= this; None: exactly 1.0 (authors), rewards checked to be 0/1-like"""

    def __post_init__(self) -> None:
        self.check_finite("weight_offset", "percentile")
        if self.weight_offset < 0:
            raise ValueError(f"algorithm.codapo.weight_offset={self.weight_offset} is invalid: >= 0 (authors: 0.1).")
        if not 0.0 <= self.percentile < 1.0:
            raise ValueError(f"algorithm.codapo.percentile={self.percentile} is invalid: a quantile level in [0, 1).")
        if isinstance(self.repeat_count, bool) or not isinstance(self.repeat_count, int) or self.repeat_count < 1:
            raise ValueError(f"algorithm.codapo.repeat_count={self.repeat_count!r} is invalid: an integer >= 1.")
        threshold = self.right_threshold
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))
                                      or not math.isfinite(threshold)):
            raise ValueError(f"algorithm.codapo.right_threshold={threshold!r} is invalid: a finite number (the least "
                             "reward of a right answer), or null for the authors' rule (exactly 1.0).")
        self.check_flags("sampling", "compose")


def right_answers(rewards: Tensor, right_threshold: float | None = None) -> Tensor:
    """(bs,) float64 1/0: which rewards count as a right answer. ``right_threshold`` None: exactly 1.0, the authors'
    rule, and then every reward must be 1.0 or <= 0 (a 0/1 or -1/1 verifier): anything else (partial credit, a
    format bonus, DAPO's overlong penalty, a KL-shaped reward) would count every such answer wrong and silently
    turn CoDaPO into a constant times GRPO, so it is a ValueError naming ``algorithm.codapo.right_threshold``."""
    r = rewards.double()
    if not torch.isfinite(r).all():
        raise ValueError("CoDaPO: a reward is not finite; check the reward function")
    if right_threshold is not None:
        return (r >= right_threshold).double()
    odd = r[(r != 1.0) & (r > 0.0)]
    if odd.numel():
        raise ValueError(
            f"CoDaPO counts a response right when its reward is exactly 1.0 (the authors' 0/1 verifier), but this "
            f"batch has rewards such as {sorted(set(odd[:5].tolist()))} that are neither 1.0 nor <= 0 (partial "
            "credit, a format bonus, a length penalty?): every such answer would count as wrong. Set "
            "+algorithm.codapo.right_threshold=X, the least reward of a right answer (e.g. 1.0 with a format bonus "
            "on top, 0.9 when an overlong penalty can take 0.1 off a right answer).")
    return (r == 1.0).double()


def question_values(rewards: Tensor, log_probs: Tensor, mask: Tensor, groups: Tensor, weight_offset: float = 0.1,
                    right_threshold: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Steps 1-4 for every row: (v (bs,) float64, each row its question's value; parts {"accuracy",
    "difficulty_value", "confidence"}, each (bs,) float64). ``rewards``: (bs,) outcome rewards, right as
    ``right_answers`` says; ``log_probs``: (bs, T) old log-probs; ``mask``:
    (bs, T) valid tokens; ``groups``: (bs,) long group ids (``core.groups.group_ids``)."""
    if log_probs.shape != mask.shape or rewards.shape != mask.shape[:1] or groups.shape != rewards.shape:
        raise ValueError(f"CoDaPO: rewards {tuple(rewards.shape)}, log-probs {tuple(log_probs.shape)}, mask "
                         f"{tuple(mask.shape)} and groups {tuple(groups.shape)} must be (bs,), (bs, T), (bs, T), (bs,)")
    valid = mask.bool()
    lp = log_probs.double()
    if not torch.isfinite(lp[valid]).all():
        raise ValueError("CoDaPO: an old log-prob is not finite on a response token; the confidence is undefined")
    count = valid.sum(-1)
    mean_lp = torch.where(count > 0, (lp * valid).sum(-1) / count.clamp(min=1), torch.zeros_like(count, dtype=torch.float64))
    right = right_answers(rewards, right_threshold)
    _, local = torch.unique(groups, return_inverse=True)
    size = torch.zeros(int(local.max()) + 1 if len(local) else 0, dtype=torch.float64).index_add_(0, local, torch.ones_like(right))
    accuracy = torch.zeros_like(size).index_add_(0, local, right) / size
    confidence = torch.exp(torch.zeros_like(size).index_add_(0, local, mean_lp) / size)
    difficulty_value = 1.0 - 4.0 * ((1.0 - accuracy) - 0.5) ** 2
    value = confidence * difficulty_value + weight_offset
    parts = {"accuracy": accuracy[local], "difficulty_value": difficulty_value[local], "confidence": confidence[local]}
    return value[local], parts


def codapo_stats(value: Tensor, parts: dict[str, Tensor]) -> dict[str, float]:
    """Per-step metrics (``codapo/...``) of :func:`question_values`' output over the rows given (each row counts its
    question once per response): the value's mean, min and max, and the means of its parts."""
    if value.numel() == 0:
        return {}
    v = value.double()
    return {
        "codapo/value/mean": float(v.mean()), "codapo/value/min": float(v.min()), "codapo/value/max": float(v.max()),
        "codapo/confidence/mean": float(parts["confidence"].mean()),
        "codapo/difficulty_value/mean": float(parts["difficulty_value"].mean()),
        "codapo/accuracy/mean": float(parts["accuracy"].mean()),
    }


def select_questions(values: Sequence[float], percentile: float) -> list[int]:
    """Indices (in order) of the questions whose value is >= the ``percentile``-quantile of ``values``
    (``torch.quantile``'s linear interpolation, as the authors' code, at any size: ``core.reshape.linear_quantile``);
    ties can select more."""
    v = torch.as_tensor(list(values), dtype=torch.float64)
    if v.numel() == 0:
        return []
    tau = linear_quantile(v, percentile)
    return [i for i, x in enumerate(v.tolist()) if x >= float(tau)]


def refocused_order(selected: Sequence[int], repeat_count: int, batch_size: int) -> list[int]:
    """The refocused batch's questions: cycle through ``selected``, appending each ``repeat_count`` times,
    until ``batch_size`` entries (truncated), as the authors' ``fit``. Each entry becomes its own group."""
    if not selected:
        raise ValueError("CoDaSampling: no question selected (an empty batch?)")
    out: list[int] = []
    while len(out) < batch_size:
        for q in selected:
            out.extend([q] * repeat_count)
            if len(out) >= batch_size:
                break
    return out[:batch_size]
