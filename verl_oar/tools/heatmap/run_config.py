"""The run's estimator settings for the heatmap (``--config``): read verl's config as a run has it, so that a
checkpoint is scored with the settings it was trained with instead of the tool's defaults.

Accepted files, given once or several times (later files win, key by key):

* a composed config (``.yaml`` / ``.json`` with a top-level ``algorithm``): Hydra's ``<run dir>/.hydra/config.yaml``,
  or the config a run logged (e.g. W&B's ``config.yaml`` with its ``{"value": ...}`` wrappers unwrapped);
* a recipe yaml with a Hydra ``defaults`` list (``recipes/config/qwen2_5_math_1_5b_oar_p.yaml``): composed by
  Hydra from its own directory with verl's config search path, as the launch script does;
* Hydra overrides: ``.hydra/overrides.yaml`` (a yaml list), or a text file with one override per line
  (``+algorithm.oar.tau=0.3``, ``algorithm.adv_estimator=oar_p``, ``~key``; ``#`` comments). Each value is read
  as YAML (numbers, booleans, null, lists); Hydra's sweep and interpolation grammar is not supported.

What is taken: ``algorithm.adv_estimator``; ``algorithm.oar`` / ``cscr`` / ``oppo`` / ``acpo`` / ``codapo`` (each
parsed by its core config class, so an unknown key is refused as training refuses it);
``actor_rollout_ref.rollout.temperature``; ``actor_rollout_ref.model.path``. :func:`setting_sources` says where
each setting came from; ``settings.resolve_settings`` lays the flags over them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from verl_oar.core.method_configs import NODES

__all__ = ["RunConfig", "RunConfigError", "read_run_config", "setting_sources"]

SECTIONS = tuple(NODES)
"""the ``algorithm.<section>`` nodes of verl-oar's estimators"""
TEMPERATURE = "actor_rollout_ref.rollout.temperature"
MODEL_PATH = "actor_rollout_ref.model.path"
ESTIMATOR = "algorithm.adv_estimator"


class RunConfigError(ValueError):
    """A run config that cannot be read; the message names the file, the problem and the fix."""


@dataclass
class RunConfig:
    """The keys the heatmap reads from a run's config, and which file set each (dotted key -> file)."""

    algorithm: dict[str, Any] = field(default_factory=dict)
    """``algorithm`` as a plain dict (only the keys the files set)"""
    temperature: float | None = None
    model_path: str | None = None
    origin: dict[str, str] = field(default_factory=dict)
    """dotted key (``algorithm.oar.tau``) -> the file that set it last"""
    files: list[str] = field(default_factory=list)

    @property
    def adv_estimator(self) -> str | None:
        value = self.algorithm.get("adv_estimator")
        return None if value is None else str(value)


def _unwrap(node: Any) -> Any:
    """A logged config's ``{"value": x, "desc": ...}`` wrappers (W&B) removed."""
    if isinstance(node, dict):
        if set(node) <= {"value", "desc"} and "value" in node:
            return _unwrap(node["value"])
        return {k: _unwrap(v) for k, v in node.items()}
    return node


def _compose_recipe(path: Path) -> dict:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(path.parent.resolve()), version_base=None):
            config = compose(config_name=path.stem)
    except Exception as err:  # Hydra raises several kinds; the message is what matters
        raise RunConfigError(f"--config {path}: Hydra cannot compose this recipe ({type(err).__name__}: {err}); give "
                             "the composed config instead (<run dir>/.hydra/config.yaml)") from None
    try:
        return OmegaConf.to_container(config, resolve=True)
    except Exception:  # an interpolation that needs the run's environment: keep those keys as written
        return OmegaConf.to_container(config, resolve=False)


def _overrides(path: Path, items: list) -> list[tuple[str, Any, bool]]:
    """(dotted key, value, delete) of each override line."""
    import yaml

    out = []
    for number, line in enumerate(items, 1):
        text = str(line).strip()
        if not text or text.startswith("#"):
            continue
        if text.startswith("~"):
            out.append((text[1:].split("=", 1)[0], None, True))
            continue
        key, sep, value = text.lstrip("+").partition("=")
        if not sep or not key:
            raise RunConfigError(f"--config {path}: line {number} {text!r} is not a Hydra override KEY=VALUE; give "
                                 "one override per line (e.g. +algorithm.oar.tau=0.3)")
        try:
            parsed = yaml.safe_load(value) if value.strip() else ""
        except yaml.YAMLError:
            parsed = value
        out.append((key.strip(), parsed, False))
    return out


def _read(path: Path) -> tuple[dict | None, list[tuple[str, Any, bool]]]:
    """(a config dict, or None; overrides) of one file."""
    if not path.is_file():
        raise RunConfigError(f"--config {path}: no such file. Give the run's composed config (.hydra/config.yaml), "
                             "a recipe yaml or a file of Hydra overrides.")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        try:
            loaded = json.loads(text)
        except json.JSONDecodeError as err:
            raise RunConfigError(f"--config {path}: not JSON ({err.msg} at line {err.lineno})") from None
    elif path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise RunConfigError(f"--config {path}: not YAML ({str(err).splitlines()[0]})") from None
    else:
        return None, _overrides(path, text.splitlines())
    if isinstance(loaded, list):
        return None, _overrides(path, loaded)
    if not isinstance(loaded, dict):
        raise RunConfigError(f"--config {path}: holds a {type(loaded).__name__}; expected a config mapping or a list "
                             "of Hydra overrides")
    if "defaults" in loaded:
        return _compose_recipe(path), []
    return _unwrap(loaded), []


def _flatten(node: Any, prefix: str) -> dict[str, Any]:
    if isinstance(node, dict) and node:
        out = {}
        for key, value in node.items():
            out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: node}


def _set(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = tree.get(part)
        if not isinstance(node, dict):
            node = tree[part] = {}
        tree = node
    tree[parts[-1]] = value


def _delete(tree: dict, dotted: str) -> None:
    parts = dotted.split(".")
    for part in parts[:-1]:
        tree = tree.get(part) if isinstance(tree.get(part), dict) else {}
    tree.pop(parts[-1], None)


def _wanted(key: str) -> bool:
    return key == ESTIMATOR or key in (TEMPERATURE, MODEL_PATH) or any(
        key == f"algorithm.{s}" or key.startswith(f"algorithm.{s}.") for s in SECTIONS)


def read_run_config(paths: Sequence[str | Path]) -> RunConfig:
    """The settings of ``paths`` applied in order (module docstring); each section is checked by its core config
    class (:class:`RunConfigError` names an unknown key or a bad value)."""
    tree: dict[str, Any] = {}
    run = RunConfig()
    for raw in paths:
        path = Path(raw)
        config, overrides = _read(path)
        run.files.append(str(path))
        if config is not None:
            for key, value in _flatten(config, "").items():
                if _wanted(key):
                    _set(tree, key, value)
                    run.origin[key] = str(path)
        for key, value, delete in overrides:
            if not _wanted(key):
                continue
            if delete:
                _delete(tree, key)
                run.origin.pop(key, None)
                continue
            for sub, leaf in _flatten(value, key).items():
                _set(tree, sub, leaf)
                run.origin[sub] = str(path)
    run.algorithm = dict(tree.get("algorithm", {}))
    rollout = tree.get("actor_rollout_ref", {})
    temperature = rollout.get("rollout", {}).get("temperature")
    run.model_path = rollout.get("model", {}).get("path")
    if temperature is not None:
        try:
            run.temperature = float(temperature)
        except (TypeError, ValueError):
            raise RunConfigError(f"--config: {TEMPERATURE}={temperature!r} is not a number "
                                 f"(set in {run.origin.get(TEMPERATURE)})") from None
    for section in SECTIONS:
        try:
            _config_class(section).from_algorithm(run.algorithm)
        except (ValueError, TypeError) as err:
            origin = sorted({f for k, f in run.origin.items() if k.startswith(f"algorithm.{section}")})
            raise RunConfigError(f"--config {', '.join(origin) or run.files}: algorithm.{section}: {err}") from None
    return run


def _config_class(section: str):
    from verl_oar.core.method_configs import config_class

    return config_class(section)


def section_config(run: RunConfig | None, section: str):
    """The typed config of ``algorithm.<section>`` (its class's defaults for keys the run did not set)."""
    return _config_class(section).from_algorithm(run.algorithm if run is not None else {})


def setting_sources(run: RunConfig | None, section: str) -> dict[str, tuple[Any, str]]:
    """key -> (value, source) of every field of ``algorithm.<section>``: the file that set it, or the default."""
    cls = _config_class(section)
    cfg = section_config(run, section)
    out = {}
    for f in fields(cls):
        key = f"algorithm.{section}.{f.name}"
        origin = run.origin if run is not None else {}
        nested = [file for k, file in origin.items() if k.startswith(key + ".")]  # a mapping (oppo.teacher)
        source = origin.get(key) or (nested[-1] if nested else None) or f"default ({cls.__name__})"
        out[f.name] = (getattr(cfg, f.name), source)
    return out
