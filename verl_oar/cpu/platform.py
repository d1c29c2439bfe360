"""The verl platform "cpu": run verl's trainer on CPU cores (extension point: ``verl.plugin.platform``).

Checked against verl 0.9.1. verl resolves its platform once per process from ``VERL_PLATFORM`` (or
by probing); this module registers a ``PlatformBase`` subclass under the name "cpu" whose device is
``"cpu"``, whose collective backend is gloo and whose memory, stream and synchronize calls are no-ops.
``register_cpu_platform()`` also

- registers verl's FSDP engines (``FSDPEngineWithLMHead``, ``FSDPEngineWithValueHead``), which verl
  registers for devices cuda and npu only, for device "cpu" in ``EngineRegistry``;
- registers the "hf" rollout replica (``verl_oar.cpu.hf_rollout``) in ``RolloutReplicaRegistry``;
- applies the patches in ``verl_oar.cpu.verl_patches`` (backend string, worker-side rollout table).

Ray sees no GPU on a CPU machine, and verl sizes its resource pools in GPUs, so a CPU run starts Ray
with a pretend GPU count (``+ray_kwargs.ray_init.num_gpus=1``): the platform's Ray resource stays
"GPU"; nothing ever runs on a GPU.

Never active by accident: ``register_cpu_platform`` refuses unless ``VERL_PLATFORM=cpu`` is set, and
warns if a CUDA device is visible (CPU mode on a GPU machine is allowed, but is rarely what one wants).
"""

from __future__ import annotations

import os
import sys
import warnings
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch

PLATFORM_NAME = "cpu"
"""the value of ``VERL_PLATFORM`` that selects this platform"""

_REGISTERED = False


def _physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _available_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


class CPUDeviceModule(ModuleType):
    """Stands in for ``torch.cuda`` (what verl calls ``get_torch_device()``) on the cpu platform.

    Memory, stream and synchronize calls are no-ops or report host memory; RNG calls go to torch's
    CPU generator; anything else falls through to ``torch.cpu``.
    """

    def __init__(self) -> None:
        super().__init__("verl_oar_cpu_device")

    # device management
    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def current_device(self) -> str:
        # like torch.cpu.current_device(); verl passes it to .to()/device=/torch.device()
        return "cpu"

    def set_device(self, device: Any) -> None:
        return None

    def get_device_name(self, device: Any = None) -> str:
        return "cpu"

    def synchronize(self, device: Any = None) -> None:
        return None

    # memory (verl logs these; host memory is reported where a number is expected)
    def empty_cache(self) -> None:
        return None

    def ipc_collect(self) -> None:
        return None

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        return _available_memory_bytes(), _physical_memory_bytes()

    def memory_allocated(self, device: Any = None) -> int:
        return 0

    def memory_reserved(self, device: Any = None) -> int:
        return 0

    def max_memory_allocated(self, device: Any = None) -> int:
        return 0

    def max_memory_reserved(self, device: Any = None) -> int:
        return 0

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        return None

    def set_per_process_memory_fraction(self, fraction: float, device: Any = None) -> None:
        return None

    # RNG
    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def get_rng_state(self, device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(state)

    # streams and events: torch.cpu has no-op versions
    def current_stream(self, device: Any = None):
        return torch.cpu.current_stream()

    def stream(self, stream: Any = None):
        return torch.cpu.stream(stream)

    Stream = torch.cpu.Stream
    Event = torch.cpu.Event

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)


_DEVICE_MODULE = CPUDeviceModule()


def _make_platform_class():
    from verl.plugin.platform import PlatformBase

    class PlatformCPU(PlatformBase):
        """verl platform for CPU-only hosts: device "cpu", gloo collectives, no-op device memory."""

        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "cpu"

        @property
        def device_module(self) -> ModuleType:
            return _DEVICE_MODULE

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            # auto-detection must never pick CPU mode; only VERL_PLATFORM=cpu does
            return os.environ.get("VERL_PLATFORM", "").strip().lower() == PLATFORM_NAME

        def current_device(self) -> str:
            # verl's get_device_id() feeds .to(x), device=x and torch.device(x): an int would mean
            # cuda:0, the string "cpu" works in all three (torch.cpu.current_device() returns it too)
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            return None

        def synchronize(self, device_index: int | None = None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            # Ray sets it for actors holding (pretend) GPUs; torch's CPU build ignores it
            return "CUDA_VISIBLE_DEVICES"

        @contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            # verl sizes resource pools in accelerators; CPU runs start Ray with a pretend GPU count
            return "GPU"

        def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
            return {"num_gpus": num_gpus}

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None

    PlatformCPU.__module__ = __name__
    PlatformCPU.__qualname__ = "PlatformCPU"
    return PlatformCPU


def _register_fsdp_engines_for_cpu() -> None:
    """Register verl's FSDP engines for device "cpu" unless an engine is already there (verl's own, or ours from an
    earlier call: ``EngineRegistry.register`` asserts on a second registration). Public API only: the lookup is
    ``get_engine_cls``, which resolves the device through the platform (initialised as "cpu" before this runs)."""
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

    for model_type, engine_cls in (("language_model", FSDPEngineWithLMHead), ("value_model", FSDPEngineWithValueHead)):
        for backend in ("fsdp", "fsdp2"):
            try:
                EngineRegistry.get_engine_cls(model_type, backend)
                continue
            except ValueError:  # "No engine registered for device='cpu' ..."
                pass
            EngineRegistry.register(model_type=model_type, backend=backend, device="cpu")(engine_cls)


def _load_hf_replica():
    from verl_oar.cpu.hf_rollout import HFReplica

    return HFReplica


def _register_hf_rollout() -> None:
    # a loader, not the class: hf_rollout imports verl, whose plugin loading calls this function,
    # so importing hf_rollout here would be circular in a process whose first import is hf_rollout
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    RolloutReplicaRegistry.register("hf", _load_hf_replica)


def register_cpu_platform() -> None:
    """Register the "cpu" platform, the FSDP engines and the hf rollout for device "cpu"; idempotent.

    Raises ``RuntimeError`` unless ``VERL_PLATFORM=cpu`` is set, so that CPU mode is never entered by
    accident. Must run before verl's platform singleton is created (the verl plugin does this while
    ``import verl`` runs).
    """
    global _REGISTERED
    requested = os.environ.get("VERL_PLATFORM", "").strip().lower()
    if requested != PLATFORM_NAME:
        raise RuntimeError(
            f"verl-oar CPU mode is opt-in: set VERL_PLATFORM={PLATFORM_NAME} to use it (VERL_PLATFORM={requested!r})."
        )
    if _REGISTERED:
        return
    if torch.cuda.is_available():
        warnings.warn(
            "verl-oar: VERL_PLATFORM=cpu is set on a machine with a CUDA device; training will run on the "
            "CPU and ignore the GPU. Unset VERL_PLATFORM to use the GPU.",
            stacklevel=2,
        )
        print("[verl-oar] WARNING: VERL_PLATFORM=cpu on a CUDA machine: running on CPU.", file=sys.stderr)

    from verl.plugin.platform import PlatformRegistry, get_platform

    PlatformRegistry.register(platform=PLATFORM_NAME)(_make_platform_class())
    # the platform singleton is created now (from VERL_PLATFORM=cpu, which is set), not at verl's first device
    # call: the engine lookup below needs it, and a process that created it earlier as another device is refused
    current = get_platform()
    if current.device_name != "cpu":
        raise RuntimeError(
            f"verl's platform was already initialised as {current.device_name!r} before verl-oar could register "
            "the cpu platform; set VERL_PLATFORM=cpu before importing verl."
        )

    from verl_oar.cpu.verl_patches import apply_verl_patches

    apply_verl_patches()
    _register_fsdp_engines_for_cpu()

    _register_hf_rollout()
    _REGISTERED = True
