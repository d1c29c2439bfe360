"""Reward for the tiny arithmetic task of CPU mode (a verl ``reward.custom_reward_function``).

Self-contained (standard library only): ``workspace.build_workspace`` copies this file into the
workspace, and verl loads it by path in its reward workers with
``reward.custom_reward_function.path=<workspace>/reward.py`` and ``.name=compute_score``.

Score of a response (``solution_str``, decoded without special tokens):

- ``1.0 + FORMAT_BONUS`` if the content of its last ``\\boxed{...}`` equals the ground truth;
- ``FORMAT_BONUS`` if it has a ``\\boxed{...}`` whose content is wrong;
- ``0.0`` if it has none (truncated or malformed).

The small format bonus makes rewards differ inside a GRPO group even when every answer is wrong,
so the advantages of a barely trained model are not all zero.
"""

from __future__ import annotations

FORMAT_BONUS = 0.1
"""reward for producing a complete ``\\boxed{...}``, right or wrong"""

_BOXED = "\\boxed{"


def last_boxed_content(text: str) -> str | None:
    """Content of the last complete ``\\boxed{...}`` in ``text`` (braces balanced), or None."""
    start = text.rfind(_BOXED)
    while start != -1:
        depth, i = 1, start + len(_BOXED)
        while i < len(text):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start + len(_BOXED) : i]
            i += 1
        start = text.rfind(_BOXED, 0, start)  # unclosed: fall back to an earlier complete one
    return None


def _normalize(answer: str) -> str:
    return answer.strip().replace(" ", "")


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """verl reward-function signature; see the module docstring for the scores."""
    boxed = last_boxed_content(solution_str)
    if boxed is None:
        return 0.0
    correct = _normalize(boxed) == _normalize(str(ground_truth))
    return (1.0 if correct else 0.0) + FORMAT_BONUS
