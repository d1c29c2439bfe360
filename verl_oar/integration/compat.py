"""What verl-oar assumes about verl, in one place: the version, every private verl name it uses, and
the verl functions whose behaviour its fused pass mirrors (each pinned by a test).

A new verl release is checked here first: :func:`check_verl_version` refuses an unsupported series at
plugin load, :func:`missing_private_names` lists what moved (``tests/unit/test_compat_on_cpu.py``
asserts it is empty for the installed verl), and each test in :data:`MIRRORED` fails when the verl
function it names changes its outputs, whatever the function is called. What verl should offer
instead of these names is the upstream series (``upstream/``, docs/upstream.md).
"""

from __future__ import annotations

import importlib

SUPPORTED_VERL = ("0.9.",)
"""verl release series verl-oar is written and tested for (prefixes of ``verl.__version__``)"""

PRIVATE_NAMES: dict[str, str] = {
    "verl.trainer.ppo.v1.trainer_base.TRAINER_REGISTRY":
        "trainer.install_trainer_hook replaces each entry by a dispatcher (verl offers register_trainer, "
        "which refuses to re-register a name)",
    "verl.trainer.main_ppo_v0.RayPPOTrainer":
        "trainer.install_legacy_guard rebinds this module-level name (what the legacy TaskRunner constructs) "
        "to a dispatcher that refuses token-level estimators at start-up",
    "verl.trainer.ppo.v1.trainer_sync.PPOTrainerSync._init_resource_pool_mgr":
        "OARTrainerSync swaps the actor worker class for one with OARWorkerMixin",
    "verl.trainer.ppo.v1.trainer_sync.PPOTrainerSync._compute_old_log_prob":
        "OARTrainerSync computes (or fuses) the token signals around the old-log-prob pass",
    "verl.trainer.ppo.v1.trainer_sync.PPOTrainerSync._compute_advantage":
        "OARTrainerSync reads the signals from TransferQueue and exposes them to the estimator",
    "verl.trainer.ppo.v1.trainer_base.PPOTrainer._init_dataloader":
        "CoDaSampling (codapo_sampling) doubles steps_per_epoch and the step total after verl computes them",
    "verl.trainer.ppo.v1.trainer_base.PPOTrainer._next_train_batch":
        "CoDaSampling returns the refocused batch instead of a dataloader fetch on a batch's second use",
    "verl.trainer.ppo.v1.trainer_base.PPOTrainer._save_checkpoint":
        "CoDaSampling saves its pending refocused batch beside verl's data.pt",
    "verl.trainer.ppo.v1.trainer_base.PPOTrainer._load_checkpoint":
        "CoDaSampling restores its pending refocused batch on resume",
    "verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead.prepare_model_outputs":
        "ACPO's modal surrogate (engines/fsdp/modal.py) wraps it on the engine instance for one compute_log_prob call",
    "verl.workers.engine.fsdp.transformer_impl.FSDPEngine._gather_and_unpad_packed":
        "ACPO's modal surrogate packs its output exactly as verl packs log_probs (engines/fsdp/modal.py)",
    "verl.workers.rollout.base._ROLLOUT_REGISTRY":
        "CPU mode only: registers the hf rollout (cpu/verl_patches.py)",
    "verl.workers.engine.fsdp.transformer_impl.CPUOffloadPolicy":
        "CPU mode only: offload without pinned memory (cpu/verl_patches.py)",
    "verl.utils.distributed.initialize_global_process_group_ray":
        "CPU mode only: a backend string torch accepts (cpu/verl_patches.py)",
    "verl.workers.engine.megatron.transformer_impl.MegatronEngineWithLMHead._lm_head_logits_processor":
        "Megatron only (needs megatron-core): verl's log-prob head, reused by the fused pass "
        "(engines/megatron/forward.py)",
}
"""every private (underscored or undocumented-to-mutate) verl name verl-oar touches -> why"""

NEEDS_MEGATRON = ("verl.workers.engine.megatron.",)
"""prefixes of names that only resolve where megatron-core is installed (GPU machines)"""

MIRRORED: dict[str, str] = {
    "verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead.forward_step":
        "tests/engine/test_engine_importance_on_cpu.py::"
        "test_fused_log_prob_pass_is_bit_identical_to_verls_and_to_the_separate_importance_pass",
    "verl.workers.engine_workers.TrainingWorker.infer_batch":
        "tests/engine/test_engine_importance_on_cpu.py::"
        "test_fused_log_prob_pass_is_bit_identical_to_verls_and_to_the_separate_importance_pass",
    "verl.workers.engine.megatron.transformer_impl.MegatronEngineWithLMHead.forward_step":
        "tests/gpu/test_megatron_importance.py (GPU only; never run)",
}
"""verl function -> the test that compares verl-oar's fused pass with it on the same inputs,
bit for bit (engines/driver.py mirrors infer_batch's micro-batching; engines/fsdp/gradient.py
mirrors forward_step's model call and post-processing)"""


class UnsupportedVerl(RuntimeError):
    """The installed verl is not one verl-oar supports."""


def check_verl_version() -> str:
    """``verl.__version__``; raises :class:`UnsupportedVerl` outside :data:`SUPPORTED_VERL`."""
    import verl

    version = getattr(verl, "__version__", "unknown")
    if not version.startswith(SUPPORTED_VERL):
        raise UnsupportedVerl(
            f"verl-oar supports verl {', '.join(v + 'x' for v in SUPPORTED_VERL)}; found verl {version}. "
            "Install verl==0.9.1 or a verl-oar release made for your verl."
        )
    return version


def resolve(dotted: str):
    """The object named ``dotted`` (module path, then attributes); raises AttributeError/ImportError."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"no module in {dotted!r}")


def missing_private_names(include_megatron: bool = False) -> list[str]:
    """The names of :data:`PRIVATE_NAMES` the installed verl lacks (Megatron's skipped unless asked)."""
    missing = []
    for name in PRIVATE_NAMES:
        if name.startswith(NEEDS_MEGATRON) and not include_megatron:
            continue
        try:
            resolve(name)
        except (ImportError, AttributeError):
            missing.append(name)
    return missing


def trainer_registry() -> dict:
    """verl's v1 trainer registry, checked to be what verl-oar expects (``sync`` is verl's
    ``PPOTrainerSync``, or verl-oar's dispatcher in front of it)."""
    from verl.trainer.ppo.v1 import trainer_base
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    registry = getattr(trainer_base, "TRAINER_REGISTRY", None)
    sync = registry.get("sync") if isinstance(registry, dict) else None
    if getattr(sync, "_verl_cls", sync) is not PPOTrainerSync:
        raise UnsupportedVerl(
            "verl's v1 trainer registry (verl.trainer.ppo.v1.trainer_base.TRAINER_REGISTRY['sync']) is not "
            "what verl-oar expects; this verl is not supported. Install verl==0.9.1."
        )
    for method in ("_init_resource_pool_mgr", "_compute_old_log_prob", "_compute_advantage"):
        if not callable(getattr(PPOTrainerSync, method, None)):
            raise UnsupportedVerl(
                f"verl's PPOTrainerSync has no {method}(), which verl-oar's trainer overrides; this verl is not "
                "supported. Install verl==0.9.1."
            )
    return registry
