"""Grading under load: batches of responses with a share of pathological answers, graded by
``verl_oar.rewards.math_reward.compute_score`` from a thread pool as verl's reward manager calls it.

    python benchmarks/reward_grading_load.py --out benchmarks/results_reward_grading_load_cpu.json \
        [--batch 512] [--shares 0,0.05,0.2,0.5] [--threads 6] [--workers 2] [--unscreened 0.05]

Each batch: ``--batch`` responses, a share of them pathological (exponent towers, a numeric double power, a huge
factorial, an overlong answer, in turn), the rest half right (``\\frac{1}{2}`` against ``0.5``: math-verify, not an
exact match) and half wrong, shuffled (seed 0). ``--threads`` is the thread pool verl's ``NaiveRewardManager`` grades
in (its event loop's default executor: ``min(32, cores + 4)``, 6 on 2 cores), ``--workers`` the math-verify worker
processes. Per row: wall time, answers per second, and what became of the right answers: scored 1, not graded
(``graded = 0``, counted), or wrongly 0 (a right answer graded and scored 0: must be 0 in every row); and the
count of every ``grade``. ``--unscreened`` adds rows at those shares with the screens off, so the slow answers
reach math-verify (each costs its 5 s parse limit) and the queue's bound, not the screen, protects the right ones.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

def _right(i: int) -> tuple[str, str]:
    return f"so the answer is \\boxed{{\\frac{{{i}}}{{{2 * i}}}}}", "0.5"


def _wrong(i: int) -> tuple[str, str]:
    return f"so the answer is \\boxed{{{i + 3}}}", "0.5"


def _pathological(i: int) -> tuple[str, str]:
    d = 2 + i % 8
    kinds = [f"so \\boxed{{{d}^{{{d}^{{{d}^{{{d}}}}}}}}}", f"so \\boxed{{{d}0^{{{d}0^{{{d}0}}}}}}",
             f"so \\boxed{{{d}9999!}}", "so \\boxed{" + "+".join([f"x_{d}"] * 300) + "}"]
    return kinds[i % len(kinds)], "0.5"


def batch_of(size: int, share: float, seed: int = 0) -> list[tuple[str, str, str]]:
    """``(kind, response, ground truth)`` rows, kind in right / wrong / pathological; every answer distinct within
    its kind's pattern (math-verify's caches must not make a repeated answer free)."""
    bad = round(size * share)
    rest = size - bad
    rows = [("pathological", *_pathological(i)) for i in range(bad)]
    rows += [("right", *_right(i + 1)) for i in range(rest - rest // 2)]
    rows += [("wrong", *_wrong(i)) for i in range(rest // 2)]
    random.Random(seed).shuffle(rows)
    return rows


def grade(rows, threads: int, workers: int, screened: bool) -> dict:
    from verl_oar.rewards import math_reward, verify_pool

    verify_pool.configure(workers)
    screen = math_reward.screen
    if not screened:
        math_reward.screen = lambda pred, truths: None
    try:
        started = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            results = list(pool.map(lambda row: math_reward.compute_score("math500", row[1], row[2]), rows))
        seconds = time.perf_counter() - started
    finally:
        math_reward.screen = screen
    right = [r for (kind, _, _), r in zip(rows, results, strict=True) if kind == "right"]
    return {
        "seconds": round(seconds, 2), "answers_per_s": round(len(rows) / seconds, 1), "right": len(right),
        "right_scored_1": sum(r["score"] == 1.0 for r in right),
        "right_not_graded": sum(r["graded"] == 0.0 for r in right),
        "right_wrongly_0": sum(r["graded"] == 1.0 and r["score"] == 0.0 for r in right),
        "grades": dict(sorted(Counter(r["grade"] for r in results).items())),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--shares", default="0,0.05,0.2,0.5")
    parser.add_argument("--unscreened", default="0.05")
    parser.add_argument("--threads", type=int, default=6)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    from verl_oar.rewards import verify_pool
    from verl_oar.testbed.machine import machine_info

    grade(batch_of(8, 0.0), args.threads, args.workers, True)      # start the workers outside the timings
    rows = []
    plan = [(float(s), True) for s in args.shares.split(",") if s] + \
           [(float(s), False) for s in args.unscreened.split(",") if s]
    for share, screened in plan:
        row = {"share_pathological": share, "screened": screened,
               **grade(batch_of(args.batch, share), args.threads, args.workers, screened)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    out = {
        "command": " ".join(["python", "benchmarks/reward_grading_load.py", *sys.argv[1:]]),
        "machine": machine_info(), "batch": args.batch, "threads": args.threads, "workers": args.workers,
        "answer_timeout_s": verify_pool.ANSWER_TIMEOUT_S, "queue_timeout_s": verify_pool.QUEUE_TIMEOUT_S,
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    if any(row["right_wrongly_0"] for row in rows):
        sys.exit("reward_grading_load: a right answer was graded and scored 0")


if __name__ == "__main__":
    main()
