"""One table of verl-oar's estimators and the ``algorithm.<node>`` each reads, for every reader of the settings (the
preflight, the heatmap's run config, the resolved-settings report): a new method adds its row here once.

The config classes are imported when asked for (``config_class``): the table itself imports nothing.
"""

from __future__ import annotations

import importlib

__all__ = ["ESTIMATOR_NODES", "NODES", "config_class"]

NODES = {
    "oar": ("verl_oar.core.config", "OARConfig"),
    "cscr": ("verl_oar.core.cscr", "CSCRConfig"),
    "oppo": ("verl_oar.core.oppo", "OPPOConfig"),
    "acpo": ("verl_oar.core.acpo", "ACPOConfig"),
    "codapo": ("verl_oar.core.codapo", "CoDaPOConfig"),
}
"""``algorithm.<node>`` -> (module, class) of its typed config (each a ``core.config.NodeConfig``)"""
ESTIMATOR_NODES = {"oar_g": "oar", "oar_p": "oar", "cscr": "cscr", "oppo": "oppo", "acpo": "acpo", "codapo": "codapo"}
"""``algorithm.adv_estimator`` -> the node its settings live under"""


def config_class(node: str) -> type:
    """The typed config class of ``algorithm.<node>``; KeyError naming the nodes for any other."""
    if node not in NODES:
        raise KeyError(f"no verl-oar settings node algorithm.{node}; the nodes are {', '.join(NODES)}")
    module, name = NODES[node]
    return getattr(importlib.import_module(module), name)
