"""Worked solutions whose answer-fixing tokens are known by construction: the real-text twin of the pick_max testbed.

A problem of ``steps`` operations (2 to 4: add or take away, numbers 1-9, never below 0) is told in words, as the
arithmetic task's word problems are (``data.arithmetic``), and solved in writing, one step per sentence, with filler
sentences (that change nothing) between the steps::

    Mia starts with 7 shells. Let us go one step at a time. She gets 5 more shells, so 7 + 5 = 12. Nothing else
    changes in the story. She gives away 3 shells, so 12 - 3 = 9. The answer is \\boxed{9}.

The *results* (``12`` and ``9`` above: what each step's ``=`` gives) are the tokens that fix the answer; a token
ranking that finds what the answer depends on should put them near its top. Everything is drawn from
``random.Random(f"{seed}/worked")``; the spans are character offsets into ``solution``.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from verl_oar.data.arithmetic import NAMES, THINGS

__all__ = ["FILLER", "WorkedSolution", "worked_solutions"]

FILLER = (
    "Let us go one step at a time.",
    "Nothing else changes in the story.",
    "It helps to write each amount down.",
    "We keep track of the total carefully.",
    "Each sentence of the problem tells us one change.",
    "This is the kind of problem we can solve by counting.",
    "We read the next sentence of the problem.",
    "There is no trick in this part.",
)
"""sentences between the steps: true of every problem, so nothing in them fixes the answer"""
SHE = ("Mia", "Ana", "Sara", "Nina", "Lily", "Eva")


@dataclass(frozen=True)
class WorkedSolution:
    question: str
    """the problem, in words"""
    solution: str
    """the written solution, ending with ``\\boxed{answer}``"""
    answer: int
    numbers: tuple[int, ...]
    """the problem's numbers, in order"""
    results: tuple[tuple[int, int], ...]
    """(start, end) character span in ``solution`` of each step's result, in order (the last is the answer's value
    before the box)"""


def _problem(rng: random.Random, steps: int) -> tuple[list[int], list[str]]:
    """The numbers and operations of a problem of ``steps`` operations whose running total stays in 0..30."""
    while True:
        numbers, ops = [rng.randint(2, 9)], []
        total = numbers[0]
        for _ in range(steps):
            op = rng.choice("+-")
            n = rng.randint(1, 9)
            if op == "-" and n > total:
                op = "+"
            numbers.append(n)
            ops.append(op)
            total = total + n if op == "+" else total - n
        if total <= 30:
            return numbers, ops


def worked_solutions(n: int, seed: int = 0, steps: tuple[int, ...] = (2, 3, 4),
                     filler: tuple[int, int] = (1, 2)) -> list[WorkedSolution]:
    """``n`` problems with their worked solutions, the number of steps cycling through ``steps`` and
    ``filler[0]``-``filler[1]`` filler sentences after the first sentence and after every step but the last."""
    if n < 0 or not steps or any(s < 1 for s in steps) or not 0 <= filler[0] <= filler[1]:
        raise ValueError(f"worked_solutions: n={n}, steps={steps}, filler={filler} (need n >= 0, steps >= 1, "
                         "0 <= filler[0] <= filler[1])")
    rng = random.Random(f"{seed}/worked")
    out = []
    for i in range(n):
        numbers, ops = _problem(rng, steps[i % len(steps)])
        name, things = rng.choice(NAMES), rng.choice(THINGS)
        pronoun = "She" if name in SHE else "He"
        question = [f"{name} has {numbers[0]} {things}."]
        for op, x in zip(ops, numbers[1:]):
            question.append(f"{pronoun} gets {x} more {things}." if op == "+" else f"{pronoun} gives away {x} {things}.")
        question.append(f"How many {things} does {name} have now?")

        parts, results, total = [f"{name} starts with {numbers[0]} {things}."], [], numbers[0]
        for op, x in zip(ops, numbers[1:]):
            parts.extend(rng.choice(FILLER) for _ in range(rng.randint(*filler)))
            new = total + x if op == "+" else total - x
            verb = f"gets {x} more {things}" if op == "+" else f"gives away {x} {things}"
            parts.append(f"{pronoun} {verb}, so {total} {op} {x} = {new}.")
            total = new
        solution = ""
        for part in parts:
            start = len(solution) + (1 if solution else 0)
            solution = f"{solution} {part}" if solution else part
            match = re.search(r"= (\d+)\.$", part)
            if match:
                results.append((start + match.start(1), start + match.end(1)))
        solution += f" The answer is \\boxed{{{total}}}."
        out.append(WorkedSolution(" ".join(question), solution, total, tuple(numbers), tuple(results)))
    return out
