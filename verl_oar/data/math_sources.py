"""The math datasets OAR recipes train and evaluate on: one declarative entry per source.

Train mix (``train.parquet``): MATH levels 3-5 (``DigitalLearningGmbH/MATH-lighteval``, train split,
the mirror verl's own ``examples/data_preprocess/math_dataset.py`` uses) + GSM8K train
(``openai/gsm8k``, config ``main``). Not the DeepScaleR mix. MATH-500 is drawn from MATH's *test*
split, so training on MATH's train split does not overlap it.
Eval (one file each): MATH-500, AIME 2024, AMC 2023, Minerva Math, GSM8K test.

Final answers of the sources that only have a worked solution are read with the code OAR uses to
locate a response's answer, ``verl_oar.core.answer_span.find_answer_span``, so a ground truth is what
the reward would read from that same text:

- MATH: the content of the last ``\\boxed{...}`` / ``\\fbox{...}`` of ``solution`` (a solution whose
  answer span is not a box is dropped and counted);
- GSM8K: what follows the last ``####`` of ``answer``, with thousands separators removed
  (``1,000`` -> ``1000``; a span from another marker is dropped and counted);
- the eval sets other than GSM8K have a short-answer field, taken as it is (stripped; an integral
  number such as AMC's ``27.0`` becomes ``"27"``).

Field names, and how they were checked (public dataset cards, verl's own scripts and public
loaders, read in the search corpora; no hub access from this machine):

- ``openai/gsm8k`` (config ``main``): ``question``, ``answer`` ending in ``#### <number>`` --
  verified (verl's ``examples/data_preprocess/gsm8k.py`` reads exactly these; GSM8K copies' cards).
- ``DigitalLearningGmbH/MATH-lighteval``: ``problem``, ``solution`` -- verified (verl's
  ``math_dataset.py``); ``level`` as the string ``"Level N"`` and ``type`` -- inferred from the cards
  of MATH copies with the same four columns (``level: string``) and MATH's original format.
- ``HuggingFaceH4/aime_2024`` (split ``train``): ``problem``, ``answer`` (string) -- verified (its
  dataset card: id, problem, solution, answer, url, year; 30 rows in ``train``).
- ``HuggingFaceH4/MATH-500`` (split ``test``, one ``test.jsonl``): ``problem``, ``answer`` -- inferred
  with high confidence (lighteval's task config for this repo, and the cards of its copies:
  problem, solution, answer, subject, level: int64, unique_id); its own card was not readable.
- ``math-ai/amc23`` (split ``test``): ``question``, ``answer`` -- inferred from several public
  loaders; the answer may be stored as a float (a copy's card says ``answer: float64``).
- ``math-ai/minervamath`` (split ``test``): ``question``, ``answer`` -- inferred from several public
  loaders (one reads ``problem``/``solution`` instead, hence the fallback fields below).

Every entry lists the expected field first and accepted alternatives after it, so a local copy in
a neighbouring schema still loads; a missing field is an error naming the columns found.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from verl_oar.core.answer_span import find_answer_span

__all__ = [
    "INSTRUCTION",
    "OUTPUTS",
    "SOURCES",
    "MathSource",
    "answer_after_hash",
    "answer_in_last_box",
    "make_row",
    "normalize_ground_truth",
    "parse_level",
]

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
"""appended to every problem (Qwen2.5-Math's chain-of-thought instruction), after a line break"""

AnswerRule = Literal["field", "last_box", "after_hash"]


@dataclass(frozen=True)
class MathSource:
    """Where one dataset comes from and how a verl row is made from each of its rows."""

    name: str
    """key of ``--source NAME=...`` and the rows' ``data_source``"""
    output: str
    """parquet file (stem) the rows go to; the train sources share ``train``"""
    hub: str
    """default Hugging Face dataset id"""
    config: str | None
    """dataset config (``name=`` of ``datasets.load_dataset``), or None for the default"""
    split: str
    """split read from the hub or from a local dataset with several splits"""
    problem_fields: tuple[str, ...]
    """the column holding the problem text: the first of these that the dataset has"""
    answer_fields: tuple[str, ...]
    """the column the ground truth is read from (by ``answer_rule``): the first one present"""
    answer_rule: AnswerRule
    """``field``: the column is the answer; ``last_box``: content of its last box;
    ``after_hash``: what follows its last ``####``, thousands separators removed"""
    levels: tuple[int, ...] | None = None
    """keep only rows whose ``level`` is one of these (MATH's ``"Level N"``); None keeps all"""
    level_fields: tuple[str, ...] = field(default=("level",))
    """the column holding the level, when ``levels`` is set"""


SOURCES: dict[str, MathSource] = {
    source.name: source
    for source in (
        MathSource("math_l3to5", "train", "DigitalLearningGmbH/MATH-lighteval", None, "train",
                   ("problem",), ("solution",), "last_box", levels=(3, 4, 5)),
        MathSource("gsm8k", "train", "openai/gsm8k", "main", "train",
                   ("question",), ("answer",), "after_hash"),
        MathSource("math500", "math500", "HuggingFaceH4/MATH-500", None, "test",
                   ("problem",), ("answer",), "field"),
        MathSource("aime24", "aime24", "HuggingFaceH4/aime_2024", None, "train",
                   ("problem", "question"), ("answer",), "field"),
        MathSource("amc23", "amc23", "math-ai/amc23", None, "test",
                   ("question", "problem"), ("answer",), "field"),
        MathSource("minerva", "minerva", "math-ai/minervamath", None, "test",
                   ("question", "problem"), ("answer",), "field"),
        MathSource("gsm8k_test", "gsm8k_test", "openai/gsm8k", "main", "test",
                   ("question",), ("answer",), "after_hash"),
    )
}
"""every source, by name; order = the order rows are read"""

OUTPUTS: dict[str, tuple[str, ...]] = {}
for _source in SOURCES.values():
    OUTPUTS.setdefault(_source.output, ())
    OUTPUTS[_source.output] += (_source.name,)
"""output file stem -> the sources it is made of (``train`` -> math_l3to5, gsm8k; one each for eval)"""

TRAIN_OUTPUTS = ("train",)
EVAL_OUTPUTS = tuple(name for name in OUTPUTS if name not in TRAIN_OUTPUTS)


# ---------------------------------------------------------------------------------------------
# Answers and levels
# ---------------------------------------------------------------------------------------------

_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_LEVEL = re.compile(r"^\s*(?:level\s*)?(\d+)\s*$", re.IGNORECASE)


def answer_in_last_box(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` of ``text`` as OAR locates it, or None
    if the answer span ``find_answer_span`` finds is not a box (or there is none)."""
    span = find_answer_span(text)
    if span is None or not text.startswith(("\\boxed", "\\fbox"), span.marker_start):
        return None
    return text[span.start:span.end]


def answer_after_hash(text: str) -> str | None:
    """GSM8K's answer: what follows the last ``####`` (as OAR locates it), without thousands
    separators; None if ``find_answer_span`` finds no ``####`` answer (a box or a phrase takes
    precedence there, and such a row is not in GSM8K's format)."""
    span = find_answer_span(text)
    if span is None or not text.startswith("####", span.marker_start):
        return None
    return _THOUSANDS.sub("", text[span.start:span.end]) or None


def normalize_ground_truth(value: Any) -> str | None:
    """A ground truth as a stripped string; numbers without a spurious ``.0``; None if empty/NaN."""
    if value is None or isinstance(value, bool):
        return None if value is None else str(value)
    if isinstance(value, (list, tuple)):
        return normalize_ground_truth(value[0]) if len(value) == 1 else None
    if isinstance(value, int) or type(value).__name__.startswith(("int", "uint")):
        return str(int(value))
    if isinstance(value, float) or type(value).__name__.startswith("float"):
        number = float(value)
        if not math.isfinite(number):
            return None
        return str(int(number)) if number.is_integer() else repr(number)
    text = str(value).strip()
    return text or None


def parse_level(value: Any) -> int | None:
    """MATH's level: ``"Level 3"`` -> 3, ``3`` -> 3; None when it is not a level (``"Level ?"``)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        match = _LEVEL.match(value)
        return int(match.group(1)) if match else None
    return None


def ground_truth_of(source: MathSource, raw_answer: Any) -> str | None:
    """The ground truth of one row under ``source.answer_rule``, or None if it cannot be read."""
    if source.answer_rule == "field":
        return normalize_ground_truth(raw_answer)
    if not isinstance(raw_answer, str):
        return None
    if source.answer_rule == "last_box":
        return normalize_ground_truth(answer_in_last_box(raw_answer))
    return normalize_ground_truth(answer_after_hash(raw_answer))


# ---------------------------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------------------------


def make_row(source: MathSource, *, problem: str, ground_truth: str, raw_answer: Any, index: int,
             level: int | None) -> dict:
    """One row in verl's RL format (what ``verl.utils.dataset.rl_dataset.RLHFDataset`` reads).

    ``extra_info`` has the same keys for every source (one parquet schema): ``split`` (the source
    split), ``index`` (the row's position in the source, before any filtering), ``question`` (the
    problem without the instruction), ``answer`` (the raw answer column as text), ``level`` (MATH's
    level, else None).
    """
    return {
        "data_source": source.name,
        "prompt": [{"role": "user", "content": f"{problem}\n{INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {
            "split": source.split,
            "index": index,
            "question": problem,
            "answer": "" if raw_answer is None else str(raw_answer),
            "level": level,
        },
    }
