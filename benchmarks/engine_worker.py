"""verl's FSDP2 engine worker as the trainer builds it (the plugin's ``OARActorRolloutRefWorker``), and the rows a
worker call takes, for the benchmarks that time passes through it (``privileged_cost``, ``modal_cost``,
``sharded_importance``, ``real_model_cost``): one place for the engine settings they compare under.

Not a benchmark itself; the scripts import it from their own folder (``sys.path``), as ``modal_cost`` imports
``privileged_cost``.
"""

from __future__ import annotations

import os
from pathlib import Path

FP32 = "{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}"
"""FSDP2's mixed-precision setting: every dtype fp32"""


def build_worker(model_dir: Path, rows: int, max_len: int, teacher_dir: Path | None = None,
                 dynamic_bsz: bool = False):
    """verl's engine worker (the plugin's subclass, as the trainer runs it) on ``model_dir``: FSDP2, fp32, sdpa
    attention, the hf rollout, the CPU platform, ``rows`` sequences per mini-batch; the caller sets up the rank
    (``RANK``, ``WORLD_SIZE``, ``MASTER_PORT``, ... in the environment).

    ``dynamic_bsz``: False, one sequence per micro-batch (``privileged_cost``'s docstring says why);
    True, verl's dynamic batch size with ``max_len`` tokens per micro-batch (as a GPU recipe's budget packs
    sequences). ``max_len`` is also the actor's ``ppo_max_token_len_per_gpu`` either way. With
    ``teacher_dir``, OPPO's frozen teacher beside the actor (``integration.teacher``), with the reference model's
    engine settings: one sequence per micro-batch, fp32."""
    import verl
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from verl_oar.integration.worker import OARActorRolloutRefWorker

    if dynamic_bsz:
        batching = ["actor_rollout_ref.actor.use_dynamic_bsz=True",
                    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True"]
    else:
        batching = ["actor_rollout_ref.actor.use_dynamic_bsz=False",
                    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=False",
                    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1"]
    teacher = [] if teacher_dir is None else [
        f"+actor_rollout_ref.oar_teacher.path={teacher_dir}", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
        f"+actor_rollout_ref.ref.fsdp_config.mixed_precision={FP32}",
    ]
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"),
                               version_base=None):
        config = compose(config_name="ppo_trainer", overrides=[
            f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.model.use_remove_padding=True",
            "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
            "actor_rollout_ref.actor.strategy=fsdp2", f"+actor_rollout_ref.actor.fsdp_config.mixed_precision={FP32}",
            "actor_rollout_ref.actor.use_torch_compile=False", "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={rows}",
            f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={max_len}",
            f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={max_len}",
            "actor_rollout_ref.rollout.name=hf", "trainer.device=cpu", "trainer.n_gpus_per_node=1",
            *batching, *teacher,
        ])
    worker = OARActorRolloutRefWorker(config=config.actor_rollout_ref, role="actor")
    worker.init_model()
    return worker


def text_rows(tokenizer, prompts: list[str], responses: list[str], oar: dict | None = None,
              method: str | None = None, fused: bool = False):
    """verl's rows (a TensorDict of jagged nested tensors, one row per prompt) for one worker call: each prompt
    and response encoded by ``tokenizer``, EOS after the response, every response token in ``response_mask``,
    temperature 1; marked for the call:

    - ``oar`` None: verl's old-log-prob pass (``compute_log_prob``, with entropy);
    - ``oar`` (``algorithm.oar`` keys; those left out take their defaults) and ``method`` ("gradient" or
      "perturbation"): the plugin's importance pass (``compute_token_importance``);
    - also ``fused`` (with ``method="gradient"``): the old-log-prob pass that returns OAR-G's importance from the
      same pass (the trainer's ``oar_fused`` mark, ``compute_log_prob``)."""
    import torch
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    p = [torch.tensor(tokenizer.encode(x), dtype=torch.long) for x in prompts]
    r = [torch.tensor(tokenizer.encode(x) + [tokenizer.eos_token_id], dtype=torch.long) for x in responses]
    ids = [torch.cat([a, b]) for a, b in zip(p, r)]
    nested = lambda rows: torch.nested.as_nested_tensor(rows, layout=torch.jagged)  # noqa: E731
    data = TensorDict({
        "prompts": nested(p), "responses": nested(r), "response_mask": nested([torch.ones_like(x) for x in r]),
        "loss_mask": nested([torch.ones_like(x) for x in r]), "input_ids": nested(ids),
        "position_ids": nested([torch.arange(len(x)) for x in ids]),
        "attention_mask": nested([torch.ones_like(x) for x in ids]),
    }, batch_size=[len(p)])
    tu.assign_non_tensor(data, temperature=1.0)
    if oar is None or fused:
        tu.assign_non_tensor(data, calculate_entropy=True, compute_loss=False)
    if oar is not None:
        tu.assign_non_tensor(data, oar_config=oar, oar_step=1, oar_method=method)
    if fused:
        tu.assign_non_tensor(data, oar_fused=True)
    return data
