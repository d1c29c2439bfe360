"""Stop a run in which OAR cannot take effect, and count the steps where it mostly does not.

A response whose final answer cannot be located has no outcome to ground importance on and keeps
GRPO's uniform credit (``oar/fallback/frac_no_answer``). Two different things make that fraction high,
and :class:`NoAnswerGuard` tells them apart:

1. *The locator never finds an answer* (a format it does not read, or every response cut at
   ``data.max_response_length``): OAR would never take effect. When no response of any of the run's first
   ``algorithm.oar.no_answer_first_steps`` training steps (default 3) has a located answer, the run stops at the
   last of them with the cause and the fix, whatever ``no_answer_action``: a start-up refusal that needs a few
   steps of responses to see.
2. *The policy writes fewer answers later*: after the first ``no_answer_warmup`` steps (global step <= it, default
   10, never count: a base model can need a few updates), a step above ``no_answer_max_frac`` (0.5) prints a
   warning and is counted (``oar/fallback/no_answer_steps``); the run stops only when more than
   ``no_answer_stop_frac`` (0.9) of the responses lack an answer for ``no_answer_patience`` (3) consecutive steps
   (``no_answer_action=error``, the default; ``warn`` keeps training), for such a run is GRPO under another name.

The counts are not saved in checkpoints: a resumed run counts afresh (the first steps and the warm-up are global
steps, so a run resumed past them does not repeat the start-up check).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

METRIC = "fallback/frac_no_answer"
"""the estimator metric watched (logged as ``oar/fallback/frac_no_answer``)"""


class NoAnswerError(RuntimeError):
    """Raised to stop a run whose responses mostly have no locatable answer."""


@dataclass
class NoAnswerGuard:
    """The start-up check and the later stop (see the module docstring); ``observe`` once per step."""

    max_frac: float = 0.5
    patience: int = 3
    action: str = "error"
    warmup: int = 0
    """global steps <= this never count towards the warning or the stop (``no_answer_warmup``)"""
    stop_frac: float = 0.9
    """a step above this counts towards the stop (``no_answer_stop_frac``)"""
    first_steps: int = 3
    """the start-up check's steps (``no_answer_first_steps``; 0: no check)"""
    streak: list[tuple[int, float]] = field(default_factory=list)
    """(step, fraction) of the current run of steps above ``stop_frac``"""
    high_steps: int = 0
    """steps after the warm-up above ``max_frac`` so far"""
    none_found: list[int] = field(default_factory=list)
    """the first steps seen so far in which no response had a located answer"""
    found_early: bool = False
    """a response of one of the first steps had a located answer: the start-up check passed"""

    @classmethod
    def from_config(cls, config) -> "NoAnswerGuard":
        """From verl's config (``algorithm.oar.no_answer_*``; validated by ``OARConfig``)."""
        from verl_oar.core.config import OARConfig

        oar = OARConfig.from_algorithm(config.algorithm)
        return cls(oar.no_answer_max_frac, oar.no_answer_patience, oar.no_answer_action, oar.no_answer_warmup,
                   oar.no_answer_stop_frac, oar.no_answer_first_steps)

    def observe(self, step: int, metrics: dict) -> dict[str, float]:
        """Feed one step's estimator metrics; returns ``{"oar/fallback/no_answer_streak": n,
        "oar/fallback/no_answer_steps": m}``.

        Raises NoAnswerError when the start-up check fails, or when the streak reaches ``patience`` and the
        action is ``error``."""
        frac = metrics.get(METRIC, None)
        if frac is not None and step <= self.first_steps and not self.found_early:
            if frac >= 1.0:
                self.none_found.append(step)
                if len(self.none_found) >= self.first_steps:
                    raise NoAnswerError(self.locator_message())
            else:
                self.found_early = True
        counted = frac is not None and step > self.warmup
        if counted and frac > self.max_frac:
            self.high_steps += 1
            print(f"[verl-oar] WARNING: step {step}: {frac:.0%} of the responses had no locatable final answer "
                  f"(oar/fallback/frac_no_answer > algorithm.oar.no_answer_max_frac={self.max_frac:g}); they keep "
                  f"GRPO's credit this step. The run stops if more than no_answer_stop_frac={self.stop_frac:g} lack "
                  f"one for no_answer_patience={self.patience} consecutive steps.", file=sys.stderr, flush=True)
        if counted and frac > self.stop_frac:
            self.streak.append((step, float(frac)))
        else:
            self.streak.clear()
        if len(self.streak) >= self.patience:
            message = self.message()
            if self.action == "error":
                raise NoAnswerError(message)
            print(f"[verl-oar] WARNING: {message}", file=sys.stderr, flush=True)
        return {"oar/fallback/no_answer_streak": float(len(self.streak)),
                "oar/fallback/no_answer_steps": float(self.high_steps)}

    def locator_message(self) -> str:
        return (
            f"OAR cannot take effect: no response of the run's first {self.first_steps} training steps had a "
            "locatable final answer (oar/fallback/frac_no_answer = 100% each), so every response kept GRPO's "
            "uniform credit. The answer locator does not read this model's answer format (the built-in reads the "
            "last \\boxed{...}, an 'Answer:' or 'Final Answer' line, '####' and 'The answer is'), or every response "
            "is cut at data.max_response_length before its answer. Fix: set "
            "algorithm.oar.answer_locator=pkg://your_module.your_locator, or return answer_span from your reward "
            "function as verl_oar.rewards.math_reward does, or raise data.max_response_length; decode a few "
            "responses to see which. algorithm.oar.no_answer_first_steps=0 turns this check off."
        )

    def message(self) -> str:
        steps = [s for s, _ in self.streak]
        fracs = ", ".join(f"{f:.0%}" for _, f in self.streak)
        return (
            f"OAR cannot take effect: for {len(self.streak)} consecutive steps ({steps[0]}-{steps[-1]}) more than "
            f"{self.stop_frac:.0%} of the responses had no locatable final answer ({fracs}; "
            "oar/fallback/frac_no_answer), so they kept GRPO's uniform credit and this run is training GRPO under "
            "another name. Causes: responses cut at data.max_response_length before their answer (raise it), or an "
            "answer format the locator does not read (set algorithm.oar.answer_locator=pkg://your_module.your_locator, "
            "or return answer_span from your reward function as verl_oar.rewards.math_reward does). To keep training "
            "anyway, set algorithm.oar.no_answer_action=warn (or raise algorithm.oar.no_answer_stop_frac, "
            "no_answer_patience or no_answer_warmup, the first steps that never count)."
        )
