"""OAR-G noise generation per training step at the recipes' shapes: before and after drawing on device.

    python benchmarks/noise_cost.py [--sequences 8] [--repeats 3] [--device cpu] [--out FILE]

What one rank draws per step for ``objective=noisy_kl``, at the FSDP2 recipes' shapes (prompt 1024 +
response 3072 tokens, the reasoning being all of the response but its last 16 tokens; 128
sequences per rank per step: 8 prompts x n=8 per GPU at batch 128 over 8 GPUs, i.e. 1024 / 8):

- before (the previous implementation, reproduced here as the baseline, since the package no longer
  has it): per sequence, a CPU generator draws standard normals for every position of the whole
  sequence (prompt included), (L, H) float32, then copies them to the model's device;
- after (``verl_oar.core.noise.layout_noise``, what the FSDP workers run): per sequence, a
  generator on the model's device draws only the reasoning positions, (R, H), placed straight into
  the packed (1, total, H) layout of the model's input on that device.

``--sequences`` sequences are timed per repeat and the time scaled to 128 (drawing is linear in
the number of sequences); before and after alternate, medians over ``--repeats``. Both variants run in the same command; the
ratio is the finding, absolute times depend on the machine (reported).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from verl_oar.core.noise import layout_noise, sequence_seed

SHAPES = {"qwen2_5_math_1_5b": 1536, "qwen2_5_math_7b": 3584}
"""recipe -> hidden size"""
PROMPT, RESPONSE, TAIL = 1024, 3072, 16
PER_STEP = 128


def before(sequences, hidden: int, device: torch.device) -> torch.Tensor:
    """The previous implementation: whole sequences drawn on the CPU, laid out (packed), then copied."""
    rows = []
    for ids in sequences:
        generator = torch.Generator().manual_seed(sequence_seed(ids, 0, 1))
        rows.append(torch.randn(len(ids), hidden, generator=generator))
    return torch.cat(rows)[None].to(device)


def after(sequences, masks, hidden: int, device: torch.device) -> torch.Tensor:
    return layout_noise(sequences, masks, torch.cat(masks)[None], hidden, 0, 1)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device) -> float:
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    seconds = time.perf_counter() - start
    del result
    return seconds


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    length = PROMPT + RESPONSE
    sequences = [torch.randint(0, 150_000, (length,), generator=g).to(device) for _ in range(args.sequences)]
    masks = []
    for _ in sequences:
        mask = torch.zeros(length, dtype=torch.bool, device=device)
        mask[PROMPT : length - TAIL] = True
        masks.append(mask)
    scale = PER_STEP / args.sequences
    rows = {}
    for recipe, hidden in SHAPES.items():
        old, new = [], []
        for _ in range(args.repeats):   # interleaved, so a slow spell of a shared machine slows both
            old.append(timed(lambda: before(sequences, hidden, device), device) * scale)
            new.append(timed(lambda: after(sequences, masks, hidden, device), device) * scale)
        ratios = sorted(n / o for n, o in zip(new, old))
        rows[recipe] = {
            "hidden": hidden,
            "before_s_per_step": statistics.median(old),
            "after_s_per_step": statistics.median(new),
            "ratio_after_over_before": statistics.median(new) / statistics.median(old),
            "ratio_per_repeat_min_max": [ratios[0], ratios[-1]],
            "before_cpu_gb_per_step": PER_STEP * length * hidden * 4 / 1e9,
            "normals_per_step_before": PER_STEP * length * hidden,
            "normals_per_step_after": PER_STEP * (RESPONSE - TAIL) * hidden,
        }
        print(f"{recipe}: before {rows[recipe]['before_s_per_step']:.2f} s/step, after "
              f"{rows[recipe]['after_s_per_step']:.2f} s/step (x{rows[recipe]['ratio_after_over_before']:.2f}, "
              f"per repeat x{ratios[0]:.2f}-{ratios[-1]:.2f}); before drew "
              f"{rows[recipe]['before_cpu_gb_per_step']:.1f} GB of float32 on the CPU per step", flush=True)
    report = {
        "command": "python benchmarks/noise_cost.py " + " ".join(argv or []),
        "device": str(device),
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None},
        "shape": {"prompt": PROMPT, "response": RESPONSE, "reasoning": RESPONSE - TAIL, "sequences_per_step": PER_STEP,
                  "timed_sequences": args.sequences, "repeats": args.repeats},
        "rows": rows,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
