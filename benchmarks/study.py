"""The study's runs (docs/study.md): every (task, method, learning rate, seed) of a phase through the fast runner.

    python benchmarks/study.py run --phase tuning --task fill2 --methods grpo,oar_g --lrs 0.5e-3,1e-3 \
        --seeds 1000-1004 --steps 32 [--shard 0/2] [--runs-dir runs/study]
    python benchmarks/study.py run --phase eval --task fill2 --methods grpo@1e-3,oar_g@2e-3 --seeds 2000-2019 --steps 28
    python benchmarks/study.py collect --out benchmarks/results_study_cpu.json [--tasks fill2] [--runs-dir runs/study]

``run`` trains each run of the grid in this process (one torch thread; start two processes with ``--shard 0/2`` and
``--shard 1/2`` to use two cores) and writes verl's file-logger metric file
``RUNS/PHASE/TASK/METHOD/lr{LR}_seed{SEED}.jsonl``; a run whose file already holds its last step is skipped, so an
interrupted phase resumes where it stopped (a partial file is rerun from the start: the runner is deterministic).
A run that raises is recorded as ``...jsonl.error`` (the traceback) and counted as censored by the analysis
(docs/study.md: no run is dropped or re-run).

``collect`` gathers every finished run into one results JSON (machine, settings, commands, per-run curves and
seconds) that ``verl_oar.testbed.study_analysis`` reads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASKS = {"fill2": None, "fill8": "fill8", "fill32": "fill32"}
"""study task -> testbed variant folder name (None: the committed start)"""


def parse_seeds(text: str) -> list[int]:
    """``"1000-1004"`` or ``"1,2,5"`` (or a mix) -> sorted distinct seeds."""
    seeds: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if "-" in part:
            lo, hi = (int(x) for x in part.split("-"))
            seeds.update(range(lo, hi + 1))
        elif part:
            seeds.add(int(part))
    return sorted(seeds)


def run_path(runs_dir: Path, phase: str, task: str, method: str, lr: float, seed: int) -> Path:
    return runs_dir / phase / task / method / f"lr{lr:g}_seed{seed}.jsonl"


def finished(path: Path, steps: int) -> bool:
    """Whether the run is done: it crashed (``.error``, counted censored, never re-run) or its metric file holds
    step ``steps`` (the run's last)."""
    if Path(str(path) + ".error").exists() and Path(str(path) + ".meta.json").exists():
        return True
    if not path.exists():
        return False
    for line in path.read_text().splitlines():
        if line.strip() and json.loads(line).get("step") == steps:
            return True
    return False


def testbed_dir(task: str) -> Path | None:
    variant = TASKS[task]
    return None if variant is None else ROOT / "verl_oar" / "testbed" / "variants" / variant


def cmd_run(args) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from verl_oar.testbed.fast_runner import METHODS, run
    from verl_oar.testbed.training_runs import RunSettings

    lrs = [float(x) for x in (args.lrs or "").split(",") if x]
    cells = []  # (method, lr): "name" takes every --lrs rate, "name@lr" that rate only
    for item in (m for m in args.methods.split(",") if m):
        name, _, rate = item.partition("@")
        if not rate and not lrs:
            sys.exit(f"study.py: {item!r} has no rate: give --lrs or write it as {name}@RATE")
        cells += [(name, float(rate))] if rate else [(name, lr) for lr in lrs]
    unknown = sorted({m for m, _ in cells if m not in METHODS})
    if unknown:
        sys.exit(f"study.py: unknown method(s) {unknown}; the fast runner carries {', '.join(METHODS)}")
    if args.task not in TASKS:
        sys.exit(f"study.py: unknown task {args.task!r}; one of {', '.join(TASKS)}")
    grid = [(m, lr, s) for s in parse_seeds(args.seeds) for m, lr in cells]
    index, count = (int(x) for x in args.shard.split("/"))
    mine = grid[index::count]
    runs_dir = Path(args.runs_dir)
    done = 0
    for method, lr, seed in mine:
        path = run_path(runs_dir, args.phase, args.task, method, lr, seed)
        if finished(path, args.steps):
            done += 1
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        settings = RunSettings(steps=args.steps, lr=lr)
        Path(str(path) + ".error").unlink(missing_ok=True)
        began = time.time()
        try:
            run(method, seed, settings, path, testbed=testbed_dir(args.task),
                log=lambda m: print(f"[study {time.strftime('%H:%M:%S')}] {args.task} lr={lr:g} {m}", flush=True)
                if ("done" in m or "ready" in m) else None)
        except Exception:  # recorded, counted as censored by the analysis (never re-run silently)
            Path(str(path) + ".error").write_text(traceback.format_exc())
            print(f"[study] {path} FAILED (see .error)", flush=True)
        meta = {"steps": args.steps, "seconds": round(time.time() - began, 2)}
        Path(str(path) + ".meta.json").write_text(json.dumps(meta) + "\n")
        done += 1
        print(f"[study] {args.phase} {args.task} shard {args.shard}: {done}/{len(mine)}", flush=True)
    return 0


def read_run(path: Path) -> dict:
    from verl_oar.testbed.training_runs import REWARD, VAL_REWARD

    records = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    train = [r for r in records if REWARD in r["data"]]
    val = {r["step"]: r["data"][VAL_REWARD] for r in records if VAL_REWARD in r["data"]}
    return {
        "reward": [r["data"][REWARD] for r in sorted(train, key=lambda r: r["step"])],
        "val_accuracy": {str(k): v for k, v in sorted(val.items())},
    }


def cmd_collect(args) -> int:
    from verl_oar.testbed.machine import machine_info

    runs_dir = Path(args.runs_dir)
    out = Path(args.out)
    runs, unfinished = [], 0
    for meta_path in sorted(runs_dir.glob("*/*/*/*.jsonl.meta.json")):
        path = Path(str(meta_path)[: -len(".meta.json")])
        phase, task, method = path.parts[-4:-1]
        if args.tasks and task not in args.tasks.split(","):
            continue
        lr_part, seed_part = path.stem.split("_seed")
        meta = json.loads(meta_path.read_text())
        entry = {"phase": phase, "task": task, "method": method, "lr": float(lr_part[2:]), "seed": int(seed_part),
                 "steps": meta["steps"], "seconds": meta["seconds"]}
        error = Path(str(path) + ".error")
        if error.exists():
            entry["error"] = error.read_text()[-2000:]
        elif finished(path, meta["steps"]):
            entry.update(read_run(path))
        else:
            unfinished += 1
            continue
        runs.append(entry)
    previous = json.loads(out.read_text()) if out.exists() else {}
    result = {
        "what": "docs/study.md: pick_max credit-assignment study, fast runner (verl's math in one process)",
        "commands": previous.get("commands", []) + ([args.note] if args.note else []),
        "machine": {**machine_info(), "torch_threads_per_run": 1,
                    "note": "2 runs at a time (one per core), beside other jobs: seconds are upper bounds"},
        "settings": {"batch_size": 8, "n": 8, "val_every": 4, "val_prompts": 64, "threshold": 0.8, "window": 3},
        "study_seconds": previous.get("study_seconds"),
        "runs": runs,
    }
    if args.study_seconds is not None:
        result["study_seconds"] = args.study_seconds
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"study.py: {len(runs)} runs -> {out} ({unfinished} unfinished left out)")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--phase", required=True, choices=("tuning", "eval"))
    r.add_argument("--task", required=True)
    r.add_argument("--methods", required=True)
    r.add_argument("--lrs", default="", help="rates for methods named without @RATE")
    r.add_argument("--seeds", required=True)
    r.add_argument("--steps", type=int, required=True)
    r.add_argument("--shard", default="0/1")
    r.add_argument("--runs-dir", default=str(ROOT / "runs" / "study"))
    c = sub.add_parser("collect")
    c.add_argument("--out", required=True)
    c.add_argument("--runs-dir", default=str(ROOT / "runs" / "study"))
    c.add_argument("--tasks", default="", help="only these tasks, comma-separated (a task's results are committed "
                   "once its evaluation phase is complete)")
    c.add_argument("--note", default="", help="a command line to record with the results")
    c.add_argument("--study-seconds", type=float, default=None)
    args = p.parse_args(argv)
    return cmd_run(args) if args.cmd == "run" else cmd_collect(args)


if __name__ == "__main__":
    sys.exit(main())
