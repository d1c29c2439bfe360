"""Math reward: the final answer OAR grounds token importance on, graded by math-verify.

verl extension point: ``reward.custom_reward_function`` with
``reward.custom_reward_function.path=pkg://verl_oar.rewards.math_reward`` and ``.name=compute_score``.
Checked against verl 0.9.1: ``verl/trainer/ppo/reward.py:get_custom_reward_fn`` calls
``verl/utils/import_utils.py:load_extern_object`` -> ``load_module``, which imports
``pkg://verl_oar.rewards.math_reward`` as the module ``verl_oar.rewards.math_reward`` (no file path needed), and
wraps the function so that ``reward.custom_reward_function.reward_kwargs`` are passed as keyword
arguments: ``timeout_s`` (an answer's own grading budget), ``queue_timeout_s`` (the bound on waiting for a
worker, per busy period) and ``verify_workers`` (worker processes) can be set there.

1. **Extraction** -- ``pred = solution_str[span.start:span.end]`` for
   ``span = verl_oar.core.answer_span.find_answer_span(solution_str)``: the last ``\\boxed{...}`` /
   ``\\fbox{...}``, else the later of the last ``Answer:`` / ``Final Answer`` label and the last
   ``####``, else what follows the last "The (final) answer is" (up to its sentence end or a
   justification such as ", since"; one pair of ``$...$`` / ``\\(...\\)`` around it removed; the
   exact rules are in ``verl_oar.core.answer_span``'s docstring). verl's reward manager grades the
   response decoded with ``skip_special_tokens=True``, the same text OAR locates the answer tokens
   in, and the result says where ``pred`` is (``answer_span``), so OAR can ground on exactly the
   characters the verifier graded. No answer -> score 0, ``pred = ""``, ``answer_span = ""``.
2. **Verification** -- ``math_verify.parse("\\boxed{ground_truth}")`` (LaTeX extraction) against
   ``parse("\\boxed{pred}")`` (expression and LaTeX extraction), correct if any pair ``verify``s:
   the configuration of verl's ``verl/utils/reward_score/math_verify.py``, which however parses the
   whole response; here only the extracted answer is parsed, so a number in the reasoning can never
   be graded in place of the answer. Identical strings (after stripping whitespace) are correct
   without calling math-verify (a ground truth that math-verify cannot parse, e.g. a plain word, is
   then still gradable by exact match).
3. **Screens and timeouts** -- an answer that would stall math-verify (an exponent tower, a huge factorial,
   an answer far longer than the ground truth: ``verl_oar.rewards.prescreen``) is not sent to it; math-verify
   runs in worker processes where its own limits work, each answer with its own time budget from the moment a
   worker takes it (``timeout_s``), and the wait for a worker bounded per busy period (``queue_timeout_s``),
   never against the answer's own budget (``verl_oar.rewards.verify_pool``). Any number of threads may call.
4. **Not graded is not wrong** -- every result says how it was graded (``grade``, below). An answer that was
   not graded scores 0 here (verl needs a number) with ``graded = 0.0``; validation averages ``graded`` into
   ``val-aux/{data_source}/graded/mean@N``. Bad input is refused with the argument named: a response that is
   not a string, a ground truth that is neither a string, a number nor a list of them (a list: any match
   counts).

Return value: ``{"score": 1.0 | 0.0, "acc": 1.0 | 0.0, "pred": str, "answer_span": str, "graded": 1.0 | 0.0,
"grade": str}``, the same keys every call. ``grade`` is one of ``GRADED`` (``exact``: equal strings,
``verified`` / ``refuted``: math-verify's verdict, ``no_answer``: the response has none, scored 0) or of
``NOT_GRADED`` (``prescreened``, ``timed_out``, ``no_worker``, ``error``, ``no_ground_truth``). ``answer_span`` is ``"<marker_start>:<start>:<end>"``, character offsets into
``solution_str`` of the graded answer's marker (``\\boxed``, ``Answer:``, ...) and content, so that
``solution_str[start:end] == pred``; or ``""`` when no answer was found.
``verl_oar.core.answer_span.parse_answer_span`` reads it back (an ``AnswerSpan``, or None for ``""``). It is
a string on purpose: verl averages every numeric key into validation metrics (and builds one numpy
array per key); a string is not averaged.
What verl 0.9.1 does with it: ``NaiveRewardManager`` takes ``result["score"]`` as the sequence
reward (on the last response token) and puts every key, ``score`` included, in
``reward_extra_info``. In training these go to each sample's ``extra_fields`` (DAPO-style group
filtering reads ``filter_groups_metric`` there, e.g. ``acc``) and to rollout dumps; they are not
logged as training metrics. In validation (``trainer_base._validate`` ->
``metric_utils.process_validation_metrics``) every numeric key becomes
``val-aux/{data_source}/{key}/mean@N`` etc., ``acc`` is the core metric
(``val-core/{data_source}/acc/mean@N``), string keys are not averaged, and ``pred`` is what
``maj@N`` votes on. Keys must be the same in every result: verl builds one array per key of the
first result.
"""

from __future__ import annotations

from typing import Any

from verl_oar.rewards import verify_pool
from verl_oar.rewards.prescreen import screen

__all__ = ["GRADED", "NOT_GRADED", "compute_score", "ground_truths"]

GRADED = ("exact", "verified", "refuted", "no_answer")
"""statuses of a graded answer (score 1 for the first two)"""
NOT_GRADED = ("prescreened", "timed_out", "no_worker", "error", "no_ground_truth")
"""statuses of an answer that was not graded (score 0, ``graded`` 0)"""


def ground_truths(ground_truth: Any) -> list[str]:
    """The accepted answers: a string or number is one, a list / tuple / 1-d array of them is several (any
    match counts); None or empty strings give none. Anything else is a TypeError naming the argument."""
    if ground_truth is None:
        return []
    if isinstance(ground_truth, (str, int, float)) and not isinstance(ground_truth, bool):
        items = [ground_truth]
    elif isinstance(ground_truth, (list, tuple)) or type(ground_truth).__name__ == "ndarray":
        items = list(ground_truth)
    else:
        raise TypeError(f"compute_score: ground_truth must be a string, a number or a list of them, got "
                        f"{type(ground_truth).__name__}; write reward_model.ground_truth as such in the data")
    out = []
    for item in items:
        if type(item).__module__ == "numpy" and hasattr(item, "item"):
            item = item.item()       # a numpy scalar from a parquet column
        if not isinstance(item, (str, int, float)) or isinstance(item, bool):
            raise TypeError(f"compute_score: ground_truth lists must hold strings or numbers, got an item of "
                            f"type {type(item).__name__}; write each accepted answer as a string in the data")
        text = str(item).strip()
        if text:
            out.append(text)
    return out


def compute_score(data_source: Any, solution_str: str, ground_truth: Any, extra_info: Any = None,
                  timeout_s: float = verify_pool.ANSWER_TIMEOUT_S,
                  queue_timeout_s: float = verify_pool.QUEUE_TIMEOUT_S, verify_workers: int | None = None,
                  **kwargs: Any) -> dict[str, Any]:
    """verl reward function: ``{"score", "acc", "pred", "answer_span", "graded", "grade"}`` (module docstring).

    ``data_source`` and ``extra_info`` are not used: every source is graded the same way.
    """
    from verl_oar.core.answer_span import find_answer_span, format_answer_span

    if not isinstance(solution_str, str):
        raise TypeError(f"compute_score: solution_str must be the decoded response (a str), got "
                        f"{type(solution_str).__name__}; pass the response text, not token ids or None")
    if verify_workers is not None:
        verify_pool.configure(verify_workers)
    truths = ground_truths(ground_truth)
    span = find_answer_span(solution_str)
    pred = "" if span is None else solution_str[span.start:span.end]
    if not truths:
        grade = "no_ground_truth"
    elif not pred:
        grade = "no_answer"
    elif any("".join(pred.split()) == "".join(truth.split()) for truth in truths):
        grade = "exact"
    elif screen(pred, truths) is not None:
        grade = "prescreened"
    else:
        grade = verify_pool.verify(pred, truths, float(timeout_s), float(queue_timeout_s))
    value = 1.0 if grade in ("exact", "verified") else 0.0
    return {"score": value, "acc": value, "pred": pred, "answer_span": format_answer_span(span),
            "graded": 0.0 if grade in NOT_GRADED else 1.0, "grade": grade}
