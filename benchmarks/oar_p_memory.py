"""Peak memory of OAR-P's pass (``core.perturbation.batched_perturbation_importance``) against the number of occluded
copies, at a fixed per-call token budget: the current path, which reduces each model call's logits before the next
call, against the old one, which kept every row's logits until its stage ended (``--old-ref``'s ``verl_oar``
package, extracted with ``git archive`` into a temp dir and imported from there in its own processes).

    python benchmarks/oar_p_memory.py [--samples 1,4,16,64] [--reasoning 16] [--vocab 32768] [--max-tokens 512]
        [--layouts share,full] [--repeats 3] [--old-ref 52bc6a4] [--out FILE]

Model: a random tiny Qwen2 (hidden 64, 2 layers, fp32, sdpa, CPU) with a ``--vocab`` output layer, so the logits
dominate. Workload: ``--samples`` samples (1x, 4x, 16x, 64x by default) of one shape: a 16-token prompt of its
own, ``--reasoning`` R tokens, a 5-token answer and one more token, in exact mode, so R copies per sample and
the number of copies grows with the samples while every call keeps the same shapes; each copy's logits are
5 x V float32 (640 KiB at V=32768). Layouts: ``share`` (prefix sharing, the FSDP path: a copy feeds its tokens
from its span on, so short copies pack many to a call) and ``full`` (``share_prefix=False``, Megatron's layout:
every copy the whole sequence).

Each measurement runs in a fresh subprocess: build the model and the batch, run the pass once on a 2-copy sample
(warm-up: lazy imports), one torch thread, reset the peak RSS (``/proc/self/clear_refs``: 5), read VmRSS (the
baseline), run the pass, read VmHWM; the row is VmHWM - baseline in MiB, median [min, max] over ``--repeats``
round-robin repeats. Also per row: model calls, the largest call's logits and all calls' logits together (MiB,
as the model returned them); a call's logits are at most ``--max-tokens`` x V x 4 B (kept positions <= tokens
fed). Memory does not depend on other processes' CPU load; absolute numbers depend on the allocator (glibc
here) and torch version, reported with the machine.
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT, ANSWER, HIDDEN, LAYERS, NEUTRAL = 16, 5, 64, 2, 0
MIB = 2**20


def _status(key: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}: this benchmark needs Linux")


def _child(spec: dict) -> dict:
    """One measurement (module docstring); ``spec``: impl, tree (the folder ``verl_oar`` is imported from), layout,
    samples, reasoning, vocab, max_tokens."""
    import gc

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import verl_oar
    from verl_oar.core.hf import HFRowsModel
    from verl_oar.core.perturbation import PerturbationConfig, occlusion_spans

    assert Path(verl_oar.__file__).resolve().is_relative_to(Path(spec["tree"]).resolve()), verl_oar.__file__
    module = importlib.import_module("verl_oar.core.perturbation")
    if not hasattr(module, "batched_perturbation_importance"):  # before the one package: its own module
        module = importlib.import_module("verl_oar.core.batched_perturbation")

    torch.set_num_threads(1)  # memory does not depend on it; one thread keeps the run short on a shared machine
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=spec["vocab"], hidden_size=HIDDEN, intermediate_size=4 * HIDDEN,
                         num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    model = Qwen2ForCausalLM(config).eval()

    def sample(reasoning_len: int, seed: int):
        n = PROMPT + reasoning_len + ANSWER + 1
        ids = torch.randint(1, spec["vocab"], (n,), generator=torch.Generator().manual_seed(seed))
        reasoning = torch.zeros(n, dtype=torch.bool)
        reasoning[PROMPT : PROMPT + reasoning_len] = True
        predict = torch.zeros(n, dtype=torch.bool)
        predict[PROMPT + reasoning_len - 1 : PROMPT + reasoning_len - 1 + ANSWER] = True
        return module.Sample(ids, torch.arange(n), occlusion_spans(reasoning, "exact", 1), predict, 1.0,
                             prompt_len=PROMPT)

    sizes: list[int] = []

    class Sizes(HFRowsModel):
        def __call__(self, rows):
            logits, caches = super().__call__(rows)
            sizes.append(sum(t.numel() * t.element_size() for t in logits if t is not None))
            return logits, caches

    rows_model = Sizes(model, pad_id=NEUTRAL)
    cfg = PerturbationConfig(share_prefix=spec["layout"] == "share")
    module.batched_perturbation_importance(rows_model, [sample(2, -1)], NEUTRAL, cfg, spec["max_tokens"])  # warm-up
    measured = [sample(spec["reasoning"], seed) for seed in range(spec["samples"])]
    sizes.clear()
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    baseline = _status("VmRSS")
    _, _, cost = module.batched_perturbation_importance(rows_model, measured, NEUTRAL, cfg, spec["max_tokens"])
    peak = _status("VmHWM")
    return {"peak_minus_baseline_mib": (peak - baseline) / MIB, "baseline_mib": baseline / MIB,
            "copies": cost.copies, "calls": cost.forwards, "largest_call_logits_mib": max(sizes) / MIB,
            "all_logits_mib": sum(sizes) / MIB}


def _old_tree(ref: str, directory: str) -> None:
    """``ref``'s ``verl_oar`` package, extracted into ``directory``."""
    archive = subprocess.run(["git", "archive", ref, "verl_oar"], cwd=ROOT, check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(directory, filter="data")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", default="1,4,16,64", help="samples per pass, comma-separated")
    parser.add_argument("--reasoning", type=int, default=16, help="R: reasoning tokens (copies) per sample")
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--max-tokens", type=int, default=512, help="the per-call token budget (fixed)")
    parser.add_argument("--layouts", default="share,full")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--old-ref", default="52bc6a4",
                        help="git ref whose verl_oar package is the old path ('' to skip it)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(_child(json.loads(args.child))))
        return
    from verl_oar.testbed.machine import machine_info

    impls = ["new", "old"] if args.old_ref else ["new"]
    counts = [int(c) for c in args.samples.split(",")]
    layouts = args.layouts.split(",")
    runs: dict[tuple, list[dict]] = {}
    with tempfile.TemporaryDirectory() as old_dir:
        if args.old_ref:
            _old_tree(args.old_ref, old_dir)
        trees = {"new": str(ROOT), "old": old_dir}
        for repeat in range(args.repeats):
            for layout in layouts:
                for n in counts:
                    for impl in impls:
                        spec = {"impl": impl, "tree": trees[impl], "layout": layout, "samples": n,
                                "reasoning": args.reasoning, "vocab": args.vocab, "max_tokens": args.max_tokens}
                        path = os.pathsep.join(filter(None, [trees[impl], os.environ.get("PYTHONPATH")]))
                        out = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)],
                                             env={**os.environ, "PYTHONPATH": path}, check=True, capture_output=True,
                                             text=True, timeout=600)
                        runs.setdefault((layout, n, impl), []).append(json.loads(out.stdout.strip().splitlines()[-1]))
                        print(f"repeat {repeat} {layout} {n} {impl}: {runs[layout, n, impl][-1]}", file=sys.stderr)
    rows = []
    print(f"\nV={args.vocab}, max_tokens={args.max_tokens}; peak RSS - baseline (MiB), median [min, max] over "
          f"{args.repeats}; one call's logits bound: max_tokens x V x 4 B = {args.max_tokens * args.vocab * 4 / MIB:.0f}"
          " MiB")
    print(f"{'layout':7s} {'samples':>7s} {'copies':>6s} {'impl':4s} {'calls':>6s} {'largest call':>12s} {'all logits':>11s} "
          f"{'peak - baseline':>24s}")
    for (layout, n, impl), results in runs.items():
        peaks = [r["peak_minus_baseline_mib"] for r in results]
        first = results[0]
        row = {"layout": layout, "samples": n, "copies": first["copies"], "factor": n // counts[0], "impl": impl,
               "calls": first["calls"], "largest_call_logits_mib": round(first["largest_call_logits_mib"], 2),
               "all_logits_mib": round(first["all_logits_mib"], 2),
               "peak_minus_baseline_mib": {"median": round(statistics.median(peaks), 1),
                                           "range": [round(min(peaks), 1), round(max(peaks), 1)]},
               "baseline_mib": round(statistics.median(r["baseline_mib"] for r in results), 1)}
        rows.append(row)
        print(f"{layout:7s} {n:7d} {row['copies']:6d} {impl:4s} {row['calls']:6d} {row['largest_call_logits_mib']:12.1f} "
              f"{row['all_logits_mib']:11.1f} {row['peak_minus_baseline_mib']['median']:10.1f} "
              f"[{min(peaks):.1f}, {max(peaks):.1f}]")
    rows.sort(key=lambda r: (layouts.index(r["layout"]), r["copies"], impls.index(r["impl"])))
    result = {
        "command": "python benchmarks/oar_p_memory.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine_info(),
        "model": {"vocab": args.vocab, "hidden": HIDDEN, "layers": LAYERS, "dtype": "float32"},
        "workload": {"prompt": PROMPT, "reasoning": args.reasoning, "answer": ANSWER, "mode": "exact",
                     "samples": counts,
                     "max_tokens": args.max_tokens, "repeats": args.repeats,
                     "old": f"{args.old_ref}:verl_oar" if args.old_ref else None,
                     "one_call_logits_bound_mib": round(args.max_tokens * args.vocab * 4 / MIB, 1)},
        "rows": rows,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
