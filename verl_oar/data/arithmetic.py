"""A real-text task a small pretrained model can start on: one- and two-step arithmetic word problems, generated
offline from a seed, in verl's parquet format, graded by ``verl_oar.rewards.math_reward``.

    python -m verl_oar.data.arithmetic --out ~/data/arithmetic [--kind word1] [--seed 0]

A problem is a sentence or two of text around small numbers ("Mia has 7 shells. She finds 5 more shells. How many
shells does Mia have now?"), its answer an integer. ``kind`` fixes the problem family:

- ``sum1``: ``What is a + b?`` with single-digit a, b (no words);
- ``word1``: one step, add or take away, numbers 1-9;
- ``word2``: two steps (add then take away, or the reverse), numbers 1-9, the answer never negative.

Train and test are disjoint by the problem's numbers and operation (never the same arithmetic in both, whatever the
names and objects), drawn with ``random.Random(seed)``. The prompt is the user turn of the model's chat template:
an instruction to end with ``\\boxed{answer}``, optionally one worked example (``example=True``), then the problem.
Which kind and prompt the real-model experiments use, and why, is in docs/real-model.md (measured start
statistics).
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["KINDS", "Problem", "TaskSpec", "problems", "prompt_text", "rows", "write"]

KINDS = ("sum1", "word1", "word2")
DATA_SOURCE = "verl_oar/arithmetic"
NAMES = ("Mia", "Tom", "Ana", "Leo", "Sara", "Ben", "Nina", "Omar", "Lily", "Sam", "Eva", "Max")
THINGS = ("apples", "shells", "stickers", "books", "coins", "marbles", "pencils", "cards", "stones", "cookies")
INSTRUCTION = "Solve the problem. Put the final answer in \\boxed{}."
EXAMPLE = ("Example problem: Ava has 3 pens. She buys 4 more pens. How many pens does Ava have now?\n"
           "Example solution: Ava starts with 3 pens and buys 4 more, so 3 + 4 = 7. The answer is \\boxed{7}.")
BRIEF_INSTRUCTION = "Solve the problem in one short sentence, then give the answer in \\boxed{}."
"""``brief=True``: the same example, asking for one sentence (a 135M model sampled at temperature 1 rambles)"""
LABEL_INSTRUCTION = "Solve the problem. End your reply with a last line of the form Answer: <number>."
LABEL_EXAMPLE = ("Example problem: Ava has 3 pens. She buys 4 more pens. How many pens does Ava have now?\n"
                 "Example solution: Ava starts with 3 pens and buys 4 more, so 3 + 4 = 7.\nAnswer: 7")
"""``answer="label"``: the answer after an ``Answer:`` label, which the math reward also grades"""


@dataclass(frozen=True)
class TaskSpec:
    kind: str = "word1"
    example: bool = True
    brief: bool = False
    answer: str = "boxed"
    """how the prompt asks for the answer: ``boxed`` (``\\boxed{}``) or ``label`` (a last line ``Answer: N``)"""
    seed: int = 0
    test_fraction: float = 0.25


@dataclass(frozen=True)
class Problem:
    question: str
    answer: int
    arithmetic: str
    """the numbers and operations alone (``7+5``, ``9-3+2``): what train and test never share"""


def _arithmetic(kind: str) -> list[tuple[str, int]]:
    """Every (arithmetic, answer) of a kind, in a fixed order."""
    out = []
    if kind == "sum1":
        out = [(f"{a}+{b}", a + b) for a in range(10) for b in range(10)]
    elif kind == "word1":
        out = [(f"{a}+{b}", a + b) for a in range(1, 10) for b in range(1, 10)]
        out += [(f"{a}-{b}", a - b) for a in range(2, 10) for b in range(1, a)]
    elif kind == "word2":
        for a in range(1, 10):
            for b in range(1, 10):
                for c in range(1, 10):
                    if a + b - c >= 0:
                        out.append((f"{a}+{b}-{c}", a + b - c))
                    if a - b >= 0:
                        out.append((f"{a}-{b}+{c}", a - b + c))
    else:
        raise ValueError(f"arithmetic: unknown kind {kind!r}; one of {', '.join(KINDS)}")
    return out


def _words(arithmetic: str, rng: random.Random) -> str:
    """The word problem of ``arithmetic`` (``a+b``, ``a-b``, ``a+b-c`` or ``a-b+c``), with a drawn name and object."""
    name, things = rng.choice(NAMES), rng.choice(THINGS)
    pronoun = "She" if name in ("Mia", "Ana", "Sara", "Nina", "Lily", "Eva") else "He"
    numbers = [int(x) for x in arithmetic.replace("-", "+").split("+")]
    ops = [c for c in arithmetic if c in "+-"]
    text = [f"{name} has {numbers[0]} {things}."]
    for op, n in zip(ops, numbers[1:]):
        text.append(f"{pronoun} gets {n} more {things}." if op == "+" else f"{pronoun} gives away {n} {things}.")
    text.append(f"How many {things} does {name} have now?")
    return " ".join(text)


def problems(spec: TaskSpec, split: str) -> list[Problem]:
    """The ``split`` ("train" or "test") problems of ``spec``: every arithmetic of the kind once, the splits disjoint
    by arithmetic."""
    if split not in ("train", "test"):
        raise ValueError(f"arithmetic: split must be 'train' or 'test', got {split!r}")
    rng = random.Random(f"{spec.seed}/{spec.kind}")
    items = _arithmetic(spec.kind)
    rng.shuffle(items)
    n_test = max(1, round(spec.test_fraction * len(items)))
    chosen = items[:n_test] if split == "test" else items[n_test:]
    text_rng = random.Random(f"{spec.seed}/{spec.kind}/{split}/words")
    out = []
    for arithmetic, answer in chosen:
        if spec.kind == "sum1":
            a, b = arithmetic.split("+")
            question = f"What is {a} + {b}?"
        else:
            question = _words(arithmetic, text_rng)
        out.append(Problem(question, answer, arithmetic))
    return out


def prompt_text(question: str, example: bool, brief: bool = False, answer: str = "boxed") -> str:
    """The user turn: the instruction (``brief``: asking for one sentence; ``answer``: the answer format), the worked
    example (if any), the problem."""
    if answer not in ("boxed", "label"):
        raise ValueError(f"arithmetic: answer must be 'boxed' or 'label', got {answer!r}")
    if answer == "label":
        instruction, example_text = LABEL_INSTRUCTION, LABEL_EXAMPLE
    else:
        instruction, example_text = BRIEF_INSTRUCTION if brief else INSTRUCTION, EXAMPLE
    parts = [instruction] + ([example_text] if example else []) + [f"Problem: {question}"]
    return "\n\n".join(parts)


def rows(spec: TaskSpec, split: str) -> list[dict]:
    """verl rows (``prompt`` as chat messages, ``reward_model.ground_truth`` the answer as text)."""
    return [{"data_source": DATA_SOURCE,
             "prompt": [{"role": "user", "content": prompt_text(p.question, spec.example, spec.brief, spec.answer)}],
             "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(p.answer)},
             "extra_info": {"split": split, "index": i, "question": p.question, "answer": str(p.answer),
                            "arithmetic": p.arithmetic}}
            for i, p in enumerate(problems(spec, split))]


def write(out: str | Path, spec: TaskSpec) -> dict[str, Path]:
    """``train.parquet``, ``test.parquet`` and ``task.json`` (the spec) under ``out``."""
    import pandas as pd

    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split in ("train", "test"):
        paths[split] = out / f"{split}.parquet"
        pd.DataFrame(rows(spec, split)).to_parquet(paths[split])
    (out / "task.json").write_text(json.dumps({"spec": asdict(spec), "rows": {s: len(rows(spec, s)) for s in paths},
                                               "command": f"python -m verl_oar.data.arithmetic --out {out} "
                                                          f"--kind {spec.kind} --seed {spec.seed}"
                                                          + ("" if spec.example else " --no-example")
                                                          + (" --brief" if spec.brief else "")
                                                          + f" --answer {spec.answer}"}, indent=2))
    return paths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--kind", default="word1", choices=KINDS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-example", action="store_true", help="no worked example in the prompt")
    p.add_argument("--brief", action="store_true", help="ask for one short sentence before the boxed answer")
    p.add_argument("--answer", default="boxed", choices=("boxed", "label"), help="the answer format asked for")
    args = p.parse_args(argv)
    paths = write(args.out, TaskSpec(kind=args.kind, example=not args.no_example, brief=args.brief,
                                     answer=args.answer, seed=args.seed))
    print(json.dumps({k: str(v) for k, v in paths.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
