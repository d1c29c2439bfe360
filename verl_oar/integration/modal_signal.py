"""Signal provider ``acpo_surrogate``: ACPO's surrogate entropy H~ per response token, from verl's own
old-log-prob pass (no extra model pass).

verl extension points (checked against verl 0.9.1): the token-signal channel (``signals``) and the actor's
``compute_log_prob`` worker call, which the plugin's worker (``worker.OARWorkerMixin``) lets return one more
field when the batch is marked ``oar_acpo_modal`` (``engines.fsdp.modal``: the top-1 log-prob from the same
logits; verl's ``log_probs`` and ``entropy`` unchanged), or, with upstream PR logits-reducers, verl's own
logits reducer (``engines.fsdp.logits_reducer``, requested with ``batch.extra_info["logits_reducers"]``). Fields written, nested (bs, response_len) float32:

- ``acpo_surrogate``: H~_t, by ``algorithm.acpo.surrogate``: ``modal`` -log p_max,t (the pass's top-1
  log-prob), ``sampled`` -old_log_prob_t, ``shannon`` verl's entropy H_t;
- ``acpo_entropy``: verl's entropy H_t (the ``acpo/entropy_gap`` metric); 0 in rollout-correction bypass
  mode, where verl computes none (only ``sampled`` runs there).
"""

from __future__ import annotations

from verl_oar.core.acpo import ACPOConfig
from verl_oar.integration.signals import register_token_signal
from verl_oar.integration.validate import bypass_mode

ACPO_FIELDS = ("acpo_surrogate", "acpo_entropy")
MODAL_MARK = "oar_acpo_modal"
"""batch.extra_info mark for the old-log-prob pass (removed after it with the other ``oar_`` keys)"""


def validate_acpo(config) -> None:
    """Start-up: ACPO's keys, and a pass that can give the chosen surrogate."""
    cfg = ACPOConfig.from_algorithm(config.algorithm)
    strategy = config.actor_rollout_ref.actor.strategy
    if strategy not in ("fsdp", "fsdp2", "megatron"):
        raise ValueError(f"algorithm.adv_estimator=acpo reads verl's old-log-prob pass on the actor's engine; "
                         f"actor_rollout_ref.actor.strategy={strategy!r} is not one of fsdp, fsdp2, megatron.")
    if cfg.surrogate != "sampled" and bypass_mode(config):
        raise ValueError(f"algorithm.acpo.surrogate={cfg.surrogate} needs verl's old-log-prob pass, which "
                         "algorithm.rollout_correction.bypass_mode=true skips (old_log_probs = the rollout's, no "
                         "entropy). Set +algorithm.acpo.surrogate=sampled, or bypass_mode=false.")
    if cfg.surrogate == "modal":
        if strategy == "megatron":
            raise ValueError("algorithm.acpo.surrogate=modal (the top-1 log-prob inside verl's old-log-prob pass) is "
                             "built for the FSDP engine only; on Megatron set +algorithm.acpo.surrogate=sampled "
                             "(-old_log_prob, equal under modal alignment) or shannon (verl's entropy).")
        if config.actor_rollout_ref.model.get("use_fused_kernels", False):
            raise ValueError("algorithm.acpo.surrogate=modal reads the logits of verl's old-log-prob pass, which "
                             "actor_rollout_ref.model.use_fused_kernels=True never materialises. Set "
                             "use_fused_kernels=False, or +algorithm.acpo.surrogate=sampled.")


def prepare_acpo(trainer, batch) -> None:
    """Before the old-log-prob pass: ask it for the top-1 log-probs too (``surrogate=modal``): through verl's logits
    reducer when the run goes through the upstream series' hooks and verl has PR logits-reducers, else by the mark that the
    plugin's worker reads (``engines.fsdp.modal``)."""
    if ACPOConfig.from_algorithm(trainer.config.algorithm).surrogate != "modal":
        return
    from verl_oar.integration import upstream_hook

    if upstream_hook.uses_logits_reducers():
        from verl_oar.engines.fsdp.logits_reducer import MODAL_KEY, REQUEST_KEY

        batch.extra_info[REQUEST_KEY] = (MODAL_KEY,)  # removed after the pass (upstream_hook.after_old_log_prob)
    else:
        batch.extra_info[MODAL_MARK] = True


@register_token_signal("acpo_surrogate", fields=ACPO_FIELDS, validate=validate_acpo, prepare=prepare_acpo)
def compute_acpo_surrogate(trainer, batch, metrics: dict) -> None:
    """Read the pass's outputs from TransferQueue and write ``acpo_surrogate`` / ``acpo_entropy`` (module docstring)."""
    import torch
    import transfer_queue as tq
    from tensordict import TensorDict
    from verl.workers.utils.padding import response_from_nested

    from verl_oar.engines.fsdp.modal import MODAL_KEY
    from verl_oar.engines.inputs import nested

    cfg = ACPOConfig.from_algorithm(trainer.config.algorithm)
    bypass = bypass_mode(trainer.config)
    select = ["response_mask", "old_log_probs"] + ([] if bypass else ["entropy"]) + (
        [MODAL_KEY] if cfg.surrogate == "modal" else [])
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=select)
    old = data["old_log_probs"].unbind()
    entropy = list(data["entropy"].unbind()) if not bypass else [torch.zeros_like(x) for x in old]
    if cfg.surrogate == "modal":
        surrogate = [-x for x in response_from_nested(data[MODAL_KEY], data["response_mask"]).unbind()]
    elif cfg.surrogate == "sampled":
        surrogate = [-x for x in old]
    else:
        surrogate = list(entropy)
    fields = TensorDict({"acpo_surrogate": nested([x.float() for x in surrogate]),
                         "acpo_entropy": nested([x.float() for x in entropy])}, batch_size=len(batch))
    tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=fields)
