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
