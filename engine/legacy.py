"""The import names of the release before ``kvblend.*``, kept for one release: ``dataplane.client``,
``engine.vllm_connector`` (a vLLM ``kv_connector_module_path``) and every other module under the
old top-level ``dataplane`` and ``engine`` resolve to the same module under ``kvblend.``, with a
``DeprecationWarning`` naming the new one. Nothing is installed under the old names: an import
hook, first on ``sys.meta_path``, hands out the new modules.

Who installs the hook: the ``kvblend-legacy.pth`` file of a wheel install (at every interpreter
start; setup.py puts it beside the package), and the vLLM plugin (``engine.vllm_plugin``), so a
vLLM config naming ``engine.vllm_connector`` loads in any install. This module imports nothing
but the standard library until an old name is asked for.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

OLD_ROOTS = ("dataplane", "engine")  # the old top-level packages with public modules
REMOVAL = "the next release"


def new_name(old: str) -> str | None:
    """The module ``old`` names now, or None when it is not an old name."""
    root = old.split(".", 1)[0]
    return f"kvblend.{old}" if root in OLD_ROOTS else None


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f"import {spec.name!r} is deprecated: use {self.new!r} (the old name goes "
                      f"in {REMOVAL})", DeprecationWarning, stacklevel=2)
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        pass  # the new module ran when it was imported


class LegacyNames(importlib.abc.MetaPathFinder):
    """Finds the old names only (``new_name``); every other import passes it by."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None
                  ) -> importlib.machinery.ModuleSpec | None:
        new = new_name(fullname)
        if new is None:
            return None
        try:
            found = importlib.util.find_spec(new)
        except ModuleNotFoundError:
            found = None
        if found is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(new),
                                              is_package=found.submodule_search_locations
                                              is not None)


def install() -> None:
    """Put the hook first on ``sys.meta_path`` (once): the old names must not find the folders
    of a source checkout, whose modules would then run twice under two names."""
    if not any(isinstance(f, LegacyNames) for f in sys.meta_path):
        sys.meta_path.insert(0, LegacyNames())


__all__ = ["LegacyNames", "install", "new_name"]
