"""OPPO's teacher oracle: a frozen forward-only model beside the actor, on verl's own engine.

verl 0.9.1 offers three candidates, and this module takes the third (reasons in docs/algo/oppo.md):
its distillation ``teacher_loop`` (inference servers on a GPU pool of their own, temperature fixed at 1,
the rollout's own prompt only, and it switches the actor's loss), its reference worker (always the
actor's checkpoint, exists only with a KL term, and would become the KL anchor), or a third
``TrainingWorker`` inside the actor worker, built the way verl builds the reference model
(``ActorRolloutRefWorker.init_model``): the teacher's checkpoint with the reference's engine settings
(``actor_rollout_ref.ref.*``: forward-only, FSDP2 parameter offload, log-prob micro-batching and
dynamic batch size), on every rank of the actor's mesh, registered as the dispatch mesh
``oar_teacher``, never updated, never checkpointed (rebuilt from its path on resume).

At start-up (driver): :func:`check_teacher` compares the teacher's tokenizer with the actor's and
:func:`attach_teacher` puts ``actor_rollout_ref.oar_teacher.path`` into the workers' config. In each
worker, :func:`build_teacher` (called by ``worker.OARWorkerMixin.init_model``) builds it.
"""

from __future__ import annotations

from typing import Any

CONFIG_NODE = "oar_teacher"
"""``actor_rollout_ref.<CONFIG_NODE>``: what the workers read (``{path}``); set by :func:`attach_teacher`"""
MESH = "oar_teacher"
"""the teacher's dispatch mesh name (the actor's ranks)"""


def check_teacher(config, teacher_path: str) -> int:
    """Refuse, with the fix, a teacher the actor's token ids cannot be scored by: a tokenizer with another
    vocabulary (token -> id, added tokens included), or a model whose embedding has fewer rows than the
    actor's ids; and strategies the teacher is not built for. Other special-token roles (an Instruct
    teacher's eos is ``<|im_end|>``, a base actor's ``<|endoftext|>``) do not matter: the teacher only scores
    given ids. Returns the teacher's context length (tokens)."""
    from transformers import AutoConfig, AutoTokenizer

    strategy = config.actor_rollout_ref.actor.strategy
    if strategy not in ("fsdp", "fsdp2"):
        raise ValueError(f"algorithm.oppo.oracle=teacher builds the teacher on verl's FSDP engine; "
                         f"actor_rollout_ref.actor.strategy={strategy!r} is not supported for it yet (Megatron's parallel "
                         "state is per process and the teacher would have to share the actor's layout). Use "
                         "actor_rollout_ref.actor.strategy=fsdp2, or algorithm.oppo.oracle=self.")
    if config.get("distillation", {}).get("enabled", False):
        raise ValueError("algorithm.oppo.oracle=teacher and distillation.enabled=true: verl's distillation replaces the "
                         "actor's loss with its own and loads its own teacher; run one of them (distillation.enabled=false, "
                         "or another algorithm.adv_estimator).")
    model = config.actor_rollout_ref.model
    remote = bool(model.get("trust_remote_code", False))
    actor_tokenizer_path = model.get("tokenizer_path", None) or model.path
    try:
        teacher_tok = AutoTokenizer.from_pretrained(teacher_path, trust_remote_code=remote)
        teacher_hf = AutoConfig.from_pretrained(teacher_path, trust_remote_code=remote)
    except (OSError, ValueError) as err:
        raise ValueError(f"algorithm.oppo.teacher.path={teacher_path}: cannot load its tokenizer and config ({err}). "
                         "Give a model directory or hub id that holds both.") from None
    actor_tok = AutoTokenizer.from_pretrained(actor_tokenizer_path, trust_remote_code=remote)
    if teacher_tok.get_vocab() != actor_tok.get_vocab():
        diff = len(set(teacher_tok.get_vocab().items()) ^ set(actor_tok.get_vocab().items()))
        raise ValueError(f"algorithm.oppo.teacher.path={teacher_path}: its tokenizer's vocabulary differs from the actor's "
                         f"({actor_tokenizer_path}; {diff} (token, id) pairs differ), so it cannot score the actor's token "
                         "ids. Use a teacher of the same model family (same tokenizer), or algorithm.oppo.oracle=self.")
    rows = getattr(teacher_hf, "vocab_size", None)
    if rows is not None and rows < len(actor_tok):
        raise ValueError(f"algorithm.oppo.teacher.path={teacher_path}: its embedding has {rows} rows but the actor's "
                         f"tokenizer has {len(actor_tok)} ids. Use a teacher whose vocab_size covers the tokenizer.")
    return int(getattr(teacher_hf, "max_position_embeddings", 0) or 0)


def attach_teacher(config, teacher_path: str) -> None:
    """Put the teacher where the workers read it: ``actor_rollout_ref.oar_teacher = {path}`` (called at
    start-up, before verl builds the workers from ``config.actor_rollout_ref``)."""
    from omegaconf import open_dict

    with open_dict(config.actor_rollout_ref):
        config.actor_rollout_ref[CONFIG_NODE] = {"path": teacher_path}


def build_teacher(worker) -> Any:
    """The teacher ``TrainingWorker`` of an actor worker whose config carries ``oar_teacher`` (else None):
    the actor's model settings with the teacher's path (no LoRA, no MTP, no fused kernels), the reference
    model's engine settings (forward-only), as ``ActorRolloutRefWorker.init_model`` builds the reference."""
    from copy import deepcopy

    from omegaconf import open_dict
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import ActorConfig, HFModelConfig, MtpConfig, TrainingWorkerConfig

    spec = worker.config.get(CONFIG_NODE, None)
    if not spec or "actor" not in worker.role:
        return None
    model_node = deepcopy(worker.config.model)
    with open_dict(model_node):
        model_node.path = spec["path"]
        for key in ("tokenizer_path", "hf_config_path", "local_path", "local_hf_config_path", "local_tokenizer_path"):
            if key in model_node:
                model_node[key] = None
        model_node.lora_rank = 0
        model_node.use_fused_kernels = False
    model_config: HFModelConfig = omega_conf_to_dataclass(model_node)
    model_config.mtp = MtpConfig(enable=False)

    ref_node = deepcopy(worker.config.ref)
    with open_dict(ref_node):  # the log-prob keys as the reference engine reads them (verl's init_model does this)
        ref_node.ppo_mini_batch_size = worker.config.actor.ppo_mini_batch_size
        if "log_prob_micro_batch_size_per_gpu" in ref_node or "ppo_micro_batch_size_per_gpu" not in ref_node:
            ref_node.ppo_micro_batch_size = ref_node.pop("log_prob_micro_batch_size", None)
            ref_node.ppo_micro_batch_size_per_gpu = ref_node.pop("log_prob_micro_batch_size_per_gpu", None)
            ref_node.use_dynamic_bsz = ref_node.pop("log_prob_use_dynamic_bsz", False)
            ref_node.ppo_max_token_len_per_gpu = ref_node.pop("log_prob_max_token_len_per_gpu", None)
    ref_config: ActorConfig = omega_conf_to_dataclass(ref_node)
    training = TrainingWorkerConfig(
        model_type="language_model", model_config=model_config, engine_config=ref_config.engine,
        optimizer_config=ref_config.optim, checkpoint_config=ref_config.checkpoint, profiler_config=None,
    )
    training.engine_config.use_dynamic_bsz = ref_node.use_dynamic_bsz
    training.engine_config.infer_max_token_len_per_gpu = ref_node.ppo_max_token_len_per_gpu
    training.engine_config.infer_micro_batch_size_per_gpu = ref_node.ppo_micro_batch_size_per_gpu
    training.engine_config.use_remove_padding = model_config.get("use_remove_padding", False)
    teacher = worker.ref_worker_cls(config=training)
    teacher.reset()
    return teacher
