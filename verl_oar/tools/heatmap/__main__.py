"""``python -m verl_oar.tools.heatmap``: the same command as ``verl-oar heatmap`` (``cli.main``)."""

import sys

from verl_oar.tools.heatmap.cli import main

main(sys.argv[1:])
