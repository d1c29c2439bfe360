"""bf16 vs fp32 importance on the testbed: do real runs' dtype and OAR's noise agree?

    python benchmarks/bf16_agreement.py [--seeds 0,1,2] [--layers 2,4] [--samples 48] [--out FILE]

Real runs compute importance in bf16 (FSDP2 ``param_dtype=bf16`` under bf16 autocast); this measures,
per estimator, how far that moves importance from fp32 on the testbed's warm-started models, through
the package's own functions (``testbed.quality.oar_g_scores`` / ``oar_p_scores``, the same
``gradient_importance`` / ``score_samples`` the workers run):

1. for every testbed seed and model depth (``--layers``: 2 is the default testbed, 4 the same task and
   warm start with 4 layers), build (or reuse) the testbed and sample ``--samples`` responses at
   temperature 1 from the fp32 model; keep those with a readable trace (the oracle);
2. score every estimator in fp32 (the model as trained) and in bf16 (the same weights cast to bf16,
   run under ``torch.autocast("cpu", bfloat16)``); OAR-G's noise draws are the same float32 draws
   in both (seeded generator), added in the embeddings' dtype; OAR-P's outcomes are computed in
   float32 from the bf16 logits;
3. per response, over its reasoning tokens: Spearman correlation of the fp32 and bf16 scores
   (average ranks), top-10% overlap |top_k(fp32) ∩ top_k(bf16)| / k with k = ceil(0.1 R), and per
   precision recall@10% of the oracle causal tokens (``testbed.pick_max``: the picks);
4. report the mean over responses per (seed, depth), and the mean and min-max over seeds.

Targets (issue 11): top-10% overlap >= 0.8 and |recall_bf16 - recall_fp32| <= 0.05.

The committed results_bf16_agreement_cpu.json were measured on the first edition of the testbed
(chain_sum, issue 11, its ``direct`` oracle); the script now builds the second edition (pick_max), whose
builds take about 7 minutes each on 2 cores, and has not been re-run on it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from verl_oar.core.gradient import GradientConfig
from verl_oar.core.token_ranking import mean_recall, rank_candidates, top_count
from verl_oar.testbed.quality import make_batch, oar_g_scores, oar_p_scores
from verl_oar.testbed.workspace import TestbedSpec, build_testbed, max_response_tokens, sample_responses

ESTIMATORS = {
    "oar_g_abs_1e-3": ("g", dict(objective="noisy_kl", noise_std=1e-3)),
    "oar_g_abs_1e-2": ("g", dict(objective="noisy_kl", noise_std=1e-2)),
    "oar_g_rel_0.01": ("g", dict(objective="noisy_kl", noise_std=0.01, noise_relative=True)),
    "oar_g_rel_0.05": ("g", dict(objective="noisy_kl", noise_std=0.05, noise_relative=True)),
    "oar_g_rel_0.1": ("g", dict(objective="noisy_kl", noise_std=0.1, noise_relative=True)),
    "oar_g_rel_0.2": ("g", dict(objective="noisy_kl", noise_std=0.2, noise_relative=True)),
    "oar_g_loglik": ("g", dict(objective="loglik")),
    "oar_p_chunk16": ("p", dict(mode="chunk", budget=16)),
    "oar_p_exact": ("p", dict(mode="exact", budget=1)),
}
"""name -> (method, settings); every OAR-G row is AS-MEAN with grad x input (the defaults)"""
FRAC = 0.1


def average_ranks(values: torch.Tensor) -> torch.Tensor:
    """Ranks 1..n of a 1-D tensor, ties sharing their average rank (as Spearman's rho needs)."""
    order = torch.argsort(values, stable=True)
    ranks = torch.empty(len(values), dtype=torch.float64)
    sorted_values = values[order]
    start = 0
    for end in range(1, len(values) + 1):
        if end == len(values) or sorted_values[end] != sorted_values[start]:
            ranks[order[start:end]] = (start + end + 1) / 2.0
            start = end
    return ranks


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra, rb = average_ranks(a.double()), average_ranks(b.double())
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denominator = math.sqrt(float((ra * ra).sum() * (rb * rb).sum()))
    return float((ra * rb).sum()) / denominator if denominator > 0 else float("nan")


def top_overlap(a: torch.Tensor, b: torch.Tensor, candidates: torch.Tensor, seed: int) -> float:
    """|top_k(a) ∩ top_k(b)| / k over ``candidates`` (ties broken by the same seeded permutation)."""
    k = top_count(FRAC, int(candidates.sum()))
    top_a = set(rank_candidates(a, candidates, torch.Generator().manual_seed(seed))[:k].tolist())
    top_b = set(rank_candidates(b, candidates, torch.Generator().manual_seed(seed))[:k].tolist())
    return len(top_a & top_b) / k


def score(model, batch, name: str, neutral_id: int, seed: int) -> torch.Tensor:
    method, settings = ESTIMATORS[name]
    if method == "g":
        cfg = GradientConfig(outcome="mean", **settings)
        return oar_g_scores(model, batch, cfg, seed, None)
    return oar_p_scores(model, batch, settings["mode"], settings["budget"], neutral_id)


def measure_testbed(seed: int, layers: int, samples: int, workdir: Path) -> dict:
    from transformers import AutoModelForCausalLM

    from verl_oar.cpu.workspace import build_tokenizer

    spec = TestbedSpec(seed=seed, num_hidden_layers=layers)
    bed = build_testbed(workdir / f"seed{seed}_layers{layers}", spec)
    tokenizer = build_tokenizer()
    fp32 = AutoModelForCausalLM.from_pretrained(bed.model_dir, dtype=torch.float32).eval()
    bf16 = AutoModelForCausalLM.from_pretrained(bed.model_dir, dtype=torch.bfloat16).eval()
    import pandas as pd

    val = pd.read_parquet(bed.val_file)
    rows = [val.iloc[i % len(val)] for i in range(samples)]
    sampled = sample_responses(fp32, tokenizer, [r["extra_info"]["question"] for r in rows], seed=seed,
                               max_new_tokens=max_response_tokens(spec))
    batch, skipped = make_batch(sampled, [str(r["reward_model"]["ground_truth"]) for r in rows], tokenizer)
    neutral_id = tokenizer.encode(" ", add_special_tokens=False)[0]
    reasoning, causal, found = batch.oracle["reasoning"], batch.oracle["causal"], batch.oracle["found"]
    out = {"seed": seed, "layers": layers, "responses": int(batch.ids.shape[0]), "skipped": skipped,
           "mean_reasoning_tokens": float(reasoning.sum(1).float().mean()), "estimators": {}}
    for name in ESTIMATORS:
        started = time.perf_counter()
        a = batch.to_response(score(fp32, batch, name, neutral_id, seed + 1))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            b = batch.to_response(score(bf16, batch, name, neutral_id, seed + 1))
        rhos, overlaps = [], []
        for row in range(a.shape[0]):
            cand = reasoning[row]
            if int(cand.sum()) < 2:
                continue
            rho = spearman(a[row][cand], b[row][cand])
            if not math.isnan(rho):
                rhos.append(rho)
            overlaps.append(top_overlap(a[row], b[row], cand, seed + 3))
        recall = {}
        for label, scores in (("fp32", a), ("bf16", b)):
            summary = mean_recall(scores, reasoning, causal, found, [FRAC], torch.Generator().manual_seed(seed + 3))
            recall[label] = summary.recall[FRAC]
        out["estimators"][name] = {
            "spearman": sum(rhos) / len(rhos) if rhos else float("nan"),
            "top10_overlap": sum(overlaps) / len(overlaps),
            "recall10_fp32": recall["fp32"],
            "recall10_bf16": recall["bf16"],
            "seconds": round(time.perf_counter() - started, 1),
        }
        print(f"  seed {seed} layers {layers} {name:<16} " + json.dumps(out["estimators"][name]), flush=True)
    return out


def summarize(runs: list[dict]) -> dict:
    """Per (layers, estimator): mean and min-max over seeds of every measure."""
    summary: dict = {}
    for layers in sorted({r["layers"] for r in runs}):
        group = [r for r in runs if r["layers"] == layers]
        for name in ESTIMATORS:
            cell = {}
            for key in ("spearman", "top10_overlap", "recall10_fp32", "recall10_bf16"):
                values = [r["estimators"][name][key] for r in group]
                cell[key] = {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}
            deltas = [r["estimators"][name]["recall10_bf16"] - r["estimators"][name]["recall10_fp32"] for r in group]
            cell["recall_delta"] = {"mean": sum(deltas) / len(deltas), "min": min(deltas), "max": max(deltas)}
            cell["meets_target"] = (cell["top10_overlap"]["mean"] >= 0.8 and abs(cell["recall_delta"]["mean"]) <= 0.05)
            summary.setdefault(str(layers), {})[name] = cell
    return summary


def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version()}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2", help="testbed seeds")
    parser.add_argument("--layers", default="2,4", help="model depths")
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "verl_oar_bf16_testbeds"))
    parser.add_argument("--out", default=None, help="write the JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    started = time.time()
    runs = [measure_testbed(int(s), int(n), args.samples, Path(args.workdir))
            for n in args.layers.split(",") for s in args.seeds.split(",")]
    report = {"command": " ".join(["python benchmarks/bf16_agreement.py", *(argv or sys.argv[1:])]),
              "machine": machine(), "samples": args.samples, "frac": FRAC, "runs": runs,
              "summary": summarize(runs), "seconds": round(time.time() - started, 1)}
    print("\nlayers estimator          spearman  top10-overlap  recall@10 fp32 -> bf16   (mean [min, max] over seeds)")
    for layers, cells in report["summary"].items():
        for name, cell in cells.items():
            f = lambda m: f"{cell[m]['mean']:.2f} [{cell[m]['min']:.2f}, {cell[m]['max']:.2f}]"  # noqa: E731
            print(f"{layers:>6} {name:<18} {f('spearman')}  {f('top10_overlap')}  {f('recall10_fp32')} -> "
                  f"{f('recall10_bf16')}  {'meets' if cell['meets_target'] else 'MISSES'} target")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
