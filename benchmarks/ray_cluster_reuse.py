"""What joining one running Ray cluster saves a CPU-mode trainer launch (issue 12: the e2e tests share
one cluster per test session instead of each run starting its own).

Each repeat times, back to back in alternating order, the same 2-step GRPO launch
(``python -m verl_oar.cpu.launch``, the e2e tests' launcher) starting its own Ray cluster and joining a
cluster that is already up (``$VERL_OAR_RAY_ADDRESS``; the cluster is the one verl_oar/cpu/ray_cluster.py
holds for a test session, started once before the first repeat and not timed). Wall-clock per launch,
medians and the per-repeat differences with their range. Needs the CPU workspace
(``python -m verl_oar.cpu.workspace``, or the tests' ``.pytest_cache/d/verl_oar_cpu_workspace``).

    python benchmarks/ray_cluster_reuse.py --workdir DIR --repeats 3 [--out benchmarks/results_ray_cluster_reuse_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from verl_oar.cpu.overrides import RAY_ADDRESS_ENV
from verl_oar.cpu.ray_cluster import SharedRayCluster  # the demo's and the test session's cluster holder


def launch(workdir: str, name: str, env: dict) -> float:
    cmd = [sys.executable, "-m", "verl_oar.cpu.launch", "--workdir", workdir, "--steps", "2",
           "--adv-estimator", "grpo", "--experiment-name", name, "--timeout", "400"]
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - t
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}")
    return seconds


def cpu_model() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    own_env = {k: v for k, v in os.environ.items() if k != RAY_ADDRESS_ENV}
    cluster = SharedRayCluster(Path(tempfile.mkdtemp()) / "holder.log")
    try:
        shared_env = {**own_env, **cluster.env}
        times: dict = {"own_cluster": [], "shared_cluster": []}
        for rep in range(args.repeats):
            order = ("own_cluster", "shared_cluster") if rep % 2 == 0 else ("shared_cluster", "own_cluster")
            for case in order:
                env = own_env if case == "own_cluster" else shared_env
                times[case].append(launch(args.workdir, f"bench_ray_{case}_{rep}", env))
                if case == "shared_cluster":
                    left = cluster.wait_for_no_leftovers()
                    assert not left, left
                print(f"repeat {rep} {case}: {times[case][-1]:.1f} s", flush=True)
    finally:
        cluster.stop()
    diffs = [o - s for o, s in zip(times["own_cluster"], times["shared_cluster"], strict=True)]
    result = {
        "command": "python benchmarks/ray_cluster_reuse.py " + " ".join(sys.argv[1:]),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version()},
        "repeats": args.repeats, "seconds": times,
        "median_own_s": statistics.median(times["own_cluster"]),
        "median_shared_s": statistics.median(times["shared_cluster"]),
        "median_saving_s": statistics.median(diffs), "saving_range_s": [min(diffs), max(diffs)],
    }
    print(f"2-step GRPO launch: own cluster {result['median_own_s']:.1f} s, shared {result['median_shared_s']:.1f} s, "
          f"saving {result['median_saving_s']:.1f} s per launch (per repeat {min(diffs):.1f} .. {max(diffs):.1f})")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
