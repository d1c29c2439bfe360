"""What happened inside the study's runs: verl's own per-step metrics of one task's evaluation runs, kept.

    python benchmarks/study_diagnostics.py --task fill32 --lr 0.001 \
        --out benchmarks/results_study_diagnostics_fill32_cpu.json [--runs-dir runs/study]
    python benchmarks/study_diagnostics.py --table benchmarks/results_study_diagnostics_fill32_cpu.json

The second form prints docs/study.md's table of the methods evaluated on fewer seeds (the main_ppo-only ones), with
GRPO and OAR-G on the same seeds, from the committed files (a test keeps the page equal to it).

The run store (``benchmarks/study_runs/``) keeps each run's training reward and held-out accuracy only; the full
metric files ``RUNS/eval/TASK/METHOD/lr{LR}_seed{SEED}.jsonl`` that verl's file logger wrote live in git-ignored
scratch. This copies, for every method at ``--lr``, the metrics below that explain a run's course (response length
and how often it hits the cap, policy entropy, gradient norm, the range of advantages, OPPO's evidence) and
summarises each run:

- ``zero_from``: the first step from which every training reward is 0 (None: the run never stays at 0). From then
  on every group's rewards are equal, every advantage is 0 and the policy no longer changes: the run cannot recover.
- ``length_first``, ``length_last``, ``length_min``: the mean response length (tokens) at the first and last step
  and its smallest per-step value.
- ``entropy_first``, ``entropy_last``: the mean token entropy (nats) of the trained responses.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METRICS = ("critic/score/mean", "response_length/mean", "response_length/clip_ratio", "actor/entropy",
           "actor/grad_norm", "critic/advantages/min", "critic/advantages/max", "oppo/evidence/mean",
           "oppo/advantage/seq_sum_mean", "oppo/advantage/abs_mean")
"""the per-step metrics kept (a metric a method does not log is left out of its runs)"""
RUN_FILE = re.compile(r"lr(?P<lr>[0-9.e-]+)_seed(?P<seed>\d+)\.jsonl")


def read_run(path: Path) -> dict[str, list[float]]:
    """verl's file-logger lines -> {metric: values at steps 1..N} (the step-0 validation line has none of them)."""
    steps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = [s for s in steps if s["step"] >= 1]
    return {m: [float(f"{s['data'][m]:.5g}") for s in steps]  # 5 significant digits: the file stays small
            for m in METRICS if steps and all(m in s["data"] for s in steps)}


def summarise(series: dict[str, list[float]]) -> dict:
    reward, length, entropy = (series[k] for k in ("critic/score/mean", "response_length/mean", "actor/entropy"))
    zero_from = next((i + 1 for i in range(len(reward)) if not any(reward[i:])), None)
    return {"zero_from": zero_from, "length_first": length[0], "length_last": length[-1], "length_min": min(length),
            "entropy_first": entropy[0], "entropy_last": entropy[-1]}


def collect(runs_dir: Path, task: str, lr: float) -> dict:
    """Every finished run of ``task``'s evaluation at ``lr``: {method: {seed: {"summary", "series"}}}."""
    out: dict = {}
    for path in sorted((runs_dir / "eval" / task).glob("*/lr*_seed*.jsonl")):
        match = RUN_FILE.fullmatch(path.name)
        if match is None or float(match["lr"]) != lr:
            continue
        series = read_run(path)
        if "critic/score/mean" not in series:
            continue  # no training step finished
        out.setdefault(path.parent.name, {})[int(match["seed"])] = {"summary": summarise(series), "series": series}
    return out


def table(diagnostics: dict, results: dict) -> str:
    """docs/study.md's table: per method evaluated on fewer seeds (``study_analysis.RATE_FROM``'s GRPO-rate ones),
    and GRPO and OAR-G on those seeds, the endpoints (from the run store's results) beside what the metrics show."""
    from verl_oar.testbed import study_analysis as sa
    from verl_oar.testbed.study_report import _label, _order

    task, lr, kept = diagnostics["task"], diagnostics["lr"], diagnostics["runs"]
    others = [m for m in _order(kept) if sa.RATE_FROM.get(m) == sa.BASELINE]
    seeds = sorted(set.intersection(*(set(map(int, kept[m])) for m in others)))
    stored = {(r["method"], r["seed"]): r for r in results["runs"]
              if r["phase"] == "eval" and r["task"] == task and r["lr"] == lr}
    lines = [f"| method (lr {lr:g}, seeds {seeds[0]}-{seeds[-1]}) | mean steps | censored | runs whose reward stays 0 "
             "(from step) | mean response length, last step | token entropy, last step: median [range] | "
             "gradient norm, steps 1-3 (median) |", "|---|---|---|---|---|---|---|"]
    for method in ["grpo", "oar_g", *others]:
        runs = [kept[method][str(s)] for s in seeds]
        ends = [sa.run_endpoints(stored[(method, s)], stored[(method, s)]["steps"]) for s in seeds]
        zero = sorted(r["summary"]["zero_from"] for r in runs if r["summary"]["zero_from"] is not None)
        length = sorted(round(r["summary"]["length_last"]) for r in runs)
        entropy = sorted(r["summary"]["entropy_last"] for r in runs)
        norms = sorted(x for r in runs for x in r["series"]["actor/grad_norm"][:3])
        runner = stored[(method, seeds[0])].get("runner", "fast runner")
        stays_zero = f"{len(zero)} (step{'s' if len(zero) > 1 else ''} {', '.join(map(str, zero))})" if zero else "none"
        lines.append(
            f"| {_label(method)}{' (fast runner)' if runner == 'fast runner' else ''} | "
            f"{statistics.fmean(e['steps'] for e in ends):.1f} | {sum(e['censored'] for e in ends)} | "
            f"{stays_zero} | "
            f"{length[0] if length[0] == length[-1] else f'{length[0]}-{length[-1]}'} | "
            f"{statistics.median(entropy):.2f} [{entropy[0]:.2f}, {entropy[-1]:.2f}] | {statistics.median(norms):.2g} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task")
    p.add_argument("--lr", type=float)
    p.add_argument("--out", type=Path)
    p.add_argument("--runs-dir", type=Path, default=ROOT / "runs" / "study")
    p.add_argument("--table", type=Path, help="print docs/study.md's table from this diagnostics file instead")
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results_study_cpu.json")
    p.add_argument("--add", action="store_true",
                   help="keep --out's methods that the scratch directory no longer has; add (or replace) the ones it has")
    args = p.parse_args(argv)
    if args.table:
        print(table(json.loads(args.table.read_text()), json.loads(args.results.read_text())))
        return
    if args.task is None or args.lr is None or args.out is None:
        p.error("--task, --lr and --out are required (or --table FILE)")
    runs = collect(args.runs_dir, args.task, args.lr)
    if not runs:
        raise SystemExit(f"study_diagnostics.py: no finished evaluation run of {args.task} at lr {args.lr:g} under "
                         f"{args.runs_dir / 'eval' / args.task} (the metric files are scratch: they exist only on "
                         "the machine that ran the study)")
    command = f"python benchmarks/study_diagnostics.py --task {args.task} --lr {args.lr:g} --out {args.out}"
    commands = [command]
    if args.add and args.out.exists():
        kept = json.loads(args.out.read_text())
        if (kept["task"], kept["lr"]) != (args.task, args.lr):
            raise SystemExit(f"study_diagnostics.py: {args.out} holds {kept['task']} at lr {kept['lr']:g}, not "
                             f"{args.task} at {args.lr:g}; --add only extends a file of the same task and rate")
        runs = {**kept["runs"], **runs}
        commands = kept.get("commands", [kept["command"]]) + [command + " --add"]
    result = {"what": "docs/study.md: verl's per-step metrics of the study's evaluation runs (benchmarks/"
                      "study_diagnostics.py)",
              "command": commands[0], "commands": commands,
              "machine": {"platform": platform.platform(), "python": platform.python_version()},
              "task": args.task, "lr": args.lr, "metrics": list(METRICS), "runs": runs}
    args.out.write_text(json.dumps(result, separators=(",", ":")) + "\n")
    print(f"study_diagnostics.py: {sum(len(v) for v in runs.values())} runs of {len(runs)} methods -> {args.out}")


if __name__ == "__main__":
    main()
