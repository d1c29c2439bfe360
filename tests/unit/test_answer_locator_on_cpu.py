"""Pluggable answer locators (verl_oar.core.answer_locator): every spec form resolves, is cached, and every
way of getting it wrong is a ValueError that names the problem and the fix."""

from __future__ import annotations

import sys
import textwrap

import pytest

from verl_oar.core.answer_locator import load_answer_locator
from verl_oar.core.answer_span import AnswerSpan, find_answer_span

LOCATOR_FILE = '''
from dataclasses import dataclass
from verl_oar.core.answer_span import AnswerSpan

CALLS = []

@dataclass
class Marker:           # a dataclass in the file: needs the module in sys.modules
    text: str = "ANS="

def last_line(text):
    CALLS.append(text)
    start = text.rfind(Marker().text)
    if start < 0:
        return None
    return AnswerSpan(start, start + 4, len(text))

NOT_CALLABLE = 3

def two_args(text, extra):
    return None
'''


@pytest.fixture
def locator_file(tmp_path):
    path = tmp_path / "my_locator.py"
    path.write_text(LOCATOR_FILE)
    return path


@pytest.fixture
def locator_package(tmp_path, monkeypatch):
    package = tmp_path / "pkg_locators"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "mine.py").write_text(LOCATOR_FILE)
    (package / "broken.py").write_text("import module_that_is_not_there_42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "pkg_locators"
    for name in [m for m in sys.modules if m.startswith("pkg_locators")]:
        del sys.modules[name]


@pytest.mark.parametrize("spec", ["", "   ", None])
def test_empty_spec_is_the_built_in(spec):
    assert load_answer_locator(spec) is find_answer_span


def test_pkg_spec(locator_package):
    locator = load_answer_locator(f"pkg://{locator_package}.mine.last_line")
    assert locator("x\nANS=12") == AnswerSpan(2, 6, 8)
    assert locator("nothing") is None
    assert load_answer_locator(f" pkg://{locator_package}.mine.last_line ") is locator
    assert load_answer_locator("pkg://verl_oar.core.answer_span.find_answer_span") is find_answer_span


def test_file_spec_is_executed_once(locator_file, monkeypatch):
    locator = load_answer_locator(f"{locator_file}:last_line")
    assert locator("a ANS=7") == AnswerSpan(2, 6, 7)
    assert load_answer_locator(f"{locator_file}:last_line") is locator              # cached
    module = sys.modules[locator.__module__]
    assert module.CALLS == ["a ANS=7"]
    # a relative spelling of the same file reaches the same module, not a second execution
    monkeypatch.chdir(locator_file.parent)
    assert load_answer_locator("my_locator.py:last_line") is locator


@pytest.mark.parametrize("spec", [
    "pkg://", "pkg://module_only", "pkg://a..b", "pkg://a.b-c.f", "my_module.find", "/x/locator.py",
    "/x/locator.txt:find", "/x/locator.py:", "/x/locator.py:not an identifier", ":find",
])
def test_malformed_specs(spec):
    with pytest.raises(ValueError, match="malformed") as error:
        load_answer_locator(spec)
    assert "pkg://package.module.function" in str(error.value) or "pkg://my_package" in str(error.value)


def test_not_a_string():
    with pytest.raises(ValueError, match="not a string"):
        load_answer_locator(3)


def test_module_not_importable(locator_package):
    with pytest.raises(ValueError, match="cannot import module 'no_such_package_42.sub'") as error:
        load_answer_locator("pkg://no_such_package_42.sub.find")
    assert "No module named 'no_such_package_42'" in str(error.value) and "PYTHONPATH" in str(error.value)
    # an import error inside the module is reported with its text too
    with pytest.raises(ValueError, match="module_that_is_not_there_42"):
        load_answer_locator(f"pkg://{locator_package}.broken.find")


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="no file") as error:
        load_answer_locator(f"{tmp_path}/absent.py:find")
    assert "existing .py file" in str(error.value)


def test_file_that_fails(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text("def find(text)\n    return None\n")
    with pytest.raises(ValueError, match="executing .* failed \\(SyntaxError") as error:
        load_answer_locator(f"{path}:find")
    assert "fix the file" in str(error.value)
    path.write_text("def find(text):\n    return None\n")            # fixed: loads now (errors are not cached)
    assert load_answer_locator(f"{path}:find")("x") is None


@pytest.mark.parametrize("form", ["pkg", "file"])
def test_missing_attribute(form, locator_file, locator_package):
    spec = f"pkg://{locator_package}.mine.lastline" if form == "pkg" else f"{locator_file}:lastline"
    with pytest.raises(ValueError, match="has no attribute 'lastline'") as error:
        load_answer_locator(spec)
    assert "last_line, two_args" in str(error.value)                                  # what it does define
    assert ("last dot" if form == "pkg" else "colon") in str(error.value)


def test_not_callable(locator_file):
    with pytest.raises(ValueError, match="NOT_CALLABLE is int 3, not callable"):
        load_answer_locator(f"{locator_file}:NOT_CALLABLE")


def test_wrong_signature(locator_file):
    with pytest.raises(ValueError, match="cannot be called with one argument") as error:
        load_answer_locator(f"{locator_file}:two_args")
    assert "(text: str) -> AnswerSpan | None" in str(error.value)


def test_locator_file_drives_the_token_masks(locator_file):
    """End to end: a loaded locator decides the answer tokens (byte-level vocabulary of 256 symbols)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from verl_oar.core.answer_span import answer_token_masks

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok)
    text = textwrap.dedent("""\
        so \\boxed{5} is wrong
        ANS=6""")
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    reasoning, answer, found = answer_token_masks(ids, torch.ones_like(ids), tokenizer,
                                                  locator=load_answer_locator(f"{locator_file}:last_line"))
    assert found.tolist() == [True]
    assert answer[0].nonzero().squeeze(1).tolist() == [len(text) - 1]               # the "6", not the box
    assert int(reasoning[0].sum()) == text.index("ANS=")
