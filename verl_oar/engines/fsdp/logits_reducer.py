"""ACPO's modal (top-1) log-probability as a logits reducer of verl's FSDP engine (upstream PR logits-reducers,
``verl.workers.engine.logits_reducers``), instead of wrapping the engine's ``prepare_model_outputs`` (``modal``).

verl applies a registered reducer to the logits its own pass already holds, after its temperature scaling
(``logits / T``, in the logits' dtype), and packs the (N,) result like ``log_probs`` under the reducer's name
(``MODAL_KEY``, the field the wrapper writes, so ``integration.modal_signal`` reads it the same way). The reducer
is therefore :func:`modal.top1_log_probs` at temperature 1. In float32 that is the wrapper's value bit for bit when
T = 1 and within float32 rounding otherwise; in bf16 verl casts T to bf16 and rounds ``z / T`` to bf16 before the
reduction, where the wrapper scales in float32: the reducer's error is at most ``2 * 2**-8 * max|z / T|`` nats per
token (one bf16 rounding of T and one of each scaled logit; tests/unit/test_logits_reducer_on_cpu.py checks the
bound against float64 on random logits; through verl's FSDP2 engine in bf16 at T = 0.7 the reducer is 0.0059 nats
from the fp32 plain-transformers reference where the wrapper is 0.0043, tests/engine/engine_modal_check.py).
"""

from __future__ import annotations

import torch

from verl_oar.engines.fsdp.modal import MODAL_KEY, top1_log_probs

__all__ = ["MODAL_KEY", "available", "modal_reducer", "register"]

ANNOUNCE = "[verl-oar] ACPO's modal log-probs through verl's logits reducer"
"""printed by a worker process when it registers the reducer"""
REQUEST_KEY = "logits_reducers"
"""the non-tensor batch key naming the reducers a pass returns (``verl.workers.engine.logits_reducers``)"""


def modal_reducer(logits: torch.Tensor) -> torch.Tensor:
    """(N,) float32 log p_max of ``logits`` (N, V), already divided by the pass's temperature."""
    return top1_log_probs(logits, 1.0)


def available() -> bool:
    """True when the imported verl has logits reducers (PR logits-reducers)."""
    try:
        from verl.workers.engine import logits_reducers
    except ImportError:
        return False
    return hasattr(logits_reducers, "register_logits_reducer")


def register() -> None:
    """Register :func:`modal_reducer` as ``MODAL_KEY`` in verl's reducer registry (idempotent; needs PR logits-reducers)."""
    from verl.workers.engine.logits_reducers import LOGITS_REDUCERS, register_logits_reducer

    if LOGITS_REDUCERS.get(MODAL_KEY) is not modal_reducer:
        register_logits_reducer(MODAL_KEY, modal_reducer)
        print(ANNOUNCE, flush=True)  # once per process (the e2e test of the series reads it in the run's log)
