"""One monkeypatch of a library's internals, as CPU mode records them (``verl_patches``: verl's;
``megatron_patches``: megatron-core's): the attribute it replaces, why, how it applies, and the library's public
fix that makes it unnecessary. A target the installed library no longer has, or a library of another release
series, fails loudly, naming the patch, the attribute and why it is needed.

Each library's patches subclass :class:`Patch` once, naming the library (``library``, ``series``, ``error``,
``source``, ``installed_version``); everything else is this one type.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

PATCHED_MARK = "__verl_oar_cpu_patch__"
"""attribute set on what a patch installs, so that applying it again does nothing"""


def mark(obj: Any) -> Any:
    """``obj`` (a function or class a patch installs), marked as installed by a patch."""
    setattr(obj, PATCHED_MARK, True)
    return obj


def is_marked(obj: Any) -> bool:
    """Whether ``obj`` was installed by a patch (:func:`mark`)."""
    return bool(getattr(obj, PATCHED_MARK, False))


@dataclass(frozen=True)
class Patch:
    """One monkeypatch: the attribute it replaces and why."""

    name: str
    """short identifier used in tests and error messages"""
    module: str
    """the module that holds the attribute"""
    attribute: str
    """the attribute (function, class or table) that is replaced or extended; dotted for a class attribute
    (``Class.method``)"""
    why: str
    """one sentence: what breaks on CPU without it"""
    apply: Callable[[Any], None]
    """applies the patch to the imported module; must be idempotent"""
    upstream: tuple[str, str] | None = None
    """(module, attribute) of the library's public API that makes this patch unnecessary (verl: added by
    verl-oar's upstream series); None: no such API"""
    use_upstream: Callable[[Any], None] | None = None
    """called with that API instead of ``apply`` when the library has it; None: nothing to do"""

    library: ClassVar[str]
    """the library as messages name it ("verl", "megatron-core")"""
    series: ClassVar[str]
    """the release series the patches were written for (a prefix of the library's version, "0.9.")"""
    error: ClassVar[type[RuntimeError]]
    """raised when a target is missing or the library is of another series"""
    source: ClassVar[str]
    """the file that holds the library's patches, named in the version error"""

    @staticmethod
    def installed_version() -> str:
        """The installed library's version (each subclass reads its library's)."""
        raise NotImplementedError

    @classmethod
    def check_version(cls) -> str:
        """Return the installed library's version; raise ``error`` unless it is of ``series``."""
        version = cls.installed_version()
        if not version.startswith(cls.series):
            raise cls.error(
                f"verl-oar cpu mode patches {cls.library} internals written for {cls.library} {cls.series}x; "
                f"found {cls.library} {version}. Check {cls.source} against it before using it."
            )
        return version

    def target(self) -> Any:
        """Import the module and return the attribute, or raise ``error`` naming it."""
        self.check_version()
        try:
            obj = importlib.import_module(self.module)
        except ImportError as exc:
            raise self.error(f"verl-oar cpu patch {self.name!r}: cannot import {self.module}: {exc}") from exc
        for part in self.attribute.split("."):
            if not hasattr(obj, part):
                raise self.error(
                    f"verl-oar cpu patch {self.name!r}: {self.module}.{self.attribute} not found in this "
                    f"{self.library} (patch written for {self.library} {self.series}x). Why it is needed: {self.why}"
                )
            obj = getattr(obj, part)
        return obj

    def applied(self) -> bool:
        """Whether the patch is in effect in this process (for a patch that installs a marked function or class)."""
        return is_marked(self.target())

    def upstream_fix(self) -> Any:
        """The library's public API that makes this patch unnecessary, or None when the installed library lacks it."""
        if self.upstream is None:
            return None
        try:
            module = importlib.import_module(self.upstream[0])
        except ImportError:
            return None
        return getattr(module, self.upstream[1], None)


def apply_patches(patches: Iterable[Patch]) -> None:
    """Apply every patch that the installed library still needs, in order (idempotent): where it has the public
    fix, ``use_upstream`` instead; raise the patch's ``error`` if one cannot apply."""
    for patch in patches:
        fix = patch.upstream_fix()
        if fix is not None:
            if patch.use_upstream is not None:
                patch.use_upstream(fix)
            continue
        patch.target()
        patch.apply(importlib.import_module(patch.module))
