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

from verl_oar.core.answer_locator import load_answer_locator
from verl_oar.core.config import OARConfig
from verl_oar.integration.fallback_guard import NoAnswerGuard
from verl_oar.integration.signals import register_token_signal

IMPORTANCE_FIELDS = ("oar_importance", "oar_reasoning_mask", "oar_answer_mask")
SUPPORTED_STRATEGIES = ("fsdp", "fsdp2", "megatron")
MEGATRON_SUPPORTED = (
    "tensor_model_parallel_size (with or without sequence_parallel), data parallelism, MoE models with "
    "expert_model_parallel_size=1, use_remove_padding on or off, pipeline_model_parallel_size=1, "
    "context_parallel_size=1"
)
"""what OAR importance supports on verl's Megatron engine, named in every refusal"""
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


def validate_importance_config(config) -> None:
    """Start-up checks: raise with the cause and the fix before any worker is built."""
    oar = OARConfig.from_algorithm(config.algorithm)
    load_answer_locator(oar.answer_locator)  # a ValueError naming the problem and the fix, before any worker
    _validate_engine(config, "actor")
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
        if config.actor_rollout_ref.get("ref", None) is not None and "strategy" in config.actor_rollout_ref.ref:
            _validate_engine(config, "ref")


def _validate_engine(config, role: str) -> None:
    """The engine of ``actor_rollout_ref.{role}`` (the model that scores importance) is one OAR supports."""
    node = config.actor_rollout_ref[role]
    prefix = f"actor_rollout_ref.{role}"
    strategy = node.strategy
    if strategy not in SUPPORTED_STRATEGIES:
        raise ValueError(
            f"OAR importance is implemented for verl's FSDP and Megatron engines {SUPPORTED_STRATEGIES}, not "
            f"{prefix}.strategy={strategy!r}. Set actor_rollout_ref.actor.strategy=fsdp2 (and ref.strategy=fsdp2), "
            "or select verl's Megatron config (model_engine=megatron), or use algorithm.adv_estimator=grpo."
        )
    if strategy == "megatron":
        _validate_megatron(config, node, prefix)
        return
    sp = int(node.get("ulysses_sequence_parallel_size", 1) or 1)
    if sp > 1:
        raise ValueError(
            f"OAR importance does not support Ulysses sequence parallelism yet "
            f"({prefix}.ulysses_sequence_parallel_size={sp}); set it to 1."
        )
    trainer = config.get("trainer", {}) or {}
    dp = int(trainer.get("n_gpus_per_node", 1) or 1) * int(trainer.get("nnodes", 1) or 1) // sp
    if strategy == "fsdp" and dp > 1:
        # OAR makes a data-dependent number of model calls per rank; FSDP2 runs them on parameters
        # gathered once (engines.fsdp.unshard), FSDP1 cannot (no forward inside summon_full_params),
        # so its per-forward all-gathers would mismatch across ranks and hang.
        raise ValueError(
            f"OAR importance on FSDP1 ({prefix}.strategy=fsdp) needs one data-parallel rank, but this run has "
            f"{dp} (trainer.n_gpus_per_node x trainer.nnodes): ranks would make different numbers of model "
            "calls and FSDP1's all-gathers would hang. Set actor_rollout_ref.actor.strategy=fsdp2 "
            "(and actor_rollout_ref.ref.strategy=fsdp2)."
        )


def _validate_megatron(config, node, prefix: str) -> None:
    """Megatron: one pipeline stage (embeddings and logits on the same rank), no context parallelism."""
    megatron = node.get("megatron", None)
    if megatron is None:
        raise ValueError(
            f"{prefix}.strategy=megatron, but {prefix} has no 'megatron' settings: verl's FSDP config was "
            "composed. Select verl's Megatron config with the override model_engine=megatron (instead of "
            "setting strategy=megatron), or set actor_rollout_ref.actor.strategy=fsdp2."
        )

    def size(key: str) -> int:
        value = megatron.get(key, 1)
        return 1 if value is None else int(value)

    why = {
        "pipeline_model_parallel_size": "the input embeddings live on the first pipeline stage and the logits "
        "on the last, while OAR calls the model on one rank, outside Megatron's pipeline schedule (OAR-G "
        "differentiates the outcome w.r.t. the embeddings)",
        "virtual_pipeline_model_parallel_size": "it splits the model into pipeline chunks (see "
        "pipeline_model_parallel_size)",
        "context_parallel_size": "context parallelism splits every sequence over ranks in a zigzag "
        "layout that OAR's token layout does not follow",
        "expert_model_parallel_size": "every MoE layer then exchanges tokens (all-to-all) over the expert-parallel "
        "group, which spans data-parallel ranks, while OAR makes a data-dependent number of model calls per rank "
        "(answers found, OAR-P copies): a rank waiting in an all-to-all its peers never enter hangs under NCCL",
    }
    for key, reason in why.items():
        if size(key) > 1:
            raise ValueError(
                f"OAR importance on verl's Megatron engine does not support {prefix}.megatron.{key}={size(key)}: "
                f"{reason}. Set {prefix}.megatron.{key}={'null' if key.startswith('virtual') else 1}; shard the model "
                f"with tensor_model_parallel_size and sequence_parallel instead (for a MoE model too: its experts "
                f"are then tensor-parallel). Supported on Megatron: "
                f"{MEGATRON_SUPPORTED}. Or use actor_rollout_ref.actor.strategy=fsdp2, or algorithm.adv_estimator=grpo."
            )
    etp = megatron.get("expert_tensor_parallel_size", None)
    if etp is not None and int(etp) not in (1, size("tensor_model_parallel_size")):
        raise ValueError(
            f"OAR importance on verl's Megatron engine does not support {prefix}.megatron.expert_tensor_parallel_size="
            f"{etp} (different from tensor_model_parallel_size={size('tensor_model_parallel_size')}): the experts' "
            "tensor-parallel group then spans data-parallel ranks, whose numbers of model calls differ under OAR, "
            f"so their collectives would hang. Set it to null (= tensor_model_parallel_size). Supported on Megatron: "
            f"{MEGATRON_SUPPORTED}."
        )
    if megatron.get("dynamic_context_parallel", False):
        raise ValueError(
            f"OAR importance on verl's Megatron engine does not support {prefix}.megatron.dynamic_context_parallel=True "
            f"(it re-packs sequences over ranks). Set it to False. Supported on Megatron: {MEGATRON_SUPPORTED}."
        )
    if megatron.get("use_megatron_fsdp", False):
        raise ValueError(
            f"OAR importance on verl's Megatron engine does not support {prefix}.megatron.use_megatron_fsdp=True: "
            "its forward gathers parameters over the data-parallel ranks, which then must run the same number "
            "of model calls, and OAR's calls depend on each rank's samples (answers found, OAR-P copies). Set it "
            f"to False (verl's default). Supported on Megatron: {MEGATRON_SUPPORTED}."
        )
    optim = node.get("optim", None) or {}
    for where, overrides in (("optim.override_optimizer_config", optim.get("override_optimizer_config", None)),
                             ("megatron.override_ddp_config", megatron.get("override_ddp_config", None))):
        if overrides and overrides.get("overlap_param_gather", False):
            raise ValueError(
                f"OAR importance on verl's Megatron engine does not support {prefix}.{where}.overlap_param_gather=True: "
                "the distributed optimizer then gathers parameters over the data-parallel ranks inside forward "
                "hooks, so those ranks must run the same number of model calls, and OAR's calls depend on each "
                f"rank's samples. Remove it (verl's default is off). Supported on Megatron: {MEGATRON_SUPPORTED}."
            )
    mtp = config.actor_rollout_ref.model.get("mtp", None)
    if mtp is not None and mtp.get("enable", False):
        raise ValueError(
            "OAR importance on verl's Megatron engine is not checked with multi-token prediction "
            "(actor_rollout_ref.model.mtp.enable=True, which patches the model's output stage). Set "
            "actor_rollout_ref.model.mtp.enable=False, or use algorithm.adv_estimator=grpo."
        )


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
