"""The study's inclusion check of a built pick_max variant (docs/study.md, amendment 1): on all 200 held-out
prompts, with two sampling seeds, sampled accuracy at most 0.6 and answer rate at least 0.95.

    python benchmarks/variant_inclusion.py fill64 [--seeds 0,1] [--out FILE.json]

Per seed, ``testbed.workspace.sample_statistics`` (the build's own statistics, one sampled and one greedy response
per prompt) on the variant's committed model; the verdict needs both seeds inside the bounds. One torch thread.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_SAMPLED, MIN_ANSWERED = 0.6, 0.95
"""the inclusion bounds (docs/study.md, amendment 1)"""


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variant")
    parser.add_argument("--seeds", default="0,1", help="sampling seeds (default: 0,1)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import torch
    from transformers import AutoModelForCausalLM

    from verl_oar.cpu.workspace import build_tokenizer
    from verl_oar.testbed.machine import machine_info
    from verl_oar.testbed.variants import load_variant
    from verl_oar.testbed.workspace import sample_statistics, split_problems

    torch.set_num_threads(1)
    bed = load_variant(args.variant)
    _, val = split_problems(bed.spec)
    tokenizer = build_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(bed.model_dir, dtype=torch.float32).eval()
    rows = []
    for seed in (int(s) for s in args.seeds.split(",")):
        start = time.time()
        stats = sample_statistics(model, tokenizer, val, replace(bed.spec, seed=seed))
        stats.pop("example", None)
        rows.append({"seed": seed, **stats, "seconds": round(time.time() - start, 1)})
        print(json.dumps(rows[-1]), file=sys.stderr)
    included = all(r["sampled_accuracy"] <= MAX_SAMPLED and r["answer_rate"] >= MIN_ANSWERED for r in rows)
    result = {
        "variant": args.variant,
        "fingerprint": bed.manifest["fingerprint"],
        "command": "python benchmarks/variant_inclusion.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "rule": {"max_sampled_accuracy": MAX_SAMPLED, "min_answer_rate": MIN_ANSWERED, "prompts": len(val)},
        "per_seed": rows,
        "included": included,
        "machine": machine_info(),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
