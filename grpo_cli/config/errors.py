"""The one error a config value raises, and the check that raises it."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config value is wrong; the message names the full key and the fix."""


def require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")
