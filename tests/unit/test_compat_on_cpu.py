"""compat: what verl-oar assumes about verl, checked against the installed verl."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from verl_oar.integration import compat

ROOT = Path(__file__).resolve().parents[2]


def test_every_private_verl_name_resolves_in_the_installed_verl():
    assert compat.missing_private_names() == []


def test_a_moved_name_is_reported(monkeypatch):
    monkeypatch.setitem(compat.PRIVATE_NAMES, "verl.trainer.ppo.core_algos._no_such_name_", "probe")
    assert compat.missing_private_names() == ["verl.trainer.ppo.core_algos._no_such_name_"]


def test_every_mirrored_verl_function_exists_and_names_a_test_that_exists():
    for function, test in compat.MIRRORED.items():
        if not function.startswith(compat.NEEDS_MEGATRON):
            assert callable(compat.resolve(function)), function
        path, _, name = test.partition("::")
        path = path.split(" ")[0]
        assert (ROOT / path).is_file(), test
        if name:
            assert re.search(rf"^def {re.escape(name)}\(", (ROOT / path).read_text(), re.M), test


def test_an_unsupported_verl_is_refused_naming_the_fix(monkeypatch):
    import verl

    monkeypatch.setattr(verl, "__version__", "0.10.0")
    with pytest.raises(compat.UnsupportedVerl, match="Install verl==0.9.1"):
        compat.check_verl_version()


def test_every_private_name_used_in_the_package_is_declared():
    """Underscored verl names in the package's code must appear in compat.PRIVATE_NAMES."""
    declared = {name.rsplit(".", 1)[1] for name in compat.PRIVATE_NAMES}
    used = set()
    for path in (ROOT / "verl_oar").rglob("*.py"):
        text = path.read_text()
        used |= set(re.findall(r"\b(?:engine|base|transformer_impl|module)\.(_[a-zA-Z][\w]*)", text))
        used |= set(re.findall(r"\bsuper\(\)\.(_[a-zA-Z][\w]*)\(", text))
        used |= set(re.findall(r"^[ \t]+def (_compute_[\w]+|_init_resource_pool_mgr)\(", text, re.M))
    assert used - declared == set()
