"""Wall-clock of one pick_max training run through main_ppo and through the fast runner (same method, seed, steps).

    python benchmarks/fast_runner_speed.py [--methods grpo,oar_g] [--seed 0] [--steps 24] [--repeats 1] \
        [--agreement grpo,oar_g,oar_p] [--out benchmarks/results_fast_runner_speed_cpu.json]

main_ppo: the demo's machinery (``testbed.training_runs``: ``python -m verl.trainer.main_ppo`` with the testbed's
overrides, joining one Ray cluster that is started once and not timed, as the demo runs its runs); its wall time is
the trainer process's, start-up and validations included. Fast runner (``fast_runner.run``, one thread as each of
main_ppo's processes): a fresh process running the same run twice: "cold" is the process's wall time to the end of
the first run (imports included: one CLI call), "warm" the second run's (a run after another in one process, as
``--seed a,b`` runs a sweep). Both on the committed start with the testbed's settings (8 prompts x 8 responses,
validation of 64 prompts before training and every 4 steps). Each repeat runs main_ppo then the fast runner; ratios
are main_ppo / fast runner, per repeat and of the medians; ``same_curve``: whether the two training-reward curves
are equal. Run it alone on the machine (timings).

``--agreement METHODS`` runs the fast runner for the seeds and steps of the committed long run
(benchmarks/results_testbed_long_run_cpu.json, main_ppo; its testbed's fingerprint must be the committed start's),
one process per method, and records per method and seed the mean over steps of (fast - main_ppo) training reward
and the held-out AUC difference, with paired bootstrap 95% intervals over seeds (``testbed.measures``), the first
step whose reward differs and whether the curves are identical. Not a timing: it may run beside other work.
``--methods ''`` skips the timing; ``--out`` keeps the part of an existing file that a call does not redo.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LONG_RUN = ROOT / "benchmarks" / "results_testbed_long_run_cpu.json"


def main_ppo_seconds(method: str, seed: int, steps: int, out: Path) -> tuple[float, list[float]]:
    """One main_ppo run (the cluster must be up: ``$VERL_OAR_RAY_ADDRESS``); (wall seconds, reward curve)."""
    from verl_oar.testbed.demo import write_val_subset
    from verl_oar.testbed.fast_runner import neutral_token_id
    from verl_oar.testbed.training_runs import REWARD, RunSettings, make_runs, run_all, train_records
    from verl_oar.testbed.workspace import committed_testbed, copy_testbed

    bed = copy_testbed(committed_testbed(), out / "testbed")
    settings = RunSettings(steps=steps)
    val_file = write_val_subset(bed, settings.val_prompts, out / "data" / "val_subset.parquet")
    (run,) = make_runs(bed, [method], [seed], settings, neutral_id=neutral_token_id(bed), out_dir=out,
                       val_file=val_file)
    run_all([run], total_steps=steps, log=lambda m: print("  main_ppo " + m, flush=True))
    return run.finished - run.started, [r["data"][REWARD] for r in train_records(run.records)]


def fast_seconds(method: str, seed: int, steps: int, out: Path) -> tuple[float, float, list[float]]:
    """The fast runner in a fresh process, the same run twice: (the process's wall seconds up to the end of the first
    run, imports included: a cold run, as one CLI call; the second run's seconds: a run in a process that already ran
    one, as ``--seed a,b`` runs them; the first run's reward curve)."""
    from verl_oar.testbed.training_runs import REWARD, read_records, train_records

    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("VERL_PLATFORM", None)
    script = (
        "import sys, time\n"
        "from verl_oar.testbed.fast_runner import run\n"
        "from verl_oar.testbed.training_runs import RunSettings\n"
        f"run({method!r}, {seed}, RunSettings(steps={steps}), {str(out / 'cold.jsonl')!r}, log=lambda m: None)\n"
        "print('COLD_DONE', time.time(), flush=True)\n"
        "began = time.perf_counter()\n"
        f"run({method!r}, {seed}, RunSettings(steps={steps}), {str(out / 'warm.jsonl')!r}, log=lambda m: None)\n"
        "print('WARM', time.perf_counter() - began, flush=True)\n"
    )
    out.mkdir(parents=True, exist_ok=True)
    began = time.time()
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"fast runner failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.startswith(("COLD_DONE", "WARM")))
    cold, warm = float(lines["COLD_DONE"]) - began, float(lines["WARM"])
    curve = [r["data"][REWARD] for r in train_records(read_records(out / "cold.jsonl"))]
    again = [r["data"][REWARD] for r in train_records(read_records(out / "warm.jsonl"))]
    if again != curve:
        raise SystemExit(f"the same run twice in one process gave two curves: {curve} vs {again}")
    return cold, warm, curve


def agreement(out: Path, methods: list[str]) -> dict:
    """The fast runner against the committed long run, per method (module docstring)."""
    from verl_oar.testbed.comparison import run_measures
    from verl_oar.testbed.fast_runner import run_summary
    from verl_oar.testbed.measures import paired_bootstrap
    from verl_oar.testbed.training_runs import read_records
    from verl_oar.testbed.workspace import TestbedSpec, committed_testbed

    long_run = json.loads(LONG_RUN.read_text())
    fingerprint = TestbedSpec(**long_run["testbed"]["spec"]).fingerprint()
    if fingerprint != committed_testbed().manifest["fingerprint"]:
        raise SystemExit(f"the long run's testbed ({fingerprint}) is not the committed start's")
    seeds, steps = long_run["seeds"], long_run["settings"]["steps"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("VERL_PLATFORM", None)
    result = {"seeds": seeds, "steps": steps, "long_run": str(LONG_RUN.relative_to(ROOT)),
              "testbed_fingerprint": fingerprint, "methods": {}}
    for method in methods:
        script = ("from verl_oar.testbed.fast_runner import run\n"
                  "from verl_oar.testbed.training_runs import RunSettings\n"
                  f"for s in {seeds!r}:\n"
                  f"    run({method!r}, s, RunSettings(steps={steps}),\n"
                  f"        {str(out)!r} + f'/agree_{method}_{{s}}.jsonl')\n")
        subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, check=True, capture_output=True)
        ours = {s: run_summary(read_records(out / f"agree_{method}_{s}.jsonl"), s) for s in seeds}
        theirs = {r["seed"]: r for r in long_run["runs"][method]}
        diff = [sum(a - b for a, b in zip(ours[s]["reward"], theirs[s]["reward"], strict=True)) / steps
                for s in seeds]
        auc_ours = [run_measures(ours[s])["auc"] for s in seeds]
        auc_theirs = [run_measures(theirs[s])["auc"] for s in seeds]
        first = [next((i + 1 for i, (a, b) in enumerate(zip(ours[s]["reward"], theirs[s]["reward"])) if a != b),
                      None) for s in seeds]
        result["methods"][method] = {
            "reward_diff_per_seed": diff,
            "reward_diff": paired_bootstrap(diff, [0.0] * len(seeds), resamples=10000, seed=0).as_dict(),
            "auc_fast": auc_ours, "auc_main_ppo": auc_theirs,
            "auc_diff": paired_bootstrap(auc_ours, auc_theirs, resamples=10000, seed=0).as_dict(),
            "final_fast": [ours[s]["val_accuracy"][str(steps)] for s in seeds],
            "final_main_ppo": [theirs[s]["val_accuracy"][str(steps)] for s in seeds],
            "first_differing_step": first,
            "reward_curve_identical": [ours[s]["reward"] == theirs[s]["reward"] for s in seeds],
            "val_accuracy_identical": [ours[s]["val_accuracy"] == theirs[s]["val_accuracy"] for s in seeds],
            "fast_reward": {str(s): ours[s]["reward"] for s in seeds},
            "fast_val_accuracy": {str(s): ours[s]["val_accuracy"] for s in seeds},
        }
        print(f"agreement {method}: reward diff {result['methods'][method]['reward_diff']}", flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default="grpo", help="methods timed (empty: no timing)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--agreement", default="", help="methods compared with the committed long run, e.g. grpo,oar_g")
    p.add_argument("--out", default="", help="results JSON; an existing one keeps the parts this call does not redo")
    args = p.parse_args()
    from verl_oar.testbed.machine import machine_info

    work = Path(tempfile.mkdtemp(prefix="fast_speed_"))
    result: dict = json.loads(Path(args.out).read_text()) if args.out and Path(args.out).exists() else {}
    command = "python benchmarks/fast_runner_speed.py " + " ".join(sys.argv[1:])
    methods = [m for m in args.methods.split(",") if m]
    if methods:
        result["timing"] = {"command": command, "machine": machine_info(), "seed": args.seed, "steps": args.steps,
                            "repeats": args.repeats, "methods": timing(methods, args, work)}
    if args.agreement:
        result["agreement"] = {"command": command, "machine": machine_info(),
                               **agreement(work, [m for m in args.agreement.split(",") if m])}
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


def timing(methods: list[str], args, work: Path) -> dict:
    from verl_oar.cpu.ray_cluster import shared_cluster

    out: dict = {}
    with shared_cluster(work / "ray_cluster.log", join_given=False):  # its own cluster, started once, not timed
        for method in methods:
            rows = {"main_ppo_s": [], "fast_cold_s": [], "fast_warm_s": [], "ratio_cold": [], "ratio_warm": [],
                    "main_ppo_reward": [], "fast_reward": []}
            for rep in range(args.repeats):
                slow, slow_curve = main_ppo_seconds(method, args.seed, args.steps, work / f"main_{method}_{rep}")
                cold, warm, fast_curve = fast_seconds(method, args.seed, args.steps, work / f"fast_{method}_{rep}")
                print(f"{method} repeat {rep}: main_ppo {slow:.1f} s, fast runner {cold:.1f} s cold "
                      f"(x{slow / cold:.2f}), {warm:.1f} s warm (x{slow / warm:.2f})", flush=True)
                for key, value in (("main_ppo_s", round(slow, 2)), ("fast_cold_s", round(cold, 2)),
                                   ("fast_warm_s", round(warm, 2)), ("ratio_cold", round(slow / cold, 2)),
                                   ("ratio_warm", round(slow / warm, 2)), ("main_ppo_reward", slow_curve),
                                   ("fast_reward", fast_curve)):
                    rows[key].append(value)
            rows["same_curve"] = [a == b for a, b in zip(rows["main_ppo_reward"], rows["fast_reward"])]
            main = statistics.median(rows["main_ppo_s"])
            rows["ratio_cold_of_medians"] = round(main / statistics.median(rows["fast_cold_s"]), 2)
            rows["ratio_warm_of_medians"] = round(main / statistics.median(rows["fast_warm_s"]), 2)
            out[method] = rows
    return out


if __name__ == "__main__":
    main()
