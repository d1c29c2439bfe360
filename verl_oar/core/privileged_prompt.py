"""Privileged prompts: the row's chat messages with the last user turn rewritten from a template.

CSCR and OPPO re-score the sampled response under a prompt that knows something the policy did not
(METHODS.md 0.1): the reference answer (OPPO's oracle) or an assertion about the outcome (CSCR's two
conditions). A template is plain text with two placeholders, replaced literally (other braces, e.g.
``\\boxed{}``, are kept as written):

- ``{question}``: the text of the row's last user message (required: the privileged prompt is the
  original one plus the privilege);
- ``{answer}``: the row's ground truth (``reward_model.ground_truth`` of verl's dataset row).

System messages and earlier turns are kept; the chat template is applied by the caller, with the
rollout's own kwargs. The identity template ``"{question}"`` gives back the rollout's prompt.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["CSCR_NEGATIVE", "CSCR_POSITIVE", "OPPO_ORACLE", "OVERFLOWS", "check_template", "ground_truth", "rewrite_messages"]

CSCR_POSITIVE = "{question}\n\n[Privileged information] The final answer reached in the response below is correct."
"""[GUESS] METHODS.md 4.3: c+ asserts the outcome is correct (the paper's texts are not public)"""
CSCR_NEGATIVE = "{question}\n\n[Privileged information] The final answer reached in the response below is incorrect."
"""[GUESS] METHODS.md 4.3: c- asserts it is incorrect"""
OPPO_ORACLE = "{question}\n\nThe correct final answer is: {answer}."
"""[GUESS: wording] METHODS.md 1.3: the reference final answer appended to the user turn"""


OVERFLOWS = ("truncate", "skip")
"""what to do with a privileged prompt + response longer than the model's context"""


def check_template(template: Any, key: str, *, needs_answer: bool = False) -> None:
    """Raise ValueError naming ``key`` unless ``template`` is a string with ``{question}`` (and ``{answer}``)."""
    if not isinstance(template, str) or "{question}" not in template:
        raise ValueError(f"{key}={template!r} is invalid: a string containing {{question}} (the user turn's text), "
                         "e.g. '{question}\\n\\nThe correct final answer is: {answer}.'")
    if needs_answer and "{answer}" not in template:
        raise ValueError(f"{key}={template!r} has no {{answer}}: the oracle prompt must contain the reference "
                         "answer, or the evidence is only the template's own effect.")


def ground_truth(reward_model: Any) -> str:
    """The row's reference answer from verl's ``reward_model`` field (``{"ground_truth": ...}``)."""
    if isinstance(reward_model, Mapping) and "ground_truth" in reward_model:
        value = reward_model["ground_truth"]
        if isinstance(value, (list, tuple)):  # several accepted answers: the first
            value = value[0] if value else ""
        return str(value)
    raise ValueError(f"the row's reward_model field is {reward_model!r}, with no 'ground_truth': a template with "
                     "{answer} needs verl's dataset column reward_model={'ground_truth': ...}.")


def rewrite_messages(messages: Sequence[Mapping[str, Any]], template: str, answer: str = "") -> list[dict[str, Any]]:
    """A copy of ``messages`` whose last user message's text is ``template`` filled in."""
    out = [dict(m) for m in messages]
    users = [i for i, m in enumerate(out) if m.get("role") == "user"]
    if not users:
        raise ValueError("the row's raw_prompt has no user message to rewrite: privileged re-scoring rewrites the "
                         f"last user turn; got roles {[m.get('role') for m in out]}")
    last = out[users[-1]]
    content = last.get("content")
    if not isinstance(content, str):
        raise ValueError("the row's last user message is not plain text (multimodal content); privileged "
                         "re-scoring supports text prompts only")
    fill = {"{question}": content, "{answer}": answer}
    last["content"] = re.sub(r"\{question\}|\{answer\}", lambda m: fill[m.group(0)], template)  # one pass
    return out
