"""The seam between the importance driver and verl's engines: which engine a worker runs, and that
engine's importance pass.

``engines.driver`` knows only :func:`importance_pass` and the :class:`ImportancePass` it yields; each
engine package supplies its own (``engines.fsdp.importance_pass``: micro-batch functions, equal model-call
counts over FSDP2 ranks or the opt-in whole-model gather; ``engines.megatron``: its micro-batch functions
and BSHD row padding). The engine is recognised by class here, outside both packages, without importing
megatron.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

from tensordict import TensorDict
from torch import Tensor

from verl_oar.core.config import OARConfig
from verl_oar.core.perturbation import PerturbationCost


class ImportancePass(Protocol):
    """One importance pass's micro-batches on one rank, in the order of verl's ``prepare_micro_batches``."""

    def gradient(self, micro_batch: TensorDict, cfg: OARConfig, step: int,
                 with_log_probs: bool) -> tuple[Tensor, dict | None]:
        """OAR-G: nested (bs, seq_len) float32 importance, and verl's log-prob outputs when fused."""
        ...

    def perturbation(self, micro_batch: TensorDict, cfg: OARConfig, neutral_id: int, token_budget: int | None,
                     rows_budget: int) -> tuple[Tensor, list[PerturbationCost]]:
        """OAR-P: nested (bs, seq_len) float32 importance and each sample's cost."""
        ...


def is_megatron_engine(engine) -> bool:
    """Whether ``engine`` is verl's Megatron engine (checked by class, without importing megatron)."""
    return any(
        cls.__name__ == "MegatronEngine" and cls.__module__.startswith("verl.workers.engine.megatron")
        for cls in type(engine).__mro__
    )


def importance_pass(engine, data: TensorDict, cfg: OARConfig) -> AbstractContextManager[ImportancePass]:
    """The engine's importance pass over ``data`` (the rank's whole batch), entered on every rank at the same
    point inside ``engine.eval_mode()``; verl's Megatron engine, else its FSDP / FSDP2 engine."""
    if is_megatron_engine(engine):
        from verl_oar.engines.megatron import megatron_importance_pass

        return megatron_importance_pass(engine, data, cfg)
    from verl_oar.engines.fsdp.importance_pass import fsdp_importance_pass

    return fsdp_importance_pass(engine, data, cfg)
