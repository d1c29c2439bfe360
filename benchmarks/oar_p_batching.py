"""OAR-P at scale: copies batched across samples (``core.perturbation``, the one path the engines run) against
the plain reference loop (``tests/_oar_p_reference.py``: one whole-sequence forward per occlusion, one sample at a
time, no cache), as tokens fed per sample and wall time in log-prob passes, all rows timed in one process,
round-robin.

    python benchmarks/oar_p_batching.py [--shapes 256,1024,4096,mixed] [--rounds 3] [--max-tokens 8192]
        [--hierarchical K:m:unit,...] [--out FILE]
    python benchmarks/oar_p_batching.py --shapes 128 --rounds 1 --hierarchical 4:1:4   # a smoke run, seconds

Model: a random tiny Qwen2 (vocabulary 2048, hidden 128, 4 layers, fp32, sdpa, CPU), as
``benchmarks/importance_cost.py``. Batches: prompts of 64 tokens, each answered by several responses (a GRPO
group: the responses of a prompt share it), the answer the last 8 tokens, reasoning everything between:

- ``256`` / ``1024`` / ``4096``: 8 / 8 / 2 responses of that total length (2 prompts; 1 at 4096); another number
  above 72 (e.g. ``128``) is the 256 layout at that length;
- ``mixed``: 64 responses, 8 prompts x 8, response lengths drawn like a real rollout (log-normal, median 300
  tokens, many short and a few long, clipped to [24, 3000]).

Rows (the baseline is the first): ``log-prob pass`` (a no-grad forward computing every token's log-prob,
samples sorted by length and packed into calls of at most ``--max-tokens`` padded tokens, like verl's dynamic
batch size), and the same one sequence at a time (column ``x 1-seq``: the unit of
``benchmarks/importance_cost.py``'s OAR-P table); for ``chunk K=16`` and ``exact`` (exact only up to 256 tokens: it
grows like R^2) the ``reference loop`` (its logits_fn computes only the predicting positions' logits, as
``importance_cost.py``'s naive row) and ``batched``; ``hierarchical`` (batched) for each ``--hierarchical`` setting
(not at 4096: minutes per run on CPU). Before timing, each batched row is checked against the reference loop on
the same batch (max abs difference in fp32; equal to 1e-10 in float64, tests/unit/test_batched_perturbation_on_cpu.py).
Absolute times depend on the machine (reported); ratios are the finding, and a GPU will differ (bigger calls pay off
more there). Until the commit that made the batched path the only one, the second arm was the per-sample cached
path (``perturbation_importance``, removed); ``benchmarks/results_oar_p_batching_cpu.json`` is from then (its rows
``..., per-sample`` and key ``checks_max_abs_diff_vs_per_sample``).

Output (``--out``, JSON): ``command``; ``machine`` (``testbed.machine.machine_info`` and ``torch_threads``);
``model`` (vocab, hidden, layers, dtype); ``max_tokens``; ``rounds``; ``shapes``: per shape ``samples``,
``mean_length``, ``max_length``, ``checks_max_abs_diff_vs_reference`` (batched row -> max |batched - reference|) and
``rows``: per row ``median_s``, ``x_log_prob`` (median / the log-prob pass's), ``x_one_sequence_log_prob``,
``range_x`` (fastest and slowest round, in log-prob passes), ``tokens_per_sample`` (fed, cached prefixes not
counted), ``calls`` (model calls) and ``copies_per_sample``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _oar_p_reference import naive_perturbation_importance  # noqa: E402  (the plain loop the tests check against)
from importance_cost import build_model, naive_logits_fn  # noqa: E402

from verl_oar.core.hf import HFRowsModel  # noqa: E402
from verl_oar.core.perturbation import (  # noqa: E402
    PerturbationConfig,
    PerturbationCost,
    Row,
    Sample,
    batched_perturbation_importance,
    occlusion_spans,
    plan_calls,
    score_samples,
)

VOCAB, HIDDEN, LAYERS, PROMPT, ANSWER, NEUTRAL = 2048, 128, 4, 64, 8, 0


def make_samples(shape: str, seed: int = 0) -> list[Sample]:
    """The batch of one shape (module docstring); spans are set per method."""
    g = torch.Generator().manual_seed(seed)
    if shape == "mixed":
        groups, per_group = 8, 8
        lengths = [int(min(3000, max(24, math.exp(math.log(300) + 0.8 * float(torch.randn(1, generator=g))))))
                   for _ in range(groups * per_group)]
    else:
        total = int(shape)
        if total <= PROMPT + ANSWER:
            raise ValueError(f"shape {shape}: a length must leave reasoning tokens after the {PROMPT}-token prompt "
                             f"and before the {ANSWER}-token answer")
        groups, per_group = (1, 2) if total >= 4096 else (2, 4)
        lengths = [total - PROMPT] * (groups * per_group)
    samples = []
    for group in range(groups):
        prompt = torch.randint(1, VOCAB, (PROMPT,), generator=g)
        for k in range(per_group):
            response = torch.randint(1, VOCAB, (lengths[group * per_group + k],), generator=g)
            ids = torch.cat([prompt, response])
            n = ids.numel()
            predict = torch.zeros(n, dtype=torch.bool)
            predict[n - ANSWER - 1 : n - 1] = True
            samples.append(Sample(ids, torch.arange(n), torch.full((n,), -1), predict, 1.0, prompt_len=PROMPT))
    return samples


def reasoning_of(sample: Sample) -> torch.Tensor:
    r = torch.zeros(sample.ids.numel(), dtype=torch.bool)
    r[PROMPT : sample.ids.numel() - ANSWER] = True
    return r


def logprob_pass(model, samples: list[Sample], max_tokens: int) -> PerturbationCost:
    """Every token's log-prob, samples packed into calls of <= max_tokens padded tokens (longest first)."""
    rows = [Row(s.ids, s.positions) for s in samples]
    cost = PerturbationCost()
    with torch.no_grad():
        for call in plan_calls(rows, max_tokens):
            n = max(rows[i].ids.numel() for i in call)
            ids = torch.zeros(len(call), n, dtype=torch.long)
            mask = torch.zeros(len(call), n, dtype=torch.long)
            for j, i in enumerate(call):
                ids[j, : rows[i].ids.numel()] = rows[i].ids
                mask[j, : rows[i].ids.numel()] = 1
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            torch.log_softmax(logits.float(), -1).gather(-1, torch.roll(ids, -1, 1).unsqueeze(-1))
            cost.add(PerturbationCost(forwards=1, tokens=int(mask.sum()), peak_call_tokens=ids.numel()))
    return cost


def reference_loop(model, samples, cfg, max_tokens):
    """The plain reference: one sample at a time, one whole-sequence forward per span (``max_tokens`` unused)."""
    cost, out = PerturbationCost(), []
    for s in samples:
        keep = s.predict.nonzero().squeeze(1)
        out.append(naive_perturbation_importance(naive_logits_fn(model, keep), s.ids, s.span, s.predict, NEUTRAL,
                                                 cfg.outcome, s.temperature))
        spans = int(s.span.max()) + 1 if (s.span >= 0).any() else 0
        cost.add(PerturbationCost(forwards=spans + 1, copies=spans, tokens=(spans + 1) * s.ids.numel(),
                                  peak_call_tokens=s.ids.numel()))
    return out, cost


def batched(model, samples, cfg, max_tokens):
    out, _, cost = batched_perturbation_importance(HFRowsModel(model, pad_id=NEUTRAL), samples, NEUTRAL, cfg,
                                                   max_tokens)
    return out, cost


def hierarchical(model, samples, cfg, max_tokens):
    out, _, cost = score_samples(HFRowsModel(model, pad_id=NEUTRAL), samples, [reasoning_of(s) for s in samples],
                                 NEUTRAL, cfg, max_tokens)
    return out, cost


def method_runs(model, samples, shape: str, args) -> dict:
    """name -> (callable returning (importance, cost), spans per sample)"""
    runs = {}
    modes = [("chunk K=16", PerturbationConfig(mode="chunk", budget=16))]
    if shape != "mixed" and int(shape) <= 256:  # exact grows like R^2 tokens: 1024 would take minutes per run on CPU
        modes.append(("exact", PerturbationConfig(mode="exact")))
    for label, cfg in modes:
        spans = [occlusion_spans(reasoning_of(s), cfg.mode, cfg.budget) for s in samples]
        for path, fn in (("reference loop", reference_loop), ("batched", batched)):
            runs[f"{label}, {path}"] = (fn, cfg, spans)
    # hierarchical at 4096 is minutes per run on CPU (~930k tokens fed per sample at K=16 m=4 u=4)
    for setting in filter(None, args.hierarchical.split(",") if shape != "4096" else []):
        k, m, unit = (int(x) for x in setting.split(":"))
        cfg = PerturbationConfig(mode="hierarchical", budget=k, refine_top=m, refine_unit=unit)
        runs[f"hierarchical K={k} m={m} unit={unit}, batched"] = (hierarchical, cfg, None)
    return runs


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="256,1024,4096,mixed")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--hierarchical", default="16:4:4", help="K:m:unit settings, comma-separated ('' for none)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from verl_oar.testbed.machine import machine_info

    model = build_model(VOCAB, HIDDEN, LAYERS)
    model.config.max_position_embeddings = 8192
    results = {}
    for shape in args.shapes.split(","):
        samples = make_samples(shape)
        runs = method_runs(model, samples, shape, args)

        def call(name):
            fn, cfg, spans = runs[name]
            if spans is not None:
                for s, span in zip(samples, spans, strict=True):
                    s.span = span
            return fn(model, samples, cfg, args.max_tokens)

        checks = {}
        for name in runs:
            if name.endswith("batched") and name.replace("batched", "reference loop") in runs:
                new, _ = call(name)
                reference, _ = call(name.replace("batched", "reference loop"))
                checks[name] = max(float((a - b).abs().max()) for a, b in zip(new, reference, strict=True))
        timers = {"log-prob pass": lambda: logprob_pass(model, samples, args.max_tokens),
                  "log-prob pass, one sequence at a time": lambda: logprob_pass(model, samples, 1)}
        timers.update({name: (lambda name=name: call(name)[1]) for name in runs})
        times, costs = {k: [] for k in timers}, {}
        for _ in range(args.rounds):
            for name, fn in timers.items():
                start = time.perf_counter()
                costs[name] = fn()
                times[name].append(time.perf_counter() - start)
        base = statistics.median(times["log-prob pass"])
        base_one = statistics.median(times["log-prob pass, one sequence at a time"])
        lengths = [s.ids.numel() for s in samples]
        results[shape] = {
            "samples": len(samples), "mean_length": statistics.mean(lengths), "max_length": max(lengths),
            "checks_max_abs_diff_vs_reference": checks,
            "rows": {name: {"median_s": round(statistics.median(ts), 4),
                            "x_log_prob": round(statistics.median(ts) / base, 3),
                            "x_one_sequence_log_prob": round(statistics.median(ts) / base_one, 3),
                            "range_x": [round(min(ts) / base, 3), round(max(ts) / base, 3)],
                            "tokens_per_sample": round(costs[name].tokens / len(samples), 1),
                            "calls": costs[name].forwards,
                            "copies_per_sample": round(costs[name].copies / len(samples), 2)}
                     for name, ts in times.items()},
        }
        print(f"\nshape {shape}: {len(samples)} samples, mean length {statistics.mean(lengths):.0f}, "
              f"max {max(lengths)}; max |batched - reference loop| {checks}")
        print(f"{'row':44s} {'median s':>9s} {'x log-prob':>11s} {'range':>13s} {'x 1-seq':>8s} {'tokens/sample':>14s} "
              f"{'calls':>6s}")
        for name, row in results[shape]["rows"].items():
            print(f"{name:44s} {row['median_s']:9.3f} {row['x_log_prob']:11.2f} "
                  f"{row['range_x'][0]:6.2f}-{row['range_x'][1]:<6.2f} {row['x_one_sequence_log_prob']:8.2f} "
                  f"{row['tokens_per_sample']:14.0f} {row['calls']:6d}")
    out = {"command": "python benchmarks/oar_p_batching.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "machine": {**machine_info(), "torch_threads": torch.get_num_threads()},
           "model": {"vocab": VOCAB, "hidden": HIDDEN, "layers": LAYERS, "dtype": "float32"},
           "max_tokens": args.max_tokens, "rounds": args.rounds, "shapes": results}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
