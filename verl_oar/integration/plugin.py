"""verl plugin entry point (setuptools group ``verl.plugins``; checked against verl 0.9.1).

verl imports this module on every ``import verl``: in the driver, in the TaskRunner actor and in
every Ray worker. verl swallows a plugin's exception at debug log level, so a failure here is
printed loudly to stderr and remembered in ``LOAD_ERROR``; the OAR estimators and the trainer
check it and refuse to run OAR on a half-loaded plugin.

What loading does, in order:
1. if ``VERL_PLATFORM=cpu`` (explicit opt-in, never auto-detected): register the CPU platform;
2. register the OAR advantage estimators in verl's registry (idempotent);
3. install the OAR trainer hook (see ``verl_oar.integration.trainer``).
"""

from __future__ import annotations

import os
import sys
import traceback

LOAD_ERROR: str | None = None


def cpu_mode_requested() -> bool:
    """True when the user asked for verl-oar's CPU platform with ``VERL_PLATFORM=cpu``."""
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == "cpu"


def _load() -> None:
    if cpu_mode_requested():
        from verl_oar.cpu.platform import register_cpu_platform

        register_cpu_platform()
    from verl_oar.integration import estimators  # noqa: F401  (registers oar_* in verl's registry)
    from verl_oar.integration import upstream_hook

    if upstream_hook.available():  # a verl with the upstream series: its own seams, no trainer hook
        upstream_hook.install()
    else:
        from verl_oar.integration.trainer import install_trainer_hook

        install_trainer_hook()


try:
    _load()
except Exception:  # noqa: BLE001 - verl would hide it; we print it and re-check later
    LOAD_ERROR = traceback.format_exc()
    try:
        from verl_oar.integration import signals

        signals.PLUGIN_LOAD_ERROR = LOAD_ERROR
    except Exception:  # noqa: BLE001 - the estimators cannot load either, so nothing can run OAR
        pass
    print(
        "\n[verl-oar] ERROR: the verl-oar plugin failed to load; OAR estimators will refuse to run.\n"
        f"{LOAD_ERROR}",
        file=sys.stderr,
        flush=True,
    )
