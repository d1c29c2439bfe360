"""OAR-P's settings (``algorithm.oar.*`` through ``core.config.OARConfig.perturbation_config``) and its cost."""

from __future__ import annotations

from dataclasses import dataclass

from verl_oar.core.outcome import OUTCOMES

__all__ = ["MODES", "PerturbationConfig", "PerturbationCost"]

MODES = ("exact", "chunk", "line", "hierarchical")
"""Occlusion units: every reasoning token, K contiguous chunks, K groups of reasoning steps, or K chunks
then the top ``refine_top`` of them split into units of ``refine_unit`` tokens (``spans.py``)."""


@dataclass(frozen=True)
class PerturbationConfig:
    """OAR-P settings."""

    outcome: str = "mean"
    """"single" | "mean" | "joint" (paper's AS-*; AS-MEAN was best)."""
    mode: str = "exact"
    """one of :data:`MODES`: what one occlusion covers."""
    budget: int = 16
    """K, the most occlusions per response in ``chunk`` and ``line`` modes (``hierarchical``'s first round);
    unused by ``exact``."""
    share_prefix: bool = True
    """Reuse KV caches of shared prompts and of the clean pass before each span (exact either way; off for models
    whose cache cannot be continued, Megatron, and to measure)."""
    refine_top: int = 4
    """m, ``hierarchical`` mode: how many of the K coarse chunks (the most important) are refined (default from
    the measured frontier, docs/method.md)."""
    refine_unit: int = 4
    """``hierarchical`` mode: tokens per refined span (1: every token of a refined chunk on its own)."""

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ValueError(f"algorithm.oar.outcome={self.outcome!r} is invalid: must be one of {OUTCOMES}")
        if self.mode not in MODES:
            raise ValueError(f"algorithm.oar.perturb_mode={self.mode!r} is invalid: must be one of {MODES}")
        if not isinstance(self.budget, int) or self.budget < 1:
            raise ValueError(
                f"algorithm.oar.perturb_budget={self.budget!r} is invalid: it is K, the most occlusions per "
                "response in chunk/line modes, an integer >= 1."
            )
        for key, value in (("perturb_refine_top", self.refine_top), ("perturb_refine_unit", self.refine_unit)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"algorithm.oar.{key}={value!r} is invalid: an integer >= 1 (hierarchical mode).")


@dataclass
class PerturbationCost:
    """What a computation cost, to compare with a log-prob pass over the same sequences."""

    forwards: int = 0
    """model calls (the clean pass included)"""
    copies: int = 0
    """perturbed sequences scored"""
    tokens: int = 0
    """tokens fed to the model (cached prefixes not counted)"""
    peak_call_tokens: int = 0
    """the largest model call, padded (``calls.call_tokens``): what the token budget bounds"""

    def add(self, other: "PerturbationCost") -> None:
        self.forwards += other.forwards
        self.copies += other.copies
        self.tokens += other.tokens
        self.peak_call_tokens = max(self.peak_call_tokens, other.peak_call_tokens)
