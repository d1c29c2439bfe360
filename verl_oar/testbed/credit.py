"""The credit a run actually assigned, read from its dumped tensors (``algorithm.oar.dump_dir``).

Per response of every dumped step (real rows only; the oracle read from the response's text,
``pick_max.oracle_token_masks``):

- **credit concentration** = mean |token advantage| over its oracle-causal reasoning tokens divided by
  the mean over its non-causal reasoning tokens. GRPO gives every token of a response the same
  advantage, so it is 1 by construction; above 1 the method put more credit on the tokens the
  answer depends on. Responses whose advantage is 0 (a group with one reward) or that have no causal
  or no non-causal reasoning token are skipped and counted (``RunCredit.skipped``).
- **recall@10%** of the method's token signal (``Method.signal``, e.g. ``oar_importance``; ranked by
  magnitude): the share of
  the oracle-causal tokens that rank among the top 10% of reasoning tokens by signal
  (``core.token_ranking.recall_at``, ties broken by a seeded generator).

A run is summarised by the median concentration over its responses and the mean recall.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from verl_oar.core.token_ranking import recall_at
from verl_oar.testbed.pick_max import oracle_token_masks

__all__ = ["RunCredit", "concentration", "run_credit", "summarize"]

RECALL_FRAC = 0.1


def concentration(advantages: torch.Tensor, causal: torch.Tensor, reasoning: torch.Tensor) -> float | None:
    """Mean |advantage| on causal reasoning tokens / mean on non-causal reasoning tokens, for one
    response; all (T,). None when either set is empty or the non-causal mean is 0."""
    causal = causal & reasoning
    other = reasoning & ~causal
    if not causal.any() or not other.any():
        return None
    denominator = float(advantages[other].abs().mean())
    if denominator == 0.0:
        return None
    return float(advantages[causal].abs().mean()) / denominator


@dataclass
class RunCredit:
    """Credit measures of one run's dumps."""

    concentrations: list[float] = field(default_factory=list)
    """one per counted response, every step"""
    recalls: list[float] = field(default_factory=list)
    """recall@10% of the signal, one per response with an oracle"""
    responses: int = 0
    skipped: dict[str, int] = field(default_factory=lambda: {"no_answer": 0, "zero_advantage": 0, "no_causal": 0,
                                                             "no_other": 0})
    steps: int = 0

    @property
    def median_concentration(self) -> float:
        return statistics.median(self.concentrations) if self.concentrations else math.nan

    @property
    def mean_recall(self) -> float:
        return statistics.fmean(self.recalls) if self.recalls else math.nan

    def as_dict(self) -> dict:
        return {"median_concentration": self.median_concentration, "mean_recall_at_10": self.mean_recall,
                "counted_concentration": len(self.concentrations), "counted_recall": len(self.recalls),
                "responses": self.responses, "skipped": dict(self.skipped), "steps": self.steps}


def run_credit(dump_dir: Path, tokenizer: Any, signal: str | None, *, seed: int = 0) -> RunCredit:
    """Read every ``step_*.pt`` of a run's dump folder (see the module docstring)."""
    out = RunCredit()
    generator = torch.Generator().manual_seed(seed)
    for path in sorted(Path(dump_dir).glob("step_*.pt"), key=lambda p: int(p.stem.split("_")[1])):
        dump = torch.load(path, weights_only=False)
        out.steps += 1
        responses, mask, advantages = dump["responses"], dump["response_mask"].bool(), dump["advantages"].float()
        rows = range(responses.shape[0])
        real = dump.get("real_rows")
        for row in rows:
            if real is not None and not bool(real[row]):
                continue
            out.responses += 1
            positions = mask[row].nonzero().squeeze(1)
            masks = oracle_token_masks(responses[row, positions].tolist(), tokenizer)
            if masks is None:
                out.skipped["no_answer"] += 1
                continue
            causal = masks.causal & masks.reasoning
            value = concentration(advantages[row, positions], masks.causal, masks.reasoning)
            if value is not None:
                out.concentrations.append(value)
            elif not causal.any():
                out.skipped["no_causal"] += 1
            elif not (masks.reasoning & ~causal).any():
                out.skipped["no_other"] += 1
            else:
                out.skipped["zero_advantage"] += 1
            if signal is not None and bool((masks.causal & masks.reasoning).any()):
                scores = dump[signal][row, positions].float().abs()  # by magnitude: OPPO's evidence is signed
                out.recalls.append(recall_at(scores, masks.reasoning, masks.causal & masks.reasoning, [RECALL_FRAC],
                                             generator)[RECALL_FRAC])
    return out


def summarize(values: Sequence[float]) -> dict:
    """{"median", "q25", "q75", "responses"} of per-response values (NaN when empty), for the report."""
    if not values:
        return {"median": math.nan, "q25": math.nan, "q75": math.nan, "responses": 0}
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"median": statistics.median(values), "q25": q[0], "q75": q[2], "responses": len(values)}
