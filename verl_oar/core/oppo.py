"""OPPO (Oracle-Prompted Policy Optimization): token advantages from a Bayesian value recursion over
the oracle's evidence.

Specification: docs/algo/oppo.md (no public code; every [GUESS] there is a key of
:class:`OPPOConfig`). Per response, over its valid tokens ``t`` (mask ``m``), with reward ``R`` in
[0, 1] and its group's success rate ``p``:

1. evidence:   e_t = log pi^(y_t | x + oracle(y*), y_<t) - log pi^(y_t | x, y_<t)    (nats)
2. clipping:   e~_t = clip(e_t, -clip, clip)
3. prior:      V_0 = clip(p, eps, 1 - eps) (``prior=group``) or 1/2 (``prior=half``); l_0 = logit(V_0)
4. recursion:  l_t = l_0 + sum_{s<t} m_s e~_s,   V_t = sigmoid(l_t)       (``state_weight=tracked``;
               ``constant``: V_t = 1/2 for every t)
5. advantage:  exact        A_t = m_t (sigmoid(l_t + e~_t) - sigmoid(l_t))   (telescopes: sum = V_T - V_0)
               first_order  A_t = m_t V_t (1 - V_t) e~_t
6. terminal:   ``last_token`` adds (R - V_0) - sum_t A_t to the last valid token, so that
               sum_t A_t = R - V_0 exactly (= R - V_T for the exact form); ``none`` leaves it
7. anchoring:  d = sign(R - V_0) (GRPO's direction);  ``clamp``: A_t <- d max(0, d A_t);
               ``abs``: A_t <- d |A_t|;  ``none``
8. scale:      ``group_std`` divides by (std of the group's rewards + 1e-6), as GRPO; ``none`` (default)

Groups whose rewards are all equal get A = 0 (GRPO gives them 0; ``zero_uniform_groups``). A row the oracle
pass could not score (its prompt + response past the context with ``overflow=skip``) keeps broadcast credit of
its own sequence total, ``(R - V_0) / T`` per token, before steps 7-8. Float64 inside, float32 out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import Tensor

from verl_oar.core.config import NodeConfig
from verl_oar.core.groups import group_ids  # noqa: F401  (re-exported: OPPO's groups are GRPO's)
from verl_oar.core.privileged_prompt import OPPO_ORACLE, OVERFLOWS, check_template

__all__ = ["OPPOConfig", "OPPOResult", "group_ids", "oppo_advantages", "oppo_stats"]

CHOICES = {
    "oracle": ("self", "teacher"),
    "prior": ("group", "half"),
    "form": ("exact", "first_order"),
    "state_weight": ("tracked", "constant"),
    "terminal": ("none", "last_token"),
    "anchor": ("clamp", "abs", "none"),
    "scale": ("none", "group_std"),
}
TEACHER_KEYS = ("path",)
"""keys of ``algorithm.oppo.teacher``"""
STD_EPS = 1e-6
"""GRPO's epsilon in verl (``compute_grpo_outcome_advantage``)"""


@dataclass(frozen=True)
class OPPOConfig(NodeConfig):
    """OPPO's advantage keys under ``algorithm.oppo`` (docs/algo/oppo.md; [GUESS] = not public)."""

    NODE = "oppo"
    DOCS = "docs/algo/oppo.md"

    clip: float = 2.0
    """[GUESS: value] evidence clipping c in nats (lambda in [e^-c, e^c]); 0 disables it"""
    prior: str = "group"
    """[GUESS] V_0: ``group`` (the group's success rate, clipped to [prior_eps, 1 - prior_eps]) or ``half``"""
    prior_eps: float = 1e-3
    form: str = "exact"
    """``exact`` (sigmoid difference, telescopes) or ``first_order`` (V (1 - V) e~)"""
    state_weight: str = "tracked"
    """``tracked`` (V_t from the recursion) or ``constant`` (V_t = 1/2: with first_order and anchor=none
    the advantage is the OPD reward e~/4)"""
    terminal: str = "none"
    """[GUESS] ``none`` (the literal formula) or ``last_token`` (the last token takes R - V_0 - sum A)"""
    anchor: str = "clamp"
    """[GUESS: form] direction anchoring: ``clamp`` (tokens against the verifier get 0), ``abs``, ``none``"""
    scale: str = "none"
    """[GUESS] ``none`` (Dr.GRPO-like) or ``group_std`` (divide by the group's reward std, as GRPO)"""
    zero_uniform_groups: bool = True
    """a group whose rewards are all equal gets advantage 0, as in GRPO (required with ``scale=group_std``: such a
    group's std is 0)"""
    template: str = OPPO_ORACLE
    """[GUESS: wording] the oracle prompt's user turn, with ``{question}`` and ``{answer}`` (``core.privileged_prompt``)"""
    overflow: str = "truncate"
    """an oracle prompt + response longer than the model's context: ``truncate`` shortens the question from its
    middle until it fits (never the chat header, system prompt, template or answer; a row that does not fit even
    with an empty question is skipped), ``skip`` skips the row (broadcast credit of its R - V_0); both counted"""
    oracle: str = "self"
    """who scores the evidence: ``self`` (the actor at the rollout's weights: the oracle prompt's log-probs
    minus ``old_log_probs``, or in rollout-correction bypass mode minus the plain prompt's from the same pass) or
    ``teacher`` (a frozen model: both terms under it)"""
    teacher: Mapping[str, Any] | None = None
    """``oracle=teacher``: ``{path: <model directory or hub id>}`` (``+algorithm.oppo.teacher.path=...``); its
    tokenizer must have the actor's vocabulary"""

    def __post_init__(self) -> None:
        for key, choices in CHOICES.items():
            self.check_choice(key, choices)
        if isinstance(self.clip, bool) or not isinstance(self.clip, (int, float)) or not self.clip >= 0:
            raise ValueError(f"algorithm.oppo.clip={self.clip!r} is invalid: nats >= 0 (0 = no clipping).")
        if isinstance(self.prior_eps, bool) or not isinstance(self.prior_eps, (int, float)) or not 0 < self.prior_eps < 0.5:
            raise ValueError(f"algorithm.oppo.prior_eps={self.prior_eps!r} is invalid: in (0, 0.5).")
        check_template(self.template, "algorithm.oppo.template", needs_answer=True)
        self.check_choice("overflow", OVERFLOWS)
        self.check_flags("zero_uniform_groups")
        if self.scale == "group_std" and not self.zero_uniform_groups:
            raise ValueError("algorithm.oppo.scale=group_std with algorithm.oppo.zero_uniform_groups=false divides the "
                             "advantages of a group whose rewards are all equal (std 0) by 1e-6: a prior-to-reward gap of "
                             "1e-3 (prior_eps) becomes a credit of about 1000 per response. Set "
                             "+algorithm.oppo.zero_uniform_groups=true (GRPO's choice: such groups get 0), or "
                             "+algorithm.oppo.scale=none.")
        teacher = dict((self.teacher or {}).items())
        object.__setattr__(self, "teacher", teacher or None)
        unknown = sorted(set(teacher) - set(TEACHER_KEYS))
        if unknown:
            raise ValueError(f"Unknown key(s) algorithm.oppo.teacher.{', algorithm.oppo.teacher.'.join(unknown)}. "
                             f"Valid keys: {', '.join(TEACHER_KEYS)} (docs/algo/oppo.md).")
        if self.oracle == "teacher" and not (isinstance(teacher.get("path"), str) and teacher["path"]):
            raise ValueError("algorithm.oppo.oracle=teacher needs the teacher model: set "
                             "+algorithm.oppo.teacher.path=<model directory or hub id> (e.g. Qwen/Qwen2.5-Math-7B-Instruct).")
        if self.oracle == "self" and teacher:
            raise ValueError(f"algorithm.oppo.teacher={teacher} is set but algorithm.oppo.oracle=self ignores it: add "
                             "+algorithm.oppo.oracle=teacher, or drop the teacher keys.")

    @property
    def teacher_path(self) -> str | None:
        """the teacher's model path (``oracle=teacher``), else None"""
        return self.teacher["path"] if self.oracle == "teacher" else None


@dataclass(frozen=True)
class OPPOResult:
    advantages: Tensor
    """(bs, T) float32, 0 on padding"""
    values: Tensor
    """(bs, T + 1) float32: V_0 .. V_T of the tracked recursion (V after each valid token; padding
    repeats the last value)"""
    prior: Tensor
    """(bs,) float32: V_0"""
    clipped: Tensor
    """(bs, T) bool: tokens whose evidence was clipped"""
    uniform: Tensor
    """(bs,) bool: rows of a group with one reward (advantage 0 when ``zero_uniform_groups``)"""


def _group_mean_std(values: Tensor, groups: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per row: its group's mean, unbiased std (0 for a group of one) and whether all its values are equal."""
    n = int(groups.max()) + 1 if groups.numel() else 0
    count = torch.zeros(n, dtype=torch.float64).index_add_(0, groups, torch.ones_like(values))
    total = torch.zeros(n, dtype=torch.float64).index_add_(0, groups, values)
    mean = total / count
    sq = torch.zeros(n, dtype=torch.float64).index_add_(0, groups, (values - mean[groups]) ** 2)
    std = torch.where(count > 1, (sq / (count - 1).clamp_min(1)).sqrt(), torch.zeros_like(sq))
    lo = torch.full((n,), math.inf, dtype=torch.float64).scatter_reduce(0, groups, values, "amin")
    hi = torch.full((n,), -math.inf, dtype=torch.float64).scatter_reduce(0, groups, values, "amax")
    return mean[groups], std[groups], (lo == hi)[groups]


def oppo_advantages(evidence: Tensor, rewards: Tensor, groups: Tensor, mask: Tensor, cfg: OPPOConfig,
                    scored: Tensor | None = None) -> OPPOResult:
    """OPPO's token advantages. ``evidence``: (bs, T) e_t in nats; ``rewards``: (bs,) R in [0, 1];
    ``groups``: (bs,) group numbers (``core.groups.group_ids``); ``mask``: (bs, T) valid tokens; ``scored``:
    (bs,) bool, False on rows the oracle pass could not score (None: every row was scored).

    A row that was not scored keeps broadcast credit of its own sequence total: ``A_t = (R - V_0) / T`` on each of
    its ``T`` valid tokens (what the exact form with ``terminal=last_token`` sums to), then scaled and zeroed like
    every other row (``scale``, ``zero_uniform_groups``); anchoring leaves it as it is. Its evidence is ignored and
    its values stay at V_0. (CSCR's unscored rows keep GRPO's uniform credit likewise: ``core.cscr``.)"""
    bs, t = mask.shape
    if evidence.shape != mask.shape or rewards.shape != (bs,) or groups.shape != (bs,):
        raise ValueError(f"OPPO: evidence {tuple(evidence.shape)} and mask {tuple(mask.shape)} must be (bs, T), "
                         f"rewards {tuple(rewards.shape)} and groups {tuple(groups.shape)} (bs,)")
    if scored is not None and scored.shape != (bs,):
        raise ValueError(f"OPPO: scored {tuple(scored.shape)} must be (bs,) = ({bs},)")
    response = mask.bool()
    rows = torch.ones(bs, dtype=torch.bool) if scored is None else scored.bool()
    valid = response & rows[:, None]          # the tokens the recursion runs over
    m = valid.double()
    r = rewards.double()
    if not torch.isfinite(r).all() or ((r < 0) | (r > 1)).any():
        bad = r[~torch.isfinite(r) | (r < 0) | (r > 1)][:3].tolist()
        raise ValueError(f"OPPO reads a response's reward as its success probability, in [0, 1]; got {bad} (the "
                         "first three). The reward function scores outside [0, 1] (e.g. verl's math_dapo scores a wrong "
                         "answer -1, a length penalty is negative): use a 0/1 verifier, or a custom reward function "
                         "(reward.custom_reward_function.path) whose scores are in [0, 1].")
    e = evidence.double()
    if not torch.isfinite(e[valid]).all():
        raise ValueError("OPPO: the oracle evidence is not finite on a response token (NaN or inf log-probs "
                         "under the oracle prompt); check the re-scoring pass's dtype and the prompt's length")
    e = torch.where(valid, e, torch.zeros_like(e))
    et = e.clamp(-cfg.clip, cfg.clip) if cfg.clip > 0 else e
    clipped = valid & (et != e)
    mean, std, uniform = _group_mean_std(r, groups.long())
    prior = mean.clamp(cfg.prior_eps, 1 - cfg.prior_eps) if cfg.prior == "group" else torch.full_like(r, 0.5)
    l0 = torch.log(prior) - torch.log1p(-prior)
    # l_t before token t (exclusive cumsum), and l_T after the last one
    inclusive = l0[:, None] + torch.cumsum(et, dim=-1)
    before = inclusive - et
    values = torch.cat([l0[:, None], inclusive], dim=-1).sigmoid()
    state = before if cfg.state_weight == "tracked" else torch.zeros_like(before)
    if cfg.form == "exact":
        adv = (state + et).sigmoid() - state.sigmoid()
    else:
        v = state.sigmoid()
        adv = v * (1 - v) * et
    adv = adv * m
    if cfg.terminal == "last_token":
        has = valid.any(-1)
        last = (valid.long() * torch.arange(1, t + 1)).argmax(-1)  # the last valid position
        gap = (r - prior) - adv.sum(-1)
        adv[torch.arange(bs)[has], last[has]] += gap[has]
    if scored is not None:
        count = response.sum(-1, keepdim=True).clamp(min=1).double()
        adv = torch.where(rows[:, None], adv, (r - prior)[:, None] * response.double() / count)
    direction = torch.sign(r - prior)[:, None]
    if cfg.anchor == "clamp":
        adv = direction * torch.clamp(direction * adv, min=0)
    elif cfg.anchor == "abs":
        adv = direction * adv.abs()
    if cfg.scale == "group_std":
        adv = adv / (std[:, None] + STD_EPS)
    if cfg.zero_uniform_groups:
        adv = torch.where(uniform[:, None], torch.zeros_like(adv), adv)
    return OPPOResult(advantages=(adv * response.double()).float(), values=values.float(), prior=prior.float(),
                      clipped=clipped, uniform=uniform)


def oppo_stats(result: OPPOResult, evidence: Tensor, rewards: Tensor, mask: Tensor,
               scored: Tensor | None = None) -> dict[str, float]:
    """Per-step metrics (``oppo/...``): evidence, clipping, prior and terminal value over the scored rows
    (``scored`` (bs,) bool, None: all), sign violations (tokens whose advantage opposes the verifier's direction
    R - V_0 after anchoring; 0 unless ``anchor=none``) and advantage statistics over every valid token, and
    ``oppo/broadcast_rows``: rows that were not scored (broadcast credit, :func:`oppo_advantages`).

    Masked reductions over the (bs, T) tensors (no boolean-indexed copies: at 2^25 tokens those cost seconds);
    means are float64 sums, min/max exact."""
    response = mask.bool()
    n_response = int(response.count_nonzero())
    if n_response == 0:
        return {"oppo/valid_tokens": 0.0}
    scored_rows = torch.ones(len(response), dtype=torch.bool) if scored is None else scored.bool()
    valid = response & scored_rows[:, None]
    adv = result.advantages
    # +-1, 0 (or NaN) per row: exact in the advantages' dtype, and adv * direction < 0 iff the signs oppose
    direction = torch.sign(rewards.double() - result.prior.double()).to(adv.dtype)[:, None]
    rows = response.any(-1)
    out = {
        "oppo/prior/mean": float(result.prior.double()[rows].mean()),
        "oppo/frac_uniform_groups": float(result.uniform.double().mean()),
        "oppo/sign_violations": float((((adv * direction) < 0) & response).count_nonzero()),
        "oppo/advantage/abs_mean": float(torch.where(response, adv.abs(), 0).sum(dtype=torch.float64)) / n_response,
        "oppo/advantage/seq_sum_mean": float(adv.sum(-1, dtype=torch.float64)[rows].mean()),
        "oppo/valid_tokens": float(n_response),
        "oppo/broadcast_rows": float((rows & ~scored_rows).sum()),
    }
    n = int(valid.count_nonzero())
    if n:
        e = evidence
        v_end = result.values.double()[:, -1]  # padding adds no evidence: V after the last valid token
        ends = valid.any(-1)
        out.update({
            "oppo/evidence/mean": float(torch.where(valid, e, 0).sum(dtype=torch.float64)) / n,
            "oppo/evidence/abs_mean": float(torch.where(valid, e.abs(), 0).sum(dtype=torch.float64)) / n,
            "oppo/evidence/max": float(torch.where(valid, e, -math.inf).amax()),
            "oppo/evidence/min": float(torch.where(valid, e, math.inf).amin()),
            "oppo/frac_clipped": int((result.clipped & valid).count_nonzero()) / n,
            "oppo/value_end/mean": float(v_end[ends].mean()),
            "oppo/terminal_gap/abs_mean": float((rewards.double() - v_end)[ends].abs().mean()),
        })
    return out
