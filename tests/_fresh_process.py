"""Fresh interpreters that several tests share.

verl resolves its platform, and the plugin loads, once per process: a check of what ``import verl``
does needs a new interpreter, and each costs ~12 s of imports on 2 cores. So the checks that can
share one do, in a fixed order (the import probe first, before anything else is imported), and each
test reads its own part of the output (tests/conftest.py: ``plugin_process``, ``cpu_mode_process``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path

SITE = Path(sysconfig.get_paths()["purelib"])

IMPORT_PROBE = """
import sys
import verl
from verl_oar.integration import plugin
assert plugin.LOAD_ERROR is None, plugin.LOAD_ERROR
assert plugin.IMPORTED_THROUGH == plugin.ENTRY_POINT, plugin.IMPORTED_THROUGH  # loaded by verl's discovery
glue = sorted(m for m in sys.modules if m.startswith('verl_oar.') and not m.startswith('verl_oar.cpu') and m not in
              ('verl_oar.integration', 'verl_oar.integration.plugin', 'verl_oar.integration.compat'))
assert not glue, glue
assert 'verl.trainer.ppo.core_algos' not in sys.modules
import verl.trainer.ppo.v1, verl.trainer.ppo.core_algos
from verl.trainer.ppo import core_algos, ray_trainer
from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY
assert {'oar_g', 'oar_p'} <= set(core_algos.ADV_ESTIMATOR_REGISTRY)
assert all(getattr(c, '_verl_oar_dispatch', False) for c in TRAINER_REGISTRY.values()), TRAINER_REGISTRY
assert ray_trainer.RayPPOTrainer.__module__ == 'verl.trainer.ppo.ray_trainer'
import verl_oar.integration.worker, verl_oar.engines.driver
from verl_oar.integration import plugin
assert plugin.LOAD_ERROR is None, plugin.LOAD_ERROR
print('OAR-MODULES ' + ' '.join(sorted(m for m in sys.modules if m.startswith('verl_oar'))), flush=True)
"""
"""``import verl`` loads only the plugin and compat; the glue waits for the modules it hooks into, then
registers the estimators and makes verl's trainer registry entries dispatchers, leaving the legacy
``RayPPOTrainer`` class verl's; then the worker-side glue loads. Prints every ``verl_oar`` module
loaded (``OAR-MODULES ...``), for tests/unit/test_import_graph_on_cpu.py."""

VERL_WHEEL_TESTS = (
    "tests/trainer/ppo/test_core_algos_on_cpu.py",
    "tests/trainer/ppo/test_dynamic_policy_losses_on_cpu.py",
    "tests/trainer/ppo/test_loss_aggregation_on_cpu.py",
    "tests/trainer/ppo/test_metric_utils_on_cpu.py",
    "tests/trainer/ppo/test_value_loss_normalization_on_cpu.py",
    "tests/trainer/test_multi_trajectories_advantage_on_cpu.py",
    "tests/trainer/test_constants_ppo_on_cpu.py",
    "tests/test_base_config_on_cpu.py",
    "tests/test_protocol_on_cpu.py",
)
"""verl's own CPU tests shipped in its wheel, of the modules the plugin hooks into or registers in
(core_algos, the trainer package, configs) and of ``DataProto``; the Ray single-controller tests
(minutes) are left out"""

VERL_WHEEL_TESTS_RUNNER = """
import pytest
from verl.trainer.ppo import core_algos
# verl's tests run with the plugin loaded and its hooks done, not with verl alone (checked before
# they run: verl's registry tests may register and remove entries of their own)
assert "verl_oar.integration.plugin" in sys.modules, "verl-oar's plugin did not load on import verl"
assert {"oar_g", "oar_p"} <= set(core_algos.ADV_ESTIMATOR_REGISTRY), "verl-oar's estimators are not registered"
print("PLUGIN-LOADED", flush=True)
if len(sys.argv) > 1:
    print("VERL-TESTS-EXIT", int(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:]])), flush=True)
"""
"""verl's wheel tests (``VERL_WHEEL_TESTS``, the script's arguments) run in this process, cwd the
installed ``site-packages`` (they read verl's config files by relative paths)"""


def wheel_has_tests() -> bool:
    return (SITE / VERL_WHEEL_TESTS[0]).exists()


@dataclass
class FreshProcess:
    returncode: int
    stdout: str
    stderr: str

    def failure(self) -> str:
        return f"exit code {self.returncode}\nstdout:\n{self.stdout[-4000:]}\nstderr:\n{self.stderr[-5000:]}"

    def modules(self) -> list[str]:
        """The ``verl_oar`` modules ``IMPORT_PROBE`` saw loaded."""
        lines = [line for line in self.stdout.splitlines() if line.startswith("OAR-MODULES ")]
        assert lines, self.failure()
        return lines[0].split()[1:]


def run_fresh(code: str, *args: str, env_extra: dict[str, str] | None = None, cwd: Path | None = None,
              timeout: int = 600) -> FreshProcess:
    """Run ``code`` in a new interpreter (with ``$VERL_PLATFORM`` and ``$VERL_USE_EXTERNAL_PLUGINS``
    unset unless given: plugins on, as every user has them)."""
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_PLATFORM", "VERL_USE_EXTERNAL_PLUGINS")}
    env.update(env_extra or {})
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                         timeout=timeout, env=env, cwd=cwd, check=False)
    return FreshProcess(out.returncode, out.stdout, out.stderr)


CPU_PLATFORM_CHECK = """
import os
import torch
from verl.utils.device import get_device_id, get_device_name, get_nccl_backend, get_torch_device
from verl.plugin.platform import PlatformRegistry, get_platform
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead
from verl.workers.rollout.base import get_rollout_class
from verl.workers.rollout.replica import get_rollout_replica_class
from verl_oar.cpu.platform import register_cpu_platform
from verl_oar.cpu.verl_patches import patches_applied
from verl_oar.cpu.hf_rollout import HFReplica, HFServerAdapter

register_cpu_platform()  # the plugin already did; a second call is a no-op
assert get_platform().device_name == "cpu" and get_device_name() == "cpu"
assert get_nccl_backend() == "gloo"
assert torch.ones(1).to(get_device_id()).device.type == "cpu"
dev = get_torch_device()
dev.synchronize(); dev.empty_cache(); dev.set_device(0)
assert dev.memory_allocated() == 0 and dev.mem_get_info()[1] > 0
assert get_platform().ray_resource_options(1) == {"num_gpus": 1}

assert EngineRegistry.get_engine_cls("language_model", "fsdp2") is FSDPEngineWithLMHead
assert EngineRegistry.get_engine_cls("value_model", "fsdp") is FSDPEngineWithValueHead
assert get_rollout_replica_class("hf") is HFReplica
assert get_rollout_class("hf", "async") is HFServerAdapter
assert all(patches_applied().values()), patches_applied()

# the patched process-group init builds "cpu:gloo", not the "cpu:gloo,cpu:gloo" torch rejects
os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
from verl.workers import engine_workers
engine_workers.initialize_global_process_group_ray(timeout_second=None)
t = torch.ones(3)
torch.distributed.all_reduce(t)
assert t.tolist() == [1.0, 1.0, 1.0]
torch.distributed.destroy_process_group()

# never auto-detected: without VERL_PLATFORM=cpu the platform declines
os.environ["VERL_PLATFORM"] = ""
assert not PlatformRegistry.get("cpu")().is_platform_available(use_smi_check=True)

# each patch's target still exists in the installed verl (VerlPatchError names it if gone)
from verl_oar.cpu.verl_patches import PATCHES, check_verl_version
print("verl", check_verl_version())
for patch in PATCHES:
    patch.target()
    print("ok", patch.name, patch.module + "." + patch.attribute)
print("CPU-PLATFORM-OK", flush=True)
"""
"""CPU mode (``VERL_PLATFORM=cpu``): verl's cpu platform registers, runs a gloo collective through
verl's own process-group init, and every CPU-mode patch finds its target in the installed verl; the
script's argument is a free port"""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a process group's MASTER_PORT)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
