"""The package's dependencies point one way (docs/architecture.md): every import of every module,
top-level or inside a function, read from the source; and what ``import verl`` really loads."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "verl_oar"

ALLOWED = {
    "core": {"core"},
    "engines": {"core", "engines"},
    "integration": {"core", "engines", "integration"},
    "rewards": {"core", "rewards"},
    "data": {"core", "data"},
    "cpu": {"core", "rewards", "cpu"},
    "tools": {"core", "rewards", "integration", "tools"},
    "testbed": {"core", "tools", "rewards", "cpu", "integration", "testbed"},
    "real_model": {"core", "tools", "rewards", "cpu", "integration", "data", "real_model"},
    "app": {"core", "engines", "integration", "rewards", "data", "cpu", "tools", "testbed", "real_model", "app"},
}
"""layer -> the layers its modules may import (itself included)"""

EXCEPTIONS = {
    ("integration/plugin.py", "verl_oar.cpu.platform"):
        "CPU mode is opt-in (VERL_PLATFORM=cpu): the plugin registers verl's cpu platform only then",
}
"""(module, imported module) -> why this edge against the layering is allowed"""


def _modules():
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _imports(path: Path) -> list[str]:
    """Every module ``path`` imports (absolute names; relative imports resolved), at any depth."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(("verl_oar", *path.relative_to(PACKAGE).parent.parts))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module
            names.append(module)
            names.extend(f"{module}.{alias.name}" for alias in node.names)  # `from pkg import submodule`
    return names


def _layer(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "verl_oar" and parts[1] in ALLOWED else None


def _violations() -> list[str]:
    found = []
    for path in _modules():
        rel = path.relative_to(PACKAGE).as_posix()
        own = rel.split("/")[0] if "/" in rel else None
        for name in _imports(path):
            if own == "core" and (name == "verl" or name.startswith("verl.")):
                found.append(f"{rel} imports {name}: core/ is pure torch, no verl")
            target = _layer(name)
            if target is None or any(rel == r and (name == m or name.startswith(m + ".")) for r, m in EXCEPTIONS):
                continue
            if own is None:  # verl_oar/__init__.py
                found.append(f"{rel} imports {name}: the package root imports nothing")
            elif target not in ALLOWED[own]:
                found.append(f"{rel} imports {name}: {own}/ may import only {sorted(ALLOWED[own])}")
    return sorted(set(found))


SEAMS = {
    "engines/driver.py": ("verl_oar.engines.fsdp", "verl_oar.engines.megatron"),
    "engines/fsdp": ("verl_oar.engines.megatron",),
    "engines/megatron": ("verl_oar.engines.fsdp",),
}
"""module or folder -> engine packages it must not import: the driver reaches the engines only through
``engines.backend`` (each engine's importance pass); the engine packages are siblings"""


def _seam_violations() -> list[str]:
    found = []
    for path in _modules():
        rel = path.relative_to(PACKAGE).as_posix()
        for owner, banned in SEAMS.items():
            if rel != owner and not rel.startswith(owner + "/"):
                continue
            for name in _imports(path):
                if any(name == b or name.startswith(b + ".") for b in banned):
                    found.append(f"{rel} imports {name}")
    return sorted(set(found))


def test_the_driver_reaches_the_engines_only_through_the_backend_seam():
    assert _seam_violations() == []


def test_the_seam_check_sees_a_driver_importing_an_engine():
    probe = PACKAGE / "engines" / "fsdp" / "x_seam_probe.py"
    probe.write_text("def f():\n    from verl_oar.engines.megatron.forward import bshd_forced_max_seqlen\n")
    try:
        found = _seam_violations()
    finally:
        probe.unlink()
    assert "engines/fsdp/x_seam_probe.py imports verl_oar.engines.megatron.forward" in found


def test_every_module_belongs_to_a_layer():
    loose = [p.relative_to(PACKAGE).as_posix() for p in _modules()
             if p.parent == PACKAGE and p.name != "__init__.py"]
    assert not loose, f"modules outside the layers {sorted(ALLOWED)}: {loose}"
    layers = {p.relative_to(PACKAGE).parts[0] for p in _modules() if p.parent != PACKAGE}
    assert layers <= set(ALLOWED), layers - set(ALLOWED)


def test_dependencies_point_one_way():
    assert _violations() == []


def test_the_check_sees_function_level_and_relative_imports():
    probe = PACKAGE / "core" / "x_graph_probe.py"
    probe.write_text("def f():\n    from verl_oar.testbed import pick_max\n    import verl.utils\n"
                     "from ..tools import heatmap\n")
    try:
        found = _violations()
    finally:
        probe.unlink()
    assert "core/x_graph_probe.py imports verl_oar.testbed: core/ may import only ['core']" in found
    assert "core/x_graph_probe.py imports verl.utils: core/ is pure torch, no verl" in found
    assert "core/x_graph_probe.py imports verl_oar.tools: core/ may import only ['core']" in found


HEAVY_OR_OPTIONAL = ("verl_oar.cpu", "verl_oar.testbed", "verl_oar.tools", "verl_oar.data", "verl_oar.real_model")


@pytest.mark.parametrize("cpu_mode", [False, True])
def test_what_import_verl_loads_of_the_plugin(cpu_mode, request):
    """A GPU run's processes (driver, TaskRunner, workers) load the plugin and its glue only, never
    the CPU mode, the testbed, the tools or the data scripts; CPU mode loads ``cpu`` on request.
    ``import verl`` alone (verl's entry point) loads only the plugin and compat
    (``IMPORT_PROBE``, tests/_fresh_process.py, run first in a fresh interpreter)."""
    process = request.getfixturevalue("cpu_mode_process" if cpu_mode else "plugin_process")
    loaded = process.modules()  # the probe's line: it passed its assertions
    assert "verl_oar.integration.estimators" in loaded and "verl_oar.integration.trainer" in loaded
    heavy = [m for m in loaded if m.startswith(HEAVY_OR_OPTIONAL)]
    if cpu_mode:
        assert heavy and all(m.startswith("verl_oar.cpu") for m in heavy), heavy
    else:
        assert heavy == [], heavy


def test_the_plugin_says_what_imported_it():
    """``plugin.IMPORTED_THROUGH`` (``plugin._importer``, run when the module loads): verl's entry point when
    ``importlib.metadata``'s ``EntryPoint.load`` loads it from verl's ``__init__`` (in a fresh ``import verl``,
    ``IMPORT_PROBE`` asserts that; a multi-node run checks it on each node's workers,
    tests/e2e/test_two_nodes_on_cpu.py), any other importer named by file and line. Here on stacks built for it, in
    this process (a fresh interpreter importing the plugin by hand cost 4-27 s of the fast tier)."""
    import os
    from functools import partial

    from verl_oar.integration import plugin

    def frames(filename: str, name: str) -> dict:
        """a function ``name`` defined in a file named ``filename`` that calls its argument"""
        namespace: dict = {}
        exec(compile(f"def {name}(call):\n    return call()\n", filename, "exec"), namespace)
        return namespace[name]

    def module_body():  # the plugin's module body, which calls _importer (both dropped from the stack it reads)
        return plugin._importer()

    verl_init = frames(os.path.join("site-packages", "verl", "__init__.py"), "_discover_plugins")
    entry_point_load = frames(os.path.join("lib", "importlib", "metadata", "__init__.py"), "load")
    assert verl_init(partial(entry_point_load, module_body)) == plugin.ENTRY_POINT
    line = sys._getframe().f_lineno + 1
    assert module_body() == f"{__file__}:{line}"  # imported from this test, not by verl
    assert verl_init(module_body).startswith(os.path.join("site-packages", "verl", "__init__.py"))  # not through load


def _module_name(path: Path) -> str:
    parts = ("verl_oar", *path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_cycles() -> list[list[str]]:
    """Import cycles between the package's modules (any import, at any depth; ``EXCEPTIONS`` edges left out)."""
    modules = {_module_name(p): p for p in _modules()}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        rel = path.relative_to(PACKAGE).as_posix()
        edges = set()
        for imported in _imports(path):
            if any(rel == r and (imported == m or imported.startswith(m + ".")) for r, m in EXCEPTIONS):
                continue
            if imported in modules and imported != name and modules[imported].name != "__init__.py":
                edges.add(imported)
        graph[name] = edges
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return cycles


def test_no_module_imports_itself_through_others():
    """A module that reaches itself through its imports (``a`` imports ``b`` imports ``a``, even inside a function)
    ties the two into one piece: a layering meant to be one-way must have no cycle (packages' ``__init__`` left
    out: importing a sibling through its package is not a dependency on the package's other modules)."""
    assert _module_cycles() == []


def test_the_cycle_check_sees_two_modules_importing_each_other_inside_functions():
    a, b = PACKAGE / "tools" / "x_cycle_a.py", PACKAGE / "tools" / "x_cycle_b.py"
    a.write_text("def f():\n    from verl_oar.tools.x_cycle_b import g\n")
    b.write_text("def g():\n    from verl_oar.tools import x_cycle_a\n")
    try:
        cycles = _module_cycles()
    finally:
        a.unlink()
        b.unlink()
    assert ["verl_oar.tools.x_cycle_a", "verl_oar.tools.x_cycle_b", "verl_oar.tools.x_cycle_a"] in cycles
