"""``verl-oar compare``: compare methods over seeds from runs logged by verl's file logger.

    verl-oar compare RUN_DIR_OR_JSONL ... [--labels a,b] [--baseline NAME] [--threshold 0.8] [--window 3]
                     [--metric critic/score/mean] [--val-metric KEY] [--pair-by REGEX] [--out DIR]

Input: the JSON lines of verl's ``file`` logger (``trainer.logger=[console,file]``;
``verl/utils/tracking.py``'s ``FileLogger``): one line ``{"step": s, "data": {metric: value}}`` per logged step, in
``$VERL_FILE_LOGGER_PATH`` if set, else ``$VERL_FILE_LOGGER_ROOT/<trainer.project_name>/<trainer.experiment_name>.jsonl``
(root default: the working directory). The file is rewritten from the start when a run starts (or resumes).

Grouping (one *method* per label, one *run* per seed), from the arguments:

- a ``.jsonl`` file is one run; a folder stands for every ``*.jsonl`` file directly in it;
- the seed is the number the ``--pair-by`` pattern captures in the file's name (default ``seed[_-]?(\\d+)``:
  ``grpo_seed3.jsonl`` -> seed 3); the method is the name with that match removed (``grpo``), or, when nothing
  is left (``seed3.jsonl``), the folder's name. ``--labels a,b,...`` (one per argument) names the method of every
  run an argument brings instead;
- a name the pattern does not match gets seed = its rank among its method's files in name order (noted);
- runs of two methods with the same seed are *paired* (the paired bootstrap; verl's ``data.seed`` and the
  rollout seed make the same seed start from the same prompt order); two runs of one method with one seed are
  refused.

So verl's default layout works as is: ``trainer.project_name=cmp trainer.experiment_name=<method>_seed<k>`` puts
every run in ``./cmp/`` and ``verl-oar compare cmp`` compares them all. Every run is cut to the steps the shortest
run has (noted), so that steps-to-threshold compares equal budgets.

Measures (``testbed.comparison``, ``testbed.measures``): per run, steps until the ``--window``-step trailing mean
of ``--metric`` reaches ``--threshold`` (never: steps + 1, censored), the mean of ``--val-metric`` over training
(AUC), its last value and gain, the median ``timing_s/step``; per method, their mean over seeds with a bootstrap
95% interval, the paired difference to ``--baseline`` with a paired bootstrap 95% interval, and the run-to-run
variance. Output: a text table; with ``--out DIR`` also ``DIR/summary.json`` and the figures of
``testbed.report`` (``reward.png``: curves with min-max bands; ``measures.png``; ``step_time.png``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PAIR_BY = r"seed[_-]?(\d+)"
STEP_TIME = "timing_s/step"
VAL_PREFIX = "val-core/"


@dataclass
class RunFile:
    """One run: its method, seed and file; ``seed_from_order`` when the name had no seed."""

    method: str
    seed: int
    path: Path
    seed_from_order: bool = False


def _fail(message: str) -> None:
    raise SystemExit(f"verl-oar compare: {message}")


def collect(paths: Sequence[str], labels: Sequence[str] | None, pair_by: str) -> list[RunFile]:
    """The runs the arguments name, grouped and paired as the module docstring says."""
    try:
        pattern = re.compile(pair_by)
    except re.error as err:
        _fail(f"--pair-by {pair_by!r} is not a regular expression ({err}). Give one with a group around the seed, "
              f"e.g. {DEFAULT_PAIR_BY!r}.")
    if pattern.groups != 1:
        _fail(f"--pair-by {pair_by!r} has {pattern.groups} groups; it needs exactly one, around the seed's digits.")
    if labels is not None and len(labels) != len(paths):
        _fail(f"--labels has {len(labels)} name(s) for {len(paths)} argument(s): give one per argument.")
    runs: list[RunFile] = []
    unnumbered: dict[str, list[Path]] = {}
    for i, arg in enumerate(paths):
        path = Path(arg).expanduser()
        if path.is_dir():
            files = sorted(path.glob("*.jsonl"))
            if not files:
                _fail(f"{arg} holds no *.jsonl file. Point it at verl's file-logger output "
                      "(trainer.logger=[console,file]: <project_name>/<experiment_name>.jsonl).")
        elif path.is_file():
            files = [path]
        else:
            _fail(f"{arg}: no such file or folder.")
        for file in files:
            match = pattern.search(file.stem)
            name = file.stem if match is None else (file.stem[:match.start()] + file.stem[match.end():])
            name = name.strip("_-. ") or file.parent.resolve().name
            method = labels[i] if labels is not None else name
            if match is None:
                unnumbered.setdefault(method, []).append(file)
            else:
                runs.append(RunFile(method, int(match.group(1)), file))
    for method, files in unnumbered.items():
        taken = {r.seed for r in runs if r.method == method}
        free = (s for s in range(len(files) + len(taken)) if s not in taken)
        runs.extend(RunFile(method, next(free), f, seed_from_order=True) for f in sorted(files))
    seen: dict[tuple[str, int], Path] = {}
    for r in runs:
        if (r.method, r.seed) in seen:
            _fail(f"two runs of method {r.method!r} with seed {r.seed}: {seen[(r.method, r.seed)]} and {r.path}. Name "
                  "the files <method>_seed<k>.jsonl, or pass --labels so that each argument is one method.")
        seen[(r.method, r.seed)] = r.path
    return runs


def training_curve(records: list[dict], metric: str, path: Path) -> list[dict]:
    """One record per training step (those with ``metric``; a step logged twice: its last), steps 1, 2, ... n."""
    by_step: dict[int, dict] = {}
    for r in records:
        if metric in r.get("data", {}):
            by_step[int(r["step"])] = r["data"]
    if not by_step:
        keys = sorted({k for r in records for k in r.get("data", {})})
        hint = ", ".join(k for k in keys if "score" in k or "reward" in k) or ", ".join(keys[:8])
        _fail(f"{path}: no step logs {metric!r}. Choose the training curve with --metric (this file has e.g. {hint}).")
    steps = sorted(by_step)
    if steps != list(range(1, len(steps) + 1)):
        gap = next((s for i, s in enumerate(steps, start=1) if s != i), None)
        _fail(f"{path}: training steps are not 1, 2, ... (first out of place: {gap}); a resumed run rewrites its file "
              "from the resumed step on. Join the two files into one (the first run's steps first) and compare that.")
    return [by_step[s] for s in steps]


def val_points(records: list[dict], key: str | None, last_step: int) -> dict[str, float]:
    """{str(step): value} of ``key`` at steps 0..last_step (verl validates at step 0 and every test_freq steps)."""
    if key is None:
        return {}
    out = {}
    for r in records:
        value = r.get("data", {}).get(key)
        if value is not None and int(r["step"]) <= last_step:
            out[str(int(r["step"]))] = float(value)
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def pick_val_metric(records: list[dict]) -> str | None:
    """verl's core validation metric: the first ``val-core/.../acc/...`` key, else the first ``val-core/`` key."""
    keys = sorted({k for r in records for k in r.get("data", {}) if k.startswith(VAL_PREFIX)})
    return next((k for k in keys if "/acc/" in k), keys[0] if keys else None)


@contextlib.contextmanager
def measured_at(threshold: float, window: int, resamples: int) -> Iterator[None]:
    """``testbed.comparison`` with this threshold, window and number of resamples (its module constants; restored
    on exit). The comparison's code is the demo's: only these three numbers change."""
    from verl_oar.testbed import comparison

    old = comparison.THRESHOLD, comparison.WINDOW, comparison.RESAMPLES
    comparison.THRESHOLD, comparison.WINDOW, comparison.RESAMPLES = threshold, window, resamples
    try:
        yield
    finally:
        comparison.THRESHOLD, comparison.WINDOW, comparison.RESAMPLES = old


def summarize(args: argparse.Namespace) -> dict:
    """The summary ``--out`` writes: {"comparison", "runs", "settings", "inputs", "notes"}."""
    from verl_oar.testbed.comparison import compare
    from verl_oar.testbed.training_runs import read_records

    labels = [s.strip() for s in args.labels.split(",")] if args.labels else None
    files = collect(args.runs, labels, args.pair_by)
    notes = [f"{r.path.name}: no seed in its name, paired as seed {r.seed} (its rank among {r.method}'s files)"
             for r in files if r.seed_from_order]
    records = {id(r): read_records(r.path) for r in files}
    curves = {id(r): training_curve(records[id(r)], args.metric, r.path) for r in files}
    steps = min(len(c) for c in curves.values())
    if args.steps is not None:
        if args.steps > steps:
            _fail(f"--steps {args.steps}: the shortest run has {steps} training steps.")
        steps = args.steps
    if any(len(c) != steps for c in curves.values()):
        notes.append(f"every run cut to {steps} steps (the shortest run's); longest had "
                     f"{max(len(c) for c in curves.values())}")
    val_key = args.val_metric or pick_val_metric([x for r in files for x in records[id(r)]])
    if val_key is None:
        notes.append("no val-core/ metric logged (trainer.test_freq): held-out AUC, final and gain are n/a")
    runs: dict[str, list[dict]] = {}
    for r in sorted(files, key=lambda r: (r.method, r.seed)):
        curve = curves[id(r)][:steps]
        runs.setdefault(r.method, []).append({
            "seed": r.seed, "file": str(r.path),
            "reward": [float(d[args.metric]) for d in curve],
            "step_seconds": [d.get(STEP_TIME) for d in curve],
            "val_accuracy": val_points(records[id(r)], val_key, steps),
        })
    order = [labels[i] for i in range(len(labels))] if labels else [r.method for r in files]
    runs = {m: runs[m] for m in dict.fromkeys(order)}
    baseline = args.baseline or next(iter(runs))
    if baseline not in runs:
        _fail(f"--baseline {baseline!r} is not one of the methods {list(runs)}.")
    runs = {baseline: runs[baseline], **{m: v for m, v in runs.items() if m != baseline}}
    if len(runs) < 2:
        notes.append(f"one method ({baseline}): no paired differences")
    with measured_at(args.threshold, args.window, args.resamples):
        comparison = compare(runs, baseline)
    seeds = sorted({r["seed"] for rs in runs.values() for r in rs})
    return {"comparison": comparison, "runs": runs, "seeds": seeds, "notes": notes,
            "settings": {"metric": args.metric, "val_metric": val_key, "threshold": args.threshold,
                         "window": args.window, "steps": steps, "resamples": args.resamples, "pair_by": args.pair_by},
            "inputs": [str(r.path) for r in files]}


def _num(value, digits: int) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def _cell(iv: dict | None, digits: int, signed: bool = False) -> str:
    """``est [low, high]`` of an interval dict; the estimate alone without an interval."""
    if iv is None or iv.get("estimate") is None or (isinstance(iv["estimate"], float) and math.isnan(iv["estimate"])):
        return "n/a"
    fmt = f"{{:{'+' if signed else ''}.{digits}f}}"
    text = fmt.format(iv["estimate"])
    if iv.get("low") is not None and iv.get("high") is not None:
        text += f" [{fmt.format(iv['low'])}, {fmt.format(iv['high'])}]"
    return text


COLUMNS = (("steps_to_threshold", "steps to thr.", 1), ("auc", "val AUC", 3), ("final", "val final", 3),
           ("gain", "val gain", 3), ("variance", "variance", 5), ("step_seconds", "s/step", 1))


def table(summary: dict) -> str:
    """Per method: mean over seeds [bootstrap 95%]; under it, minus the baseline [paired bootstrap 95%]."""
    comp, s = summary["comparison"], summary["settings"]
    base = comp["baseline"]
    head = ["method", "seeds", *[c[1] for c in COLUMNS]]
    rows = [head]
    for m, row in comp["methods"].items():
        mean = {**row["mean"], "variance": row["variance"]}
        steps = _cell(mean["steps_to_threshold"], 1)
        if row["censored"]:
            steps += f" ({row['censored']} never)"
        rows.append([m, str(len(row["seeds"])), steps, *[_cell(mean[c], d) for c, _, d in COLUMNS[1:]]])
        if m != base:
            diff = {**(row["vs_baseline"] or {}), "variance": row["variance_vs_baseline"]}
            rows.append([f"  - {base}", f"{len(row['seeds']) - row['unpaired']} pairs",
                         *[_cell(diff.get(c), d, signed=True) for c, _, d in COLUMNS]])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    intro = (f"{s['metric']}: steps until its {s['window']}-step trailing mean reaches {s['threshold']} "
             f"(of {s['steps']}); val: {s['val_metric'] or 'none logged'}; mean over seeds [bootstrap 95%], "
             f"'- {base}' rows: paired difference [paired bootstrap 95%, {s['resamples']} resamples]")
    return "\n".join([intro, *lines, *[f"note: {n}" for n in summary["notes"]]])


def write_outputs(summary: dict, out: Path) -> list[Path]:
    """``summary.json`` and the report's figures (reward.png, measures.png, step_time.png) into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "summary.json"]
    written[0].write_text(json.dumps(summary, indent=2, default=str))
    from verl_oar.tools.heatmap_render import MissingMatplotlib, require_matplotlib

    try:
        require_matplotlib("verl-oar compare's figures")
    except MissingMatplotlib as error:
        print(f"verl-oar compare: figures skipped: {error}", file=sys.stderr)
        return written
    from verl_oar.testbed.report import plot_measures, plot_reward, plot_step_time

    figures = {"reward.png": plot_reward, "step_time.png": plot_step_time}
    if len(summary["comparison"]["methods"]) > 1:
        figures["measures.png"] = plot_measures
    for name, plot in figures.items():
        plot(summary, out / name)
        written.append(out / name)
    return written


class _HelpFormat(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """the docstring's layout kept, each flag's default shown"""


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    doc = __doc__.split("\n\n")
    p = argparse.ArgumentParser(prog="verl-oar compare", description=doc[0], epilog="\n\n".join(doc[2:5]),
                                formatter_class=_HelpFormat)
    p.add_argument("runs", nargs="+", help="verl file-logger .jsonl files, or folders of them")
    p.add_argument("--labels", default=None, help="comma-separated method names, one per argument")
    p.add_argument("--baseline", default=None, help="the method the others are paired with (default: the first)")
    p.add_argument("--threshold", type=float, default=0.8, help="value of --metric's trailing mean to reach")
    p.add_argument("--window", type=int, default=3, help="trailing-mean window, in steps")
    p.add_argument("--metric", default="critic/score/mean", help="the training curve (a key of each step's data)")
    p.add_argument("--val-metric", default=None,
                   help="held-out metric for AUC / final / gain (default: the first val-core/.../acc/... key logged)")
    p.add_argument("--pair-by", default=DEFAULT_PAIR_BY, help="regular expression; its one group is the seed")
    p.add_argument("--steps", type=int, default=None, help="compare the first N training steps (default: the shortest run's)")
    p.add_argument("--resamples", type=int, default=10000, help="bootstrap resamples")
    p.add_argument("--out", type=Path, default=None, help="write summary.json and figures here")
    args = p.parse_args(list(argv))
    if args.window < 1:
        p.error("--window must be at least 1")
    if args.resamples < 1:
        p.error("--resamples must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    summary = summarize(args)
    print(table(summary))
    if args.out is not None:
        for path in write_outputs(summary, args.out.expanduser()):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
