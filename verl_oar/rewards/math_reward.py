"""Math reward: the final answer OAR grounds token importance on, graded by math-verify.

verl extension point: ``reward.custom_reward_function`` with
``reward.custom_reward_function.path=pkg://verl_oar.rewards.math_reward`` and ``.name=compute_score``.
Checked against verl 0.9.1: ``verl/trainer/ppo/reward.py:get_custom_reward_fn`` calls
``verl/utils/import_utils.py:load_extern_object`` -> ``load_module``, which imports
``pkg://verl_oar.rewards.math_reward`` as the module ``verl_oar.rewards.math_reward`` (no file path needed), and
wraps the function so that ``reward.custom_reward_function.reward_kwargs`` are passed as keyword
arguments (``timeout_s`` below can be set there).

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
3. **Timeout** -- math-verify's own timeouts use ``signal.alarm``, which works only in a process's
   main thread; verl 0.9.1's ``NaiveRewardManager.run_single`` runs a synchronous reward function in
   the event loop's default thread pool, where math-verify's ``parse`` raises ``ValueError``
   ("doesn't support threaded environment"). Here parse/verify run in up to ``VERIFY_PROCESSES``
   worker processes (``python -m verl_oar.rewards.math_reward``, fed one JSON line per question), in their
   main thread, so math-verify's own limits work (``PARSE_TIMEOUT_S`` per parse,
   ``VERIFY_TIMEOUT_S`` per comparison). The caller waits at most ``timeout_s`` in all (default
   ``TIMEOUT_S``; a free worker, its start-up and its answer) and scores 0 after that; a worker that
   overran is stuck where signals cannot reach and is killed, and a fresh one starts on demand. So a
   hung verification can neither hang the reward worker nor use up the workers; any number of
   threads may call. Workers are plain subprocesses, not a ``multiprocessing`` spawn pool, because
   a spawn pool re-imports the caller's ``__main__`` in every worker (re-running a calling script
   without an ``if __name__ == "__main__"`` guard). This module imports only the standard library at
   import time (``find_answer_span`` and math-verify are imported when used): workers start without
   torch, in about a second.

Return value: ``{"score": 1.0 | 0.0, "acc": 1.0 | 0.0, "pred": str, "answer_span": str}``, the same
keys every call. ``answer_span`` is ``"<marker_start>:<start>:<end>"``, character offsets into
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

import atexit
import contextlib
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from typing import Any

__all__ = ["PARSE_TIMEOUT_S", "TIMEOUT_S", "VERIFY_PROCESSES", "VERIFY_TIMEOUT_S", "compute_score", "verify_answer"]

logger = logging.getLogger(__name__)

TIMEOUT_S = 30.0
"""longest wait for one verification, in seconds (override: ``reward_kwargs.timeout_s``)"""
PARSE_TIMEOUT_S = 5
"""math-verify's own limit per parse, in the worker (whole seconds: it uses ``signal.alarm``)"""
VERIFY_TIMEOUT_S = 5
"""math-verify's own limit per comparison, in the worker"""
VERIFY_PROCESSES = max(1, min(4, os.cpu_count() or 1))
"""most math-verify worker processes per grading process (started on demand, kept while idle)"""


# ---------------------------------------------------------------------------------------------
# 1. Verification (runs in the worker processes)
# ---------------------------------------------------------------------------------------------


def verify_answer(pred: str, ground_truth: str) -> bool:
    """Whether ``pred`` and ``ground_truth`` (answer contents, no ``\\boxed``) are equivalent for
    math-verify. Uses signal-based timeouts: call it in a main thread (the workers do)."""
    from math_verify import parse, verify
    from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig

    gold = parse("\\boxed{" + ground_truth + "}", (LatexExtractionConfig(),), parsing_timeout=PARSE_TIMEOUT_S)
    if not gold:
        return False
    answer = parse("\\boxed{" + pred + "}", (ExprExtractionConfig(), LatexExtractionConfig()),
                   parsing_timeout=PARSE_TIMEOUT_S)
    return any(verify(g, p, timeout_seconds=VERIFY_TIMEOUT_S) for g in gold for p in answer)


# ---------------------------------------------------------------------------------------------
# 2. The worker processes
# ---------------------------------------------------------------------------------------------


class _Worker:
    """One ``python -m verl_oar.rewards.math_reward`` process: a JSON line ``[pred, ground_truth]`` in, a
    JSON line ``{"correct": bool}`` or ``{"error": str}`` out. A plain subprocess rather than a
    ``multiprocessing`` pool: nothing of the caller's ``__main__`` is re-imported in it (a spawn pool
    re-runs an unguarded calling script in every worker), and one stuck worker is killed alone."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "verl_oar.rewards.math_reward"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, encoding="utf-8", bufsize=1,
        )
        self.owner = os.getpid()

    def ask(self, pred: str, ground_truth: str, deadline: float) -> bool:
        """The worker's verdict; TimeoutError after ``deadline`` (``time.monotonic``), RuntimeError
        if the worker died or failed."""
        self.proc.stdin.write(json.dumps([pred, ground_truth]) + "\n")
        self.proc.stdin.flush()
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([self.proc.stdout], [], [], remaining)[0]:
            raise TimeoutError
        line = self.proc.stdout.readline()      # the worker writes whole lines
        if not line:
            raise RuntimeError(f"math-verify worker exited with code {self.proc.poll()}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return bool(reply["correct"])

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.kill()
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=5)
        for pipe in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                pipe.close()


_lock = threading.Lock()
_idle: list[_Worker] = []
_all: set[_Worker] = set()
_slots = threading.BoundedSemaphore(VERIFY_PROCESSES)


def _take_worker() -> _Worker:
    with _lock:
        while _idle:
            worker = _idle.pop()
            if worker.owner == os.getpid() and worker.proc.poll() is None:
                return worker
            _all.discard(worker)    # dead, or inherited through a fork: not ours to use
        worker = _Worker()
        _all.add(worker)
        return worker


def _drop_worker(worker: _Worker) -> None:
    with _lock:
        _all.discard(worker)
    worker.kill()


@atexit.register
def _shutdown() -> None:
    with _lock:
        workers = [w for w in _all if w.owner == os.getpid()]
        _all.clear()
        _idle.clear()
    for worker in workers:
        worker.kill()


def _verify_with_timeout(pred: str, ground_truth: str, timeout_s: float) -> bool:
    """``verify_answer`` in a worker process, waiting at most ``timeout_s`` in all (for a free
    worker, its start, and its answer); False after that, and the worker is killed."""
    deadline = time.monotonic() + timeout_s
    if not _slots.acquire(timeout=max(timeout_s, 0.0)):
        logger.warning("no math-verify worker free within %.1fs (pred=%r): scored 0", timeout_s, pred[:200])
        return False
    worker = None
    try:
        worker = _take_worker()
        correct = worker.ask(pred, ground_truth, deadline)
    except TimeoutError:
        logger.warning("math-verify did not answer in %.1fs (pred=%r, ground truth=%r): scored 0, worker "
                       "killed", timeout_s, pred[:200], ground_truth[:200])
        correct = None
    except Exception as error:  # noqa: BLE001 - a verifier failure must not crash the reward worker
        logger.warning("math-verify failed (%s: %s) on pred=%r: scored 0", type(error).__name__, error, pred[:200])
        correct = None
    finally:
        _slots.release()
    if correct is None:
        if worker is not None:
            _drop_worker(worker)
        return False
    with _lock:
        _idle.append(worker)
    return correct


def _serve() -> None:
    """Worker loop (``python -m verl_oar.rewards.math_reward``): runs in the process's main thread, where
    math-verify's ``signal.alarm`` timeouts work. Exits when its stdin closes (the caller exited)."""
    import math_verify  # noqa: F401 - import before the first request, not inside its deadline

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    os.dup2(2, 1)               # anything else printed goes to stderr, not into the replies
    sys.stdout = sys.stderr
    for line in sys.stdin:
        try:
            pred, ground_truth = json.loads(line)
            reply = {"correct": verify_answer(pred, ground_truth)}
        except Exception as error:  # noqa: BLE001 - report it; the caller scores 0
            reply = {"error": f"{type(error).__name__}: {error}"}
        replies.write(json.dumps(reply) + "\n")


# ---------------------------------------------------------------------------------------------
# 3. The reward
# ---------------------------------------------------------------------------------------------


def compute_score(data_source: Any, solution_str: str, ground_truth: Any, extra_info: Any = None,
                  timeout_s: float = TIMEOUT_S, **kwargs: Any) -> dict[str, Any]:
    """verl reward function: ``{"score", "acc", "pred", "answer_span"}`` (see the module docstring).

    ``data_source`` and ``extra_info`` are not used: every source is graded the same way.
    """
    from verl_oar.core.answer_span import find_answer_span, format_answer_span

    span = find_answer_span(solution_str)
    pred = "" if span is None else solution_str[span.start:span.end]
    truth = "" if ground_truth is None else str(ground_truth).strip()
    if not pred or not truth:
        correct = False
    elif "".join(pred.split()) == "".join(truth.split()):
        correct = True
    else:
        correct = _verify_with_timeout(pred, truth, float(timeout_s))
    value = 1.0 if correct else 0.0
    return {"score": value, "acc": value, "pred": pred, "answer_span": format_answer_span(span)}


if __name__ == "__main__":
    _serve()
