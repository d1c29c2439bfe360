"""Privileged prompts: the row's chat messages with the last user turn rewritten from a template.

CSCR and OPPO re-score the sampled response under a prompt that knows something the policy did not
(docs/algo/cscr.md, docs/algo/oppo.md): the reference answer (OPPO's oracle) or an assertion about the outcome (CSCR's two
conditions). A template is plain text with two placeholders, replaced literally (other braces, e.g.
``\\boxed{}``, are kept as written):

- ``{question}``: the text of the row's last user message (required: the privileged prompt is the
  original one plus the privilege);
- ``{answer}``: the row's ground truth (``reward_model.ground_truth`` of verl's dataset row).

System messages and earlier turns are kept; the chat template is applied by the caller, with the
rollout's own kwargs. The identity template ``"{question}"`` gives back the rollout's prompt.

A privileged prompt + response longer than the model's context is made to fit by shortening the question
alone (:func:`fit_question`: its middle is replaced by :data:`ELISION`, the chat header, system prompt, earlier
turns, the template's text and the answer are never cut); a row that does not fit even with an empty question
is not scored.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["CSCR_NEGATIVE", "CSCR_POSITIVE", "ELISION", "OPPO_ORACLE", "OVERFLOWS", "check_template", "fit_question",
           "ground_truth", "last_user_text", "rewrite_messages", "shorten"]

CSCR_POSITIVE = "{question}\n\n[Privileged information] The final answer reached in the response below is correct."
"""[GUESS] docs/algo/cscr.md: c+ asserts the outcome is correct (the paper's texts are not public)"""
CSCR_NEGATIVE = "{question}\n\n[Privileged information] The final answer reached in the response below is incorrect."
"""[GUESS] docs/algo/cscr.md: c- asserts it is incorrect"""
OPPO_ORACLE = "{question}\n\nThe correct final answer is: {answer}."
"""[GUESS: wording] docs/algo/oppo.md: the reference final answer appended to the user turn"""


OVERFLOWS = ("truncate", "skip")
"""what to do with a privileged prompt + response longer than the model's context: shorten the question
(:func:`fit_question`) or skip the row"""
ELISION = " [...] "
"""what stands for the middle of a question shortened to fit the context"""


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


def last_user_text(messages: Sequence[Mapping[str, Any]]) -> tuple[int, str]:
    """(index, text) of the last user message: what ``{question}`` stands for. Raises ValueError naming the cause
    for a row without a user message or with multimodal content."""
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    if not users:
        raise ValueError("the row's raw_prompt has no user message to rewrite: privileged re-scoring rewrites the "
                         f"last user turn; got roles {[m.get('role') for m in messages]}")
    content = messages[users[-1]].get("content")
    if not isinstance(content, str):
        raise ValueError("the row's last user message is not plain text (multimodal content); privileged "
                         "re-scoring supports text prompts only")
    return users[-1], content


def rewrite_messages(messages: Sequence[Mapping[str, Any]], template: str, answer: str = "",
                     question: str | None = None) -> list[dict[str, Any]]:
    """A copy of ``messages`` whose last user message's text is ``template`` filled in (``{question}`` with that
    message's text, or with ``question`` when given: a shortened one, :func:`fit_question`)."""
    out = [dict(m) for m in messages]
    index, content = last_user_text(out)
    fill = {"{question}": content if question is None else question, "{answer}": answer}
    out[index]["content"] = re.sub(r"\{question\}|\{answer\}", lambda m: fill[m.group(0)], template)  # one pass
    return out


def shorten(text: str, keep: int) -> str:
    """``text`` with its middle replaced by :data:`ELISION` so that ``keep`` of its characters remain (the first
    ``ceil(keep / 2)`` and the last ``floor(keep / 2)``: a math question's set-up and what it asks); all of it
    when ``keep >= len(text)``, "" when ``keep <= 0``."""
    if keep >= len(text):
        return text
    if keep <= 0:
        return ""
    head = (keep + 1) // 2
    return text[:head] + ELISION + text[len(text) - (keep - head):]


def fit_question(messages: Sequence[Mapping[str, Any]], template: str, answer: str,
                 build_tokens: Callable[[list[dict[str, Any]]], Sequence[int]], room: int) -> tuple[list[int] | None, int]:
    """The rewritten prompt's token ids, ``build_tokens`` (the rollout's chat rendering) of ``messages`` with
    ``template`` filled in, at most ``room`` tokens long: the question is shortened from its middle
    (:func:`shorten`) to the most characters that fit, each candidate re-rendered (a binary search over the
    characters kept: about log2(len(question)) renderings). Returns (ids, characters of the question kept), or
    (None, 0) when even an empty question does not fit."""
    _, question = last_user_text(messages)

    def render(keep: int) -> list[int]:
        return list(build_tokens(rewrite_messages(messages, template, answer, question=shorten(question, keep))))

    best = render(len(question))
    if len(best) <= room:
        return best, len(question)
    empty = render(0)
    if len(empty) > room:
        return None, 0
    lo, hi, best = 0, len(question), empty  # render(lo) fits, render(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        ids = render(mid)
        if len(ids) <= room:
            lo, best = mid, ids
        else:
            hi = mid
    return best, lo
