"""Reward of the pick_max testbed (a verl ``reward.custom_reward_function``), standard library only.

Written by ``verl_oar.testbed.workspace.build_testbed`` (the box parser is
``verl_oar/rewards/tiny_reward.py``'s); verl loads it by path with ``.name=compute_score``.
Score: 1.0 if the content of the last complete ``\\boxed{...}`` equals the ground truth (the larger
digit of every pair, concatenated; spaces ignored), else 0.0.
"""

from __future__ import annotations

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
    """verl reward-function signature: 1.0 for the right boxed answer, else 0.0."""
    boxed = last_boxed_content(solution_str)
    return 1.0 if boxed is not None and _normalize(boxed) == _normalize(str(ground_truth)) else 0.0
