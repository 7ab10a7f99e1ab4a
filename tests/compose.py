"""Compose the app's Hydra config in-process (as notebooks and scripts do)."""

from pathlib import Path

from hydra import compose, initialize_config_dir

CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "configs")


def compose_config(*overrides: str):
    with initialize_config_dir(CONFIG_DIR, version_base="1.3"):
        return compose("config", overrides=list(overrides))
