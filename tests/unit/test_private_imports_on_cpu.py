"""No module of the package imports another module's underscore names (read from the source; the
layering itself is test_import_graph_on_cpu.py's)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "verl_oar"


def imports(folder: str) -> list[tuple[str, str, list[str]]]:
    """(file, imported module, imported names) of every import in ``verl_oar/<folder>`` (nested ones too)."""
    out = []
    for path in sorted((PACKAGE / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module:
                out.append((path.name, node.module, [a.name for a in node.names]))
            elif isinstance(node, ast.Import):
                out.extend((path.name, a.name, []) for a in node.names)
    return out


def test_no_underscore_names_imported_across_modules():
    bad = [(f, m, n) for folder in ("core", "tools", "testbed", "cpu", "engines", "integration", "rewards", "data")
           if (PACKAGE / folder).is_dir()
           for f, m, names in imports(folder) if m.startswith("verl_oar")
           for n in names if n.startswith("_")]
    assert bad == []
