"""OAR-P, token importance by occlusion: one implementation, batched across samples.

* ``config.py``: :class:`PerturbationConfig` (outcome, mode, K, prefix sharing, hierarchical's m and u) and
  :class:`PerturbationCost`;
* ``spans.py``: what one occlusion covers in each mode (``exact``, ``chunk``, ``line``, and ``hierarchical``'s
  coarse and refined rounds and how they combine);
* ``calls.py``: the model calls: :class:`Row`, :class:`RowsModel` and :func:`plan_calls` (token budget, padding);
* ``importance.py``: :func:`score_samples`, the entry point, over :func:`batched_perturbation_importance` (prompts
  once, clean passes, copies of all samples sharing calls) and :func:`hierarchical_importance` (two rounds).

The plain reference (one whole-sequence forward per span, no cache, no batching) lives in the tests
(``tests/_oar_p_reference.py``), which check this package against it to 1e-10 in float64. Pure torch: no verl or
transformers import (``core.hf.HFRowsModel`` adapts a transformers model).
"""

from verl_oar.core.perturbation.calls import (
    CACHE_FACTOR,
    WASTE_FRACTION,
    Row,
    RowsModel,
    cached_tokens,
    call_tokens,
    plan_calls,
)
from verl_oar.core.perturbation.config import MODES, PerturbationConfig, PerturbationCost
from verl_oar.core.perturbation.importance import (
    HierarchicalStats,
    Sample,
    ScoreSpans,
    batched_perturbation_importance,
    hierarchical_importance,
    score_samples,
)
from verl_oar.core.perturbation.spans import (
    FILLS,
    coarse_spans,
    combine,
    hierarchical_cost,
    occlusion_spans,
    refined_spans,
    select_refined,
    span_values,
)

__all__ = [
    "CACHE_FACTOR",
    "FILLS",
    "MODES",
    "WASTE_FRACTION",
    "HierarchicalStats",
    "PerturbationConfig",
    "PerturbationCost",
    "Row",
    "RowsModel",
    "Sample",
    "ScoreSpans",
    "batched_perturbation_importance",
    "cached_tokens",
    "call_tokens",
    "coarse_spans",
    "combine",
    "hierarchical_cost",
    "hierarchical_importance",
    "occlusion_spans",
    "plan_calls",
    "refined_spans",
    "score_samples",
    "select_refined",
    "span_values",
]
