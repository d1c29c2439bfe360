"""Token importance I_t of the reasoning tokens, from a model callable (pure torch, no verl).

One method per module: ``gradient`` (OAR-G: one forward, one gradient w.r.t. the input embeddings).
"""

from verl_oar.importance.gradient import (
    GradientConfig,
    gradient_importance,
    gradient_importance_in_forward,
    make_hf_logits_fn,
)

__all__ = ["GradientConfig", "gradient_importance", "gradient_importance_in_forward", "make_hf_logits_fn"]
