"""Build a pick_max variant's warm start: ``python -m verl_oar.testbed.variants NAME [--out DIR] [--force]``;
``--list`` prints every variant's spec facts. One torch thread unless ``--threads`` (the committed builds)."""

from __future__ import annotations

import argparse
import json
import os


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(prog="python -m verl_oar.testbed.variants", description=__doc__.splitlines()[0])
    parser.add_argument("name", nargs="?", help="the variant to build (see --list)")
    parser.add_argument("--out", default=None, help="build here instead of the variant's committed folder")
    parser.add_argument("--force", action="store_true", help="rebuild even if a build of the same spec is there")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the warm start (committed: 1)")
    parser.add_argument("--list", action="store_true", help="print every variant's spec facts and exit")
    args = parser.parse_args(argv)

    from verl_oar.testbed.variants import VARIANTS, build_variant, describe, variant

    if args.list or args.name is None:
        for v in VARIANTS.values():
            print(json.dumps(describe(v)))
        return None
    try:
        v = variant(args.name)
    except ValueError as error:
        parser.error(str(error))
    if args.out is None and v.name == "fill2":
        parser.error(f"fill2 is the committed start; rebuild it with {v.build_command}, or pass --out DIR")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # read by cpu.workspace.all_cpu_threads during the build
    bed = build_variant(v.name, args.out, force=args.force)
    print(json.dumps(bed.manifest, indent=2))
    return bed.manifest


if __name__ == "__main__":
    main()
