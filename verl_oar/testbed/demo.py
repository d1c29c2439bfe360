"""The demo on the pick_max testbed: train every method (``testbed.methods``) through verl's real
trainer on CPU from the committed start, compare them on the pre-registered measures, and show the
credit each one assigned; an HTML report.

    python -m verl_oar.testbed.demo [--out DIR] [--seeds 0] [--steps 10] [--methods grpo,oar_g,oar_p] ...

In order, each printing progress:

1. copy the committed testbed (``workspace.committed_testbed``) into ``DIR/testbed``;
2. importance quality on that warm-started model (``testbed.quality``): recall of the oracle causal
   tokens at top-K% and the occlusion counterfactual, per estimator;
3. one ``python -m verl.trainer.main_ppo`` run per (method, seed) (``testbed.training_runs``), one
   after the other in one Ray cluster (``verl_oar.cpu.ray_cluster``), greedy validation on held-out
   prompts every few steps; methods with a token signal dump their token tensors;
4. ``summary.json``: the comparison (``testbed.comparison``: measures with bootstrap intervals over
   seeds, paired with GRPO), the credit each run assigned (``testbed.credit``), the machine; and the
   report, ``index.html`` with PNG figures (``testbed.report``), rendered from it.

Nothing in the report is typed in by hand: it is rendered from ``summary.json``, which this command
writes from the run it just made; the seeds, the command line and the machine are in both.
``python -m verl_oar.testbed.demo --resummarize DIR`` recomputes a finished folder's measures from its
metric files and dumps with the current code (e.g. after a fix to a measure), without training again.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from verl_oar.testbed.methods import BASELINE, DEFAULT_DEMO, METHODS, method
from verl_oar.testbed.reuse import reuse_runs
from verl_oar.testbed.training_runs import REWARD, VAL_REWARD, Run, RunSettings, make_runs, run_all, train_records
from verl_oar.testbed.workspace import Testbed, committed_testbed, copy_testbed

QUALITY_ESTIMATORS = ("oar_g_noisy_kl", "oar_p_exact", "oar_p_chunk8", "oar_g_loglik", "entropy", "random")


def _log(msg: str) -> None:
    print(f"[verl-oar demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("oar_demo"), help="report folder (index.html, PNGs, summary.json, logs)")
    p.add_argument("--testbed", type=Path, default=None,
                   help="a testbed built by python -m verl_oar.testbed.workspace (default: the committed one)")
    p.add_argument("--seeds", default="0", help="training seeds, comma-separated (the long run: 0,1,2,3,4)")
    p.add_argument("--steps", type=int, default=RunSettings.steps, help="training steps per run")
    p.add_argument("--methods", default=",".join(DEFAULT_DEMO),
                   help=f"comma-separated, from {','.join(METHODS)}, or 'all' (the long run)")
    p.add_argument("--batch-size", type=int, default=RunSettings.batch_size, help="prompts per step")
    p.add_argument("--mini-batch-size", type=int, default=RunSettings.mini_batch_size,
                   help="prompts per PPO mini-batch, one optimizer step each (default: the whole step)")
    p.add_argument("--n", type=int, default=RunSettings.n, help="responses per prompt (GRPO group)")
    p.add_argument("--lr", type=float, default=RunSettings.lr)
    p.add_argument("--val-prompts", type=int, default=RunSettings.val_prompts, help="held-out prompts validated greedily")
    p.add_argument("--val-every", type=int, default=RunSettings.val_every,
                   help="validate every N steps (0: before and after training only)")
    p.add_argument("--quality-samples", type=int, default=16, help="sampled responses scored by every estimator")
    p.add_argument("--fracs", default="0.05,0.1,0.3", help="top-K%% fractions for recall and the counterfactual")
    p.add_argument("--run-timeout", type=float, default=None, help="stop a training run after this many seconds")
    p.add_argument("--reuse", type=Path, default=None,
                   help="a finished demo folder, or a summary file (the committed long run's JSON): its runs of the same "
                        "method, seed, settings and testbed are reused, not trained again (to add a method to a long "
                        "run; testbed/reuse.py); the summary records which")
    args = p.parse_args(argv)
    args.seed_list = _ints(args.seeds)
    names = list(METHODS) if args.methods.strip() == "all" else args.methods.split(",")
    args.method_list = [m.strip() for m in names if m.strip()]
    args.frac_list = [float(f) for f in args.fracs.split(",")]
    unknown = [m for m in args.method_list if m not in METHODS]
    if unknown or not args.method_list:
        p.error(f"--methods: unknown {unknown}; choose from {', '.join(METHODS)}")
    if BASELINE not in args.method_list:
        p.error(f"--methods must include {BASELINE}: every measure is paired with its run of the same seed")
    if not args.seed_list or len(set(args.seed_list)) != len(args.seed_list):
        p.error("--seeds: give distinct integers, e.g. 0,1,2")
    if args.steps < 1 or args.quality_samples < 1 or args.val_every < 0 or args.batch_size < 1 or args.val_prompts < 1:
        p.error("--steps, --batch-size, --val-prompts and --quality-samples must be >= 1, --val-every >= 0")
    if args.mini_batch_size is not None and (
            not 1 <= args.mini_batch_size <= args.batch_size or args.batch_size % args.mini_batch_size):
        p.error(f"--mini-batch-size must divide --batch-size ({args.batch_size}); got {args.mini_batch_size}")
    if args.n < 2:
        p.error("--n must be >= 2: a GRPO group of one response has advantage 0 on every token")
    if not all(0 < f <= 1 for f in args.frac_list) or 0.1 not in args.frac_list:
        p.error("--fracs: every value must be in (0, 1], and 0.1 among them (the report's recall@10%)")
    return args


# ---------------------------------------------------------------------------------------------------
# summary.json
# ---------------------------------------------------------------------------------------------------


def run_summary(run: Run, credit: dict | None) -> dict:
    """Per-step curves of one run from its metric records, and its credit measures (None: GRPO)."""
    train = train_records(run.records)
    val = {r["step"]: r["data"][VAL_REWARD] for r in run.records if VAL_REWARD in r["data"]}
    return {
        "seed": run.seed,
        "reward": [r["data"][REWARD] for r in train],
        "response_length": [r["data"].get("response_length/mean") for r in train],
        "step_seconds": [r["data"].get("timing_s/step") for r in train],
        "importance_seconds": [r["data"].get("oar/timing_s/token_importance") for r in train],
        "val_accuracy": {str(k): v for k, v in sorted(val.items())},
        "credit": credit,
        "seconds": round(run.finished - run.started, 1),
    }


def credit_of(run: Run, tokenizer) -> tuple[dict | None, list[float]]:
    """The run's credit measures (``testbed.credit``) and its per-response concentrations; GRPO (no
    dumps): None, [] -- its concentration is 1 by construction."""
    from verl_oar.testbed.credit import run_credit

    if run.dump_dir is None:
        return None, []
    measured = run_credit(run.dump_dir, tokenizer, method(run.method).signal, seed=run.seed)
    return measured.as_dict(), measured.concentrations


def same_response_weights(runs: Sequence[Run], tokenizer, count: int) -> list[dict]:
    """Heatmap rows: the token weights every method gave the *same* responses at step 1 (every run of
    a seed starts from the same model with the same rollout seed, so their step-1 responses are the
    same). Picks the first ``count`` responses of the first dumped run's step 1 that have an oracle, a
    non-zero GRPO advantage and a twin in every other dumped run of that seed. GRPO: weight 1."""
    import torch

    from verl_oar.testbed.pick_max import oracle_token_masks

    seed = runs[0].seed if runs else None
    dumped = [r for r in runs if r.seed == seed and r.dump_dir is not None and (r.dump_dir / "step_1.pt").exists()]
    if not dumped:
        return []
    loaded = {r.method: torch.load(r.dump_dir / "step_1.pt", weights_only=False) for r in dumped}

    def sequences(dump) -> list[tuple[int, ...]]:
        return [tuple(dump["responses"][b][dump["response_mask"][b].bool()].tolist()) for b in range(dump["responses"].shape[0])]

    index = {m: {seq: b for b, seq in enumerate(sequences(d))} for m, d in loaded.items()}
    first = dumped[0].method
    examples = []
    for seq, b in index[first].items():
        if len(examples) == count:
            break
        masks = oracle_token_masks(list(seq), tokenizer)
        if masks is None or float(loaded[first]["grpo_advantages"][b].abs().max()) == 0.0:
            continue
        if not all(seq in index[m] for m in loaded):
            continue
        rows = {}
        for name in (r.method for r in runs if r.seed == seed):
            if name in loaded:
                rows[name] = loaded[name]["weights"][index[name][seq], : len(seq)].tolist()
            else:
                rows[name] = [1.0] * len(seq)  # no token signal: the same advantage on every token
        examples.append({
            "tokens": [tokenizer.decode([t]) for t in seq],
            "weights": rows,
            "masks": {"causal": masks.causal.tolist(), "reasoning": masks.reasoning.tolist()},
            "advantage": float(loaded[first]["grpo_advantages"][b][loaded[first]["response_mask"][b].bool()][0]),
        })
    return examples


def write_val_subset(bed: Testbed, count: int, path: Path) -> Path:
    """The first ``count`` val prompts, the same for every run (verl's ``val_max_samples`` draws at random)."""
    import pandas as pd

    path.parent.mkdir(parents=True, exist_ok=True)
    pd.read_parquet(bed.val_file).head(count).to_parquet(path)
    return path


# ---------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the demo (see the module docstring); returns the summary."""
    args = parse_args(argv)
    from verl_oar.tools.heatmap_render import MissingMatplotlib, require_matplotlib

    try:  # the report needs it at the end: say so now, not after the training runs
        require_matplotlib("the demo's report figures")
    except MissingMatplotlib as error:
        raise SystemExit(f"verl_oar.testbed.demo: {error}") from None
    from verl_oar.cpu.ray_cluster import shared_cluster
    from verl_oar.testbed.machine import machine_info
    from verl_oar.testbed.quality import load_testbed, run_quality

    start = time.time()
    out = args.out.expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m verl_oar.testbed.demo " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    _log(f"report folder {out}; methods {args.method_list}, seeds {args.seed_list}, {args.steps} steps each")

    source = committed_testbed() if args.testbed is None else load_testbed(args.testbed)
    bed = copy_testbed(source, out / "testbed")
    warm = bed.manifest["val_samples"]
    _log(f"1/4 testbed from {source.root}: sampled accuracy {warm['sampled_accuracy']:.2f}, greedy "
         f"{warm['greedy_accuracy']:.2f}, filler entropy {warm['filler_entropy']:.2f} nats/token")

    _log(f"2/4 importance quality on {args.quality_samples} sampled responses of the warm-started model")
    quality = run_quality(bed, samples=args.quality_samples, seed=0, fracs=args.frac_list)
    q = quality.report
    _log("    recall of the causal tokens @10%: " + ", ".join(
        f"{n} {q['estimators'][n]['recall']['causal']['0.1']:.2f}" for n in QUALITY_ESTIMATORS) + f" ({q['seconds']} s)")

    settings = RunSettings(steps=args.steps, batch_size=args.batch_size, mini_batch_size=args.mini_batch_size, n=args.n, lr=args.lr,
                           val_every=args.val_every, val_prompts=args.val_prompts)
    val_file = write_val_subset(bed, args.val_prompts, out / "data" / "val_subset.parquet")
    with shared_cluster(out / "logs" / "ray_cluster.log"):  # the runs' overrides and environments join this cluster
        runs = make_runs(bed, args.method_list, args.seed_list, settings, neutral_id=q["config"]["neutral_id"],
                         out_dir=out, val_file=val_file)
        reused, earlier = reuse_runs(runs, args.reuse, settings, bed) if args.reuse else ({}, None)
        pending = [r for r in runs if r.label not in reused.get("runs", [])]
        _log(f"3/4 {len(pending)} training runs through verl.trainer.main_ppo, one after the other in one Ray "
             f"cluster (about a minute each to start, then a few seconds per step)"
             + (f"; {len(runs) - len(pending)} reused from {args.reuse}" if reused else ""))
        run_all(pending, total_steps=args.steps, log=lambda m: _log("    " + m), timeout_s=args.run_timeout)

    _log("4/4 summary and report")
    summary = {
        "command": command,
        "seeds": args.seed_list,
        "methods": args.method_list,
        "settings": {**vars(settings), "quality_samples": args.quality_samples, "fracs": args.frac_list},
        "machine": machine_info(),
        "testbed": {"source": str(source.root), "spec": bed.manifest["spec"], "warm_start": bed.manifest["warm_start"],
                    "val_samples": warm, "num_parameters": bed.manifest["num_parameters"],
                    "built_on": bed.manifest.get("machine")},
        **measured(runs, args.method_list, earlier),
        "quality": q,
        "seconds": round(time.time() - start, 1),
        **({"reused": reused} if reused else {}),
    }
    index = write_summary_and_report(out, summary)
    _log(f"done in {summary['seconds']:.0f} s: open {index}")
    return summary


def measured(runs: Sequence[Run], methods: Sequence[str], earlier: dict | None = None) -> dict:
    """The summary's parts computed from the runs' files: "runs" (curves and credit per method),
    "comparison", "concentration_quartiles", "same_response". Runs reused from a summary file
    (``run.summary``) bring their own entries; ``earlier`` is that summary (``testbed.reuse``)."""
    from verl_oar.cpu.workspace import build_tokenizer
    from verl_oar.testbed.comparison import compare
    from verl_oar.testbed.credit import summarize

    tokenizer = build_tokenizer()
    per_method: dict[str, list[dict]] = {m: [] for m in methods}
    concentrations: dict[str, list[float]] = {m: [] for m in methods}
    for m in methods:
        own = [r.summary is not None for r in runs if r.method == m]
        if any(own) and not all(own):
            raise SystemExit(f"verl_oar.testbed.demo: method {m} has runs reused from a summary file and runs trained "
                             "here; its concentration quartiles would cover only some seeds: reuse all of its seeds or none")
    for run in runs:
        if run.summary is not None:
            per_method[run.method].append(run.summary)
            continue
        credit, values = credit_of(run, tokenizer)
        per_method[run.method].append(run_summary(run, credit))
        concentrations[run.method] += values
    quartiles = {m: summarize(v) for m, v in concentrations.items()}
    for m in methods:  # a method whose runs come from a summary file: that summary's quartiles
        if earlier is not None and any(r.summary is not None for r in runs if r.method == m):
            quartiles[m] = earlier["concentration_quartiles"][m]
    if earlier is None:
        same = same_response_weights(runs, tokenizer, 3)
    else:
        import torch

        from verl_oar.testbed.reuse import merge_same_response

        seed = runs[0].seed if runs else None
        loaded = {r.method: torch.load(r.dump_dir / "step_1.pt", weights_only=False) for r in runs
                  if r.seed == seed and r.summary is None and r.dump_dir is not None and (r.dump_dir / "step_1.pt").exists()}
        same = merge_same_response(earlier.get("same_response", []), loaded, tokenizer)
    return {
        "runs": per_method,
        "comparison": compare(per_method, BASELINE),
        "concentration_quartiles": quartiles,
        "same_response": same,
    }


def write_summary_and_report(out: Path, summary: dict) -> Path:
    """Write ``summary.json`` (strict JSON) and the report; print the headline; return the page's path."""
    from verl_oar.testbed.report import headline, write_report

    summary.update(finite_json(summary))
    (out / "summary.json").write_text(json.dumps(summary, indent=2, allow_nan=False))
    index = write_report(out, summary)
    for line in headline(summary):
        _log("    " + line)
    return index


def resummarize(out: Path) -> Path:
    """Recompute the measured parts of ``out/summary.json`` from the folder's metric files and dumps with
    this version's code (the runs, their settings, the quality section and the machine are kept)."""
    from verl_oar.testbed.training_runs import read_records

    out = Path(out).expanduser().resolve()
    summary = json.loads((out / "summary.json").read_text())
    from_file = summary.get("reused", {}).get("files") is False  # runs reused from a summary file have no files here
    from_summary = set(summary["reused"]["runs"]) if from_file else set()
    runs = []
    for seed in summary["seeds"]:
        for name in summary["methods"]:
            label = f"{name}_seed{seed}"
            old = next(r for r in summary["runs"][name] if r["seed"] == seed)
            dump_dir = out / "dumps" / label
            run = Run(name, seed, [], out / "metrics" / f"{label}.jsonl", out / "logs" / f"{label}.log", cwd=out,
                      dump_dir=dump_dir if method(name).dump is not None else None, started=0.0,
                      finished=float(old["seconds"]))
            if run.label in from_summary:
                run.summary = old
            else:
                run.records = read_records(run.metrics_path)
            runs.append(run)
    summary.update(measured(runs, summary["methods"], summary if from_file else None))
    return write_summary_and_report(out, summary)


def finite_json(value):
    """``value`` with every NaN or infinite float replaced by None (strict JSON; the report reads None
    as "not measured")."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value



if __name__ == "__main__":
    if sys.argv[1:2] == ["--resummarize"]:  # python -m verl_oar.testbed.demo --resummarize DIR
        print(resummarize(Path(sys.argv[2])))
    else:
        main()
