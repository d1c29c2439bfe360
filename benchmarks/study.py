"""The study's runs (docs/study.md): every (task, method, learning rate, seed) of a phase through the fast runner.

    python benchmarks/study.py run --phase tuning --task fill2 --methods grpo,oar_g --lrs 0.5e-3,1e-3 \
        --seeds 1000-1004 --steps 32 [--runs-dir runs/study]
    python benchmarks/study.py run --phase eval --task fill2 --methods grpo@1e-3,oar_g@2e-3 --seeds 2000-2019 --steps 28
    python benchmarks/study.py store [--runs-dir runs/study]
    python benchmarks/study.py status
    python benchmarks/study.py plan --task fill32
    python benchmarks/study.py collect --out benchmarks/results_study_cpu.json [--tasks fill2]

``run`` trains each run of the grid in this process (one torch thread; start the same command twice to use two cores:
each process claims the next run nobody has claimed, through a ``.claim`` file holding its pid, taken over when that
process is gone; ``--shard i/n`` splits the grid statically instead) and writes verl's file-logger metric file
``RUNS/PHASE/TASK/METHOD/lr{LR}_seed{SEED}.jsonl`` (git-ignored scratch). A run that raises is recorded as
``...jsonl.error`` (the traceback) and counted as censored by the analysis (docs/study.md: no run is dropped or
re-run). A main_ppo trainer killed by a signal from outside (an operator, the OOM killer) did not fail on its own:
that run is not recorded and the process stops, so that the same command trains it again.

Every finished run is appended, as one line (its curves, seconds, error if any and CPU), to the committed run store
``benchmarks/study_runs/`` (one file per phase and task): the study spans many sessions on machines whose scratch
does not survive, and the store is what is kept. ``run`` skips a run found in the store or whose metric file already
holds its last step, so an interrupted phase resumes where it stopped (a partial file is rerun from the start: the
runner is deterministic). ``store`` adds finished runs of the scratch directory that the store lacks.

A method the fast runner does not carry (CSCR, OPPO, ACPO, CoDaPO, OAR-G x CoDaPO: docs/study.md runs them at the
longest task through main_ppo with fewer seeds) trains through ``python -m verl.trainer.main_ppo`` instead, with
the same testbed settings (``testbed.training_runs``, as the demo runs it), one run at a time in a Ray cluster this
process starts; its store line says ``"runner": "main_ppo"``. ``grpo_main_ppo`` is GRPO trained that way: their
same-runner control (``--methods grpo_main_ppo@1e-3 --seeds 2000-2004``).

``status`` counts the stored runs per phase, task, method and rate (crashed ones apart). ``plan`` applies
docs/study.md's rules to a task's stored tuning runs (each method's rate, the evaluation length) and prints the
evaluation phase's commands, so that nobody reads the decision off a table by hand. ``collect`` gathers the
store's runs of the listed tasks into one results JSON (machine, settings, commands, per-run curves and seconds) that
``verl_oar.testbed.study_analysis`` reads.
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
TASKS = {"fill2": None, "fill8": "fill8", "fill32": "fill32", "fill64": "fill64"}
"""study task -> testbed variant folder name (None: the committed start)"""
STORE = ROOT / "benchmarks" / "study_runs"
"""the committed run store: one ``PHASE_TASK.jsonl`` per phase and task, one finished run per line"""
KEY = ("phase", "task", "method", "lr", "seed")
TUNING_SEEDS, EVAL_SEEDS, OTHER_SEEDS = "1000-1004", "2000-2019", "2000-2004"
"""docs/study.md's seeds: tuning; evaluation; the methods only main_ppo carries (fewer seeds, the plan says)"""
REPLICATION_SEEDS = "4000-4039"
"""the confirmatory replication's fresh block (docs/study.md, pre-registered 2026-12-06): phase ``replication``"""
RUNNER_SEEDS = "7000-7009"
"""phase ``runners``: each fast-runner method beside its main_ppo twin on seeds nothing else uses"""
PHASES = ("tuning", "eval", "replication", "runners")
SAME_RUNNER_CONTROL = {"grpo_main_ppo": "grpo", "oar_g_main_ppo": "oar_g"}
"""study method -> the testbed method it trains through main_ppo: GRPO's is the control for the methods only main_ppo
carries (docs/study.md, "Same-runner control"), on their seeds and rate; both are the fast runner's twins in phase
``runners`` (the runners compared over whole runs)"""
LONGEST = "fill32"
"""the task where the ablations, tau and the other registered methods run"""


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


def store_file(store: Path, phase: str, task: str) -> Path:
    return store / f"{phase}_{task}.jsonl"


def read_store(store: Path, phase: str | None = None, task: str | None = None) -> list[dict]:
    """Every stored run (of one phase / task when given); a run stored twice is refused (the store is append-only
    and ``run`` skips stored runs, so a duplicate means two processes ran the same grid cell)."""
    runs, seen = [], set()
    pattern = f"{phase or '*'}_{task or '*'}.jsonl"
    for path in sorted(store.glob(pattern)):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            entry = json.loads(line)
            key = tuple(entry[k] for k in KEY)
            if key in seen:
                raise SystemExit(f"study.py: {path}:{number} stores {dict(zip(KEY, key))} a second time; keep the "
                                 "first line (the run is deterministic) and delete the other")
            seen.add(key)
            runs.append(entry)
    return runs


def entry_of(path: Path, phase: str, task: str, method: str, lr: float, seed: int) -> dict | None:
    """A finished run's compact record (what the analysis reads), or None while the run is unfinished."""
    meta_path = Path(str(path) + ".meta.json")
    if not meta_path.exists():
        return None
    meta = json.loads(meta_path.read_text())
    entry = {"phase": phase, "task": task, "method": method, "lr": lr, "seed": seed,
             "steps": meta["steps"], "seconds": meta["seconds"]}
    error = Path(str(path) + ".error")
    if error.exists():
        entry["error"] = error.read_text()[-2000:]
        if path.exists():  # the curve up to the stop: the analysis counts every later validation point as 0
            entry.update(read_run(path))
    elif finished(path, meta["steps"]):
        entry.update(read_run(path))
    else:
        return None
    entry["cpu"] = meta.get("cpu", "unknown")
    if "cpu_id" in meta:  # vendor, family, model, stepping: float32 trajectories are repeatable only on one of these
        entry["cpu_id"] = meta["cpu_id"]
    if "runner" in meta:
        entry["runner"] = meta["runner"]
    return entry


def append_to_store(store: Path, entry: dict) -> None:
    """One line in one write call on a file opened for appending, so that two shards' lines land whole."""
    store.mkdir(parents=True, exist_ok=True)
    with open(store_file(store, entry["phase"], entry["task"]), "a") as out:
        out.write(json.dumps(entry) + "\n")


def claim(path: Path) -> bool:
    """Whether this process may train the run at ``path``: it creates ``PATH.claim`` (its pid) exclusively, or takes
    over a claim whose process has ended (an interrupted run is rerun from the start)."""
    lock = Path(str(path) + ".claim")
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                owner = int(lock.read_text() or 0)
            except (OSError, ValueError):
                owner = 0
            if owner == os.getpid():
                return True
            if owner and _alive(owner):
                return False
            lock.unlink(missing_ok=True)  # its process is gone; two takers race on O_EXCL above, one wins
            continue
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        return True
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class MainPPORoute:
    """The main_ppo route of one ``run`` process: a copy of the task's testbed (main_ppo writes beside it), the
    validation subset, and one Ray cluster that the process's main_ppo runs share (stopped by :meth:`close`)."""

    def __init__(self, task: str, scratch: Path):
        self.task, self.scratch, self.cluster, self._bed = task, scratch, None, None

    def train(self, method: str, seed: int, settings, path: Path, log) -> None:
        """One run; its metric file ends at ``path``. Raises (with the run's log) when it fails."""
        import shutil

        from verl_oar.cpu.ray_cluster import SharedRayCluster
        from verl_oar.testbed.demo import write_val_subset
        from verl_oar.testbed.fast_runner import load_bed, neutral_token_id
        from verl_oar.testbed.training_runs import make_runs, run_all
        from verl_oar.testbed.workspace import copy_testbed

        out = self.scratch / "main_ppo" / self.task / f"process_{os.getpid()}"  # two processes: two copies
        if self._bed is None:
            self._bed = copy_testbed(load_bed(testbed_dir(self.task)), out / "testbed")
        if self.cluster is None:
            self.cluster = SharedRayCluster(out / "ray_cluster.log")
            os.environ.update(self.cluster.env)  # the runs' overrides and environments join this cluster
        val_file = write_val_subset(self._bed, settings.val_prompts, out / f"val_{settings.val_prompts}.parquet")
        trained = SAME_RUNNER_CONTROL.get(method, method)
        [one] = make_runs(self._bed, [trained], [seed], settings, neutral_id=neutral_token_id(self._bed),
                          out_dir=out / f"lr{settings.lr:g}", val_file=val_file)
        one.cmd = [*one.cmd, f"trainer.default_local_dir={out / 'checkpoints' / f'{method}_seed{seed}'}"]
        run_all([one], total_steps=settings.steps, log=log)
        shutil.copyfile(one.metrics_path, path)

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None


def preflight(task: str, main_ppo_methods: list[str]) -> None:
    """Stop at start-up, not mid-grid, when a main_ppo method cannot run on the task's testbed: building a method's
    overrides checks its prerequisites (OPPO's teacher for the task's start), with the command that makes them."""
    if not main_ppo_methods:
        return
    from verl_oar.testbed.fast_runner import load_bed
    from verl_oar.testbed.methods import method as method_entry

    bed = load_bed(testbed_dir(task))
    for name in main_ppo_methods:
        method_entry(SAME_RUNNER_CONTROL.get(name, name)).algorithm(0, 0, bed)


def runner_of(method: str) -> str:
    """``"fast"`` for the fast runner's methods, ``"main_ppo"`` for the testbed's other methods."""
    from verl_oar.testbed.fast_runner import METHODS
    from verl_oar.testbed.methods import METHODS as TESTBED_METHODS

    if method in SAME_RUNNER_CONTROL:
        return "main_ppo"
    if method in METHODS:
        return "fast"
    if method in TESTBED_METHODS:
        return "main_ppo"
    raise SystemExit(f"study.py: unknown method {method!r}; the fast runner carries {', '.join(METHODS)}, main_ppo "
                     f"the testbed's {', '.join(m for m in TESTBED_METHODS if m not in METHODS)}")


def testbed_dir(task: str) -> Path | None:
    variant = TASKS[task]
    return None if variant is None else ROOT / "verl_oar" / "testbed" / "variants" / variant


def refuse_seen_seeds(seeds: list[int], stored: list[dict], task: str, phase: str = "replication") -> None:
    """A replication (or the runners' comparison) runs only on seeds no other phase of the task has used."""
    seen = sorted({e["seed"] for e in stored if e["task"] == task and e["phase"] != phase} & set(seeds))
    if seen:
        block = REPLICATION_SEEDS if phase == "replication" else RUNNER_SEEDS
        raise SystemExit(f"study.py: seeds {seen} were already used by another phase of {task}; phase {phase} needs "
                         f"fresh seeds (docs/study.md's block is {block})")


def cmd_run(args) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from verl_oar.testbed.fast_runner import run
    from verl_oar.testbed.machine import cpu_id, machine_info

    lrs = [float(x) for x in (args.lrs or "").split(",") if x]
    cells = []  # (method, lr): "name" takes every --lrs rate, "name@lr" that rate only
    for item in (m for m in args.methods.split(",") if m):
        name, _, rate = item.partition("@")
        if not rate and not lrs:
            sys.exit(f"study.py: {item!r} has no rate: give --lrs or write it as {name}@RATE")
        cells += [(name, float(rate))] if rate else [(name, lr) for lr in lrs]
    runners = {m: runner_of(m) for m, _ in cells}
    if args.task not in TASKS:
        sys.exit(f"study.py: unknown task {args.task!r}; one of {', '.join(TASKS)}")
    preflight(args.task, [m for m, runner in runners.items() if runner == "main_ppo"])
    seeds = parse_seeds(args.seeds)
    if args.phase in ("replication", "runners"):
        refuse_seen_seeds(seeds, read_store(Path(args.store)), args.task, args.phase)
    grid = [(m, lr, s) for s in seeds for m, lr in cells]
    index, count = (int(x) for x in args.shard.split("/"))
    mine = grid[index::count]
    stored = {tuple(e[k] for k in KEY) for e in read_store(Path(args.store), args.phase, args.task)}
    cpu = {"cpu": machine_info()["cpu"], "cpu_id": cpu_id()}
    route = MainPPORoute(args.task, Path(args.runs_dir))
    done = 0
    try:
        for method, lr, seed in mine:
            trained = train_one(args, route, runners[method], method, lr, seed, stored, cpu, run)
            done += 1
            if trained:
                print(f"[study] {args.phase} {args.task}: {done}/{len(mine)} of this process's grid", flush=True)
    finally:
        route.close()
    return 0


def train_one(args, route: MainPPORoute, runner: str, method: str, lr: float, seed: int, stored: set, cpu: dict,
              fast_run) -> bool:
    """Train one grid cell unless it is stored, finished or claimed by another process, and append it to the store;
    whether it trained here."""
    from verl_oar.testbed.training_runs import RunInterrupted, RunSettings

    runs_dir, store = Path(args.runs_dir), Path(args.store)
    path = run_path(runs_dir, args.phase, args.task, method, lr, seed)
    if (args.phase, args.task, method, lr, seed) in stored or finished(path, args.steps):
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    if not claim(path) or finished(path, args.steps):  # another process trains it, or just has
        return False
    path.unlink(missing_ok=True)
    settings = RunSettings(steps=args.steps, lr=lr)
    Path(str(path) + ".error").unlink(missing_ok=True)

    def log(message: str) -> None:
        if "done" in message or "ready" in message or "finished" in message or "started" in message:
            print(f"[study {time.strftime('%H:%M:%S')}] {args.task} lr={lr:g} {message}", flush=True)

    began = time.time()
    try:
        if runner == "fast":
            fast_run(method, seed, settings, path, testbed=testbed_dir(args.task), log=log)
        else:
            route.train(method, seed, settings, path, log)
    except RunInterrupted:  # killed from outside: not the run's failure, so not stored; the command resumes it
        path.unlink(missing_ok=True)
        Path(str(path) + ".claim").unlink(missing_ok=True)
        raise
    except Exception:  # recorded, counted as censored by the analysis (never re-run silently)
        Path(str(path) + ".error").write_text(traceback.format_exc())
        print(f"[study] {path} FAILED (see .error)", flush=True)
    meta = {"steps": args.steps, "seconds": round(time.time() - began, 2), **cpu,
            **({"runner": runner} if runner != "fast" else {})}
    Path(str(path) + ".meta.json").write_text(json.dumps(meta) + "\n")
    append_to_store(store, entry_of(path, args.phase, args.task, method, lr, seed))
    return True


def read_run(path: Path) -> dict:
    from verl_oar.testbed.training_runs import REWARD, VAL_REWARD

    records = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    train = [r for r in records if REWARD in r["data"]]
    val = {r["step"]: r["data"][VAL_REWARD] for r in records if VAL_REWARD in r["data"]}
    return {
        "reward": [r["data"][REWARD] for r in sorted(train, key=lambda r: r["step"])],
        "val_accuracy": {str(k): v for k, v in sorted(val.items())},
    }


def cmd_store(args) -> int:
    """Add the scratch directory's finished runs that the store lacks (runs finished before the store existed)."""
    runs_dir, store = Path(args.runs_dir), Path(args.store)
    stored = {tuple(e[k] for k in KEY) for e in read_store(store)}
    added = unfinished = 0
    for meta_path in sorted(runs_dir.glob("*/*/*/*.jsonl.meta.json")):
        path = Path(str(meta_path)[: -len(".meta.json")])
        phase, task, method = path.parts[-4:-1]
        lr_part, seed_part = path.stem.split("_seed")
        key = (phase, task, method, float(lr_part[2:]), int(seed_part))
        if key in stored:
            continue
        entry = entry_of(path, *key)
        if entry is None:
            unfinished += 1
            continue
        append_to_store(store, entry)
        added += 1
    print(f"study.py: {added} runs added to {store} ({unfinished} unfinished left out)")
    return 0


def cmd_status(args) -> int:
    counts: dict[tuple, list[int]] = {}
    for entry in read_store(Path(args.store)):
        cell = counts.setdefault((entry["phase"], entry["task"], entry["method"], entry["lr"]), [0, 0])
        cell[1 if "error" in entry else 0] += 1
    for (phase, task, method, lr), (ok, crashed) in sorted(counts.items()):
        print(f"{phase:7} {task:7} {method:16} lr={lr:<7g} {ok:3} runs" + (f" + {crashed} crashed" if crashed else ""))
    return 0


def plan_commands(runs: list[dict], task: str) -> tuple[dict, int, list[str]]:
    """docs/study.md's decisions from one task's stored tuning runs: (per method its chosen rate, the evaluation
    length, the evaluation phase's ``run`` commands). Refuses an incomplete grid (every method needs every rate on
    every tuning seed)."""
    from verl_oar.testbed import study_analysis as sa

    seeds = parse_seeds(TUNING_SEEDS)
    tuning = sa.tune(runs, task)
    rates = sorted({lr for t in tuning.values() for lr in t["grid"]}, key=float)
    for method, t in tuning.items():
        for rate in rates:
            have = t["grid"].get(rate, {}).get("seeds", [])
            if have != seeds:
                raise SystemExit(f"study.py plan: {task}'s tuning is incomplete: {method} at lr {rate} has seeds "
                                 f"{have or 'none'} of {TUNING_SEEDS}; finish the tuning phase first")
    if sa.BASELINE not in tuning:
        raise SystemExit(f"study.py plan: {task} has no GRPO tuning runs: the evaluation length is GRPO's")
    chosen = {m: t["lr"] for m, t in tuning.items()}
    steps = sa.eval_steps(tuning)
    base = f"python benchmarks/study.py run --phase eval --task {task}"

    def at(methods, lr: float) -> str:
        return ",".join(f"{m}@{lr:g}" for m in methods)

    commands = [f"{base} --methods {','.join(f'{m}@{lr:g}' for m, lr in chosen.items())} --seeds {EVAL_SEEDS} "
                f"--steps {steps}"]
    others = [r for r in rates if float(r) != chosen[sa.BASELINE]]
    commands.append(f"{base} --methods grpo --lrs {','.join(others)} --seeds {EVAL_SEEDS} --steps {steps}")
    if task == LONGEST and "oar_g" in chosen:
        commands.append(f"{base} --methods {at((*sa.ABLATIONS, *sa.TAUS), chosen['oar_g'])} --seeds {EVAL_SEEDS} "
                        f"--steps {steps}")
        main_ppo_only = [m for m, source in sa.RATE_FROM.items() if source == sa.BASELINE]
        commands.append(f"{base} --methods {at(main_ppo_only, chosen[sa.BASELINE])} --seeds {OTHER_SEEDS} "
                        f"--steps {steps}")
    return chosen, steps, commands


def cmd_plan(args) -> int:
    chosen, steps, commands = plan_commands(read_store(Path(args.store), "tuning", args.task), args.task)
    print(f"{args.task}: tuned rates " + ", ".join(f"{m} {lr:g}" for m, lr in chosen.items())
          + f"; evaluation runs of {steps} steps")
    print("\n".join(commands))
    return 0


def planned_seeds(phase: str, method: str) -> list[int]:
    """The seeds docs/study.md plans for a cell: tuning seeds; evaluation seeds; fewer for the main_ppo-only methods."""
    from verl_oar.testbed import study_analysis as sa

    if phase == "tuning":
        return parse_seeds(TUNING_SEEDS)
    if phase == "replication":
        return parse_seeds(REPLICATION_SEEDS)
    if phase == "runners":
        return parse_seeds(RUNNER_SEEDS)
    return parse_seeds(OTHER_SEEDS if sa.RATE_FROM.get(method) == sa.BASELINE else EVAL_SEEDS)


def complete_cells(runs: list[dict]) -> tuple[list[dict], list[str]]:
    """(the runs of every cell (phase, task, method, rate) that holds all its planned seeds, one line per cell left
    out): a cell is reported only once complete, so a partly run cell never enters an analysis."""
    cells: dict[tuple, list[dict]] = {}
    for entry in runs:
        cells.setdefault((entry["phase"], entry["task"], entry["method"], entry["lr"]), []).append(entry)
    kept, left_out = [], []
    for (phase, task, method, lr), entries in cells.items():
        have, planned = sorted(e["seed"] for e in entries), planned_seeds(phase, method)
        if have == planned:
            kept += entries
        else:
            left_out.append(f"{phase} {task} {method} lr={lr:g}: {len(have)} of {len(planned)} seeds")
    return kept, left_out


def cmd_collect(args) -> int:
    from verl_oar.testbed.machine import machine_info

    out = Path(args.out)
    tasks = [t for t in args.tasks.split(",") if t]
    runs, left_out = complete_cells([e for e in read_store(Path(args.store)) if not tasks or e["task"] in tasks])
    for line in left_out:
        print(f"study.py collect: left out (incomplete) {line}")
    cpus: dict[str, int] = {}
    for entry in runs:
        cpus[entry["cpu"]] = cpus.get(entry["cpu"], 0) + 1
    previous = json.loads(out.read_text()) if out.exists() else {}
    result = {
        "what": "docs/study.md: pick_max credit-assignment study, fast runner (verl's math in one process)",
        "commands": previous.get("commands", []) + ([args.note] if args.note else []),
        "machine": {**machine_info(), "torch_threads_per_run": 1, "runs_per_cpu": cpus,
                    "note": "collected here; each run's CPU is in its entry (runs_per_cpu counts them); 2 runs at "
                            "a time (one per core), beside other jobs: seconds are upper bounds"},
        "settings": {"batch_size": 8, "n": 8, "val_every": 4, "val_prompts": 64, "threshold": 0.8, "window": 3},
        "study_seconds": previous.get("study_seconds"),
        "runs": runs,
    }
    if args.study_seconds is not None:
        result["study_seconds"] = args.study_seconds
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"study.py: {len(runs)} runs -> {out}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--phase", required=True, choices=PHASES)
    r.add_argument("--task", required=True)
    r.add_argument("--methods", required=True)
    r.add_argument("--lrs", default="", help="rates for methods named without @RATE")
    r.add_argument("--seeds", required=True)
    r.add_argument("--steps", type=int, required=True)
    r.add_argument("--shard", default="0/1")
    r.add_argument("--runs-dir", default=str(ROOT / "runs" / "study"))
    r.add_argument("--store", default=str(STORE))
    st = sub.add_parser("store")
    st.add_argument("--runs-dir", default=str(ROOT / "runs" / "study"))
    st.add_argument("--store", default=str(STORE))
    sub.add_parser("status").add_argument("--store", default=str(STORE))
    pl = sub.add_parser("plan")
    pl.add_argument("--task", required=True)
    pl.add_argument("--store", default=str(STORE))
    c = sub.add_parser("collect")
    c.add_argument("--out", required=True)
    c.add_argument("--store", default=str(STORE))
    c.add_argument("--tasks", default="", help="only these tasks, comma-separated (a task's results are committed "
                   "once its evaluation phase is complete)")
    c.add_argument("--note", default="", help="a command line to record with the results")
    c.add_argument("--study-seconds", type=float, default=None)
    args = p.parse_args(argv)
    commands = {"run": cmd_run, "store": cmd_store, "status": cmd_status, "plan": cmd_plan, "collect": cmd_collect}
    return commands[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
