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

from verl_oar.core.config import OARConfig
from verl_oar.integration.fallback_guard import NoAnswerGuard
from verl_oar.integration.signals import register_token_signal
from verl_oar.integration.validate import validate_importance_config

IMPORTANCE_FIELDS = ("oar_importance", "oar_reasoning_mask", "oar_answer_mask")
IMPORTANCE_METHOD = {"oar_g": "gradient", "oar_p": "perturbation"}
"""estimator name -> how its importance is measured (``verl_oar.engines.driver.METHODS``)"""
PERTURBATION_COST_FIELDS = ("oar_perturb_copies", "oar_perturb_passes", "oar_perturb_peak_tokens")
"""(bs,) float32 per-sample cost written by OAR-P workers, read back for metrics"""
ANSWER_SPAN_KEY = "answer_span"
"""the reward function's extra key holding the graded answer's span (``verl_oar.rewards.math_reward``)"""
ANSWER_SPAN_FIELD = "oar_answer_span"
"""(bs, 3) int64 TransferQueue field: the reward's span (marker_start, start, end), -1 = none"""
ANSWER_SOURCES = {0: "none", 1: "locator", 2: "reward", 3: "reward_rejected"}
"""``oar_answer_source`` (bs,) int64 written by the workers: no answer; found by the locator; the
reward's span; the reward's span did not fit the response's text (the locator was used instead)"""


def importance_method(config) -> str:
    name = config.algorithm.adv_estimator
    return IMPORTANCE_METHOD[str(getattr(name, "value", name))]


OAR_EXTRA_KEYS = ("oar_config", "oar_step", "oar_fused", "oar_method", "no_lora_adapter")
"""batch.extra_info keys this provider sets for one worker call and removes afterwards"""


def fuse_into_log_prob(trainer, batch) -> bool:
    """Mark the batch so that the actor's old-log-prob pass also computes importance.

    Only OAR-G: OAR-P scores each sample in passes of its own (``engines.fsdp.perturbation``), so sharing
    the old-log-prob pass would save under one of its R+1 passes. Not when importance comes from the
    reference model, nor in rollout-correction bypass mode (verl then skips the old-log-prob pass),
    nor with Megatron router replay (verl's old-log-prob pass records the MoE routes there, which the
    fused pass does not), nor with ``algorithm.oar.fuse_log_prob=false``.
    The trainer removes the marks after the pass (``OAR_EXTRA_KEYS``).
    """
    oar = OARConfig.from_algorithm(trainer.config.algorithm)
    rollout_corr = trainer.config.algorithm.get("rollout_correction", None)
    bypass = bool(rollout_corr and rollout_corr.get("bypass_mode", False))
    if not oar.fuse_log_prob or oar.importance_model != "actor" or bypass or _router_replay(trainer.config):
        return False
    if importance_method(trainer.config) != "gradient":
        return False
    batch.extra_info.update({"oar_config": oar.to_dict(), "oar_step": int(trainer.global_steps), "oar_fused": True})
    return True


def _router_replay(config) -> bool:
    """Whether verl's Megatron engine replays MoE routes (``actor.megatron.router_replay.mode``)."""
    actor = config.actor_rollout_ref.actor
    if actor.strategy != "megatron":
        return False
    replay = (actor.get("megatron", None) or {}).get("router_replay", None) or {}
    return replay.get("mode", "disabled") != "disabled"


def attach_reward_answer_spans(trainer, batch) -> None:
    """Hand the workers the character span of the answer the reward graded, where the reward gave one.

    verl's agent loop stores each output's ``reward_extra_info`` (the reward function's extra keys) in
    its ``extra_fields``; a reward that returns ``answer_span`` (``"<marker_start>:<start>:<end>"``,
    e.g. ``verl_oar.rewards.math_reward``) says which characters of the response it graded. This writes
    ``ANSWER_SPAN_FIELD`` (bs, 3) int64 into TransferQueue: the parsed span, or -1 for outputs
    without one, for synthetic padding rows, and for every output of a session but its final one
    (the reward graded the final output's text). Nothing is written when no output has a span.
    """
    import torch
    import transfer_queue as tq
    from tensordict import TensorDict

    from verl_oar.core.answer_span import parse_answer_span
    from verl_oar.integration.signals import real_rows, session_final_rows

    if batch.fields is not None and "extra_fields" not in batch.fields:
        return
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["extra_fields"])
    extra = data["extra_fields"]
    extra = extra.tolist() if hasattr(extra, "tolist") else list(extra)
    real = real_rows(batch.tags)
    final = session_final_rows(batch.keys)
    spans = torch.full((len(batch), 3), -1, dtype=torch.long)
    for row, fields in enumerate(extra):
        if (real is not None and not bool(real[row])) or (final is not None and int(final[row]) != row):
            continue
        info = (fields or {}).get("reward_extra_info", None) if isinstance(fields, dict) else None
        value = (info or {}).get(ANSWER_SPAN_KEY, None)
        try:
            span = parse_answer_span(value)
        except ValueError as error:
            raise ValueError(
                f"the reward function returned {ANSWER_SPAN_KEY}={value!r}, which OAR cannot read: {error}. Return "
                "verl_oar.core.answer_span.format_answer_span(span) (or '' for no answer), or drop the key to let "
                "algorithm.oar.answer_locator find the answer."
            ) from None
        if span is not None:
            spans[row] = torch.tensor([span.marker_start, span.start, span.end])
    if not bool((spans[:, 0] >= 0).any()):
        return
    tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id,
                    fields=TensorDict({ANSWER_SPAN_FIELD: spans}, batch_size=len(batch)))
    if batch.fields is not None and ANSWER_SPAN_FIELD not in batch.fields:
        batch.fields = [*batch.fields, ANSWER_SPAN_FIELD]


def report_importance(trainer, batch) -> dict[str, float]:
    """Per-step metrics of the workers' pass: where each answer came from (``oar/answer/*``, over real
    rows) and, for OAR-P, its cost (``oar/perturb/*``)."""
    import torch
    import transfer_queue as tq

    from verl_oar.integration.signals import real_rows

    fields = ["oar_answer_source"]
    perturb = importance_method(trainer.config) == "perturbation"
    if perturb:
        fields += list(PERTURBATION_COST_FIELDS)
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
    real = real_rows(batch.tags)
    keep = torch.ones(len(batch), dtype=torch.bool) if real is None else real
    source = data["oar_answer_source"].reshape(-1)[keep]
    metrics = {f"oar/answer/frac_{name}": float((source == code).float().mean()) for code, name in ANSWER_SOURCES.items()}
    if perturb:
        copies, passes = data["oar_perturb_copies"].float()[keep], data["oar_perturb_passes"].float()[keep]
        metrics.update({
            "oar/perturb/copies_mean": float(copies.mean()),
            "oar/perturb/copies_max": float(copies.max()),
            "oar/perturb/cost_passes_mean": float(passes.mean()),
            "oar/perturb/peak_call_tokens": float(data["oar_perturb_peak_tokens"].float()[keep].max()),
        })
    return metrics


@register_token_signal(
    "token_importance", fields=IMPORTANCE_FIELDS, validate=validate_importance_config, fuse=fuse_into_log_prob,
    prepare=attach_reward_answer_spans, report=report_importance, guard=NoAnswerGuard.from_config,
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
