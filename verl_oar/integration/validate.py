"""Every start-up refusal of a token-level estimator, in one place: what the configuration must
satisfy before any worker is built, each error naming the cause and the fix.

Called by the trainer (``trainer.check_token_signals_supported`` runs at trainer construction) and
by each signal provider's ``validate`` (e.g. OPPO's reward range, ``validate_success_probability_reward``). Pure config checks: reads verl's composed Hydra config, never
touches a worker. (``core.config.OARConfig.from_algorithm`` refuses unknown or out-of-range
``algorithm.oar.*`` keys; the worker class is checked in ``worker.with_oar_worker``, where verl's
role-worker mapping is known.)
"""

from __future__ import annotations

from verl_oar.core.answer_locator import load_answer_locator
from verl_oar.core.config import OARConfig

LEGACY = "legacy"
"""trainer mode name used here for verl's deprecated ``RayPPOTrainer`` (``trainer.use_v1=false``)"""
SUPPORTED_STRATEGIES = ("fsdp", "fsdp2", "megatron")
MEGATRON_SUPPORTED = (
    "tensor_model_parallel_size (with or without sequence_parallel), data parallelism, MoE models with "
    "expert_model_parallel_size=1, use_remove_padding on or off, pipeline_model_parallel_size=1, "
    "context_parallel_size=1"
)
"""what OAR importance supports on verl's Megatron engine, named in every refusal"""

def estimator_name(config) -> str:
    est = config.algorithm.adv_estimator
    return str(getattr(est, "value", est))


def check_token_signals_supported(config, trainer_mode: str) -> tuple:
    """Start-up checks for an estimator that needs token signals; returns its providers.

    Raises ValueError naming the cause and the fix (unsupported trainer mode, bad
    ``algorithm.oar`` keys, unsupported engine settings).
    """
    from verl_oar.integration.signals import needed_signals

    providers = needed_signals(config.algorithm.adv_estimator, config.algorithm)
    name = estimator_name(config)
    validate_codapo(config, token_level=bool(providers))
    if (providers or name == "codapo") and config.algorithm.get("use_pf_ppo", False):
        raise ValueError(
            f"algorithm.use_pf_ppo=true cannot be combined with algorithm.adv_estimator={name}: verl 0.9.1 applies "
            "pf-ppo's resampling only to GAE's advantages (ray_trainer.compute_advantage) and otherwise ignores it, "
            "and where it resamples rows after the advantage its v1 trainer writes the advantages back by the "
            "original keys, pairing each response with another's credit (verl issue #7956). Set "
            "algorithm.use_pf_ppo=false.")
    if not providers:
        return ()
    if trainer_mode == LEGACY:
        raise ValueError(
            f"algorithm.adv_estimator={name} needs per-token signals, which verl-oar computes in verl's "
            "v1 trainer only, not in the deprecated legacy trainer (trainer.use_v1=false). "
            "Set trainer.use_v1=true (verl's default)."
        )
    if trainer_mode != "sync":
        raise ValueError(
            f"algorithm.adv_estimator={name} needs per-token signals, which verl-oar computes in verl's "
            f"synchronous v1 trainer only, not trainer.v1.trainer_mode={trainer_mode!r}. "
            "Set trainer.v1.trainer_mode=sync."
        )
    for provider in providers:
        if provider.validate is not None:
            provider.validate(config)
    return providers


def validate_codapo(config, token_level: bool) -> None:
    """``algorithm.codapo.*``: valid keys, and a combination that takes effect: ``adv_estimator=codapo``
    (without ``compose``), or ``compose=true`` beside another of verl-oar's token estimators. CoDaSampling beside
    DAPO's group filter is supported (``codapo_sampling``: refills of evicted groups join the refocus pool)."""
    from verl_oar.core.codapo import CoDaPOConfig

    name = estimator_name(config)
    node = config.algorithm.get("codapo", None)
    if name != "codapo" and not node:
        return
    cfg = CoDaPOConfig.from_algorithm(config.algorithm)
    if name == "codapo" and cfg.compose:
        raise ValueError("algorithm.codapo.compose=true multiplies CoDaPO's question value into another token estimator's "
                         "advantages; algorithm.adv_estimator=codapo already applies it to GRPO's. Drop compose, or set "
                         "algorithm.adv_estimator=oar_g (oar_p, cscr, oppo, acpo).")
    if name != "codapo" and not cfg.compose:
        raise ValueError(f"algorithm.codapo.* is set but algorithm.adv_estimator={name} does not read it. Set "
                         "+algorithm.codapo.compose=true to compose CoDaPO with it, or algorithm.adv_estimator=codapo.")
    if name != "codapo" and not token_level:
        raise ValueError(f"algorithm.codapo.compose=true composes CoDaPO with one of verl-oar's token estimators (oar_g, "
                         f"oar_p, cscr, oppo, acpo); algorithm.adv_estimator={name} is not one of them. For CoDaPO on "
                         "GRPO's credit use algorithm.adv_estimator=codapo.")
    filter_groups = config.algorithm.get("filter_groups", None) or {}
    dapo = bool(filter_groups.get("enable", False))  # verl then draws prompts one at a time (gen_batch_size=1)
    if cfg.sampling and not dapo and config.data.get("gen_batch_size", None) not in (None, config.data.train_batch_size):
        raise ValueError("CoDaSampling rebuilds a whole train batch from the previous one; data.gen_batch_size="
                         f"{config.data.gen_batch_size} differs from data.train_batch_size={config.data.train_batch_size}. "
                         "Leave data.gen_batch_size unset, or set +algorithm.codapo.sampling=false.")


def bypass_mode(config) -> bool:
    """verl's rollout-correction bypass mode (``algorithm.rollout_correction.bypass_mode=true``): verl skips its
    old-log-prob pass and sets ``old_log_probs`` to the rollout engine's log-probs."""
    corr = config.algorithm.get("rollout_correction", None)
    return bool(corr and corr.get("bypass_mode", False))


def validate_success_probability_reward(config, name: str) -> None:
    """Start-up refusals for an estimator that reads each response's reward as a success probability in [0, 1]
    (OPPO): a reward that verl's config already says is not one. What the config cannot tell (a custom reward
    function, a data source scored -1/1 such as verl's ``math_dapo``) is checked on every batch
    (``core.oppo.oppo_advantages``)."""
    if config.algorithm.get("use_kl_in_reward", False):
        raise ValueError(
            f"algorithm.adv_estimator={name} reads each response's reward as its success probability in [0, 1]; "
            "algorithm.use_kl_in_reward=true subtracts the KL penalty from every token's reward (verl's "
            "apply_kl_penalty), so no reward is 0 or 1 and the run would stop at its first batch. Keep the KL term "
            "in the loss instead: algorithm.use_kl_in_reward=false actor_rollout_ref.actor.use_kl_loss=true."
        )
    reward = config.get("reward", None) or {}
    model = reward.get("reward_model", None) or {}
    function = reward.get("custom_reward_function", None) or {}
    if model.get("enable", False) and not function.get("path", None):
        raise ValueError(
            f"algorithm.adv_estimator={name} reads each response's reward as its success probability in [0, 1]; "
            "reward.reward_model.enable=true without a custom reward function scores responses with the reward "
            "model's raw output (verl's reward loop: a discriminative model's logit, unbounded). Use a verifier "
            "(reward.reward_model.enable=false, verl's rule-based scoring or reward.custom_reward_function.path), or "
            "a custom reward function that maps the reward model's score into [0, 1]."
        )
    manager = (reward.get("reward_manager", None) or {}).get("name", None)
    overlong = ((reward.get("reward_kwargs", None) or {}).get("overlong_buffer_cfg", None) or {})
    if manager == "dapo" and overlong.get("enable", False):
        raise ValueError(
            f"algorithm.adv_estimator={name} reads each response's reward as its success probability in [0, 1]; "
            "verl's dapo reward manager with reward.reward_kwargs.overlong_buffer_cfg.enable=true adds a negative "
            "length penalty to it. Set reward.reward_kwargs.overlong_buffer_cfg.enable=false (or "
            "reward.reward_manager.name=naive)."
        )


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
        # verl's engine slices each packed sequence over the SP group (prepare_model_inputs, keyed on
        # engine.use_ulysses_sp; its all-to-all attention is patched into flash-attention only). OAR-P scores whole
        # sequences with KV caches and OAR-G lays its masks over the whole sequence, so the pass would need SP
        # switched off in verl's engine state, each SP rank scoring micro-batches of sp x its token budget (verl
        # multiplies max_token_len_per_gpu by sp) -- the memory SP exists to split -- and fused log-probs would no
        # longer be verl's SP forward; none of it runs on a CPU.
        raise ValueError(
            f"OAR importance does not support Ulysses sequence parallelism ({prefix}.ulysses_sequence_parallel_size="
            f"{sp}): verl's engine splits every sequence over the sequence-parallel group, while OAR-P scores whole "
            "sequences (each occluded copy continues its prefix's KV cache) and OAR-G lays its answer and noise masks "
            "over the whole sequence. Set it to 1 (shard a large model over more GPUs with FSDP2 instead: the "
            "importance pass keeps its parameters sharded), or use algorithm.adv_estimator=grpo."
        )
    trainer = config.get("trainer", {}) or {}
    dp = int(trainer.get("n_gpus_per_node", 1) or 1) * int(trainer.get("nnodes", 1) or 1) // sp
    if strategy == "fsdp" and dp > 1:
        # Every FSDP1 model call all-gathers its units; the pass keeps the ranks' calls equal (engines.fsdp.lockstep)
        # as on FSDP2, but verl's FSDP1 engine cannot be built on a CPU (sync_module_states refuses CPU parameters),
        # so this path has never run: refused until it is tested on several GPUs.
        raise ValueError(
            f"OAR importance on FSDP1 ({prefix}.strategy=fsdp) needs one data-parallel rank, but this run has "
            f"{dp} (trainer.n_gpus_per_node x trainer.nnodes): with several ranks every model call all-gathers "
            "FSDP1's units, a path OAR has tested on FSDP2 only. Set actor_rollout_ref.actor.strategy=fsdp2 "
            "(and actor_rollout_ref.ref.strategy=fsdp2): its importance passes keep the parameters sharded."
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
