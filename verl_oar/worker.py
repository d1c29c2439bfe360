"""The actor/ref worker with OAR's extra capability: ``compute_token_importance``.

verl extension point: a subclass of ``verl.workers.engine_workers.ActorRolloutRefWorker`` whose
new methods are exposed to the trainer with verl's ``@register`` and the same n-d dispatch as
``compute_log_prob`` / ``compute_ref_log_prob`` (TransferQueue in, TransferQueue out). Nothing
else of the parent is overridden. Checked against verl 0.9.1.
"""

from __future__ import annotations

from tensordict import TensorDict
from verl.single_controller.base.decorator import make_nd_compute_dataproto_dispatch_fn, register
from verl.workers.engine_workers import ActorRolloutRefWorker

from verl_oar.engine_importance import token_importance_on_training_worker


class OARActorRolloutRefWorker(ActorRolloutRefWorker):
    """verl's actor/rollout/ref worker plus OAR token importance (OAR-G or OAR-P) on the same engines."""

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def compute_log_prob(self, data: TensorDict) -> TensorDict | None:
        """verl's old-log-prob pass; when the trainer marks the batch ``oar_fused``, the same pass
        also computes token importance (one clean forward shared, see engine_importance)."""
        from verl.utils import tensordict_utils as tu

        if not tu.get(data, key="oar_fused", default=False):
            return super().compute_log_prob(data)
        output = token_importance_on_training_worker(self.actor, data, with_log_probs=True)
        return output.cpu() if output is not None else None

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def compute_token_importance(self, data: TensorDict) -> TensorDict | None:
        """Importance under the actor (the policy that produced the rollout); see engine_importance."""
        output = token_importance_on_training_worker(self.actor, data)
        return output.cpu() if output is not None else None

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="ref"))
    def compute_ref_token_importance(self, data: TensorDict) -> TensorDict | None:
        """Importance under the reference model (``algorithm.oar.importance_model=ref``)."""
        output = token_importance_on_training_worker(self.ref, data)
        return output.cpu() if output is not None else None
