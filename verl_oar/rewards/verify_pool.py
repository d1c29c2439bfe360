"""math-verify in worker processes: each answer gets its own time budget, the queue for a worker a bound of its own.

Why processes: math-verify's timeouts use ``signal.alarm``, which works only in a process's main thread, and
verl 0.9.1's ``NaiveRewardManager.run_single`` calls a synchronous reward function from a thread pool (where
math-verify's ``parse`` raises "doesn't support threaded environment"). Each worker is a plain
``python -m verl_oar.rewards.verify_pool`` subprocess fed one JSON line per question and answering in its main
thread, so math-verify's own limits work (``PARSE_TIMEOUT_S`` per parse, ``VERIFY_TIMEOUT_S`` per comparison).
Plain subprocesses, not a ``multiprocessing`` spawn pool: a spawn pool re-imports the caller's ``__main__`` in
every worker. This module imports only the standard library: a worker starts without torch, in about a second.

Two clocks, so that slow answers cannot make a right one wrong:

- **the answer's own budget** (``timeout_s``, default ``ANSWER_TIMEOUT_S``) starts when a worker takes the
  answer: the worker's start-up and its reply. Past it the worker (stuck where signals cannot reach) is
  killed and the answer is ``timed_out``; a fresh worker starts on demand.
- **the queue's bound** (``queue_timeout_s``, default ``QUEUE_TIMEOUT_S``) caps a *busy period*: the time
  since the pool last had no answer in a worker and none waiting. An answer still waiting for a worker when
  the busy period is older than the bound is ``no_worker``. In verl a busy period is one step's reward
  computation (between steps nothing is graded), so this bounds the whole reward step at about
  ``queue_timeout_s + timeout_s`` however many answers are slow, while no answer loses its own time waiting.

Results are statuses, never a silent 0: ``verified``, ``refuted`` (graded) or ``timed_out``, ``no_worker``,
``error`` (not graded). ``verl_oar.rewards.math_reward`` turns them into verl's reward dict.
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

__all__ = ["ANSWER_TIMEOUT_S", "PARSE_TIMEOUT_S", "QUEUE_TIMEOUT_S", "VERIFY_TIMEOUT_S", "VERIFY_WORKERS",
           "configure", "verify", "verify_answer"]

logger = logging.getLogger(__name__)

ANSWER_TIMEOUT_S = 30.0
"""an answer's own budget in a worker, seconds (the worker's start included)"""
QUEUE_TIMEOUT_S = 600.0
"""the longest busy period in which an answer may still wait for a worker, seconds"""
PARSE_TIMEOUT_S = 5
"""math-verify's own limit per parse, in the worker (whole seconds: it uses ``signal.alarm``)"""
VERIFY_TIMEOUT_S = 5
"""math-verify's own limit per comparison, in the worker"""
VERIFY_WORKERS = max(1, min(4, os.cpu_count() or 1))
"""default number of worker processes per grading process (started on demand, kept while idle)"""


def verify_answer(pred: str, ground_truth: str) -> bool:
    """Whether ``pred`` and ``ground_truth`` (answer contents, no ``\\boxed``) are equivalent for math-verify:
    ``parse("\\boxed{ground_truth}")`` (LaTeX) against ``parse("\\boxed{pred}")`` (expression and LaTeX), any
    pair verifying. Signal-based timeouts: call it in a main thread (the workers do)."""
    from math_verify import parse
    from math_verify import verify as mv_verify
    from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig

    gold = parse("\\boxed{" + ground_truth + "}", (LatexExtractionConfig(),), parsing_timeout=PARSE_TIMEOUT_S)
    if not gold:
        return False
    answer = parse("\\boxed{" + pred + "}", (ExprExtractionConfig(), LatexExtractionConfig()),
                   parsing_timeout=PARSE_TIMEOUT_S)
    return any(mv_verify(g, p, timeout_seconds=VERIFY_TIMEOUT_S) for g in gold for p in answer)


class _Worker:
    """One worker process: a JSON line ``[pred, [truth, ...]]`` in, ``{"correct": bool}`` or ``{"error": str}``
    out (correct when any truth verifies)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "verl_oar.rewards.verify_pool"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, encoding="utf-8", bufsize=1,
        )
        self.owner = os.getpid()

    def ask(self, pred: str, truths: list[str], deadline: float) -> bool:
        """The verdict; TimeoutError after ``deadline`` (``time.monotonic``), RuntimeError if the worker failed."""
        self.proc.stdin.write(json.dumps([pred, truths]) + "\n")   # ensure_ascii: lone surrogates travel escaped
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


class _Pool:
    """At most ``capacity`` answers in workers at once; waiters bounded by the busy period (module docstring)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.cond = threading.Condition()
        self.in_use = 0
        self.waiting = 0
        self.busy_since: float | None = None
        self.idle: list[_Worker] = []
        self.every: set[_Worker] = set()

    def acquire(self, queue_timeout_s: float) -> bool:
        with self.cond:
            if self.busy_since is None:
                self.busy_since = time.monotonic()
            self.waiting += 1
            try:
                while self.in_use >= self.capacity:
                    remaining = self.busy_since + queue_timeout_s - time.monotonic()
                    if remaining <= 0:
                        return False
                    self.cond.wait(remaining)
                self.in_use += 1
                return True
            finally:
                self.waiting -= 1
                self._maybe_idle()

    def release(self, worker: _Worker | None, healthy: bool) -> None:
        if worker is not None and not healthy:
            worker.kill()
        with self.cond:
            if worker is not None:
                (self.idle.append if healthy else self.every.discard)(worker)
            self.in_use -= 1
            self._maybe_idle()
            self.cond.notify()

    def _maybe_idle(self) -> None:
        if self.in_use == 0 and self.waiting == 0:
            self.busy_since = None

    def take_worker(self) -> _Worker:
        with self.cond:
            while self.idle:
                worker = self.idle.pop()
                if worker.owner == os.getpid() and worker.proc.poll() is None:
                    return worker
                self.every.discard(worker)     # dead, or inherited through a fork: not ours to use
        worker = _Worker()
        with self.cond:
            self.every.add(worker)
        return worker

    def shutdown(self) -> None:
        with self.cond:
            workers = [w for w in self.every if w.owner == os.getpid()]
            self.every.clear()
            self.idle.clear()
        for worker in workers:
            worker.kill()


_pool = _Pool(VERIFY_WORKERS)
atexit.register(lambda: _pool.shutdown())


def configure(workers: int) -> None:
    """Set the number of worker processes (takes effect for the next answers; running ones finish)."""
    if int(workers) < 1:
        raise ValueError(f"verify workers must be >= 1, got {workers!r}: set reward_kwargs.verify_workers to a "
                         "positive integer (about one per free CPU core)")
    with _pool.cond:
        _pool.capacity = int(workers)
        _pool.cond.notify_all()


def verify(pred: str, truths: list[str], timeout_s: float = ANSWER_TIMEOUT_S,
           queue_timeout_s: float = QUEUE_TIMEOUT_S) -> str:
    """``verified`` | ``refuted`` | ``timed_out`` | ``no_worker`` | ``error`` for ``pred`` against any of
    ``truths`` (answer contents). Safe from any number of threads; never raises for a bad answer."""
    if not _pool.acquire(float(queue_timeout_s)):
        logger.warning("no math-verify worker free within the queue bound of %.0fs (pred=%r): not graded",
                       queue_timeout_s, pred[:200])
        return "no_worker"
    worker, healthy = None, False
    try:
        deadline = time.monotonic() + float(timeout_s)   # the answer's own budget starts with its worker
        worker = _pool.take_worker()
        correct = worker.ask(pred, truths, deadline)
        healthy = True
        return "verified" if correct else "refuted"
    except TimeoutError:
        logger.warning("math-verify did not answer in %.1fs (pred=%r): not graded, worker killed",
                       timeout_s, pred[:200])
        return "timed_out"
    except Exception as error:  # noqa: BLE001 - a verifier failure must not crash the reward worker
        logger.warning("math-verify failed (%s: %s) on pred=%r: not graded", type(error).__name__, error,
                       pred[:200])
        return "error"
    finally:
        _pool.release(worker, healthy)


def _serve() -> None:
    """Worker loop: in the process's main thread, where math-verify's ``signal.alarm`` timeouts work. Exits when
    its stdin closes (the caller exited)."""
    import math_verify  # noqa: F401 - import before the first request, not inside its deadline

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    os.dup2(2, 1)               # anything else printed goes to stderr, not into the replies
    sys.stdout = sys.stderr
    for line in sys.stdin:
        try:
            pred, truths = json.loads(line)
            reply = {"correct": any(verify_answer(pred, truth) for truth in truths)}
        except Exception as error:  # noqa: BLE001 - report it; the caller marks the answer not graded
            reply = {"error": f"{type(error).__name__}: {error}"}
        replies.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    _serve()
