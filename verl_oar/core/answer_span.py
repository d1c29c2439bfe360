"""Answer span: where the final answer of a math response is, in characters and in tokens.

OAR grounds token importance on the model's prediction of the *final answer*; the tokens before
the answer are the *reasoning* tokens that get reshaped. For math the final answer is found by three
rules of decreasing rank; a rule is consulted only when the ones above it found nothing, and within a
rule only the *last* marker in the text counts (if that marker has no content, the rule finds nothing:
an earlier marker of the same rule is not used):

1. **Box**: the content of the last ``\\boxed{...}`` or ``\\fbox{...}`` (nested braces matched, ``\\{``
   and ``\\}`` escaped), or of ``\\boxed <content>`` (up to ``$``, ``\\]``, ``\\)`` or the end of the
   line, as in verl's and Hendrycks' ``last_boxed_only_string``). A box inside display or inline math
   (``\\[ \\boxed{42} \\]``, ``$\\boxed{42}$``) gives the box's content: the math delimiters are never
   part of it. An unclosed last box (a truncated response) or an empty one falls through to 2.
2. **Explicit marker**, the later of the two kinds below (by the marker's first character; a label
   beats a ``####`` that starts at the same character, as in the heading ``#### Final Answer``):

   * a *label*: a line whose first non-blank characters are ``Answer`` or ``Final Answer``
     (case-insensitive), optionally after a quote ``>``, a heading ``#``..``######`` and markdown emphasis
     (``**Answer:**``, ``**Answer**:``, ``__Final Answer__:``, ``## Final Answer``), followed by a colon,
     or by nothing else on its line (a heading). ``Answer: 42`` is DAPO-Math's required last line. The
     content is the rest of the label's line; when that is blank, the next non-blank line. If that
     content line contains a saying-form phrase (rule 3, e.g. Minerva's ``Final Answer: The final
     answer is $42$. I hope it is correct.``), the content starts after its last phrase on that line.
     The marker (``marker_start``) is still the label. ``Answer the question`` (no colon) and
     ``so Answer: 5`` (not at the start of its line) are no labels;
   * ``####`` (exactly four, GSM8K): the content is the rest of its line.
3. **Saying form**: the last "The answer is" / "The final answer is" (also "my", "our" for "the", or
   "Final answer is"; case-insensitive, optional colon). The content is the rest of its line; when that
   is blank and the phrase ends with a colon (``The final answer is:`` then display math), the next
   non-blank line.

The content of rules 2 and 3 (a *phrase*) is read from its start to the first of, at top level:

* the end of the line (a display-math block ``$$``/``\\[`` opened at the start of the content and
  closed on a later line is read whole);
* a sentence end: ``.`` followed by whitespace or the end of the text, unless it follows another
  dot (``1, 2, 3, ...`` keeps its ellipsis), or ``。``;
* a *justification*: ``,`` or ``;``, whitespace, then one of the words since, because, as, so,
  which, where, whereas, while, and, but, therefore, thus, hence, given, i.e., e.g. (a whole word,
  any case); or whitespace then ``because`` / ``since`` with no punctuation (subordinators that no
  math answer contains). ``The answer is 3, since 3 is odd.`` -> ``3``.

*Top level* means outside ``(...)``, ``[...]``, ``{...}``, ``\\(...\\)``, ``\\[...\\]``, ``\\{...\\}``
(one depth counter for all brackets, so ``[0, 1)`` is closed; a stray closer does not go below 0)
and outside ``$...$`` / ``$$...$$`` whose closing ``$`` is on the same line (a lone ``$``, as in the
amount ``$5, so``, is an ordinary character). So the cut never splits a formula:
``1,000`` (no space after the comma), ``(1, 2)`` (inside brackets) and ``x = 3, y = 4`` (``y`` is
no justification word) are kept whole; a comma-separated list of values is one answer (the verifier
compares it as a tuple/set). ``x = 3, and y = 4`` is cut after ``x = 3``: ", and" is read as the
start of a justification (write the list without "and" or box it). Then the content is trimmed of
whitespace, one trailing ``.`` is removed (not from ``...``), and one pair of math delimiters
enclosing all of it is removed (``$...$``, ``$$...$$``, ``\\(...\\)``, ``\\[...\\]``; only when they
are a pair, so ``$1$ and $2$`` stays), then trimmed and a trailing ``.`` removed again.
``The answer is $\\frac{1}{2}$.`` -> ``\\frac{1}{2}``. Empty content is "not found".

Token mapping: the response is decoded once with ``skip_special_tokens=True`` (what verl's reward
functions grade); every token gets the character span it produced in that text. For byte-level BPE
tokenizers (GPT-2, Qwen2, Llama-3) the span comes from each token's bytes, so a character whose
UTF-8 bytes are split over several tokens belongs to all of them; other tokenizers are decoded
incrementally (a short sliding window, like streaming detokenizers), O(T) small decodes. Either way
the concatenation is checked against ``tokenizer.decode`` of the whole response.

Reasoning tokens end at or before the answer marker (``marker_start``); answer tokens overlap the
answer content; the marker itself, what follows the answer (closing brace, justification, end of
sequence) and padding are neither.

Pluggable locators: :func:`locate_answer_tokens` and :func:`answer_token_masks` take any function
``text -> AnswerSpan | None`` in place of :func:`find_answer_span` (``verl_oar.core.answer_locator``
loads one from ``algorithm.oar.answer_locator``), and :func:`answer_token_masks` takes per-row spans
given by the caller (e.g. the span the reward function graded, ``"<marker_start>:<start>:<end>"`` in
its result: :func:`parse_answer_span`). Every span is checked: an :class:`AnswerSpan` of ints with
``0 <= marker_start <= start < end <= len(text)``, else ValueError naming where it came from.
"""

from __future__ import annotations

import codecs
import functools
import itertools
import logging
import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "AnswerLocator",
    "AnswerSpan",
    "answer_token_masks",
    "decode_with_offsets",
    "token_texts",
    "find_answer_span",
    "format_answer_span",
    "line_break_tokens",
    "locate_answer_tokens",
    "parse_answer_span",
    "token_char_offsets",
]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# 1. The answer in the text
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AnswerSpan:
    """Character offsets of the final answer in a response text."""

    marker_start: int
    """Where the answer's marker (``\\boxed``, ``Answer:``, ``####``, "The answer is") begins: the
    reasoning tokens are those that end at or before it."""
    start: int
    """First character of the answer content."""
    end: int
    """One past its last character: the content is ``text[start:end]``."""


AnswerLocator = Callable[[str], AnswerSpan | None]
"""A function ``text -> AnswerSpan | None`` like :func:`find_answer_span` (``verl_oar.core.answer_locator``)."""


_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_EMPHASIS = r"(?:\*{1,2}|_{1,2})"
_LABEL = re.compile(  # closing emphasis only after an opening one: "Answer: *x*" keeps its "*"
    r"^[ \t]*(?P<marker>(?:>[ \t]*)?(?:#{1,6}[ \t]*)?(?P<em>" + _EMPHASIS + r"[ \t]*)?"
    r"(?:final[ \t]+)?answer(?![A-Za-z0-9])[ \t]*(?(em)" + _EMPHASIS + r"?)[ \t]*"
    r"(?::(?(em)(?:[ \t]*" + _EMPHASIS + r"(?![*_]))?)|(?=[ \t]*$)))",
    re.IGNORECASE | re.MULTILINE,
)
_HASH = re.compile(r"(?<!#)####(?!#)")
_SAY = re.compile(r"\b(?:(?:the|my|our)\s+(?:final\s+)?|final\s+)answer\s+is\b[ \t]*:?", re.IGNORECASE)
_JUSTIFICATION = re.compile(
    r"[,;]\s+(?:(?:since|because|as|so|which|where|whereas|while|and|but|therefore|thus|hence|given)"
    r"(?![A-Za-z0-9])|i\.e\.|e\.g\.)|\s+(?:because|since)(?![A-Za-z0-9])",
    re.IGNORECASE,
)
_UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")
_MATH_PAIRS = (("$$", "$$"), ("\\[", "\\]"), ("\\(", "\\)"), ("$", "$"))


def find_answer_span(text: str) -> AnswerSpan | None:
    """Locate the final answer of a math response (rules and precedence in the module docstring).

    Returns None when no marker with non-empty content is found.
    """
    for finder in (_boxed_span, _marked_span, _saying_span):
        span = finder(text)
        if span is not None:
            return span
    return None


def _trimmed(text: str, marker_start: int, start: int, end: int) -> AnswerSpan | None:
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return AnswerSpan(marker_start, start, end) if end > start else None


def _last_match(pattern: re.Pattern[str], text: str, pos: int = 0, endpos: int | None = None) -> re.Match[str] | None:
    last = None
    for last in pattern.finditer(text, pos, len(text) if endpos is None else endpos):
        pass
    return last


def _line_end(text: str, pos: int) -> int:
    end = text.find("\n", pos)
    return len(text) if end < 0 else end


def _next_content_line(text: str, pos: int) -> tuple[int, int] | None:
    """``(start, end)`` of the first non-blank line after the line holding ``pos``, or None."""
    end = _line_end(text, pos)
    while end < len(text):
        start, end = end + 1, _line_end(text, end + 1)
        if text[start:end].strip():
            return start, end
    return None


def _boxed_span(text: str) -> AnswerSpan | None:
    last = _last_match(_BOX, text)
    if last is None:
        return None
    pos = last.end()
    while pos < len(text) and text[pos].isspace():
        pos += 1
    if pos < len(text) and text[pos] == "{":
        depth, i = 1, pos + 1
        while i < len(text):
            char = text[i]
            if char == "\\":
                i += 2          # \{ \} \\ are not structure
                continue
            if char == "{":
                depth += 1
            elif char == "}":
                depth -= 1
                if depth == 0:
                    return _trimmed(text, last.start(), pos + 1, i)
            i += 1
        return None             # unclosed: truncated response
    if pos == last.end():       # "\boxedx": another macro, or "\boxed" at the very end
        return None
    end = pos                   # "\boxed 5": up to $, \], \) or the end of the line
    while end < len(text) and text[end] not in "$\n" and not text.startswith(("\\]", "\\)"), end):
        end += 1
    return _trimmed(text, last.start(), pos, end)


def _marked_span(text: str) -> AnswerSpan | None:
    label = _last_match(_LABEL, text)
    hashes = _last_match(_HASH, text)
    if label is not None and (hashes is None or label.start("marker") >= hashes.start()):
        return _label_span(text, label)
    if hashes is not None:
        return _phrase_span(text, hashes.start(), hashes.end())
    return None


def _label_span(text: str, label: re.Match[str]) -> AnswerSpan | None:
    pos, line_end = label.end(), _line_end(text, label.end())
    if not text[pos:line_end].strip():      # a heading: the answer is on the next non-blank line
        line = _next_content_line(text, pos)
        if line is None:
            return None
        pos, line_end = line
    phrase = _last_match(_SAY, text, pos, line_end)
    return _phrase_span(text, label.start("marker"), pos if phrase is None else phrase.end())


def _saying_span(text: str) -> AnswerSpan | None:
    last = _last_match(_SAY, text)
    if last is None:
        return None
    pos = last.end()
    if not text[pos:_line_end(text, pos)].strip() and text[pos - 1] == ":":
        line = _next_content_line(text, pos)
        if line is not None:
            pos = line[0]
    return _phrase_span(text, last.start(), pos)


def _phrase_span(text: str, marker_start: int, pos: int) -> AnswerSpan | None:
    """The answer content of a phrase that starts at ``pos`` (rules in the module docstring)."""
    line_end = _line_end(text, pos)
    while pos < line_end and text[pos].isspace():
        pos += 1
    end = _display_block_end(text, pos, line_end)
    if end is None:
        end = _phrase_end(text, pos, line_end)
    span = _trimmed(text, marker_start, pos, end)
    if span is None:
        return None
    start, end = _unwrapped_math(text, span.start, _without_period(text, span.start, span.end))
    span = _trimmed(text, marker_start, start, end)
    if span is None:
        return None
    return _trimmed(text, marker_start, span.start, _without_period(text, span.start, span.end))


def _display_block_end(text: str, pos: int, line_end: int) -> int | None:
    """End of a ``$$``/``\\[`` display block opened at ``pos`` and closed on a later line, else None."""
    for opening, closing in _MATH_PAIRS[:2]:
        if text.startswith(opening, pos):
            close = text.find(closing, pos + len(opening))
            if close > line_end:
                return close + len(closing)
    return None


def _math_end(text: str, pos: int, line_end: int) -> int | None:
    """End of the ``$...$`` / ``$$...$$`` opened at ``pos`` if it closes on this line, else None."""
    opening = "$$" if text.startswith("$$", pos) else "$"
    if opening == "$$":
        close = text.find("$$", pos + 2, line_end)
        return None if close < 0 else close + 2
    close = _UNESCAPED_DOLLAR.search(text, pos + 1, line_end)
    return None if close is None else close.end()


def _phrase_end(text: str, pos: int, line_end: int) -> int:
    """Where a phrase's content ends: the first top-level sentence end or justification, else the line end."""
    depth, i = 0, pos
    while i < line_end:
        char = text[i]
        if char == "\\":
            escaped = text[i + 1:i + 2]
            if escaped and escaped in "([{":
                depth += 1
            elif escaped and escaped in ")]}":
                depth = max(0, depth - 1)
            i += 2
            continue
        if char == "$":
            close = _math_end(text, i, line_end)
            if close is not None:
                i = close
                continue
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth = max(0, depth - 1)
        elif depth == 0:
            if char == "。" or (char == "." and (i + 1 == len(text) or text[i + 1].isspace())
                                and (i == pos or text[i - 1] != ".")):
                return i
            if char in ",; \t" and _JUSTIFICATION.match(text, i, line_end):
                return i
        i += 1
    return line_end


def _without_period(text: str, start: int, end: int) -> int:
    """``end`` less one trailing ``.`` (not the last dot of an ellipsis)."""
    if end > start and text[end - 1] == "." and not (end - 2 >= start and text[end - 2] == "."):
        return end - 1
    return end


def _unwrapped_math(text: str, start: int, end: int) -> tuple[int, int]:
    """``(start, end)`` inside one pair of math delimiters enclosing all of ``text[start:end]``."""
    for opening, closing in _MATH_PAIRS:
        inner_start, inner_end = start + len(opening), end - len(closing)
        if inner_start > inner_end or not (text.startswith(opening, start) and text.startswith(closing, inner_end)):
            continue
        inner = text[inner_start:inner_end]
        paired = _UNESCAPED_DOLLAR.search(inner) is None if opening == "$" else closing not in inner
        return (inner_start, inner_end) if paired else (start, end)
    return start, end


_SPAN_STRING = re.compile(r"(\d+):(\d+):(\d+)", re.ASCII)


def format_answer_span(span: AnswerSpan | None) -> str:
    """``"<marker_start>:<start>:<end>"``, or ``""`` for None: the form a reward function returns
    (a string, so that verl does not average it into metrics); read back by :func:`parse_answer_span`."""
    return "" if span is None else f"{span.marker_start}:{span.start}:{span.end}"


def parse_answer_span(value: str | AnswerSpan | None) -> AnswerSpan | None:
    """Read a span in the form :func:`format_answer_span` writes (e.g. ``verl_oar.rewards.math_reward``'s
    ``answer_span``): ``"<marker_start>:<start>:<end>"`` -> AnswerSpan; None, ``""`` (or blanks) -> None;
    an AnswerSpan is returned as is. ValueError on anything else, or on offsets out of order
    (``marker_start <= start < end`` is required; the bound ``end <= len(text)`` is checked where the
    text is known, in :func:`answer_token_masks`)."""
    if value is None or isinstance(value, AnswerSpan):
        return value
    if not isinstance(value, str):
        raise ValueError(
            f"answer span {value!r} ({type(value).__name__}) is not a string: expected "
            f"'<marker_start>:<start>:<end>' (character offsets) or '' for no answer"
        )
    if not value.strip():
        return None
    match = _SPAN_STRING.fullmatch(value.strip())
    if match is None:
        raise ValueError(
            f"answer span {value!r} is not of the form '<marker_start>:<start>:<end>' (three non-negative "
            f"integers, character offsets, e.g. '10:22:24') or '' for no answer"
        )
    marker_start, start, end = map(int, match.groups())
    if not marker_start <= start < end:
        raise ValueError(
            f"answer span {value!r} is out of order: need marker_start <= start < end (the answer content "
            f"text[start:end] is not empty and its marker does not begin after it)"
        )
    return AnswerSpan(marker_start, start, end)


def _checked_span(value: Any, text: str, source: str) -> AnswerSpan | None:
    """``value`` if it is None or a valid AnswerSpan of ``text``; ValueError naming ``source`` otherwise."""
    if value is None:
        return None
    if not isinstance(value, AnswerSpan):
        raise ValueError(
            f"{source} returned {value!r} ({type(value).__name__}); an answer locator must return "
            f"verl_oar.core.answer_span.AnswerSpan(marker_start, start, end) or None"
        )
    try:
        fields = [operator.index(v) for v in (value.marker_start, value.start, value.end)]
    except TypeError:
        fields = None
    if fields is None or any(isinstance(v, bool) for v in (value.marker_start, value.start, value.end)):
        raise ValueError(f"{source} returned {value!r}: its offsets must be integers (character offsets)")
    marker_start, start, end = fields
    if not 0 <= marker_start <= start < end <= len(text):
        raise ValueError(
            f"{source} returned {value!r} for a text of {len(text)} characters: need "
            f"0 <= marker_start <= start < end <= {len(text)} (character offsets into the response decoded "
            f"with skip_special_tokens=True; the answer is text[start:end], non-empty)"
        )
    return AnswerSpan(marker_start, start, end)


def _locator_name(locator: Any) -> str:
    module = getattr(locator, "__module__", None)
    name = getattr(locator, "__qualname__", None) or getattr(locator, "__name__", None)
    return f"answer locator {module}.{name}" if module and name else f"answer locator {locator!r}"


# ---------------------------------------------------------------------------------------------
# 2. Characters of each token
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {byte: chr(code) for byte, code in zip(printable, codes)}


@functools.lru_cache(maxsize=1)
def _byte_of_unicode() -> dict[str, int]:
    """Inverse of :func:`bytes_to_unicode`: the byte each printable character stands for."""
    return {char: byte for byte, char in bytes_to_unicode().items()}


def _special_ids(tokenizer: Any) -> set[int]:
    ids = {int(i) for i in getattr(tokenizer, "all_special_ids", []) or []}
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(int(i) for i, tok in added.items() if getattr(tok, "special", False))
    return ids


def _byte_level_pieces(ids: list[int], tokenizer: Any, skip_special: bool) -> list[bytes] | None:
    """Bytes of each token as GPT-2's ByteLevel decoder reads them: a token made only of characters
    of the byte alphabet is those bytes; any other token (e.g. an added token with other characters,
    or a SentencePiece piece) is its own UTF-8. Skipped special tokens produce no bytes. Whether this
    reproduces the tokenizer's decoding is checked by the caller."""
    table = _byte_of_unicode()
    skipped = _special_ids(tokenizer) if skip_special else set()
    pieces = []
    for token_id, token in zip(ids, tokenizer.convert_ids_to_tokens(ids)):
        if token_id in skipped:
            pieces.append(b"")
        elif token is None:
            return None
        elif all(char in table for char in token):
            pieces.append(bytes(table[char] for char in token))
        else:
            pieces.append(token.encode("utf-8"))
    return pieces


def _char_span_of_bytes(data: bytes) -> tuple[str, list[int], list[int]]:
    """Decode UTF-8 with replacement; return the text and, per byte, the span of characters it is
    part of (a replacement character spans all the bytes it replaces)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        pass
    else:  # valid UTF-8: a character starts at every byte that is not a continuation byte
        index = list(itertools.accumulate(int((b & 0xC0) != 0x80) for b in data))
        return text, [i - 1 for i in index], index
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    starts, ends, parts = [0] * len(data), [0] * len(data), []
    count, pending = 0, 0
    for k in range(len(data) + 1):  # one byte at a time; the final call flushes held bytes
        out = decoder.decode(data[k:k + 1], final=k == len(data))
        done = min(k + 1, len(data)) - len(decoder.getstate()[0])   # bytes [pending, done) made `out`
        if not out:
            continue
        # Several characters from one byte: the earlier bytes became U+FFFD(s) and the last byte is
        # the last character on its own (bytes are fed one by one, so no longer character can end here).
        total = count + len(out)
        if len(out) > 1 and done - pending > 1:
            for j in range(pending, done - 1):
                starts[j], ends[j] = count, total - 1
            starts[done - 1], ends[done - 1] = total - 1, total
        else:
            for j in range(pending, done):
                starts[j], ends[j] = count, total
        count += len(out)
        pending = done
        parts.append(out)
    return "".join(parts), starts, ends


def _byte_level_offsets(
    ids: list[int], tokenizer: Any, skip_special: bool
) -> tuple[str, list[tuple[int, int]]] | None:
    pieces = _byte_level_pieces(ids, tokenizer, skip_special)
    if pieces is None:
        return None
    text, starts, ends = _char_span_of_bytes(b"".join(pieces))
    offsets, cursor = [], 0
    for piece in pieces:
        if piece:
            offsets.append((starts[cursor], ends[cursor + len(piece) - 1]))
        else:  # zero-width token: sits after whatever came before it
            at = ends[cursor - 1] if cursor else 0
            offsets.append((at, at))
        cursor += len(piece)
    return text, offsets


def _incremental_offsets(ids: list[int], tokenizer: Any, skip_special: bool) -> tuple[str, list[tuple[int, int]]]:
    """Streaming detokenisation: the text a token adds is decode(window + token) minus
    decode(window), where the window is the previous emitted group (so SentencePiece's leading-space
    rule sees context). Tokens that end inside a character (decode ends in U+FFFD) wait for the next
    ones and the group shares the span."""

    def decode(a: int, b: int) -> str:
        return tokenizer.decode(ids[a:b], skip_special_tokens=skip_special, clean_up_tokenization_spaces=False)

    offsets: list[tuple[int, int]] = [(0, 0)] * len(ids)
    parts: list[str] = []
    count = 0
    prefix, read, prefix_text = 0, 0, ""
    for i in range(len(ids)):
        new_text = decode(prefix, i + 1)
        last = i == len(ids) - 1
        if new_text == prefix_text and read == i and decode(i, i + 1) == "":
            offsets[i] = (count, count)      # zero-width (e.g. a skipped special token)
            read = i + 1
            continue
        complete = len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd")
        if not (complete or last):
            continue
        delta = new_text.removeprefix(prefix_text)
        for j in range(read, i + 1):
            offsets[j] = (count, count + len(delta))
        count += len(delta)
        parts.append(delta)
        prefix, read = read, i + 1
        prefix_text = decode(prefix, read)
    return "".join(parts), offsets


def decode_with_offsets(
    token_ids: Sequence[int], tokenizer: Any, skip_special_tokens: bool = False
) -> tuple[str, list[tuple[int, int]]]:
    """Decode ``token_ids`` and give each token's ``(start, end)`` character span in the text.

    The text is ``tokenizer.decode(token_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)``
    whenever the per-token pieces reproduce it (always, for byte-level BPE and for tokenizers whose
    decoding is concatenative). Otherwise a warning is logged and the text returned is the
    concatenation of the incremental pieces, so that offsets and text still agree.
    Spans of consecutive tokens may share characters (a multi-byte character split over tokens);
    skipped special tokens get an empty span at their position.
    """
    ids = [int(i) for i in token_ids]
    reference = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
    byte_level = _byte_level_offsets(ids, tokenizer, skip_special_tokens)
    if byte_level is not None and byte_level[0] == reference:
        return byte_level
    text, offsets = _incremental_offsets(ids, tokenizer, skip_special_tokens)
    if text != reference:
        logger.warning(
            "verl_oar.core.answer_span: %s does not decode token by token to the same text as a whole; "
            "answer spans are located on the token-by-token text", type(tokenizer).__name__,
        )
    return text, offsets


def token_char_offsets(token_ids: Sequence[int], tokenizer: Any) -> list[tuple[int, int]]:
    """Character span ``(start, end)`` of each token in ``tokenizer.decode(token_ids,
    skip_special_tokens=False, clean_up_tokenization_spaces=False)`` (see :func:`decode_with_offsets`)."""
    return decode_with_offsets(token_ids, tokenizer, skip_special_tokens=False)[1]


def token_texts(token_ids: Sequence[int], tokenizer: Any) -> list[str]:
    """The text each token produced (special tokens included), as :func:`decode_with_offsets` splits it."""
    text, offsets = decode_with_offsets(token_ids, tokenizer, skip_special_tokens=False)
    return [text[start:end] for start, end in offsets]


# ---------------------------------------------------------------------------------------------
# 3. Reasoning and answer tokens
# ---------------------------------------------------------------------------------------------


def _classify(offsets: list[tuple[int, int]], span: AnswerSpan) -> tuple[list[bool], list[bool]]:
    reasoning = [end <= span.marker_start for _, end in offsets]
    answer = [start < span.end and end > span.start for start, end in offsets]
    return reasoning, answer


def locate_answer_tokens(
    token_ids: Sequence[int], tokenizer: Any, locator: AnswerLocator | None = None
) -> tuple[list[bool], list[bool]] | None:
    """Classify the tokens of one response (no padding) as reasoning and/or answer tokens.

    The response is decoded with ``skip_special_tokens=True`` and ``locator`` (default
    :func:`find_answer_span`) finds the answer in that text; its result is checked (ValueError naming
    the locator if it is not None or an AnswerSpan with ``0 <= marker_start <= start < end <= len(text)``).
    Reasoning: the token's span ends at or before the marker's first character (skipped special
    tokens before the marker included). Answer: the token's span overlaps the answer content.

    Returns:
        ``(reasoning, answer)``, two lists of ``len(token_ids)`` bools, or None when no answer is found.
    """
    text, offsets = decode_with_offsets(token_ids, tokenizer, skip_special_tokens=True)
    locator = find_answer_span if locator is None else locator
    span = _checked_span(locator(text), text, _locator_name(locator))
    return None if span is None else _classify(offsets, span)


def answer_token_masks(
    responses: Tensor,
    response_mask: Tensor,
    tokenizer: Any,
    locator: AnswerLocator | None = None,
    spans: Sequence[AnswerSpan | None] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Reasoning and answer masks of a batch of responses (one text pass per row).

    Args:
        responses: (B, T) long, response token ids; padding may hold any id.
        response_mask: (B, T) bool or 0/1; true on the response's real tokens (in verl a prefix).
        tokenizer: a Hugging Face tokenizer (``decode``, ``convert_ids_to_tokens``).
        locator: ``text -> AnswerSpan | None`` for the rows without a span (default :func:`find_answer_span`).
        spans: optional, B entries of ``AnswerSpan | None``: a row's span in characters of its text as
            :func:`locate_answer_tokens` decodes it (the row's masked tokens, ``skip_special_tokens=True``),
            used instead of calling the locator; None rows call the locator. Every span is checked
            against its row's text (ValueError naming the row). Mind the decoding: verl's reward managers
            decode with the tokenizer's default ``clean_up_tokenization_spaces``; where that is True
            (e.g. Llama-3's tokenizer config) a reward's offsets can be shifted from this text (which
            is decoded without clean-up), and only their range is checked here.

    Returns:
        reasoning: (B, T) bool, answer: (B, T) bool — both False on padding and on rows without an
        answer; found: (B,) bool. All on ``responses``' device.
    """
    batch, length = responses.shape
    if spans is not None and len(spans) != batch:
        raise ValueError(
            f"answer_token_masks: {len(spans)} spans for {batch} responses; give one per row (None: locate it)"
        )
    locator = find_answer_span if locator is None else locator
    name = _locator_name(locator)
    mask = response_mask.to(torch.bool).cpu()
    ids = responses.cpu()
    reasoning = torch.zeros(batch, length, dtype=torch.bool)
    answer = torch.zeros(batch, length, dtype=torch.bool)
    found = torch.zeros(batch, dtype=torch.bool)
    for row in range(batch):  # text processing is per sample by nature
        positions = mask[row].nonzero().squeeze(1)
        text, offsets = decode_with_offsets(ids[row, positions].tolist(), tokenizer, skip_special_tokens=True)
        given = None if spans is None else spans[row]
        if given is not None:
            span = _checked_span(given, text, f"spans[{row}] (given to answer_token_masks)")
        else:
            span = _checked_span(locator(text), text, name)
        if span is None:
            continue
        located = _classify(offsets, span)
        found[row] = True
        reasoning[row, positions] = torch.tensor(located[0], dtype=torch.bool)
        answer[row, positions] = torch.tensor(located[1], dtype=torch.bool)
    device = responses.device
    return reasoning.to(device), answer.to(device), found.to(device)


def line_break_tokens(token_ids: Sequence[int], tokenizer: Any) -> list[bool]:
    """Whether each token's text contains a line break: the tokens that end a reasoning step
    (OAR-P's ``line`` occlusion mode)."""
    text, offsets = decode_with_offsets(token_ids, tokenizer, skip_special_tokens=False)
    return ["\n" in text[start:end] for start, end in offsets]
