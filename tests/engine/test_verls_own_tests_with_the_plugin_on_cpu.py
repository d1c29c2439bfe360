"""verl's own CPU tests, shipped in its wheel, pass with verl-oar installed (issue 12: a run that does
not use OAR sees verl's own objects).

verl's test modules run in a fresh interpreter from the installed ``site-packages`` (they read verl's
config files by paths relative to it), with plugin discovery on as every user has it: the plugin
loads on ``import verl`` and its post-import hooks register the OAR estimators in verl's registry
while verl's tests of that registry, its advantage estimators, policy losses, metrics, configs and
``DataProto`` run. The upstream series' tests of a patched verl are in tests/e2e/test_upstream_series_on_cpu.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

SITE = Path(sysconfig.get_paths()["purelib"])
VERL_TESTS = (
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
"""the wheel's CPU tests of the modules the plugin hooks into or registers in (core_algos, the trainer
package, configs) and of ``DataProto``; the Ray single-controller tests (minutes) are left out"""

RUNNER = """
import sys
import pytest
import verl
from verl.trainer.ppo import core_algos
# verl's tests run with the plugin loaded and its hooks done, not with verl alone (checked before
# they run: verl's registry tests may register and remove entries of their own)
assert "verl_oar.integration.plugin" in sys.modules, "verl-oar's plugin did not load on import verl"
assert {"oar_g", "oar_p"} <= set(core_algos.ADV_ESTIMATOR_REGISTRY), "verl-oar's estimators are not registered"
from verl_oar.integration import plugin
assert plugin.LOAD_ERROR is None, plugin.LOAD_ERROR
print("PLUGIN-LOADED", flush=True)
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
"""


@pytest.mark.skipif(not (SITE / VERL_TESTS[0]).exists(), reason="this verl wheel ships no tests/ folder")
def test_verls_wheel_cpu_tests_pass_with_the_plugin_loaded():
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_USE_EXTERNAL_PLUGINS", "VERL_PLATFORM")}
    proc = subprocess.run([sys.executable, "-c", RUNNER, *VERL_TESTS], cwd=SITE, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "PLUGIN-LOADED" in proc.stdout, out[-3000:]
    summary = [line for line in proc.stdout.splitlines() if " passed" in line][-1]
    assert "failed" not in summary and "error" not in summary, summary
