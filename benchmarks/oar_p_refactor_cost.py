"""OAR-P's cost before and after it became one implementation: the same inputs through the production entry
(``score_samples``) of two source trees, each in processes of its own, alternated; wall time and importances compared.

    git worktree add /tmp/oarp_before 5fd9d7e    # the three implementations: core/perturbation.py,
                                                 # core/batched_perturbation.py, core/hierarchical.py
    python benchmarks/oar_p_refactor_cost.py --before-tree /tmp/oarp_before [--after-tree .] [--repeats 5]
        [--inner 3] [--modes exact,chunk16,hierarchical] [--samples 8] [--length 256] [--max-tokens 8192]
        [--threads 1] [--out FILE]
    python benchmarks/oar_p_refactor_cost.py --before-tree /tmp/oarp_before --smoke    # seconds: 2 x 96 tokens, once
    git worktree remove /tmp/oarp_before

Each repeat starts one process per tree, the order alternating between repeats (before first, then after first), so
a slow spell of a shared machine falls on both. A process imports ``verl_oar`` from its tree only (``PYTHONPATH``;
checked), sets ``--threads`` torch threads, builds the same random tiny Qwen2 (``oar_p_batching.py``'s: vocabulary
2048, hidden 128, 4 layers, fp32, sdpa, CPU, seed 0) and the same batch (``--samples`` responses of ``--length``
tokens, two 64-token prompts each shared by half of them, an 8-token answer at the end, reasoning between,
temperature 1), then per mode runs ``score_samples`` over ``core.hf.HFRowsModel`` (AS-MEAN, prefix sharing,
``--max-tokens`` padded tokens per call) once untimed and ``--inner`` times timed. Modes: ``exact``; ``chunk16``
(K=16); ``hierarchical`` (K=16, m=4, u=4: the defaults).

Printed per mode: each tree's median seconds (the median over repeats of each process's median), after / before
of those medians, the per-repeat ratios' range, and whether every repeat's importances are equal (max |after -
before| <= ``--atol``, default 0: bit for bit, the same computation in the same calls). Exit status 1 when a mode's
importances differ. ``--out`` (JSON): ``command``, ``machine`` (``testbed.machine.machine_info``), ``trees`` (per
side: ``path``, ``commit``, ``dirty``), ``workload`` (samples, length, prompt, answer, max_tokens, threads, inner,
repeats, model), and ``modes``: per mode ``before_s`` and ``after_s`` (each process's median, per repeat, in run
order), ``before_median_s``, ``after_median_s``, ``after_over_before`` (ratio of the medians),
``ratio_per_repeat``, ``max_abs_diff`` and ``equal``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VOCAB, HIDDEN, LAYERS, PROMPT, ANSWER, NEUTRAL = 2048, 128, 4, 64, 8, 0
MODES = {"exact": dict(mode="exact"), "chunk16": dict(mode="chunk", budget=16),
         "hierarchical": dict(mode="hierarchical", budget=16, refine_top=4, refine_unit=4)}


# ---------------------------------------------------------------------------------------------------
# one process: one tree, every mode
# ---------------------------------------------------------------------------------------------------


def _api():
    """(PerturbationConfig, Sample, score_samples, HFRowsModel) of the imported tree, before or after the one
    package (before it, ``Sample`` and ``score_samples`` lived in ``core.batched_perturbation``)."""
    perturbation = importlib.import_module("verl_oar.core.perturbation")
    batched = (perturbation if hasattr(perturbation, "score_samples")
               else importlib.import_module("verl_oar.core.batched_perturbation"))
    from verl_oar.core.hf import HFRowsModel

    return perturbation.PerturbationConfig, batched.Sample, batched.score_samples, HFRowsModel


def _batch(sample_cls, samples: int, length: int):
    """The module docstring's batch: (samples, reasoning masks), spans unset (``score_samples`` sets them)."""
    import torch

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, VOCAB, (PROMPT,), generator=g) for _ in range(2)]
    out, reasoning = [], []
    for i in range(samples):
        ids = torch.cat([prompts[i * 2 // samples], torch.randint(1, VOCAB, (length - PROMPT,), generator=g)])
        predict = torch.zeros(length, dtype=torch.bool)
        predict[length - ANSWER - 1 : length - 1] = True
        mask = torch.zeros(length, dtype=torch.bool)
        mask[PROMPT : length - ANSWER] = True
        out.append(sample_cls(ids, torch.arange(length), torch.full((length,), -1), predict, 1.0, prompt_len=PROMPT))
        reasoning.append(mask)
    return out, reasoning


def _child(spec: dict) -> dict:
    """Time every mode of ``spec`` in this process; save the importances to ``spec["save"]``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import verl_oar

    where = Path(verl_oar.__file__).resolve()
    if not where.is_relative_to(Path(spec["tree"]).resolve()):
        raise RuntimeError(f"verl_oar was imported from {where}, not from the tree {spec['tree']}")
    config_cls, sample_cls, score_samples, rows_model_cls = _api()
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                         max_position_embeddings=max(2048, spec["length"]))
    config._attn_implementation = "sdpa"
    model = Qwen2ForCausalLM(config).eval()
    rows_model = rows_model_cls(model, pad_id=NEUTRAL)
    samples, reasoning = _batch(sample_cls, spec["samples"], spec["length"])
    seconds, importance = {}, {}
    for mode in spec["modes"]:
        cfg = config_cls(outcome="mean", **MODES[mode])
        importance[mode] = score_samples(rows_model, samples, reasoning, NEUTRAL, cfg, spec["max_tokens"])[0]
        times = []
        for _ in range(spec["inner"]):
            start = time.perf_counter()
            score_samples(rows_model, samples, reasoning, NEUTRAL, cfg, spec["max_tokens"])
            times.append(time.perf_counter() - start)
        seconds[mode] = statistics.median(times)
    torch.save(importance, spec["save"])
    return seconds


# ---------------------------------------------------------------------------------------------------
# the driver: alternate the trees, compare
# ---------------------------------------------------------------------------------------------------


def _run_child(tree: Path, spec: dict) -> dict:
    path = os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps({**spec, "tree": str(tree)})],
                          env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True, timeout=3600)
    if proc.returncode:
        raise RuntimeError(f"the process on {tree} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _tree_info(tree: Path) -> dict:
    def git(*args):
        return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True).stdout.strip()

    return {"path": str(tree), "commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before-tree", type=Path, help="a checkout of the commit before (git worktree add)")
    parser.add_argument("--after-tree", type=Path, default=ROOT, help="default: this working tree")
    parser.add_argument("--repeats", type=int, default=5, help="processes per tree, alternated")
    parser.add_argument("--inner", type=int, default=3, help="timed runs per mode in a process (median)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--length", type=int, default=256, help="tokens per sample (prompt 64, answer 8)")
    parser.add_argument("--max-tokens", type=int, default=8192, help="padded tokens per model call")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--atol", type=float, default=0.0, help="largest |after - before| importance accepted")
    parser.add_argument("--smoke", action="store_true", help="2 samples of 96 tokens, 1 repeat, 1 timed run")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(_child(json.loads(args.child))))
        return 0
    if args.before_tree is None:
        parser.error("--before-tree is required (git worktree add /tmp/oarp_before 5fd9d7e)")
    if args.smoke:
        args.samples, args.length, args.repeats, args.inner = 2, 96, 1, 1
    if args.length <= PROMPT + ANSWER:
        parser.error(f"--length must leave reasoning tokens after the {PROMPT}-token prompt and before the "
                     f"{ANSWER}-token answer")
    modes = args.modes.split(",")
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}: choose from {list(MODES)}")
    import torch

    trees = {"before": args.before_tree.resolve(), "after": args.after_tree.resolve()}
    spec = {"modes": modes, "samples": args.samples, "length": args.length, "max_tokens": args.max_tokens,
            "threads": args.threads, "inner": args.inner}
    seconds = {side: [] for side in trees}
    diffs = {mode: 0.0 for mode in modes}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            order = ("before", "after") if repeat % 2 == 0 else ("after", "before")
            saved = {}
            for side in order:
                saved[side] = str(Path(tmp, f"{side}_{repeat}.pt"))
                seconds[side].append(_run_child(trees[side], {**spec, "save": saved[side]}))
                print(f"repeat {repeat} {side}: " + ", ".join(f"{m} {s:.3f} s" for m, s in seconds[side][-1].items()),
                      file=sys.stderr, flush=True)
            before, after = (torch.load(saved[side]) for side in ("before", "after"))
            for mode in modes:
                diffs[mode] = max(diffs[mode], max(float((a.double() - b.double()).abs().max())
                                                   for a, b in zip(after[mode], before[mode], strict=True)))
    results = {}
    print(f"\n{args.samples} samples x {args.length} tokens, {args.threads} thread(s), {args.repeats} repeats x "
          f"{args.inner} timed runs; before {trees['before']}, after {trees['after']}")
    print(f"{'mode':13s} {'before s':>9s} {'after s':>9s} {'after/before':>13s} {'per repeat':>13s} "
          f"{'max |diff|':>11s}")
    for mode in modes:
        b = [s[mode] for s in seconds["before"]]
        a = [s[mode] for s in seconds["after"]]
        ratios = [x / y for x, y in zip(a, b)]
        row = {"before_s": b, "after_s": a, "before_median_s": statistics.median(b),
               "after_median_s": statistics.median(a),
               "after_over_before": statistics.median(a) / statistics.median(b), "ratio_per_repeat": ratios,
               "max_abs_diff": diffs[mode], "equal": diffs[mode] <= args.atol}
        results[mode] = row
        print(f"{mode:13s} {row['before_median_s']:9.3f} {row['after_median_s']:9.3f} {row['after_over_before']:13.3f} "
              f"{min(ratios):6.3f}-{max(ratios):<6.3f} {diffs[mode]:11.2e}" + ("" if row["equal"] else "  DIFFERENT"))
    if args.out:
        from verl_oar.testbed.machine import machine_info

        command = "python benchmarks/oar_p_refactor_cost.py " + " ".join(argv if argv is not None else sys.argv[1:])
        args.out.write_text(json.dumps({
            "command": command,
            "machine": machine_info(), "trees": {side: _tree_info(tree) for side, tree in trees.items()},
            "workload": {**{k: v for k, v in spec.items() if k != "modes"}, "prompt": PROMPT, "answer": ANSWER,
                         "repeats": args.repeats,
                         "model": {"vocab": VOCAB, "hidden": HIDDEN, "layers": LAYERS, "dtype": "float32"}},
            "modes": results}, indent=1) + "\n")
    different = [m for m, r in results.items() if not r["equal"]]
    if different:
        print(f"importances differ (max |after - before| > {args.atol}) in: {different}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
