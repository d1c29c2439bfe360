"""verl plugin entry point (setuptools group ``verl.plugins``; checked against verl 0.9.1).

verl imports this module on every ``import verl``: in the driver, in the TaskRunner actor and in
every Ray worker. Loading it must stay cheap (``import verl`` is on every process's start-up path)
and must not change verl for runs that do not use OAR, so it only arranges work for later:

1. if ``VERL_PLATFORM=cpu`` (explicit opt-in, never auto-detected): register the CPU platform now;
2. when verl imports ``verl.trainer.ppo.core_algos``: register the OAR estimators in its registry
   (through the upstream series' hook when verl has it, ``upstream_hook``);
3. when verl imports ``verl.trainer.ppo.v1`` (or the legacy ``verl.trainer.main_ppo_v0``): replace its
   trainer registry entries (the legacy trainer's name there) by dispatchers that build verl's own
   trainer for every non-token estimator (``trainer``), unless verl has the upstream hook.

Steps 2-3 run as post-import hooks (:func:`after_import`): processes that never import those modules
never load verl-oar's glue. verl swallows a plugin's exception at debug log level, so a failure is
printed loudly to stderr and remembered in ``LOAD_ERROR`` (and ``signals.PLUGIN_LOAD_ERROR``); the
OAR estimators check it and refuse to run OAR on a half-loaded plugin.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
import traceback
from collections.abc import Callable

LOAD_ERROR: str | None = None
ENTRY_POINT = "verl.plugins entry point"
"""what :data:`IMPORTED_THROUGH` says when verl's own plugin discovery loaded this module"""


def _importer() -> str:
    """What imported this module: :data:`ENTRY_POINT` when ``importlib.metadata.EntryPoint.load`` did, called from
    verl's ``__init__`` (verl 0.9.1's discovery of the ``verl.plugins`` group, in every process that imports verl);
    otherwise ``file:line`` of the first frame outside Python's import machinery."""
    try:
        outer = [f for f in traceback.extract_stack()[:-2]
                 if not f.filename.startswith("<frozen") and f.filename != __file__
                 and not f.filename.endswith(os.path.join("importlib", "__init__.py"))]
        if not outer:
            return "unknown"
        last = outer[-1]
        if (last.name == "load" and last.filename.endswith(os.path.join("importlib", "metadata", "__init__.py"))
                and len(outer) > 1 and outer[-2].filename.endswith(os.path.join("verl", "__init__.py"))):
            return ENTRY_POINT
        return f"{last.filename}:{last.lineno}"
    except Exception:  # noqa: BLE001 - a diagnostic only; never break verl's import
        return "unknown"


IMPORTED_THROUGH = _importer()
"""how this process loaded the plugin (:func:`_importer`): a multi-node run checks it on every node's workers"""


def cpu_mode_requested() -> bool:
    """True when the user asked for verl-oar's CPU platform with ``VERL_PLATFORM=cpu``."""
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == "cpu"


def _report(exc_text: str) -> None:
    global LOAD_ERROR
    LOAD_ERROR = exc_text
    try:
        from verl_oar.integration import signals

        signals.PLUGIN_LOAD_ERROR = exc_text
    except Exception:  # noqa: BLE001 - the estimators cannot load either, so nothing can run OAR
        pass
    print(
        "\n[verl-oar] ERROR: the verl-oar plugin failed to load; OAR estimators will refuse to run.\n"
        f"{exc_text}",
        file=sys.stderr,
        flush=True,
    )


def _guarded(callback: Callable[..., None]) -> Callable[..., None]:
    def run(*args) -> None:
        try:
            callback(*args)
        except Exception:  # noqa: BLE001 - raising here would break verl's own import; refuse OAR instead
            _report(traceback.format_exc())

    return run


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs callbacks right after a named module has been executed (a post-import hook).

    Finds the module with the other finders, then wraps only its ``exec_module``; the module keeps its
    own loader and spec (``__loader__``/``__spec__.loader`` are restored before it executes)."""

    def __init__(self) -> None:
        self.pending: dict[str, list[Callable]] = {}

    def find_spec(self, name, path, target=None):
        if name not in self.pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        callbacks = self.pending.pop(name)

        class _Then(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                module.__loader__ = loader
                module.__spec__.loader = loader
                loader.exec_module(module)
                for callback in callbacks:
                    callback(module)

        spec.loader = _Then()
        return spec


_FINDER = _AfterImport()


def after_import(module_name: str, callback: Callable[[object], None]) -> None:
    """Call ``callback(module)`` once ``module_name`` is imported (now, if it already is)."""
    module = sys.modules.get(module_name)
    if module is not None:
        callback(module)
        return
    _FINDER.pending.setdefault(module_name, []).append(callback)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def _register_estimators(_core_algos) -> None:
    from verl_oar.integration import estimators  # noqa: F401  (registers oar_* in verl's registry)
    from verl_oar.integration import privileged_estimators  # noqa: F401  (registers cscr, oppo)
    from verl_oar.integration import acpo_estimator  # noqa: F401  (registers acpo)
    from verl_oar.integration import codapo_estimator  # noqa: F401  (registers codapo and its composition)
    from verl_oar.integration import upstream_hook

    if upstream_hook.available():  # a verl with the upstream series: its own seams, no trainer hook
        upstream_hook.install()


def _install_trainer_hook(_v1) -> None:
    from verl_oar.integration import upstream_hook

    if not upstream_hook.available():
        from verl_oar.integration.trainer import install_trainer_hook

        install_trainer_hook()


def _install_legacy_guard(main_ppo_v0) -> None:
    from verl_oar.integration import upstream_hook

    if not upstream_hook.available():
        from verl_oar.integration.trainer import install_legacy_guard

        install_legacy_guard(main_ppo_v0)


def _load() -> None:
    from verl_oar.integration import compat

    compat.check_verl_version()
    after_import("verl.trainer.ppo.core_algos", _guarded(_register_estimators))
    after_import("verl.trainer.ppo.v1", _guarded(_install_trainer_hook))
    after_import("verl.trainer.main_ppo_v0", _guarded(_install_legacy_guard))
    if cpu_mode_requested():
        from verl_oar.cpu.platform import register_cpu_platform

        register_cpu_platform()


_guarded(_load)()
