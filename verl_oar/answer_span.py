"""Answer span: where the final answer of a math response is, in characters and in tokens.

OAR grounds token importance on the model's prediction of the *final answer*; the tokens before
the answer are the *reasoning* tokens that get reshaped. For math the final answer is, in order of
precedence (only the last occurrence of a marker counts):

1. the content of the last ``\\boxed{...}`` or ``\\fbox{...}`` (nested braces matched, ``\\{``
   and ``\\}`` escaped), or of ``\\boxed <content>`` (up to ``$`` or the end of the line, as in
   verl's and Hendrycks' ``last_boxed_only_string``). An unclosed last box (a truncated response)
   or an empty one falls through to 2;
2. what follows the last ``####`` up to the end of its line (GSM8K);
3. what follows the last "The answer is" / "The final answer is" (case-insensitive, optional colon)
   up to the end of its sentence (a period followed by whitespace or the end) or line, with a
   trailing period stripped.
Content is trimmed of surrounding whitespace; empty content is "not found".

Token mapping: the response is decoded once with ``skip_special_tokens=True`` (what verl's reward
functions grade); every token gets the character span it produced in that text. For byte-level BPE
tokenizers (GPT-2, Qwen2, Llama-3) the span comes from each token's bytes, so a character whose
UTF-8 bytes are split over several tokens belongs to all of them; other tokenizers are decoded
incrementally (a short sliding window, like streaming detokenizers), O(T) small decodes. Either way
the concatenation is checked against ``tokenizer.decode`` of the whole response.

Reasoning tokens end at or before the answer marker; answer tokens overlap the answer content; the
marker itself, what follows the answer (closing brace, end of sequence) and padding are neither.
"""

from __future__ import annotations

import codecs
import functools
import itertools
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "AnswerSpan",
    "answer_token_masks",
    "decode_with_offsets",
    "find_answer_span",
    "line_break_tokens",
    "locate_answer_tokens",
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
    """Where the answer's marker (``\\boxed``, ``####``, "The answer is") begins."""
    start: int
    """First character of the answer content."""
    end: int
    """One past its last character: the content is ``text[start:end]``."""


_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_SAY = re.compile(r"\bthe\s+(?:final\s+)?answer\s+is\b[ \t]*:?", re.IGNORECASE)
_SENTENCE_END = re.compile(r"\.(?=\s|$)|\n")


def find_answer_span(text: str) -> AnswerSpan | None:
    """Locate the final answer of a math response (precedence in the module docstring).

    Returns None when no marker with non-empty content is found.
    """
    for finder in (_boxed_span, _hash_span, _saying_span):
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


def _last_match(pattern: re.Pattern[str], text: str) -> re.Match[str] | None:
    last = None
    for last in pattern.finditer(text):
        pass
    return last


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
    end = pos
    while end < len(text) and text[end] not in "$\n":
        end += 1
    return _trimmed(text, last.start(), pos, end)


def _hash_span(text: str) -> AnswerSpan | None:
    marker = text.rfind("####")
    if marker < 0:
        return None
    start = marker + 4
    end = text.find("\n", start)
    return _trimmed(text, marker, start, len(text) if end < 0 else end)


def _saying_span(text: str) -> AnswerSpan | None:
    last = _last_match(_SAY, text)
    if last is None:
        return None
    stop = _SENTENCE_END.search(text, last.end())
    end = len(text) if stop is None else stop.start()
    span = _trimmed(text, last.start(), last.end(), end)
    if span is not None and text[span.end - 1] == ".":
        span = _trimmed(text, span.marker_start, span.start, span.end - 1)
    return span


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
            "verl_oar.answer_span: %s does not decode token by token to the same text as a whole; "
            "answer spans are located on the token-by-token text", type(tokenizer).__name__,
        )
    return text, offsets


def token_char_offsets(token_ids: Sequence[int], tokenizer: Any) -> list[tuple[int, int]]:
    """Character span ``(start, end)`` of each token in ``tokenizer.decode(token_ids,
    skip_special_tokens=False, clean_up_tokenization_spaces=False)`` (see :func:`decode_with_offsets`)."""
    return decode_with_offsets(token_ids, tokenizer, skip_special_tokens=False)[1]


# ---------------------------------------------------------------------------------------------
# 3. Reasoning and answer tokens
# ---------------------------------------------------------------------------------------------


def locate_answer_tokens(token_ids: Sequence[int], tokenizer: Any) -> tuple[list[bool], list[bool]] | None:
    """Classify the tokens of one response (no padding) as reasoning and/or answer tokens.

    The response is decoded with ``skip_special_tokens=True``. Reasoning: the token's span ends at or
    before the marker's first character (skipped special tokens before the marker included).
    Answer: the token's span overlaps the answer content. Returns None when no answer is found.
    """
    text, offsets = decode_with_offsets(token_ids, tokenizer, skip_special_tokens=True)
    span = find_answer_span(text)
    if span is None:
        return None
    reasoning = [end <= span.marker_start for _, end in offsets]
    answer = [start < span.end and end > span.start for start, end in offsets]
    return reasoning, answer


def answer_token_masks(
    responses: Tensor, response_mask: Tensor, tokenizer: Any
) -> tuple[Tensor, Tensor, Tensor]:
    """Reasoning and answer masks of a batch of responses (one text pass per row).

    Args:
        responses: (B, T) long, response token ids; padding may hold any id.
        response_mask: (B, T) bool or 0/1; true on the response's real tokens (in verl a prefix).
        tokenizer: a Hugging Face tokenizer (``decode``, ``convert_ids_to_tokens``).

    Returns:
        reasoning: (B, T) bool, answer: (B, T) bool — both False on padding and on rows without an
        answer; found: (B,) bool. All on ``responses``' device.
    """
    batch, length = responses.shape
    mask = response_mask.to(torch.bool).cpu()
    ids = responses.cpu()
    reasoning = torch.zeros(batch, length, dtype=torch.bool)
    answer = torch.zeros(batch, length, dtype=torch.bool)
    found = torch.zeros(batch, dtype=torch.bool)
    for row in range(batch):  # text processing is per sample by nature
        positions = mask[row].nonzero().squeeze(1)
        located = locate_answer_tokens(ids[row, positions].tolist(), tokenizer)
        if located is None:
            continue
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
