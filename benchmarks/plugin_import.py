"""What the verl-oar plugin adds to ``import verl`` (issue 12: < 0.5 s), and to importing verl's trainer.

Each repeat runs four fresh interpreters back to back, in alternating order: ``import verl`` with
verl's plugin discovery off (``VERL_USE_EXTERNAL_PLUGINS=none``) and on (the default, which loads
verl-oar), then the same for ``import verl.trainer.ppo.v1`` (what ``main_ppo`` imports; there the
plugin's post-import hooks load its glue: estimators and trainer dispatchers). Each interpreter
times its own import with ``time.perf_counter`` (interpreter start-up excluded). Reports the
median per case and the median of the per-repeat differences (plugin on - off), with their range.
Whole-import times vary by about a second between interpreters here, far more than the plugin
costs, so each repeat also times the plugin directly: with discovery off, import verl (or its
trainer) first, then time ``import verl_oar.integration.plugin`` in the same interpreter; for the
trainer case its post-import hooks then run at once, so that figure includes the glue they load.

    python benchmarks/plugin_import.py --repeats 9 [--out benchmarks/results_plugin_import_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

CASES = {"verl": "import verl", "trainer": "import verl.trainer.ppo.v1, verl.trainer.ppo.core_algos"}
SNIPPET = "import time; t = time.perf_counter(); {stmt}; print(time.perf_counter() - t)"
DIRECT = "{stmt}; import time; t = time.perf_counter(); import verl_oar.integration.plugin; print(time.perf_counter() - t)"


def timed(stmt: str, plugins: str, snippet: str = SNIPPET) -> float:
    env = {**os.environ, "VERL_USE_EXTERNAL_PLUGINS": plugins, "PYTHONWARNINGS": "ignore"}
    env.pop("VERL_PLATFORM", None)  # CPU mode registers a platform at load: not what a GPU user pays
    out = subprocess.run([sys.executable, "-c", snippet.format(stmt=stmt)], env=env, capture_output=True,
                         text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    times: dict = {f"{case}/{p}": [] for case in CASES for p in ("none", "auto", "direct")}
    for rep in range(args.repeats):
        for case, stmt in CASES.items():
            order = ("none", "auto") if rep % 2 == 0 else ("auto", "none")
            for plugins in order:
                times[f"{case}/{plugins}"].append(timed(stmt, plugins))
            times[f"{case}/direct"].append(timed(stmt, "none", DIRECT))
    result = {"machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version()},
              "repeats": args.repeats, "seconds": times, "summary": {}}
    for case in CASES:
        diffs = [a - n for a, n in zip(times[f"{case}/auto"], times[f"{case}/none"], strict=True)]
        result["summary"][case] = {
            "median_without_plugin_s": statistics.median(times[f"{case}/none"]),
            "median_with_plugin_s": statistics.median(times[f"{case}/auto"]),
            "median_added_s": statistics.median(diffs), "added_range_s": [min(diffs), max(diffs)],
            "median_plugin_direct_s": statistics.median(times[f"{case}/direct"]),
            "plugin_direct_range_s": [min(times[f"{case}/direct"]), max(times[f"{case}/direct"])],
        }
        s = result["summary"][case]
        print(f"{CASES[case]:60s} without {s['median_without_plugin_s']:.3f} s  with {s['median_with_plugin_s']:.3f} s  "
              f"added {s['median_added_s']:+.3f} s (per repeat {min(diffs):+.3f} .. {max(diffs):+.3f}); "
              f"plugin alone {s['median_plugin_direct_s']:.3f} s ({s['plugin_direct_range_s'][0]:.3f} .. "
              f"{s['plugin_direct_range_s'][1]:.3f})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
