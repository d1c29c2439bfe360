"""Token importance I_t of the reasoning tokens, from a model callable (pure torch, no verl).

One method per module: ``gradient`` (OAR-G: one forward, one gradient w.r.t. the input embeddings)
and ``perturbation`` (OAR-P: occlude tokens, re-score the outcome, sharing the clean prefix).
"""

from verl_oar.importance.gradient import (
    GradientConfig,
    gradient_importance,
    gradient_importance_in_forward,
    make_hf_logits_fn,
)
from verl_oar.importance.perturbation import (
    PerturbationConfig,
    naive_perturbation_importance,
    occlusion_spans,
    perturbation_importance,
)

__all__ = [
    "GradientConfig",
    "PerturbationConfig",
    "gradient_importance",
    "gradient_importance_in_forward",
    "make_hf_logits_fn",
    "naive_perturbation_importance",
    "occlusion_spans",
    "perturbation_importance",
]
