"""chain_sum: add k single-digit numbers with a running-sum trace padded by filler words.

Prompt ``"sum: 3 7 2 5"``; canonical response (2 filler words per gap)::

    3 ok hmm +7=10 so well +2=12 right now +5=17 ok fine \\boxed{17}

Long traces with few pivotal tokens: with 3 filler words per gap and k in 4..8, a canonical
response has about 106 reasoning characters (tokens of the CPU workspace's byte tokenizer), of which
about 15 are numbers the answer depends on and 2 (the last total) are what it copies.

Oracle of causal tokens, from the response TEXT only (so it applies to sampled, imperfect responses):

* the answer is located by ``verl_oar.core.answer_span.find_answer_span`` (the rule OAR itself uses);
  the reasoning is the text before the answer's marker. No answer -> no oracle (None).
* the reasoning is read with one regex scan whose matches are, in order of text:
  ``start``  an integer ``\\d+``, which must be the first match;
  ``step``   ``+ <operand> = <total>`` (``\\+\\s*\\d+\\s*=\\s*\\d+``), any number of them after the start.
  Everything between matches must hold no digit, ``+`` or ``=``: any text is accepted there as
  filler (not only the canonical words). A second bare integer, a stray ``+`` / ``=`` or a
  malformed step (``+7 10``, ``+=10``, ``+7=``) makes the trace unreadable -> None.
* ``direct``: the characters of the last total written (the start number if there is no step): the
  answer copies it. This holds whether or not the totals are right and whether or not the answer
  equals it (``ChainTrace.arithmetic_ok`` and ``ChainTrace.answer_copies_last_total`` say).
* ``chain``: the characters of the start number, every operand and every total: the answer depends
  on them transitively. ``direct`` is a subset of ``chain``.
* everything else in the reasoning (filler, whitespace, ``+``, ``=``) is non-causal.

Tokens: a token is causal when its character span (``verl_oar.core.answer_span.decode_with_offsets`` of
the response decoded with ``skip_special_tokens=True``, as OAR's answer location does) overlaps a
causal character; reasoning and answer tokens follow ``verl_oar.core.answer_span.locate_answer_tokens``.
With the CPU workspace's byte tokenizer that is one token per character.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from verl_oar.core.answer_span import AnswerSpan, decode_with_offsets, find_answer_span

__all__ = [
    "DATA_SOURCE",
    "FILLER_WORDS",
    "ChainSumProblem",
    "ChainTrace",
    "OracleMasks",
    "canonical_response",
    "char_spans_to_token_mask",
    "make_problems",
    "oracle_batch",
    "oracle_token_masks",
    "parse_response",
    "rl_rows",
]

DATA_SOURCE = "verl_oar/chain_sum"
FILLER_WORDS = ("ok", "hmm", "so", "well", "right", "now", "fine")
"""the filler vocabulary of canonical responses (the parser accepts any digit-free filler)"""
PROMPT_PREFIX = "sum: "

Span = tuple[int, int]
"""character span (start, end) in a response text, end exclusive"""


# ---------------------------------------------------------------------------------------------
# 1. Problems and canonical responses
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChainSumProblem:
    """One prompt: the numbers to add, and a canonical response for supervised warm starts."""

    numbers: tuple[int, ...]
    """the k numbers, each in 1..9 (no 0, so every step changes the total)"""
    response: str
    """canonical response (see :func:`canonical_response`)"""

    @property
    def prompt(self) -> str:
        return PROMPT_PREFIX + " ".join(str(n) for n in self.numbers)

    @property
    def answer(self) -> str:
        return str(sum(self.numbers))


def canonical_response(numbers: Sequence[int], fillers_per_step: int | tuple[int, int], rng: random.Random) -> str:
    """``"3 ok hmm +7=10 ... \\boxed{17}"``: the first number, then per further number a gap of
    filler words and ``+n=total``, then a last gap and the boxed answer; items joined by one space.

    ``fillers_per_step``: filler words per gap, an int or an inclusive (low, high) range drawn per gap.
    Words are drawn from :data:`FILLER_WORDS` with ``rng``.
    """
    low, high = (fillers_per_step, fillers_per_step) if isinstance(fillers_per_step, int) else fillers_per_step
    if not 0 <= low <= high:
        raise ValueError(f"fillers_per_step={fillers_per_step!r}: need 0 <= low <= high")

    def gap() -> list[str]:
        return [rng.choice(FILLER_WORDS) for _ in range(rng.randint(low, high))]

    total = numbers[0]
    items = [str(total)]
    for n in numbers[1:]:
        total += n
        items += [*gap(), f"+{n}={total}"]
    items += [*gap(), f"\\boxed{{{total}}}"]
    return " ".join(items)


def make_problems(
    n: int, k_range: tuple[int, int] = (3, 6), seed: int = 0, fillers_per_step: int | tuple[int, int] = 2
) -> list[ChainSumProblem]:
    """``n`` problems with k uniform in the inclusive ``k_range`` and numbers uniform in 1..9.

    Deterministic per ``seed``; the numbers do not depend on ``fillers_per_step`` (separate streams).
    Problems may repeat (k=3 has 729 distinct ones).
    """
    low, high = k_range
    if not 1 <= low <= high:
        raise ValueError(f"k_range={k_range!r}: need 1 <= low <= high")
    numbers_rng, filler_rng = random.Random(f"{seed}/numbers"), random.Random(f"{seed}/fillers")
    problems = []
    for _ in range(n):
        numbers = tuple(numbers_rng.randint(1, 9) for _ in range(numbers_rng.randint(low, high)))
        problems.append(ChainSumProblem(numbers, canonical_response(numbers, fillers_per_step, filler_rng)))
    return problems


def rl_rows(problems: Sequence[ChainSumProblem], split: str) -> list[dict]:
    """verl RL rows (as ``verl_oar.cpu.workspace``): chat prompt, rule reward on the boxed answer."""
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": p.prompt}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": p.answer},
            "extra_info": {
                "split": split, "index": i, "question": p.prompt, "answer": p.answer, "numbers": list(p.numbers),
            },
        }
        for i, p in enumerate(problems)
    ]


# ---------------------------------------------------------------------------------------------
# 2. The oracle in the text
# ---------------------------------------------------------------------------------------------

_TRACE = re.compile(
    r"(?P<step>\+\s*(?P<operand>\d+)\s*=\s*(?P<total>\d+))"
    r"|(?P<number>\d+)"
    r"|(?P<stray>[+=])",
    re.ASCII,
)


@dataclass(frozen=True)
class ChainTrace:
    """A response's trace as character spans of its text."""

    text: str
    answer: AnswerSpan
    start: Span
    """the first number"""
    operands: tuple[Span, ...]
    totals: tuple[Span, ...]
    """``totals[i]`` is the total written by the step that adds ``operands[i]``"""

    def value(self, span: Span) -> int:
        return int(self.text[span[0]:span[1]])

    @property
    def direct(self) -> tuple[Span, ...]:
        """What the answer copies: the last total written, or the start number without steps."""
        return (self.totals[-1] if self.totals else self.start,)

    @property
    def chain(self) -> tuple[Span, ...]:
        """Start number, operands and totals, in text order."""
        return tuple(sorted((self.start, *self.operands, *self.totals)))

    @property
    def arithmetic_ok(self) -> bool:
        """Every written total equals the previous total plus the operand."""
        total = self.value(self.start)
        for operand, written in zip(self.operands, self.totals):
            total += self.value(operand)
            if self.value(written) != total:
                return False
        return True

    @property
    def answer_copies_last_total(self) -> bool:
        content = self.text[self.answer.start:self.answer.end]
        return content.strip() == self.text[slice(*self.direct[0])]


def parse_response(text: str) -> ChainTrace | None:
    """Read a chain_sum response (acceptance rule in the module docstring); None if unreadable."""
    answer = find_answer_span(text)
    if answer is None:
        return None
    start, operands, totals = None, [], []
    for match in _TRACE.finditer(text, 0, answer.marker_start):
        if match["number"] is not None and start is None:
            start = match.span("number")
        elif match["step"] is not None and start is not None:
            operands.append(match.span("operand"))
            totals.append(match.span("total"))
        else:  # a second bare number, a step before any number, a stray '+' or '='
            return None
    if start is None:
        return None
    return ChainTrace(text, answer, start, tuple(operands), tuple(totals))


# ---------------------------------------------------------------------------------------------
# 3. Characters to tokens
# ---------------------------------------------------------------------------------------------


def char_spans_to_token_mask(spans: Sequence[Span], offsets: Sequence[Span]) -> Tensor:
    """(T,) bool: token t is True when its character span ``offsets[t]`` overlaps one of ``spans``.

    Zero-width tokens (skipped special tokens) overlap nothing.
    """
    return torch.tensor(
        [any(s < end and e > start for s, e in spans) for start, end in offsets], dtype=torch.bool
    )


@dataclass(frozen=True)
class OracleMasks:
    """Token masks of one response, all (T,) bool over its T tokens."""

    trace: ChainTrace
    reasoning: Tensor
    """token ends at or before the answer marker (as ``answer_span.locate_answer_tokens``)"""
    answer: Tensor
    """token overlaps the answer content"""
    direct: Tensor
    """token overlaps the last written total"""
    chain: Tensor
    """token overlaps the start number, an operand or a total"""


def oracle_token_masks(response_ids: Sequence[int], tokenizer: Any) -> OracleMasks | None:
    """Oracle masks of one response (no padding), or None when its text cannot be read.

    The text is ``tokenizer.decode(response_ids, skip_special_tokens=True)``.
    """
    text, offsets = decode_with_offsets(response_ids, tokenizer, skip_special_tokens=True)
    trace = parse_response(text)
    if trace is None:
        return None
    reasoning = torch.tensor([end <= trace.answer.marker_start for _, end in offsets], dtype=torch.bool)
    answer = char_spans_to_token_mask([(trace.answer.start, trace.answer.end)], offsets)
    return OracleMasks(
        trace, reasoning, answer,
        char_spans_to_token_mask(trace.direct, offsets), char_spans_to_token_mask(trace.chain, offsets),
    )


def heatmap_oracle(response_ids: Sequence[int], tokenizer: Any) -> dict[str, list[bool]] | None:
    """The oracle for ``verl_oar.tools.heatmap`` (its ``Oracle``): {"direct", "chain"} (T,) bool lists
    of one response, or None when its text is not a readable chain_sum trace."""
    masks = oracle_token_masks(response_ids, tokenizer)
    return None if masks is None else {"direct": masks.direct.tolist(), "chain": masks.chain.tolist()}


def oracle_batch(responses: Tensor, response_mask: Tensor, tokenizer: Any) -> dict[str, Tensor]:
    """Oracle masks of a padded batch (one text pass per row).

    Args:
        responses: (B, T) long response ids; padding may hold any id.
        response_mask: (B, T) bool or 0/1, true on real tokens.

    Returns:
        {"reasoning", "answer", "direct", "chain"}: (B, T) bool, False on padding and on unreadable
        rows; "found": (B,) bool, whether the row was readable. On CPU.
    """
    batch, length = responses.shape
    mask = response_mask.to(torch.bool).cpu()
    out = {name: torch.zeros(batch, length, dtype=torch.bool) for name in ("reasoning", "answer", "direct", "chain")}
    out["found"] = torch.zeros(batch, dtype=torch.bool)
    for row in range(batch):
        positions = mask[row].nonzero().squeeze(1)
        masks = oracle_token_masks(responses[row].cpu()[positions].tolist(), tokenizer)
        if masks is None:
            continue
        out["found"][row] = True
        for name in ("reasoning", "answer", "direct", "chain"):
            out[name][row, positions] = getattr(masks, name)
    return out
