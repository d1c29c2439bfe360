"""``verl-oar heatmap``: token-credit heatmaps, one module per concern.

* ``cli``: the flags and :func:`main` (``verl-oar heatmap``, ``python -m verl_oar.tools.heatmap``), which picks the
  mode;
* ``dump``: the dump mode (``--dump``): the credit a run applied, read from its step dump, no model;
* ``rollouts``: the rollouts mode (``--model``): each estimator recomputed on given responses with a Hugging Face
  causal LM;
* ``inputs``: rollouts files, prompt and response ids, answer masks (:class:`Sample`, :func:`make_sample`);
* ``scoring``: one response's importance and weights per estimator: OAR-G and OAR-P here, CSCR and OPPO in
  ``privileged``, ACPO in ``modal``;
* ``run_config``: the run's config as its files hold it (``--config``); ``settings``: the settings a recompute
  uses: flags, else the run's config, else training's defaults;
* ``outputs``: the PNG, HTML and JSON files both modes write, drawn by ``verl_oar.tools.heatmap_render`` (outside
  this package: the testbed's report and ``verl-oar compare`` draw with it too, without torch).

The names below are re-exported for callers outside the command (the real-model counterfactual benchmark).
"""

from verl_oar.tools.heatmap.cli import main
from verl_oar.tools.heatmap.inputs import HeatmapInputError, Sample, make_sample

__all__ = ["HeatmapInputError", "Sample", "main", "make_sample"]
