"""verl's own CPU tests, shipped in its wheel, pass with verl-oar installed (issue 12: a run that does
not use OAR sees verl's own objects).

verl's test modules run in a fresh interpreter from the installed ``site-packages`` (they read verl's
config files by paths relative to it; the interpreter is shared with the import-graph check,
tests/_fresh_process.py), with plugin discovery on as every user has it: the plugin
loads on ``import verl`` and its post-import hooks register the OAR estimators in verl's registry
while verl's tests of that registry, its advantage estimators, policy losses, metrics, configs and
``DataProto`` run. The upstream series' tests of a patched verl are in tests/e2e/test_upstream_series_on_cpu.py.
"""

from __future__ import annotations

import pytest
from _fresh_process import wheel_has_tests


@pytest.mark.skipif(not wheel_has_tests(), reason="this verl wheel ships no tests/ folder")
def test_verls_wheel_cpu_tests_pass_with_the_plugin_loaded(plugin_process):
    """``VERL_WHEEL_TESTS`` (tests/_fresh_process.py) in the shared fresh interpreter, after the import probe."""
    out = plugin_process.stdout + plugin_process.stderr
    assert plugin_process.returncode == 0, plugin_process.failure()
    assert "PLUGIN-LOADED" in plugin_process.stdout, out[-3000:]
    assert "VERL-TESTS-EXIT 0" in plugin_process.stdout, out[-6000:]
    summary = [line for line in plugin_process.stdout.splitlines() if " passed" in line][-1]
    assert "failed" not in summary and "error" not in summary, summary
