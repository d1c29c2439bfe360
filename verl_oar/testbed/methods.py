"""The methods the testbed compares: one :class:`Method` entry each, in :data:`METHODS`.

Adding a method to the demo, its report and its committed results is one entry here: the demo
trains it (``training_runs``), the summary measures it (``comparison``), the report draws it
(``report``) in its colour, and the credit measures read its dumped token signal (``credit``).
Every method's run differs from GRPO's only in ``algorithm.*`` overrides (a test checks it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from verl_oar.testbed.workspace import Testbed

__all__ = ["BASELINE", "DEFAULT_DEMO", "METHODS", "Method", "method"]


@dataclass(frozen=True)
class Method:
    """One credit-assignment method as the testbed runs it."""

    name: str
    """the method's key in summaries, and its ``algorithm.adv_estimator`` unless ``estimator`` says otherwise"""
    label: str
    """for figures and tables"""
    color: str
    algorithm: Callable[[int, int, Testbed], list[str]]
    """(seed, neutral token id, the run's testbed) -> the run's ``algorithm.*`` overrides beyond the estimator"""
    signal: str | None = None
    """the per-token field of the run's dumps ranked for recall@10% of the oracle (None: no token signal)"""
    dump: Callable[[str], list[str]] | None = None
    """directory -> the overrides that make the run dump its token tensors each step (None: no dumps;
    the method's credit is uniform over a response by construction)"""
    default_demo: bool = True
    """run by the default demo (``bash scripts/demo.sh``, <= 10 minutes on 2 cores); every method runs in
    the long run and with ``--methods``"""
    estimator: str | None = None
    """``algorithm.adv_estimator`` when it is not ``name`` (one estimator, two testbed methods)"""

    @property
    def adv_estimator(self) -> str:
        return self.estimator or self.name


def _oar_dump(directory: str) -> list[str]:
    return [f"+algorithm.oar.dump_dir={directory}"]


def _none(seed: int, neutral_id: int, bed: Testbed) -> list[str]:
    return []


NO_ANSWER_STOP = "+algorithm.oar.no_answer_stop_frac=0.5"
"""the no-answer stop the study's runs were made under (a step above half counts towards it), kept for every
testbed run so that later runs stay comparable with the committed ones (the plugin's default is 0.9)"""


def _oar_g(seed: int, neutral_id: int, bed: Testbed) -> list[str]:
    return [f"+algorithm.oar.seed={seed}", NO_ANSWER_STOP]


def _oar_p(seed: int, neutral_id: int, bed: Testbed) -> list[str]:
    # exact mode: one occluded copy per reasoning token (the paper's definition); a space occludes
    # (in-distribution between filler words, carries no digit; see testbed.quality)
    return [f"+algorithm.oar.seed={seed}", NO_ANSWER_STOP, "+algorithm.oar.perturb_mode=exact",
            f"+algorithm.oar.perturb_token_id={neutral_id}"]


def _oar_g_codapo(seed: int, neutral_id: int, bed: Testbed) -> list[str]:
    return [*_oar_g(seed, neutral_id, bed), "+algorithm.codapo.compose=true"]


def _oppo_teacher(seed: int, neutral_id: int, bed: Testbed) -> list[str]:
    from verl_oar.testbed.teacher import check_teacher

    return ["+algorithm.oppo.oracle=teacher", f"+algorithm.oppo.teacher.path={check_teacher(bed)}"]


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("grpo", "GRPO", "#555555", _none),
        Method("oar_g", "OAR-G", "#1f77b4", _oar_g, signal="oar_importance", dump=_oar_dump),
        Method("oar_p", "OAR-P", "#d62728", _oar_p, signal="oar_importance", dump=_oar_dump),
        # self-teacher / self-oracle; their recipes' defaults (docs/algo/cscr.md, oppo.md). Not in the
        # default demo: five runs of ~2 minutes each do not fit its 10 minutes on 2 cores
        Method("cscr", "CSCR", "#2ca02c", _none, signal="sensitivity", dump=_oar_dump, default_demo=False),
        Method("oppo", "OPPO", "#9467bd", _none, signal="oppo_evidence", dump=_oar_dump, default_demo=False),
        # the teacher: the start taught to read the oracle's hint (testbed.teacher; committed beside the start)
        Method("oppo_teacher", "OPPO-T", "#8c564b", _oppo_teacher, signal="oppo_evidence", dump=_oar_dump,
               default_demo=False, estimator="oppo"),
        # ACPO: the modal surrogate from verl's own pass; CoDaPO: a per-question value (no token signal: its credit
        # is flat over a response) with CoDaSampling, so 24 steps are 12 dataloader batches, each used twice;
        # OAR-G x CoDaPO: OAR-G's token credit times CoDaPO's value, CoDaSampling on (docs/algo/codapo.md)
        Method("acpo", "ACPO", "#e377c2", _none, signal="acpo_surrogate", dump=_oar_dump, default_demo=False),
        Method("codapo", "CoDaPO", "#bcbd22", _none, default_demo=False),
        Method("oar_g_codapo", "OAR-G x CoDaPO", "#17becf", _oar_g_codapo, signal="oar_importance", dump=_oar_dump,
               default_demo=False, estimator="oar_g"),
    )
}
DEFAULT_DEMO = tuple(name for name, m in METHODS.items() if m.default_demo)
"""the default demo's methods"""
BASELINE = "grpo"
"""every comparison is paired against this method's run of the same seed"""


def method(name: str) -> Method:
    """The entry of ``name``; a clear error naming the known methods otherwise."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; the testbed knows {', '.join(METHODS)} (verl_oar/testbed/methods.py)")
    return METHODS[name]
