"""Test helper: verl's real ppo_trainer config, composed with Hydra exactly as main_ppo does."""

from __future__ import annotations

import os


def compose_ppo_config(overrides: list[str] | None = None):
    """verl's ``ppo_trainer`` config with ``overrides`` applied (a DictConfig)."""
    import verl
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=list(overrides or []))


def compose_recipe(name: str, overrides: list[str] | None = None):
    """A recipe of ``recipes/config`` composed as ``main_ppo --config-path recipes/config --config-name name`` does."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from verl_oar.cpu.recipe import RECIPES_DIR

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(RECIPES_DIR / "config"), version_base=None):
        return compose(config_name=name, overrides=list(overrides or []))
