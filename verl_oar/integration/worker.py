"""The actor/ref worker with OAR's extra capability: ``compute_token_importance``.

verl extension point: methods added to ``verl.workers.engine_workers.ActorRolloutRefWorker`` and
exposed to the trainer with verl's ``@register`` and the same n-d dispatch as ``compute_log_prob`` /
``compute_ref_log_prob`` (TransferQueue in, TransferQueue out). They live in a mixin,
:class:`OARWorkerMixin`, so that a user's own subclass of verl's worker can carry them too
(``class MyWorker(OARWorkerMixin, MyActorRolloutRefWorker)``). The trainer swaps verl's own worker
for :class:`OARActorRolloutRefWorker` at start-up (:func:`with_oar_worker`) and refuses, at start-up,
any other actor worker class that lacks the mixin. ``compute_log_prob`` is overridden only to fuse
importance into it when the trainer asks (batch mark ``oar_fused``); otherwise it is the parent's.
Checked against verl 0.9.1.
"""

from __future__ import annotations

from tensordict import TensorDict
from verl.single_controller.base.decorator import Dispatch, make_nd_compute_dataproto_dispatch_fn, register
from verl.workers.engine_workers import ActorRolloutRefWorker

from verl_oar.engines.driver import token_importance_on_training_worker


class OARWorkerMixin:
    """OAR token importance (OAR-G or OAR-P) on the engines of an ``ActorRolloutRefWorker``, and OPPO's
    frozen teacher beside them (``integration.teacher``)."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        """verl's models, then OPPO's teacher when the trainer attached one (``actor_rollout_ref.oar_teacher``), then,
        on a GPU, the estimator's memory against the device (``memory_check``: stops a pass that cannot fit)."""
        super().init_model()
        from verl_oar.integration.memory_check import check_worker_memory
        from verl_oar.integration.teacher import MESH, build_teacher

        self.oar_teacher = build_teacher(self)
        if self.oar_teacher is not None:
            self.set_dispatch_collect(mesh_name=MESH, **self.oar_teacher.get_dispatch_collect())
        check_worker_memory(self)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="oar_teacher"))
    def compute_teacher_log_prob(self, data: TensorDict) -> TensorDict | None:
        """Log-probs under OPPO's frozen teacher (the same call as ``compute_log_prob``, on the teacher)."""
        output = self.oar_teacher.infer_batch(data)
        return output.cpu() if output is not None else None

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def compute_log_prob(self, data: TensorDict) -> TensorDict | None:
        """verl's old-log-prob pass; when the trainer marks the batch ``oar_fused``, the same pass
        also computes token importance (one clean forward shared, see engines.driver); marked
        ``oar_acpo_modal``, it also returns ACPO's top-1 log-probs (``engines.fsdp.modal``); with verl's
        ``logits_reducers`` request (upstream PR logits-reducers), verl's own pass does (``engines.fsdp.logits_reducer``)."""
        from verl.utils import tensordict_utils as tu

        if tu.get(data, key="oar_acpo_modal", default=False):  # ACPO: the same pass also returns log p_max
            from verl_oar.engines.fsdp.modal import GATHER, PREPARE, modal_log_probs
            from verl_oar.integration import compat

            engine = self.actor.engine
            gather = compat.private_attr(engine, GATHER) if hasattr(engine, GATHER.rsplit(".", 1)[1]) else None
            compat.record(PREPARE, "wrapped on the engine instance for one compute_log_prob call")
            with modal_log_probs(engine, gather):
                return super().compute_log_prob(data)
        if tu.get(data, key="logits_reducers", default=None):  # a verl with PR logits-reducers: ACPO's reducer, registered here
            from verl_oar.engines.fsdp import logits_reducer  # (the worker's process) before verl's pass looks it up

            logits_reducer.register()
        if not tu.get(data, key="oar_fused", default=False):
            return super().compute_log_prob(data)
        output = token_importance_on_training_worker(self.actor, data, with_log_probs=True)
        return output.cpu() if output is not None else None

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def compute_token_importance(self, data: TensorDict) -> TensorDict | None:
        """Importance under the actor (the policy that produced the rollout); see engines.driver."""
        output = token_importance_on_training_worker(self.actor, data)
        return output.cpu() if output is not None else None

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="ref"))
    def compute_ref_token_importance(self, data: TensorDict) -> TensorDict | None:
        """Importance under the reference model (``algorithm.oar.importance_model=ref``)."""
        output = token_importance_on_training_worker(self.ref, data)
        return output.cpu() if output is not None else None


class OARActorRolloutRefWorker(OARWorkerMixin, ActorRolloutRefWorker):
    """verl's actor/rollout/ref worker plus OAR token importance on the same engines."""


def with_oar_worker(role_worker_mapping: dict, estimator: str, ref_scores: bool = False) -> None:
    """Make the actor (and reference) workers of ``role_worker_mapping`` (role -> ``ray.remote`` class,
    verl's ``RayPPOTrainer.role_worker_mapping``) OAR-capable, in place, at start-up.

    verl's own ``ActorRolloutRefWorker`` becomes :class:`OARActorRolloutRefWorker`; a class that
    already has :class:`OARWorkerMixin` is kept; any other class for a role that scores importance
    (a user's subclass of verl's worker, or another worker) is refused with the fix, instead of
    failing at the first step with a missing ``compute_token_importance``. The reference role scores
    importance only with ``ref_scores`` (``algorithm.oar.importance_model=ref``).
    """
    scoring = {"Actor", "ActorRollout", "ActorRolloutRef"} | ({"RefPolicy"} if ref_scores else set())
    import ray

    for role, remote_cls in list(role_worker_mapping.items()):
        cls = getattr(remote_cls, "__ray_actor_class__", remote_cls)
        if cls is ActorRolloutRefWorker:
            role_worker_mapping[role] = ray.remote(OARActorRolloutRefWorker)
        elif isinstance(cls, type) and issubclass(cls, OARWorkerMixin):
            continue
        elif str(getattr(role, "name", role)) in scoring:
            raise ValueError(
                f"algorithm.adv_estimator={estimator} computes token importance on the actor (and reference) "
                f"workers, which verl-oar adds to verl's ActorRolloutRefWorker; this run's {getattr(role, 'name', role)} "
                f"worker is {cls.__module__}.{cls.__qualname__}, which has no such method. Add the methods to your "
                "class with the mixin: `from verl_oar.integration.worker import OARWorkerMixin` and "
                f"`class {cls.__name__}(OARWorkerMixin, <your base>)`, or use verl's ActorRolloutRefWorker, or "
                "algorithm.adv_estimator=grpo."
            )
