"""The real-model learning pilot: GRPO against OAR-G through ``python -m verl.trainer.main_ppo`` on
SmolLM2-135M-Instruct (Q4_1 dequantized, fp32, full fine-tuning) and the ``sum1`` task, on CPU.

    python benchmarks/real_model_pilot.py run --phase tuning --methods grpo,oar_g --lrs 3e-6,1e-5,3e-5 --seeds 100
    python benchmarks/real_model_pilot.py plan                      # each method's rate, from the tuning runs
    python benchmarks/real_model_pilot.py run --phase eval --methods grpo@LR,oar_g@LR --seeds 200-205
    python benchmarks/real_model_pilot.py collect                   # the analysis -> results_real_model_pilot_cpu.json

The design, the endpoints, the seed blocks and the analysis are fixed in docs/real-model.md ("The learning pilot")
before any run they govern. Every run is one ``main_ppo`` launch (``verl_oar.real_model.launch.run`` with
``SETTINGS``); its record (``real_model_pilot/runs/<phase>_<method>_lr<lr>_s<seed>.json``: exit code, seconds,
the rollout engine, every step's training metrics, held-out accuracy after training) is written when the launch ends, so
that ``run`` resumes by skipping recorded runs; commit the folder as it grows. A launch that ends without its
final validation is retried once (``attempts`` counts it); a run still without one is kept and counted by the
rule of the pre-registration (its held-out accuracy is the untrained model's: no learning).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RUNS = ROOT / "benchmarks" / "real_model_pilot" / "runs"
OUT = ROOT / "benchmarks" / "results_real_model_pilot_cpu.json"
METHODS = ("grpo", "oar_g")
TUNING_SEEDS = "100"
EVAL_SEEDS = "200-205"
STEPS = 12
"""training steps per run (the held-out endpoint is measured after the last one)"""
SETTINGS = {"n": 8, "batch_size": 2, "max_response_length": 128, "micro_batch": 4}
"""``real_model_overrides`` settings shared by every run: 2 prompts x 8 responses of up to 128 new tokens a step"""
VAL_SAMPLES = 4
"""held-out responses per test problem, sampled at temperature 1 (25 problems: 100 responses per validation)"""
THRESHOLD, WINDOW = 0.25, 4
"""secondary endpoint: first step whose training reward's trailing mean over WINDOW steps reaches THRESHOLD"""
START_ACCURACY = 0.10
"""the untrained model's held-out accuracy at these settings (25 x 4 responses at T=1, measured once before the
pilot; the task's start statistics: 0.102 on 16 x 8)"""
TIMEOUT_S = 3 * 3600
ROLLOUT = "hf"
"""the rollout the design was registered with (CPU mode's transformers loop); ``run --rollout`` can name another
(``auto``, ``vllm``), and every record and the analysis say which one sampled"""


def parse_seeds(text: str) -> list[int]:
    """``"200-205"`` or ``"100,101"`` -> the seeds."""
    seeds = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        seeds.extend(range(int(lo), int(hi or lo) + 1))
    return seeds


def parse_methods(text: str, lrs: list[float] | None) -> list[tuple[str, float]]:
    """``grpo@1e-5,oar_g@3e-6`` or ``grpo,oar_g`` with ``--lrs`` -> (method, lr) cells."""
    cells = []
    for item in text.split(","):
        method, _, lr = item.partition("@")
        if method not in METHODS:
            raise SystemExit(f"real_model_pilot: unknown method {method!r}; the pilot compares {', '.join(METHODS)}")
        if lr:
            cells.append((method, float(lr)))
        elif lrs:
            cells.extend((method, x) for x in lrs)
        else:
            raise SystemExit(f"real_model_pilot: {method} has no learning rate: write {method}@LR or pass --lrs")
    return cells


def run_path(phase: str, method: str, lr: float, seed: int) -> Path:
    return RUNS / f"{phase}_{method}_lr{lr:g}_s{seed}.json"


def overrides(steps: int) -> list[str]:
    """One validation, after the last step: VAL_SAMPLES responses per test problem at T=1."""
    return ["trainer.val_before_train=False", f"trainer.test_freq={steps}",
            "actor_rollout_ref.rollout.val_kwargs.do_sample=True", "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
            "actor_rollout_ref.rollout.val_kwargs.top_p=1.0", "actor_rollout_ref.rollout.val_kwargs.top_k=-1",
            f"actor_rollout_ref.rollout.val_kwargs.n={VAL_SAMPLES}"]


def read_metrics(path: Path) -> tuple[list[dict], list[dict]]:
    """(training steps, validations) from verl's file logger: each a ``{"step": s, ...}`` dict."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    keep = ("critic/score/mean", "response_length/mean", "response_length/clip_ratio", "timing_s/step",
            "actor/pg_loss", "actor/grad_norm", "oar/fallback/no_answer")
    steps, vals = [], []
    for r in rows:
        data = r.get("data", {})
        val = [k for k in data if k.startswith("val-core/") and k.endswith(f"/acc/mean@{VAL_SAMPLES}")]
        if val:
            vals.append({"step": r["step"], "accuracy": data[val[0]], "key": val[0]})
        if "critic/score/mean" in data:
            steps.append({"step": r["step"], **{k: data[k] for k in keep if k in data}})
    return steps, vals


def train_one(phase: str, method: str, lr: float, seed: int, steps: int, rollout: str = ROLLOUT) -> dict:
    """One launch, sampled by ``rollout`` (resolved: hf or vllm); its record (written by the caller)."""
    from verl_oar.real_model.launch import run

    work = Path(tempfile.mkdtemp(prefix=f"pilot_{method}_{seed}_"))
    began = time.time()
    try:
        rc, metrics = run(work, steps=steps, adv_estimator=method, extra_overrides=overrides(steps),
                          timeout_s=TIMEOUT_S, experiment_name=f"pilot_{method}", lr=lr, seed=seed, rollout=rollout,
                          **SETTINGS)
        train, vals = read_metrics(metrics)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # checkpoints and the task; the record keeps the metrics
    return {"phase": phase, "method": method, "lr": lr, "seed": seed, "steps": steps, "rollout": rollout,
            "exit_code": rc, "seconds": round(time.time() - began), "train": train, "val": vals}


def complete(record: dict) -> bool:
    """The launch reached its final validation (after step ``steps``)."""
    return record["exit_code"] == 0 and any(v["step"] == record["steps"] for v in record["val"])


def rollout_of(record: dict) -> str:
    """The engine that sampled a run: its record's ``rollout`` (records written before the field: hf, the only one
    the pilot ran then)."""
    return record.get("rollout", ROLLOUT)


def cmd_run(args) -> int:
    from verl_oar.real_model.launch import resolve_rollout
    from verl_oar.testbed.machine import cpu_id, machine_info

    rollout = resolve_rollout(args.rollout)  # vllm without vLLM's CPU build stops here, naming the install command
    RUNS.mkdir(parents=True, exist_ok=True)
    for seed in parse_seeds(args.seeds):
        for method, lr in parse_methods(args.methods, [float(x) for x in args.lrs.split(",")] if args.lrs else None):
            path = run_path(args.phase, method, lr, seed)
            if path.exists():
                print(f"[pilot] {path.name}: recorded, skipped", flush=True)
                continue
            attempts = []
            for _ in range(2):  # one retry for a launch that ends without its final validation
                print(f"[pilot {time.strftime('%H:%M:%S')}] {args.phase} {method} lr={lr:g} seed={seed} "
                      f"({rollout} rollout)", flush=True)
                record = train_one(args.phase, method, lr, seed, args.steps, rollout)
                attempts.append({"exit_code": record["exit_code"], "seconds": record["seconds"]})
                if complete(record):
                    break
            record.update(attempts=attempts, machine={**machine_info(), "cpu_id": cpu_id()},
                          settings={**SETTINGS, "val_samples": VAL_SAMPLES, "rollout": rollout})
            path.write_text(json.dumps(record, indent=1) + "\n")
            print(f"[pilot] {path.name}: exit {record['exit_code']}, {record['seconds']} s, held-out "
                  f"{[round(v['accuracy'], 3) for v in record['val']]}", flush=True)
    return 0


def read_runs(phase: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(RUNS.glob(f"{phase}_*.json"))]


def endpoints(record: dict) -> dict:
    """The pre-registered endpoints of one run. A run without its final validation counts as no learning: its
    held-out accuracy is the start's, START_ACCURACY (the rule fixed before the runs)."""
    from verl_oar.testbed.measures import steps_to_threshold_censored

    after = {v["step"]: v["accuracy"] for v in record["val"]}.get(record["steps"], START_ACCURACY)
    curve = [s["critic/score/mean"] for s in record["train"]]
    to_threshold, censored = steps_to_threshold_censored(curve, THRESHOLD, WINDOW) if curve else (0.0, True)
    if censored:  # never reached within the planned steps (a stopped run's curve is shorter: same value)
        to_threshold = float(record["steps"] + 1)
    return {"held_out_after": after, "held_out_gain": after - START_ACCURACY,
            "steps_to_threshold": to_threshold, "censored": censored, "complete": complete(record),
            "mean_train_reward": sum(curve) / len(curve) if curve else 0.0}


def plan(tuning: list[dict]) -> dict:
    """Each method's rate: the highest mean training reward over the steps (mean over tuning seeds; no held-out
    problem is used to tune), ties to the lower rate."""
    cells: dict[tuple[str, float], list[float]] = {}
    for r in tuning:
        cells.setdefault((r["method"], r["lr"]), []).append(endpoints(r)["mean_train_reward"])
    chosen = {}
    for method in METHODS:
        rows = sorted((lr, sum(v) / len(v)) for (m, lr), v in cells.items() if m == method)
        if rows:
            best = max(rows, key=lambda x: (x[1], -x[0]))
            chosen[method] = {"lr": best[0], "mean_train_reward": best[1], "grid": {f"{lr:g}": v for lr, v in rows}}
    return chosen


def cmd_plan(args) -> int:
    chosen = plan(read_runs("tuning"))
    print(json.dumps(chosen, indent=1))
    if set(chosen) == set(METHODS):
        cells = ",".join(f"{m}@{chosen[m]['lr']:g}" for m in METHODS)
        print(f"python benchmarks/real_model_pilot.py run --phase eval --methods {cells} --seeds {EVAL_SEEDS}")
    return 0


def analyse(runs: list[dict]) -> dict:
    """Paired by seed: OAR-G minus GRPO on each endpoint, 95% bootstrap intervals; seeds a confirmatory study needs."""
    from verl_oar.testbed.measures import bootstrap, paired_bootstrap

    by = {(r["method"], r["seed"]): endpoints(r) for r in runs}
    seeds = sorted({s for (m, s) in by if (("grpo", s) in by and ("oar_g", s) in by)})
    out = {"seeds": seeds, "runs": len(runs), "complete": sum(e["complete"] for e in by.values()),
           "per_method": {}, "oar_g_minus_grpo": {}}
    for method in METHODS:
        out["per_method"][method] = {k: bootstrap([by[(method, s)][k] for s in seeds]).as_dict()
                                     for k in ("held_out_after", "steps_to_threshold")} if seeds else {}
    for k in ("held_out_after", "steps_to_threshold", "mean_train_reward"):
        m, b = [by[("oar_g", s)][k] for s in seeds], [by[("grpo", s)][k] for s in seeds]
        out["oar_g_minus_grpo"][k] = paired_bootstrap(m, b).as_dict() if seeds else None
    if len(seeds) >= 2:
        import statistics
        d = [by[("oar_g", s)]["held_out_after"] - by[("grpo", s)]["held_out_after"] for s in seeds]
        sd = statistics.stdev(d)
        # seeds for a 5-point held-out difference at 80% power, two-sided 5%, at the observed paired spread
        out["seeds_for_0.05"] = math.ceil(((1.960 + 0.842) * sd / 0.05) ** 2) if sd > 0 else None
        out["sd_paired_difference"] = sd
    return out


def cmd_collect(args) -> int:
    tuning, evaluation = read_runs("tuning"), read_runs("eval")
    engines = sorted({rollout_of(r) for r in evaluation})
    if len(engines) > 1:
        raise SystemExit(f"real_model_pilot: the evaluation runs were sampled by different rollouts "
                         f"({', '.join(engines)}); the paired analysis compares runs of one engine")

    def row(r: dict) -> dict:
        return {k: r[k] for k in ("method", "lr", "seed", "exit_code", "seconds")} | {"rollout": rollout_of(r)}

    result = {"command": "python benchmarks/real_model_pilot.py collect", "steps": STEPS,
              "settings": {**SETTINGS, "val_samples": VAL_SAMPLES, "threshold": THRESHOLD, "window": WINDOW},
              "rollout": sorted({rollout_of(r) for r in tuning + evaluation}),
              "tuning": {"runs": [row(r) | endpoints(r) for r in tuning], "plan": plan(tuning)},
              "eval": {"runs": [row(r) | endpoints(r) for r in evaluation],
                       "analysis": analyse(evaluation) if evaluation else None},
              "machine": (evaluation or tuning or [{}])[0].get("machine")}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["eval"]["analysis"] or result["tuning"]["plan"], indent=1))
    return 0


def main(argv=None) -> int:
    from verl_oar.real_model.launch import ROLLOUT_CHOICES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="train the (method, lr, seed) cells not yet recorded")
    r.add_argument("--phase", choices=("tuning", "eval"), required=True)
    r.add_argument("--methods", required=True, help="grpo,oar_g with --lrs, or grpo@LR,oar_g@LR")
    r.add_argument("--lrs", default=None)
    r.add_argument("--seeds", required=True)
    r.add_argument("--steps", type=int, default=STEPS)
    r.add_argument("--rollout", choices=ROLLOUT_CHOICES, default=ROLLOUT,
                   help="the engine that samples (default hf, the registered design's; auto: vllm where vLLM's CPU "
                        "build is installed, else hf)")
    sub.add_parser("plan", help="each method's learning rate from the tuning runs")
    c = sub.add_parser("collect", help="the pre-registered analysis")
    c.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    if args.cmd == "run":
        seen = {r["seed"] for r in read_runs("tuning" if args.phase == "eval" else "eval")}
        if seen & set(parse_seeds(args.seeds)):
            raise SystemExit(f"real_model_pilot: seeds {sorted(seen & set(parse_seeds(args.seeds)))} were used by the "
                             f"other phase; tuning seeds are never evaluated on (tuning {TUNING_SEEDS}, eval {EVAL_SEEDS})")
        return cmd_run(args)
    return cmd_plan(args) if args.cmd == "plan" else cmd_collect(args)


if __name__ == "__main__":
    raise SystemExit(main())
