"""The OAR demo on the chain_sum testbed: train GRPO, OAR-G and OAR-P through verl's real trainer on
CPU over a few seeds, measure the importance estimators against the oracle, write an HTML report.

    python -m verl_oar.testbed.demo [--out DIR] [--seeds 0,1] [--steps 12] [--methods grpo,oar_g,oar_p]
        [--k-range 3,5] [--fillers 2,4] [--parallel 2] [--quality-samples 32] ...   (--help for all)

In order, each printing progress:

1. build (or reuse) the testbed for the task size (``testbed.workspace.build_testbed``; about a
   minute the first time, cached in ``--workdir``);
2. importance quality on the warm-started model every run starts from (``testbed.quality``):
   recall of the oracle causal tokens at top-K% and the occlusion counterfactual, per estimator;
3. one ``python -m verl.trainer.main_ppo`` run per (method, seed) (``testbed.training_runs``),
   ``--parallel`` at a time, greedy validation on held-out prompts before training and at the end;
4. ``summary.json`` (every number of the report, computed here from the runs' metric files and
   step 2) and the report: ``index.html`` with PNG figures (``testbed.report``).

Nothing in the report is typed in by hand: it is rendered from ``summary.json``, which this command
writes from the run it just made; the seeds and the command line are in both.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from verl_oar.testbed import dynamics
from verl_oar.testbed.training_runs import METHODS, REWARD, VAL_REWARD, Run, RunSettings, make_runs, run_all, train_records
from verl_oar.testbed.workspace import TestbedSpec, build_testbed

DEFAULT_WORKDIR = Path("~/.cache/verl_oar/testbed").expanduser()
HEATMAP_ESTIMATORS = ("oar_g_noisy_kl", "oar_p_exact")
"""the estimators drawn in the heatmaps (the two the OAR runs train with)"""
QUALITY_ESTIMATORS = ("oar_g_noisy_kl", "oar_p_exact", "oar_p_chunk8", "oar_g_loglik", "entropy", "random")


def _log(msg: str) -> None:
    print(f"[verl-oar demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("oar_demo"), help="report folder (index.html, PNGs, summary.json, logs)")
    p.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR, help="where the testbed is built and cached")
    p.add_argument("--seeds", default="0,1", help="training seeds, comma-separated")
    p.add_argument("--steps", type=int, default=RunSettings.steps, help="training steps per run")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from {','.join(METHODS)}")
    p.add_argument("--k-range", default="3,5", help="task size: fewest,most numbers to add")
    p.add_argument("--fillers", default="2,4", help="task size: fewest,most filler words between steps")
    p.add_argument("--batch-size", type=int, default=RunSettings.batch_size, help="prompts per step")
    p.add_argument("--n", type=int, default=RunSettings.n, help="responses per prompt (GRPO group)")
    p.add_argument("--lr", type=float, default=RunSettings.lr)
    p.add_argument("--val-prompts", type=int, default=RunSettings.val_prompts, help="held-out prompts validated greedily")
    p.add_argument("--val-every", type=int, default=0, help="validate every N steps (0: before and after training)")
    p.add_argument("--parallel", type=int, default=2, help="training runs at a time")
    p.add_argument("--quality-samples", type=int, default=32, help="sampled responses scored by every estimator")
    p.add_argument("--fracs", default="0.05,0.1,0.2,0.3,0.5", help="top-K%% fractions for recall and the counterfactual")
    p.add_argument("--window", type=int, default=3, help="trailing-mean window (steps) for thresholds and variance")
    p.add_argument("--threshold", type=float, default=None,
                   help="reward threshold for steps-to-threshold (default: halfway from the start to GRPO's best)")
    p.add_argument("--heatmaps", type=int, default=3, help="sample traces drawn as heatmaps")
    p.add_argument("--run-timeout", type=float, default=None, help="stop a training run after this many seconds")
    args = p.parse_args(argv)
    args.seed_list = _ints(args.seeds)
    args.method_list = [m.strip() for m in args.methods.split(",") if m.strip()]
    args.frac_list = [float(f) for f in args.fracs.split(",")]
    unknown = [m for m in args.method_list if m not in METHODS]
    if unknown or not args.method_list:
        p.error(f"--methods: unknown {unknown}; choose from {', '.join(METHODS)}")
    if not args.seed_list or len(set(args.seed_list)) != len(args.seed_list):
        p.error("--seeds: give distinct integers, e.g. 0,1,2")
    if args.steps < 1 or args.parallel < 1 or args.window < 1 or args.quality_samples < 1:
        p.error("--steps, --parallel, --window and --quality-samples must be >= 1")
    if not all(0 < f <= 1 for f in args.frac_list):
        p.error("--fracs: every value must be in (0, 1]")
    k, fillers = _ints(args.k_range), _ints(args.fillers)
    if len(k) != 2 or not 2 <= k[0] <= k[1] or len(fillers) != 2 or not 0 <= fillers[0] <= fillers[1]:
        p.error("--k-range needs 2 <= fewest <= most (e.g. 3,5); --fillers needs 0 <= fewest <= most (e.g. 2,4)")
    args.spec = TestbedSpec(k_min=k[0], k_max=k[1], fillers_min=fillers[0], fillers_max=fillers[1])
    return args


# ---------------------------------------------------------------------------------------------------
# summary.json
# ---------------------------------------------------------------------------------------------------


def run_summary(run: Run) -> dict:
    """Per-step curves of one run from its metric records."""
    train = train_records(run.records)
    val = {r["step"]: r["data"][VAL_REWARD] for r in run.records if VAL_REWARD in r["data"]}
    return {
        "seed": run.seed,
        "reward": [r["data"][REWARD] for r in train],
        "response_length": [r["data"].get("response_length/mean") for r in train],
        "step_seconds": [r["data"].get("timing_s/step") for r in train],
        "importance_seconds": [r["data"].get("oar/timing_s/token_importance") for r in train],
        "val_accuracy": {str(k): v for k, v in sorted(val.items())},
        "seconds": round(run.finished - run.started, 1),
    }


def method_dynamics(runs: dict[str, list[dict]], *, baseline: str, window: int, threshold: float | None) -> dict:
    """Steps to threshold, run-to-run variance and their ratios to ``baseline``, per method."""
    curves = {m: [r["reward"] for r in rs] for m, rs in runs.items()}
    auto = dynamics.auto_threshold(curves, baseline, window) if baseline in curves else None
    value = threshold if threshold is not None else (auto.value if auto else None)
    out: dict = {
        "window": window,
        "baseline": baseline,
        "threshold": value,
        "threshold_rule": "given by --threshold" if threshold is not None else
        ("start + 0.5 x (best smoothed GRPO mean - start)" if auto else "undefined: GRPO never rose above its start"),
        "start_reward": auto.start if auto else None,
        "baseline_best": auto.best if auto else None,
        "methods": {},
    }
    for method, rs in curves.items():
        steps = len(rs[0])
        reached = [dynamics.steps_to_threshold(c, value, window) if value is not None else None for c in rs]
        censored = sum(s is None for s in reached)
        # a run that never reached it counts as steps + 1: the mean is then a lower bound
        mean_steps = statistics.fmean(s if s is not None else steps + 1 for s in reached) if value is not None else None
        mean, std, _, _ = dynamics.mean_and_spread(rs)
        val_start = [r["val_accuracy"].get("0") for r in runs[method]]
        val_end = [r["val_accuracy"].get(str(steps)) for r in runs[method]]
        step_s = [s for r in runs[method] for s in r["step_seconds"][1:] if s is not None]  # step 1 warms up
        imp_s = [s for r in runs[method] for s in r["importance_seconds"][1:] if s is not None]
        out["methods"][method] = {
            "steps_to_threshold": reached,
            "censored": censored,
            "mean_steps_to_threshold": mean_steps,
            "variance": dynamics.run_variance(rs, window),
            "final_reward": statistics.fmean(dynamics.smooth(mean, window)[-1:]),
            "mean_reward": statistics.fmean(mean),
            "val_accuracy_start": _mean_or_none(val_start),
            "val_accuracy_end": _mean_or_none(val_end),
            "median_step_seconds": statistics.median(step_s) if step_s else None,
            "median_importance_seconds": statistics.median(imp_s) if imp_s else None,
        }
    base = out["methods"].get(baseline)
    for row in out["methods"].values():
        row["steps_ratio"] = dynamics.ratio(row["mean_steps_to_threshold"], base and base["mean_steps_to_threshold"])
        row["variance_ratio"] = dynamics.ratio(row["variance"], base and base["variance"])
        row["step_seconds_ratio"] = dynamics.ratio(row["median_step_seconds"], base and base["median_step_seconds"])
    return out


def _mean_or_none(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def heatmap_examples(result, count: int) -> list[dict]:
    """The first ``count`` scored responses: tokens, the heatmap estimators' scores, the oracle masks
    (response coordinates, response tokens only)."""
    batch, tok = result.batch, result.tokenizer
    examples = []
    for b in range(min(count, batch.ids.shape[0])):
        p, t = int(batch.prompt_len[b]), int(batch.response_len[b])
        ids = batch.ids[b, p : p + t].tolist()
        prompt = tok.decode(batch.ids[b, :p].tolist(), skip_special_tokens=True)
        examples.append({
            "prompt": next((line for line in prompt.splitlines() if line.startswith("sum:")), prompt.strip()),
            "tokens": [tok.decode([i]) for i in ids],
            "scores": {name: result.scores[name][b, :t].tolist() for name in HEATMAP_ESTIMATORS},
            "masks": {name: batch.oracle[name][b, :t].tolist() for name in ("direct", "chain")},
            "truth": batch.truths[b],
        })
    return examples


# ---------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------


def write_val_subset(bed, count: int, path: Path) -> Path:
    """The first ``count`` val prompts, the same for every run (verl's ``val_max_samples`` draws at random)."""
    import pandas as pd

    path.parent.mkdir(parents=True, exist_ok=True)
    pd.read_parquet(bed.val_file).head(count).to_parquet(path)
    return path


def main(argv: Sequence[str] | None = None, *, spec: TestbedSpec | None = None) -> dict:
    """Run the demo; ``spec`` (in-process callers, e.g. tests) replaces the testbed spec of the flags."""
    args = parse_args(argv)
    if spec is not None:
        args.spec = spec
    from verl_oar.tools.heatmap_render import MissingMatplotlib, require_matplotlib

    try:  # the report needs it at the end: say so now, not after the training runs
        require_matplotlib("the demo's report figures")
    except MissingMatplotlib as error:
        raise SystemExit(f"verl_oar.testbed.demo: {error}") from None
    from verl_oar.testbed.quality import run_quality
    from verl_oar.testbed.report import write_report

    start = time.time()
    out = args.out.expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m verl_oar.testbed.demo " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    _log(f"report folder {out}; methods {args.method_list}, seeds {args.seed_list}, {args.steps} steps each")

    _log(f"1/4 testbed (k {args.spec.k_range}, fillers {args.spec.fillers}) in {args.workdir}")
    bed = build_testbed(args.workdir, args.spec)
    warm = bed.manifest["val_samples"]
    _log(f"    warm start: sampled accuracy {warm['accuracy']:.2f}, parse rate {warm['parse_rate']:.2f}")

    _log(f"2/4 importance quality on {args.quality_samples} sampled responses of the warm-started model")
    quality = run_quality(bed, samples=args.quality_samples, seed=0, fracs=args.frac_list)
    q = quality.report
    recall10 = {n: q["estimators"][n]["recall"]["direct"].get("0.1") for n in QUALITY_ESTIMATORS}
    _log("    recall of the direct oracle @10%: " + ", ".join(f"{n} {v:.2f}" for n, v in recall10.items() if v is not None)
         + f" ({q['seconds']} s)")

    settings = RunSettings(steps=args.steps, batch_size=args.batch_size, n=args.n, lr=args.lr,
                           val_every=args.val_every, val_prompts=args.val_prompts)
    val_file = write_val_subset(bed, args.val_prompts, out / "data" / "val_subset.parquet")
    runs = make_runs(bed, args.method_list, args.seed_list, settings, neutral_id=q["config"]["neutral_id"],
                     out_dir=out, val_file=val_file)
    _log(f"3/4 {len(runs)} training runs through verl.trainer.main_ppo, {args.parallel} at a time "
         f"(about a minute each to start, then a few seconds per step)")
    run_all(runs, parallel=args.parallel, total_steps=args.steps, log=lambda m: _log("    " + m), timeout_s=args.run_timeout)

    per_method: dict[str, list[dict]] = {}
    for run in runs:
        per_method.setdefault(run.method, []).append(run_summary(run))
    summary = {
        "command": command,
        "seeds": args.seed_list,
        "methods": args.method_list,
        "settings": {**vars(settings), "parallel": args.parallel, "quality_samples": args.quality_samples,
                     "fracs": args.frac_list},
        "testbed": {"root": str(bed.root), "spec": bed.manifest["spec"], "warm_start": bed.manifest["warm_start"],
                    "val_samples": bed.manifest["val_samples"], "num_parameters": bed.manifest["num_parameters"]},
        "runs": per_method,
        "dynamics": method_dynamics(per_method, baseline="grpo", window=args.window, threshold=args.threshold),
        "quality": q,
        "heatmaps": heatmap_examples(quality, args.heatmaps),
        "seconds": None,
    }
    _log("4/4 report")
    summary["seconds"] = round(time.time() - start, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    index = write_report(out, summary)
    for line in headline(summary):
        _log("    " + line)
    _log(f"done in {summary['seconds']:.0f} s: open {index}")
    return summary


def headline(summary: dict) -> list[str]:
    """The report's headline numbers as text lines."""
    d = summary["dynamics"]
    lines = [f"threshold {d['threshold']:.3f} ({d['threshold_rule']})" if d["threshold"] is not None
             else f"threshold: {d['threshold_rule']}"]
    for method, row in d["methods"].items():
        lines.append(
            f"{method}: steps to threshold {row['steps_to_threshold']} (ratio to grpo {row['steps_ratio']:.2f}), "
            f"variance ratio {row['variance_ratio']:.2f}, mean reward {row['mean_reward']:.3f}, "
            f"{row['median_step_seconds'] or float('nan'):.1f} s/step"
        )
    est = summary["quality"]["estimators"]
    lines.append("recall@10% (direct oracle): " + ", ".join(
        f"{n} {est[n]['recall']['direct'][str(0.1)]:.2f}" for n in QUALITY_ESTIMATORS if str(0.1) in est[n]["recall"]["direct"]))
    return lines


if __name__ == "__main__":
    main()
