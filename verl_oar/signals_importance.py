"""Signal provider ``token_importance``: OAR importance per response token, from the workers.

Runs in the trainer right after the old-log-prob step (or inside it, see ``fuse_into_log_prob``).
It asks the actor worker group (or the reference one, ``algorithm.oar.importance_model=ref``) to
score every response of the batch, by the method of the configured estimator
(:data:`IMPORTANCE_METHOD`: ``oar_g`` gradient, ``oar_p`` perturbation); the workers write three
nested (bs, response_len) fields into TransferQueue:

- ``oar_importance``: float32, importance I_t of reasoning tokens, 0 elsewhere;
- ``oar_reasoning_mask``: int64 0/1, tokens before the final-answer marker (reshaped tokens);
- ``oar_answer_mask``: int64 0/1, tokens of the final answer (all 0: no answer found).
"""

from __future__ import annotations

from verl_oar.config import OARConfig
from verl_oar.signals import register_token_signal

IMPORTANCE_FIELDS = ("oar_importance", "oar_reasoning_mask", "oar_answer_mask")
SUPPORTED_STRATEGIES = ("fsdp", "fsdp2")
IMPORTANCE_METHOD = {"oar_g": "gradient", "oar_p": "perturbation"}
"""estimator name -> how its importance is measured (``verl_oar.engine_importance.METHODS``)"""
PERTURBATION_COST_FIELDS = ("oar_perturb_copies", "oar_perturb_passes", "oar_perturb_peak_tokens")
"""(bs,) float32 per-sample cost written by OAR-P workers, read back for metrics"""


def importance_method(config) -> str:
    name = config.algorithm.adv_estimator
    return IMPORTANCE_METHOD[str(getattr(name, "value", name))]


def validate_importance_config(config) -> None:
    """Start-up checks: raise with the cause and the fix before any worker is built."""
    oar = OARConfig.from_algorithm(config.algorithm)
    actor = config.actor_rollout_ref.actor
    strategy = actor.strategy
    if strategy not in SUPPORTED_STRATEGIES:
        raise ValueError(
            f"OAR importance is implemented for the FSDP engines {SUPPORTED_STRATEGIES}, not "
            f"actor_rollout_ref.actor.strategy={strategy!r}. Set actor_rollout_ref.actor.strategy=fsdp2 "
            "(and ref.strategy=fsdp2), or use algorithm.adv_estimator=grpo."
        )
    sp = int(actor.get("ulysses_sequence_parallel_size", 1) or 1)
    if sp > 1:
        raise ValueError(
            f"OAR importance does not support Ulysses sequence parallelism yet "
            f"(actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp}); set it to 1."
        )
    if config.actor_rollout_ref.model.get("use_fused_kernels", False):
        raise ValueError(
            "OAR importance needs the model's logits; actor_rollout_ref.model.use_fused_kernels=True "
            "does not produce them. Set actor_rollout_ref.model.use_fused_kernels=False."
        )
    if oar.importance_model == "ref":
        from verl.trainer.ppo.utils import need_reference_policy

        if not need_reference_policy(config):
            raise ValueError(
                "algorithm.oar.importance_model=ref needs a reference model, and this run has none. "
                "Enable one (actor_rollout_ref.actor.use_kl_loss=True or algorithm.use_kl_in_reward=True) "
                "or use algorithm.oar.importance_model=actor."
            )


OAR_EXTRA_KEYS = ("oar_config", "oar_step", "oar_fused", "oar_method", "no_lora_adapter")
"""batch.extra_info keys this provider sets for one worker call and removes afterwards"""


def fuse_into_log_prob(trainer, batch) -> bool:
    """Mark the batch so that the actor's old-log-prob pass also computes importance.

    Only OAR-G: OAR-P scores each sample in passes of its own (``engine_perturbation``), so sharing
    the old-log-prob pass would save under one of its R+1 passes. Not when importance comes from the
    reference model, nor in rollout-correction bypass mode (verl then skips the old-log-prob pass),
    nor with ``algorithm.oar.fuse_log_prob=false``.
    The trainer removes the marks after the pass (``OAR_EXTRA_KEYS``).
    """
    oar = OARConfig.from_algorithm(trainer.config.algorithm)
    rollout_corr = trainer.config.algorithm.get("rollout_correction", None)
    bypass = bool(rollout_corr and rollout_corr.get("bypass_mode", False))
    if not oar.fuse_log_prob or oar.importance_model != "actor" or bypass:
        return False
    if importance_method(trainer.config) != "gradient":
        return False
    batch.extra_info.update({"oar_config": oar.to_dict(), "oar_step": int(trainer.global_steps), "oar_fused": True})
    return True


@register_token_signal(
    "token_importance", fields=IMPORTANCE_FIELDS, validate=validate_importance_config, fuse=fuse_into_log_prob
)
def compute_token_importance(trainer, batch, metrics: dict) -> None:
    """Fill ``IMPORTANCE_FIELDS`` for every sample of ``batch`` (a TransferQueue KVBatchMeta)."""
    oar = OARConfig.from_algorithm(trainer.config.algorithm)
    extra = {
        "oar_config": oar.to_dict(),
        "oar_step": int(trainer.global_steps),
        "oar_method": importance_method(trainer.config),
        "temperature": trainer.config.actor_rollout_ref.rollout.temperature,
        "calculate_entropy": False,
        "compute_loss": False,
    }
    use_ref = oar.importance_model == "ref"
    if use_ref and trainer.ref_in_actor:
        extra["no_lora_adapter"] = True
    batch.extra_info.update(extra)
    try:
        if use_ref and not trainer.ref_in_actor:
            output = trainer.ref_policy_wg.compute_ref_token_importance(batch)
        else:
            output = trainer.actor_rollout_wg.compute_token_importance(batch)
    finally:
        for key in OAR_EXTRA_KEYS:
            batch.extra_info.pop(key, None)
    if len(output) != len(batch):
        raise RuntimeError(f"compute_token_importance returned {len(output)} samples for a batch of {len(batch)}")
    if extra["oar_method"] == "perturbation":
        metrics.update(_perturbation_cost_metrics(batch))


def _perturbation_cost_metrics(batch) -> dict[str, float]:
    """``oar/perturb/*``: occluded copies per response and the cost in log-prob passes per response."""
    import transfer_queue as tq

    cost = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=list(PERTURBATION_COST_FIELDS))
    copies, passes = cost["oar_perturb_copies"].float(), cost["oar_perturb_passes"].float()
    return {
        "oar/perturb/copies_mean": float(copies.mean()),
        "oar/perturb/copies_max": float(copies.max()),
        "oar/perturb/cost_passes_mean": float(passes.mean()),
        "oar/perturb/peak_call_tokens": float(cost["oar_perturb_peak_tokens"].float().max()),
    }
