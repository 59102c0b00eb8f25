"""kvblend's version: the installed distribution's (``pyproject.toml`` is its one source)."""

from __future__ import annotations

from functools import cache
from importlib.metadata import PackageNotFoundError, version


@cache
def kvblend_version() -> str:
    """The installed package's version ("0+unknown" in a source tree that was never installed)."""
    try:
        return version("kvblend")
    except PackageNotFoundError:
        return "0+unknown"


__all__ = ["kvblend_version"]
