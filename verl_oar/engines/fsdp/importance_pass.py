"""The importance pass on verl's FSDP / FSDP2 engine: what ``engines.backend`` hands the driver.

With several ranks on FSDP2 the parameters stay sharded (default): every model call gathers as in verl's
own forward, the ranks' calls kept equal by ``engines.fsdp.lockstep`` (OAR-P: a flag before each call and
padding forwards at the end; OAR-G: the same forwards and backward on a micro-batch with nothing to score
when another rank has something) and the root group kept unsharded for the pass
(``engines.fsdp.unshard.root_unsharded_for_importance``). With ``algorithm.oar.gather_params=True`` the
whole model is gathered once instead and calls may differ. On one rank nothing needs to match. FSDP1
(``strategy=fsdp``) gathers per wrapped unit in every call too: its calls are kept equal the same way (it has
no root to keep unsharded: FSDP1 does not free a ``FULL_SHARD`` root after forward), though OAR refuses FSDP1
with several data-parallel ranks at start-up (verl's FSDP1 engine cannot be built on a CPU, so this path is
untested).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from tensordict import TensorDict

from verl_oar.core.config import OARConfig
from verl_oar.core.perturbation import PerturbationCost
from verl_oar.engines.fsdp.gradient import gradient_micro_batch
from verl_oar.engines.fsdp.lockstep import Lockstep, padding_forward, shard_group
from verl_oar.engines.fsdp.perturbation import perturbation_micro_batch
from verl_oar.engines.fsdp.unshard import fsdp2_modules, root_unsharded_for_importance, unsharded_for_importance
from verl_oar.engines.rank_errors import RankErrors


class FSDPImportancePass:
    """One importance pass's micro-batches on an FSDP engine (``engines.backend.ImportancePass``)."""

    def __init__(self, engine, lockstep: Lockstep | None, errors: RankErrors):
        self.engine = engine
        self.lockstep = lockstep
        """None when the ranks' model calls need not match (one rank, gathered parameters, FSDP1)"""
        self.errors = errors
        """the checks of the rank's rows deferred to the pass's end (``engines.rank_errors``)"""

    def gradient(self, micro_batch: TensorDict, cfg: OARConfig, step: int,
                 with_log_probs: bool) -> tuple[torch.Tensor, dict | None]:
        return gradient_micro_batch(self.engine, micro_batch, cfg, step, with_log_probs, peers=self.lockstep,
                                    errors=self.errors)

    def perturbation(self, micro_batch: TensorDict, cfg: OARConfig, neutral_id: int, token_budget: int | None,
                     rows_budget: int) -> tuple[torch.Tensor, list[PerturbationCost]]:
        return perturbation_micro_batch(self.engine, micro_batch, cfg, neutral_id, token_budget, rows_budget,
                                        peers=self.lockstep)


def _several_ranks() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@contextmanager
def fsdp_importance_pass(engine, data: TensorDict, cfg: OARConfig):
    """The pass's context on every rank (inside ``engine.eval_mode()``), yielding :class:`FSDPImportancePass`;
    on a normal exit a rank whose model calls are done pads until no rank calls, then, parameters resharded, a
    check deferred on any rank raises on every rank (``engines.rank_errors``)."""
    del data  # nothing of the batch shapes an FSDP pass
    errors = RankErrors()
    if cfg.gather_params and fsdp2_modules(engine.module):
        with unsharded_for_importance(engine):
            yield FSDPImportancePass(engine, None, errors)
    else:
        from verl.utils.device import get_device_id

        lockstep = Lockstep(get_device_id(), shard_group(engine)) if _several_ranks() else None
        with root_unsharded_for_importance(engine):
            yield FSDPImportancePass(engine, lockstep, errors)
            if lockstep is not None:
                lockstep.finish(padding_forward(engine))
    errors.agree()
