"""OAR on verl's Megatron engine; :func:`megatron_importance_pass` is what ``engines.backend`` hands the
driver. Megatron's data-parallel ranks issue no collective in OAR's model calls (tensor-parallel groups
see the same data; pipeline, context and expert parallelism are refused at start-up), so their call counts
may differ and the pass needs no lockstep."""

from __future__ import annotations

from contextlib import contextmanager


class MegatronImportancePass:
    """One importance pass's micro-batches on verl's Megatron engine (``engines.backend.ImportancePass``)."""

    def __init__(self, engine, forced_max_seqlen: int | None):
        self.engine = engine
        self.forced_max_seqlen = forced_max_seqlen
        """BSHD: the row length verl pads every micro-batch to; None for THD"""

    def _rows(self, micro_batch) -> None:
        if self.forced_max_seqlen is not None:  # as verl's Megatron forward_backward_batch pads BSHD rows
            from verl.utils import tensordict_utils as tu

            tu.assign_non_tensor(micro_batch, forced_max_seqlen=self.forced_max_seqlen)

    def gradient(self, micro_batch, cfg, step: int, with_log_probs: bool):
        from verl_oar.engines.megatron.gradient import megatron_gradient_micro_batch

        self._rows(micro_batch)
        return megatron_gradient_micro_batch(self.engine, micro_batch, cfg, step, with_log_probs)

    def perturbation(self, micro_batch, cfg, neutral_id: int, token_budget: int | None, rows_budget: int):
        from verl_oar.engines.megatron.perturbation import megatron_perturbation_micro_batch

        self._rows(micro_batch)
        return megatron_perturbation_micro_batch(self.engine, micro_batch, cfg, neutral_id, token_budget, rows_budget)


@contextmanager
def megatron_importance_pass(engine, data, cfg):
    """The pass's context (``engines.backend.importance_pass``); ``data`` is the rank's whole batch."""
    from verl_oar.engines.megatron.forward import bshd_forced_max_seqlen

    del cfg
    yield MegatronImportancePass(engine, bshd_forced_max_seqlen(engine, data))
