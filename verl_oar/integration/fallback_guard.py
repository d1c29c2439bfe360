"""Stop a run in which OAR cannot take effect: most responses without a locatable answer.

A response whose final answer cannot be located has no outcome to ground importance on and keeps
GRPO's uniform credit (``oar/fallback/frac_no_answer``). A run where that is most responses, step
after step, is plain GRPO under the name ``oar_g`` / ``oar_p``; typical causes are responses cut at
``data.max_response_length`` before their answer, or an answer format the locator does not read.
:class:`NoAnswerGuard` watches that metric: more than ``algorithm.oar.no_answer_max_frac`` for
``no_answer_patience`` consecutive steps stops the run with the cause and the fix
(``no_answer_action=error``, the default) or prints a warning (``warn``). The run's first
``no_answer_warmup`` training steps (global step <= it, default 10) never count: a base model can need a
few updates before it answers in a format the locator reads. The streak is not saved in checkpoints: a
resumed run starts counting afresh (after the warm-up, which is counted in global steps).
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
    """Counts consecutive steps with too many answerless responses (see the module docstring)."""

    max_frac: float = 0.5
    patience: int = 3
    action: str = "error"
    warmup: int = 0
    """global steps <= this never count (``no_answer_warmup``)"""
    streak: list[tuple[int, float]] = field(default_factory=list)
    """(step, fraction) of the current run of offending steps"""

    @classmethod
    def from_config(cls, config) -> "NoAnswerGuard":
        """From verl's config (``algorithm.oar.no_answer_*``; validated by ``OARConfig``)."""
        from verl_oar.core.config import OARConfig

        oar = OARConfig.from_algorithm(config.algorithm)
        return cls(oar.no_answer_max_frac, oar.no_answer_patience, oar.no_answer_action, oar.no_answer_warmup)

    def observe(self, step: int, metrics: dict) -> dict[str, float]:
        """Feed one step's estimator metrics; returns ``{"oar/fallback/no_answer_streak": n}``.

        Raises NoAnswerError when the streak reaches ``patience`` and the action is ``error``."""
        frac = metrics.get(METRIC, None)
        if frac is None or frac <= self.max_frac or step <= self.warmup:
            self.streak.clear()
        else:
            self.streak.append((step, float(frac)))
        if len(self.streak) >= self.patience:
            message = self.message()
            if self.action == "error":
                raise NoAnswerError(message)
            print(f"[verl-oar] WARNING: {message}", file=sys.stderr, flush=True)
        return {"oar/fallback/no_answer_streak": float(len(self.streak))}

    def message(self) -> str:
        steps = [s for s, _ in self.streak]
        fracs = ", ".join(f"{f:.0%}" for _, f in self.streak)
        return (
            f"OAR cannot take effect: for {len(self.streak)} consecutive steps ({steps[0]}-{steps[-1]}) more than "
            f"{self.max_frac:.0%} of the responses had no locatable final answer ({fracs}; oar/fallback/frac_no_answer), "
            "so they kept GRPO's uniform credit and this run is training GRPO under another name. Causes: responses "
            "cut at data.max_response_length before their answer (raise it), or an answer format the locator does "
            "not read (set algorithm.oar.answer_locator=pkg://your_module.your_locator, or return answer_span from "
            "your reward function as verl_oar.rewards.math_reward does). To keep training anyway, set "
            "algorithm.oar.no_answer_action=warn (or raise algorithm.oar.no_answer_max_frac, no_answer_patience or "
            "no_answer_warmup, the first steps that never count)."
        )
