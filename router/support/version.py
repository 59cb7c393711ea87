"""The installed package's version: what `waybill --version` and `GET /healthz` report."""

from __future__ import annotations

from functools import cache
from importlib.metadata import PackageNotFoundError, version

__all__ = ["package_version"]


@cache
def package_version() -> str:
    """The version of the installed `waybill` distribution (pyproject.toml's `version`)."""
    try:
        return version("waybill")
    except PackageNotFoundError:  # imported from a tree nobody installed: say so, not crash
        return "unknown"
