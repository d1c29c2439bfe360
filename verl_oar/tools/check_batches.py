"""What verl's v1 trainer and engine workers assume of the batch sizes and lengths at their first step, checked on
a composed config (``verl-oar check``), dynamic batch size or not.

verl's ``validate_config`` skips its batch-size checks under ``use_dynamic_bsz`` (every recipe sets it) and lets
``rollout.n=0`` pass, though verl 0.9.1's trainer sends ``ppo_mini_batch_size * rollout.n`` responses per
mini-batch (``trainer_base._update_actor``) and the engine worker splits that evenly over data-parallel ranks
(``engine_workers``: ``mini_batch_size % data_parallel_size == 0``). Each problem names the keys and the fix.
"""

from __future__ import annotations

__all__ = ["GROUP_ESTIMATORS", "batch_problems", "data_parallel_size"]

GROUP_ESTIMATORS = ("grpo", "rloo", "grpo_passk", "opo", "gpg", "grpo_vectorized", "oar_g", "oar_p", "cscr", "oppo",
                    "acpo", "codapo")
"""estimators whose baseline is the other responses of a prompt's group: one response per prompt learns nothing"""


def data_parallel_size(config) -> int:
    """World size (``trainer.n_gpus_per_node * trainer.nnodes``) over the model-parallel sizes of the actor."""
    trainer, actor = config.trainer, config.actor_rollout_ref.actor
    world = int(trainer.n_gpus_per_node) * int(trainer.nnodes)
    if str(actor.get("strategy", "fsdp")) == "megatron":
        mg = actor.get("megatron", None) or {}
        split = 1
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
            split *= int(mg.get(key, 1) or 1)
    else:
        split = int(actor.get("ulysses_sequence_parallel_size", 1) or 1)
    return max(1, world // max(1, split))


def batch_problems(config, model_config=None) -> list[str]:
    """Every batch-size and length problem of ``config`` (cause and fix each); ``model_config`` (a transformers
    config, or None when the model is not on this machine) for the context length."""
    problems: list[str] = []
    rollout, actor, data = config.actor_rollout_ref.rollout, config.actor_rollout_ref.actor, config.data
    n = int(rollout.n)
    estimator = str(getattr(config.algorithm.adv_estimator, "value", config.algorithm.adv_estimator))
    if n < 1:
        problems.append(f"actor_rollout_ref.rollout.n={n}: no response would be sampled per prompt (verl's trainer "
                        "sends ppo_mini_batch_size * rollout.n responses per mini-batch: none). Set rollout.n to the "
                        "group size, e.g. 8.")
    elif n == 1 and estimator in GROUP_ESTIMATORS:
        problems.append(f"actor_rollout_ref.rollout.n=1 with algorithm.adv_estimator={estimator}: its baseline is the "
                        "other responses of the prompt's group, so every advantage would be 0 and nothing would be "
                        "learned. Set rollout.n >= 2 (the recipes use 8).")
    train, mini = int(data.train_batch_size), int(actor.ppo_mini_batch_size)
    if mini < 1:
        problems.append(f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}: at least 1 prompt per mini-batch.")
    elif train < mini:
        problems.append(f"data.train_batch_size={train} < actor_rollout_ref.actor.ppo_mini_batch_size={mini}: a step "
                        "would not fill one mini-batch (verl checks this only without use_dynamic_bsz). Lower the "
                        "mini-batch or raise the train batch.")
    dp = data_parallel_size(config)
    if n >= 1 and mini >= 1:
        responses = mini * n
        if responses % dp:
            problems.append(f"a mini-batch of {responses} responses (ppo_mini_batch_size={mini} x rollout.n={n}) does "
                            f"not split over {dp} data-parallel ranks (verl's engine worker asserts mini_batch_size % "
                            "data_parallel_size == 0). Make ppo_mini_batch_size * rollout.n a multiple of "
                            f"{dp}.")
        elif not actor.get("use_dynamic_bsz", False):
            micro = actor.get("ppo_micro_batch_size_per_gpu", None)
            per_rank = responses // dp
            if micro is not None and int(micro) > 0 and per_rank % int(micro):
                problems.append(f"each rank's mini-batch of {per_rank} responses is not a multiple of "
                                f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={int(micro)}. Make it one, or "
                                "set actor_rollout_ref.actor.use_dynamic_bsz=true.")
    prompt, response = int(data.max_prompt_length), int(data.max_response_length)
    context = getattr(model_config, "max_position_embeddings", None) if model_config is not None else None
    if context is not None and prompt + response > int(context):
        problems.append(f"data.max_prompt_length + data.max_response_length = {prompt} + {response} = "
                        f"{prompt + response} tokens, more than the model's context ({int(context)}, "
                        "max_position_embeddings in its config.json). Shorten them to fit.")
    return problems
