"""``verl-oar heatmap``: token-credit heatmaps, one module per concern.

* ``cli``: the flags and :func:`main` (``verl-oar heatmap``, ``python -m verl_oar.tools.heatmap``), which picks the
  mode;
* ``rollouts``: the rollouts mode (``--model``): each estimator recomputed on given responses with a Hugging Face
  causal LM;
* ``verl_oar/tools/heatmap_dump.py``: the dump mode (``--dump``): the credit a run applied, from its step dump;
* ``inputs``: rollouts files, prompt and response ids, answer masks (:class:`Sample`, :func:`make_sample`);
* ``scoring``: one response's importance and weights per estimator (OAR-G, OAR-P, CSCR, OPPO, ACPO);
* ``settings``: the settings a recompute uses: flags, else the run's config (``heatmap_config``), else training's;
* ``outputs``: the PNG, HTML and JSON files both modes write (drawn by ``heatmap_render``).

The names below are re-exported for callers outside the command (the real-model counterfactual benchmark).
"""

from verl_oar.tools.heatmap.cli import main
from verl_oar.tools.heatmap.inputs import HeatmapInputError, Sample, make_sample

__all__ = ["HeatmapInputError", "Sample", "main", "make_sample"]
