"""The estimator settings a recompute uses, and where each came from: a flag given, else the run's config
(``--config``, read by ``run_config``; keys the run left unset at training's defaults, as the run had them), else
training's defaults (:data:`TOOL_DEFAULTS`).

The ``algorithm.oar`` keys with a flag are :data:`FLAG_FIELDS`; the reshaping and OAR-G's objective
(:data:`OAR_SCORING_KEYS`), ``algorithm.cscr`` / ``oppo`` / ``acpo`` and the rollout temperature come from the run's
config alone. :func:`resolve_settings` builds each section's typed config through the same classes training parses
``algorithm.<section>`` with (``core.method_configs``), so a bad key is refused as training refuses it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from verl_oar.core.config import OARConfig
from verl_oar.tools.heatmap.inputs import HeatmapInputError
from verl_oar.tools.heatmap.run_config import RunConfig, section_config, setting_sources

__all__ = ["FLAG_FIELDS", "MAX_TOKENS", "OAR_SCORING_KEYS", "TOOL_DEFAULTS", "Settings", "flag_name", "print_settings",
           "resolve_settings"]

MAX_TOKENS = 8192
"""tokens per OAR-P model call when neither the flag nor the run's config sets it (the run's 0 = verl's budget)"""
_TRAINING = OARConfig()
TOOL_DEFAULTS = {"oar_p_mode": _TRAINING.perturb_mode, "oar_p_budget": _TRAINING.perturb_budget,
                 "oar_p_refine_top": _TRAINING.perturb_refine_top, "oar_p_refine_unit": _TRAINING.perturb_refine_unit,
                 "oar_p_max_tokens": MAX_TOKENS, "neutral": "pad", "seed": _TRAINING.seed,
                 "answer_locator": _TRAINING.answer_locator}
"""the settings without --config: training's defaults (``OARConfig()``: OAR-P chunk mode, K=16), so that a heatmap
shows the credit a run with default settings used; ``--oar-p-mode exact`` gives the paper's every-token definition.
OAR-P's tokens per call: the tool's :data:`MAX_TOKENS` (training's 0 means verl's log-prob budget, unknown here)"""
FLAG_FIELDS = {"oar_p_mode": "perturb_mode", "oar_p_budget": "perturb_budget", "oar_p_refine_top": "perturb_refine_top",
               "oar_p_refine_unit": "perturb_refine_unit", "oar_p_max_tokens": "perturb_max_tokens",
               "neutral": "perturb_token_id", "seed": "seed", "answer_locator": "answer_locator"}
"""flag (argparse dest) -> the ``algorithm.oar`` key it overrides"""
OAR_SCORING_KEYS = ("tau", "beta", "floor", "amplify", "suppress", "preserve_mass", "outcome", "objective", "saliency",
                    "noise_std", "noise_relative")
"""``algorithm.oar`` keys the recompute reads besides the flags' (reshaping, OAR-G's objective)"""


@dataclass
class Settings:
    """The estimator settings a recompute uses, and where each came from."""

    oar: OARConfig
    cscr: Any
    oppo: Any
    acpo: Any
    temperature: float
    neutral: str
    """pad, space or a token id (OAR-P's occlusion token)"""
    max_tokens: int
    seed: int
    answer_locator: str
    sources: dict[str, dict] = field(default_factory=dict)
    """setting -> {"value", "source"}: the flag, the --config file, or the default (tool's or training's)"""


def flag_name(dest: str) -> str:
    """The command-line flag of an argparse dest: ``oar_p_budget`` -> ``--oar-p-budget``."""
    return "--" + dest.replace("_", "-")


def _labelled(run: RunConfig | None, section: str) -> dict[str, tuple[Any, str]]:
    """``setting_sources`` with a default named for whose it is: training's (the run left the key unset) or,
    without --config, the tool's (the core config class's default)."""
    who = "training" if run is not None else "tool"
    return {key: (value, f"{who} {source}" if source.startswith("default") else source)
            for key, (value, source) in setting_sources(run, section).items()}


def resolve_settings(args, run: RunConfig | None, estimators: Sequence[str]) -> Settings:
    """Explicit flags win; then the run's config (keys it does not set: training's defaults, as the run had
    them); without --config training's defaults (:data:`TOOL_DEFAULTS`). ``args``: the parsed flags (each
    :data:`FLAG_FIELDS` dest and ``temperature``, None when not given)."""
    oar_sources = _labelled(run, "oar")
    chosen, sources = {}, {}
    for dest, key in FLAG_FIELDS.items():
        given = getattr(args, dest)
        if given is not None:
            value, source = given, flag_name(dest)
        elif run is not None:
            value, source = oar_sources[key]
            if dest == "neutral":
                value = "pad" if value == -1 else str(value)
            elif dest == "oar_p_max_tokens" and value == 0:
                value, source = MAX_TOKENS, f"{source}: 0 = verl's log-prob budget, unknown here; the tool's {MAX_TOKENS}"
        else:
            value, source = TOOL_DEFAULTS[dest], "training default (no --config)"
        chosen[dest] = value
        sources[f"algorithm.oar.{key}" if dest != "neutral" else "neutral (algorithm.oar.perturb_token_id)"] = \
            {"value": value, "source": source}
    neutral = str(chosen.pop("neutral"))
    replaced = {FLAG_FIELDS[d]: v for d, v in chosen.items()}
    if neutral.isdigit():
        replaced["perturb_token_id"] = int(neutral)
    try:
        oar = replace(section_config(run, "oar"), **replaced)
    except ValueError as err:
        raise HeatmapInputError(str(err)) from None
    if set(estimators) & {"oar_g", "oar_p"}:
        for key, (value, source) in oar_sources.items():
            name = f"algorithm.oar.{key}"
            if name not in sources and key in OAR_SCORING_KEYS:
                sources[name] = {"value": value, "source": source}
    for section in ("cscr", "oppo", "acpo"):
        if section in estimators:
            for key, (value, source) in _labelled(run, section).items():
                if key not in ("teacher", "overflow"):
                    sources[f"algorithm.{section}.{key}"] = {"value": value, "source": source}
    if args.temperature is not None:
        temperature, source = args.temperature, "--temperature"
    elif run is not None and run.temperature is not None:
        temperature, source = run.temperature, run.origin.get("actor_rollout_ref.rollout.temperature", "--config")
    else:
        temperature, source = 1.0, "tool default (verl's rollout default)"
    sources["actor_rollout_ref.rollout.temperature"] = {"value": temperature, "source": source}
    return Settings(oar=oar, cscr=section_config(run, "cscr"), oppo=section_config(run, "oppo"),
                    acpo=section_config(run, "acpo"), temperature=temperature, neutral=neutral,
                    max_tokens=int(oar.perturb_max_tokens) or MAX_TOKENS, seed=int(oar.seed),
                    answer_locator=oar.answer_locator, sources=sources)


def print_settings(sources: dict[str, dict]) -> None:
    """Each setting used, its value and where it came from, on stderr (stdout lists the files written)."""
    for name, entry in sources.items():
        print(f"verl_oar.tools.heatmap: {name} = {entry['value']!r} ({entry['source']})", file=sys.stderr)
