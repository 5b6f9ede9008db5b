"""The config file a subcommand's --config names, or the built-in defaults."""

from __future__ import annotations

from gpuguard.base.validation import ConfigError
from gpuguard.config import Config, load_config
from gpuguard.console.contract import EXIT_USAGE, Failure


def load(path: str | None) -> Config:
    """The config file, or the built-in defaults; a bad file is exit 2 with one line."""
    try:
        return load_config(path)
    except ConfigError as exc:
        raise Failure(EXIT_USAGE, f"config error: {exc}") from None
