"""pick_max: for each pair of digits, write the larger one among random filler words, then box the picks.

Prompt ``"max: 3 7 | 2 5"``; a right response (2 filler words per gap)::

    qzt kdm 7 abx fod 5 kle pqa \\boxed{75}

Few pivotal tokens among many high-entropy ones: with 2 pairs and 2 words of 3 random letters per gap,
a response has 28 reasoning characters (tokens of the CPU workspace's byte tokenizer), of which 2 are
the picks; each filler letter is uniform over 26 letters (ln 26 = 3.26 nats) for a model that has
learnt the data, so broadcasting one advantage over every token puts most of it on noise.

The warm-start data pick the larger digit only with probability ``pick_max_prob`` and the pair's first
digit otherwise (a right pick either way when the first is larger), so the starting model errs at
the picks, and RL has one thing to learn: pick the larger digit.

Oracle of causal tokens, from the response TEXT only (it applies to sampled, imperfect responses):

* the answer is located by ``verl_oar.core.answer_span.find_answer_span`` (the rule OAR itself uses);
  the reasoning is the text before the answer's marker. No answer -> no oracle (None).
* ``causal``: every digit of the reasoning (the picks). The answer is written by copying them; a
  response whose answer is not the concatenation of its picks is still read (``copies_picks`` says).
* everything else in the reasoning (letters, spaces) is non-causal.

Tokens: a token is causal when its character span (``verl_oar.core.answer_span.decode_with_offsets``
of the response decoded with ``skip_special_tokens=True``, as OAR's answer location does) overlaps a
causal character; reasoning tokens end at or before the answer marker (as
``verl_oar.core.answer_span.locate_answer_tokens``). With the byte tokenizer: one token per character.
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from verl_oar.core.answer_span import AnswerSpan, decode_with_offsets, find_answer_span

__all__ = [
    "DATA_SOURCE",
    "ORACLES",
    "OracleMasks",
    "PickMaxProblem",
    "PickTrace",
    "char_spans_to_token_mask",
    "heatmap_oracle",
    "make_problems",
    "oracle_batch",
    "oracle_token_masks",
    "parse_response",
    "rl_rows",
    "warm_start_response",
]

DATA_SOURCE = "verl_oar/pick_max"
PROMPT_PREFIX = "max: "
LETTERS = string.ascii_lowercase
ORACLES = ("causal",)
"""the oracle masks of a response (one here; the quality and report code loop over this tuple)"""

Span = tuple[int, int]
"""character span (start, end) in a response text, end exclusive"""


# ---------------------------------------------------------------------------------------------
# 1. Problems and warm-start responses
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PickMaxProblem:
    """One prompt: pairs of distinct digits 0..9, and one warm-start response for it."""

    pairs: tuple[tuple[int, int], ...]
    response: str
    """warm-start response (:func:`warm_start_response`): its picks are right only sometimes"""

    @property
    def prompt(self) -> str:
        return PROMPT_PREFIX + " | ".join(f"{a} {b}" for a, b in self.pairs)

    @property
    def answer(self) -> str:
        """the right answer: the larger digit of every pair, concatenated"""
        return "".join(str(max(a, b)) for a, b in self.pairs)


def filler_gap(words: int, word_length: int, rng: random.Random, repeat_prob: float = 0.0) -> list[str]:
    """``words`` words of ``word_length`` letters, each letter uniform over a..z; with probability
    ``repeat_prob`` instead one uniform letter written throughout the gap (``"qqq qqq"``).

    Why the repeated gaps: greedy decoding of uniform letters writes one letter over and over, and
    without such gaps in the warm-start data that greedy context is out of distribution (the
    held-out greedy accuracy then swings with it; docs/testbed.md, "Tried after the long run")."""
    if repeat_prob > 0 and rng.random() < repeat_prob:
        return [rng.choice(LETTERS) * word_length] * words
    return ["".join(rng.choice(LETTERS) for _ in range(word_length)) for _ in range(words)]


def warm_start_response(
    pairs: Sequence[tuple[int, int]], pick_max_prob: float, words: int, word_length: int, rng: random.Random,
    repeat_prob: float = 0.0,
) -> str:
    """``"qzt kdm 7 abx fod 5 kle pqa \\boxed{75}"``: a gap of filler words (:func:`filler_gap`) before
    every pick and after the last, then the boxed picks. Each pick is the pair's larger digit with
    probability ``pick_max_prob``, else the pair's first digit."""
    picks = [max(a, b) if rng.random() < pick_max_prob else a for a, b in pairs]
    items = filler_gap(words, word_length, rng, repeat_prob)
    for pick in picks:
        items += [str(pick), *filler_gap(words, word_length, rng, repeat_prob)]
    return " ".join(items) + " \\boxed{" + "".join(map(str, picks)) + "}"


def make_problems(
    n: int, pairs: int, seed: int, *, pick_max_prob: float, words: int = 2, word_length: int = 3,
    repeat_prob: float = 0.0,
) -> list[PickMaxProblem]:
    """``n`` problems of ``pairs`` pairs of distinct digits, deterministic per ``seed``; the digits do
    not depend on the other arguments (separate random streams). Problems may repeat."""
    if pairs < 1 or words < 0 or word_length < 1 or not 0 <= pick_max_prob <= 1 or not 0 <= repeat_prob <= 1:
        raise ValueError(f"pick_max: need pairs >= 1, words >= 0, word_length >= 1, 0 <= pick_max_prob <= 1, "
                         f"0 <= repeat_prob <= 1; got {pairs}, {words}, {word_length}, {pick_max_prob}, {repeat_prob}")
    digits_rng, text_rng = random.Random(f"{seed}/digits"), random.Random(f"{seed}/responses")
    problems = []
    for _ in range(n):
        chosen = tuple(tuple(digits_rng.sample(range(10), 2)) for _ in range(pairs))
        problems.append(PickMaxProblem(chosen, warm_start_response(chosen, pick_max_prob, words, word_length, text_rng, repeat_prob)))
    return problems


def rl_rows(problems: Sequence[PickMaxProblem], split: str) -> list[dict]:
    """verl RL rows (as ``verl_oar.cpu.workspace``): chat prompt, rule reward on the boxed answer."""
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": p.prompt}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": p.answer},
            "extra_info": {"split": split, "index": i, "question": p.prompt, "answer": p.answer,
                           "pairs": [list(pair) for pair in p.pairs]},
        }
        for i, p in enumerate(problems)
    ]


# ---------------------------------------------------------------------------------------------
# 2. The oracle in the text
# ---------------------------------------------------------------------------------------------

_DIGIT = re.compile(r"\d", re.ASCII)


@dataclass(frozen=True)
class PickTrace:
    """A response's picks as character spans of its text."""

    text: str
    answer: AnswerSpan
    picks: tuple[Span, ...]
    """every digit of the reasoning, in text order"""

    @property
    def causal(self) -> tuple[Span, ...]:
        return self.picks

    @property
    def copies_picks(self) -> bool:
        """The answer is exactly the picks, concatenated."""
        written = "".join(self.text[s:e] for s, e in self.picks)
        return self.text[self.answer.start:self.answer.end].strip() == written


def parse_response(text: str) -> PickTrace | None:
    """Read a response (rule in the module docstring); None when it has no boxed answer."""
    answer = find_answer_span(text)
    if answer is None:
        return None
    picks = tuple(m.span() for m in _DIGIT.finditer(text, 0, answer.marker_start))
    return PickTrace(text, answer, picks)


# ---------------------------------------------------------------------------------------------
# 3. Characters to tokens
# ---------------------------------------------------------------------------------------------


def char_spans_to_token_mask(spans: Sequence[Span], offsets: Sequence[Span]) -> Tensor:
    """(T,) bool: token t is True when its character span ``offsets[t]`` overlaps one of ``spans``.

    Zero-width tokens (skipped special tokens) overlap nothing.
    """
    return torch.tensor([any(s < end and e > start for s, e in spans) for start, end in offsets], dtype=torch.bool)


@dataclass(frozen=True)
class OracleMasks:
    """Token masks of one response, all (T,) bool over its T tokens."""

    trace: PickTrace
    reasoning: Tensor
    """token ends at or before the answer marker (as ``answer_span.locate_answer_tokens``)"""
    answer: Tensor
    """token overlaps the answer content"""
    causal: Tensor
    """token overlaps a pick"""


def oracle_token_masks(response_ids: Sequence[int], tokenizer: Any) -> OracleMasks | None:
    """Oracle masks of one response (no padding), or None when it has no answer.

    The text is ``tokenizer.decode(response_ids, skip_special_tokens=True)``.
    """
    text, offsets = decode_with_offsets(response_ids, tokenizer, skip_special_tokens=True)
    trace = parse_response(text)
    if trace is None:
        return None
    reasoning = torch.tensor([end <= trace.answer.marker_start for _, end in offsets], dtype=torch.bool)
    answer = char_spans_to_token_mask([(trace.answer.start, trace.answer.end)], offsets)
    return OracleMasks(trace, reasoning, answer, char_spans_to_token_mask(trace.causal, offsets))


def heatmap_oracle(response_ids: Sequence[int], tokenizer: Any) -> dict[str, list[bool]] | None:
    """The oracle for ``verl_oar.tools.heatmap`` (``scoring.Oracle``): {"causal": (T,) bool list} of one
    response, or None when it has no answer."""
    masks = oracle_token_masks(response_ids, tokenizer)
    return None if masks is None else {"causal": masks.causal.tolist()}


def oracle_batch(responses: Tensor, response_mask: Tensor, tokenizer: Any) -> dict[str, Tensor]:
    """Oracle masks of a padded batch (one text pass per row).

    Args:
        responses: (B, T) long response ids; padding may hold any id.
        response_mask: (B, T) bool or 0/1, true on real tokens.

    Returns:
        {"reasoning", "answer", "causal"}: (B, T) bool, False on padding and on rows without an
        answer; "found": (B,) bool, whether the row has an answer. On CPU.
    """
    batch, length = responses.shape
    mask = response_mask.to(torch.bool).cpu()
    names = ("reasoning", "answer", *ORACLES)
    out = {name: torch.zeros(batch, length, dtype=torch.bool) for name in names}
    out["found"] = torch.zeros(batch, dtype=torch.bool)
    for row in range(batch):
        positions = mask[row].nonzero().squeeze(1)
        masks = oracle_token_masks(responses[row].cpu()[positions].tolist(), tokenizer)
        if masks is None:
            continue
        out["found"][row] = True
        for name in names:
            out[name][row, positions] = getattr(masks, name)
    return out
