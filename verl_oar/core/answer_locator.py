"""Pluggable answer locator: the value of ``algorithm.oar.answer_locator`` -> ``text -> AnswerSpan | None``.

OAR grounds token importance on the final answer; :func:`verl_oar.core.answer_span.find_answer_span` finds
it in math responses. Data in another format can bring its own function with the same signature
(``text -> AnswerSpan | None``; the text is the response decoded with ``skip_special_tokens=True``,
offsets are characters of it; None means "no answer": that response keeps GRPO's uniform credit).

Spec forms (surrounding whitespace ignored):

* ``""`` (or None): the built-in :func:`~verl_oar.core.answer_span.find_answer_span`;
* ``pkg://package.module.function``: ``importlib.import_module("package.module")`` and its attribute
  ``function`` (everything before the last dot is the module; like verl's ``pkg://`` reward paths). The
  module must be importable in every process that locates answers (installed, or on ``PYTHONPATH``);
* ``/path/to/file.py:function``: the file (a path ending in ``.py``, after the last ``:`` the function;
  a relative path is resolved against the current directory of the call) is executed once as a module
  named ``verl_oar_answer_locator_<hash of the path>`` (registered in ``sys.modules``, so
  dataclasses and pickling inside it work) with ``importlib.util.spec_from_file_location``.

Results are cached per spec (per resolved file for paths): a module is imported, a file executed, once
per process. Errors are ValueErrors that name the spec, the problem and the fix: a malformed spec, a
module that cannot be imported or a file that cannot be executed (with the error's text), a missing
attribute (listing the functions the module has), an attribute that is not callable or does not accept
one argument. What the function returns is checked on every call by ``answer_span.locate_answer_tokens``
and ``answer_span.answer_token_masks``.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from types import ModuleType
from typing import Any

from verl_oar.core.answer_span import AnswerLocator, find_answer_span

__all__ = ["SPEC_FORMS", "load_answer_locator"]

SPEC_FORMS = "'' (the built-in find_answer_span), 'pkg://package.module.function' or '/path/to/file.py:function'"
"""The accepted forms, as error messages spell them."""


def load_answer_locator(spec: str | None) -> AnswerLocator:
    """The function ``text -> AnswerSpan | None`` that ``spec`` names (forms in the module docstring).

    Raises:
        ValueError: the spec is malformed, its module or file cannot be loaded, or it names no callable
            of one argument; the message says which and how to fix it.
    """
    if spec is None:
        return find_answer_span
    if not isinstance(spec, str):
        raise ValueError(f"answer_locator {spec!r} ({type(spec).__name__}) is not a string: use {SPEC_FORMS}")
    text = spec.strip()
    if not text:
        return find_answer_span
    if text.startswith("pkg://"):
        module, dot, name = text.removeprefix("pkg://").rpartition(".")
        if not dot or not module or not name or not all(part.isidentifier() for part in (*module.split("."), name)):
            raise ValueError(
                f"answer_locator {spec!r} is malformed: after 'pkg://' give a dotted module path and the "
                f"function's name, e.g. 'pkg://my_package.locators.find_answer' (forms: {SPEC_FORMS})"
            )
        return _from_module(spec, module, name)
    path, colon, name = text.rpartition(":")
    if not colon or not path.endswith(".py") or not name.isidentifier():
        raise ValueError(
            f"answer_locator {spec!r} is malformed: use {SPEC_FORMS} (a file path must end in '.py' and be "
            f"followed by ':' and the function's name)"
        )
    return _from_file(spec, os.path.abspath(os.path.expanduser(path)), name)


@functools.lru_cache(maxsize=None)
def _from_module(spec: str, module_name: str, name: str) -> AnswerLocator:
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - any import failure is reported with its text
        raise ValueError(
            f"answer_locator {spec!r}: cannot import module {module_name!r} ({type(error).__name__}: {error}); "
            f"install the package or put its directory on PYTHONPATH in every worker, or give the file "
            f"instead: '/path/to/file.py:{name}'"
        ) from error
    return _checked_attribute(spec, module, f"module {module_name!r}", name)


@functools.lru_cache(maxsize=None)
def _from_file(spec: str, path: str, name: str) -> AnswerLocator:
    if not os.path.isfile(path):
        raise ValueError(
            f"answer_locator {spec!r}: no file {path!r}; give the path of an existing .py file (absolute, or "
            f"relative to the current directory {os.getcwd()!r}) that every worker can read"
        )
    module_name = "verl_oar_answer_locator_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    module = sys.modules.get(module_name)
    if module is None:
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        if module_spec is None or module_spec.loader is None:
            raise ValueError(
                f"answer_locator {spec!r}: Python cannot load {path!r} as a module; give a .py source file"
            )
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module
        try:
            module_spec.loader.exec_module(module)
        except BaseException as error:
            del sys.modules[module_name]
            if not isinstance(error, Exception):
                raise
            raise ValueError(
                f"answer_locator {spec!r}: executing {path!r} failed ({type(error).__name__}: {error}); fix the "
                f"file (it must import cleanly in every worker)"
            ) from error
    return _checked_attribute(spec, module, f"file {path!r}", name)


def _checked_attribute(spec: str, module: ModuleType, where: str, name: str) -> AnswerLocator:
    if not hasattr(module, name):
        functions = sorted(
            key for key, value in vars(module).items()
            if inspect.isfunction(value) and not key.startswith("_") and value.__module__ == module.__name__
        )
        hint = f"; it defines {', '.join(functions)}" if functions else "; it defines no public function"
        raise ValueError(f"answer_locator {spec!r}: {where} has no attribute {name!r}{hint}. Fix the name after the "
                         f"{'last dot' if spec.strip().startswith('pkg://') else 'colon'}")
    locator: Any = getattr(module, name)
    if not callable(locator):
        raise ValueError(
            f"answer_locator {spec!r}: {where}.{name} is {type(locator).__name__} {locator!r:.80}, not callable; "
            f"name a function text -> AnswerSpan | None"
        )
    try:
        signature = inspect.signature(locator)
    except (TypeError, ValueError):     # some builtins and C callables have none: accept them
        return locator
    try:
        signature.bind("")
    except TypeError as error:
        raise ValueError(
            f"answer_locator {spec!r}: {where}.{name}{signature} cannot be called with one argument (the "
            f"response text): {error}; give it the signature (text: str) -> AnswerSpan | None"
        ) from None
    return locator
