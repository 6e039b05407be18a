"""Modules that were renamed, importable under their old names for one release.

``dartcore.build`` (and its submodules) is now :mod:`dartcore.ngram_build`,
``dartcore.builders`` is :mod:`dartcore.trees` and ``dartcore.verify`` is
:mod:`dartcore.acceptance`. Importing an old name emits a DeprecationWarning and
gives a thin module that re-exports the new one's names (attribute reads fall
through to it). The old names are served by an import hook rather than stub files
so that no file keeps the old path.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

__all__ = ["RENAMED", "install"]

# old module -> new module; a submodule of an old package maps to the same submodule of the new one
RENAMED = {
    "dartcore.build": "dartcore.ngram_build",
    "dartcore.builders": "dartcore.trees",
    "dartcore.verify": "dartcore.acceptance",
}


def new_name(fullname: str) -> str | None:
    """The module ``fullname`` was renamed to, or None."""
    for old, new in RENAMED.items():
        if fullname == old or fullname.startswith(old + "."):
            return new + fullname[len(old) :]
    return None


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        new = new_name(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, self, is_package=fullname in RENAMED)

    def create_module(self, spec):
        return types.ModuleType(spec.name)

    def exec_module(self, module):
        new = new_name(module.__name__)
        warnings.warn(
            f"{module.__name__} is now {new}: import it from there (the old name goes in the next "
            "release)",
            DeprecationWarning,
            stacklevel=2,
        )
        real = importlib.import_module(new)
        names = getattr(real, "__all__", None) or [n for n in vars(real) if not n.startswith("_")]
        for name in names:
            setattr(module, name, getattr(real, name))
        module.__all__ = list(names)
        module.__getattr__ = lambda name: getattr(real, name)
        if module.__spec__.submodule_search_locations is not None:
            module.__path__ = []


def install() -> None:
    """Serve the old names (idempotent)."""
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())
