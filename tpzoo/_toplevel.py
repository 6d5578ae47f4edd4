"""One copy of tpzoo.models and tpzoo.kernels, whatever name they are imported by.

models/ and kernels/ install as tpzoo.models and tpzoo.kernels (pyproject's package-dir), but Python started in
the checkout root has that root on sys.path and finds them as top-level `models` and `kernels` as well. Executed
again under those names they would be a second copy of every class and registry (a ModelConfig that is not
tpzoo.models.ModelConfig), and our `kernels` folder would stand in for Hugging Face's `kernels` package, which
transformers imports when the `kernels` distribution is installed.

So each of their __init__ files first calls `redirect(__name__)` when run under the top-level name. A package of
that name installed elsewhere on sys.path is loaded in its place (the folder no longer shadows it); otherwise the
name becomes the tpzoo module itself, and every `models.x` the tpzoo module `tpzoo.models.x`. Python's import
system returns whatever sys.modules holds for the name once its __init__ has run, so `import models` then yields
tpzoo.models.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of `name.x` resolve to the module object `target.x` (imported under its own name if need be)."""

    def __init__(self, name: str, target: str):
        self.name, self.target = name, target

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(self.name + ".") and sys.modules.get(self.name) is sys.modules.get(self.target):
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        module = importlib.import_module(self.target + spec.name[len(self.name):])
        spec.loader_state = module.__spec__  # module_from_spec is about to overwrite it with `spec`
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state  # already executed under its own name: restore its spec


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)  # through symlinks and differently spelled paths
    except OSError:  # inside a zip, say: not our file
        return False


def _installed_elsewhere(name: str, here: str):
    """The spec of the first regular package or module `name` on sys.path other than the file `here`, or None."""
    for entry in sys.path:
        spec = importlib.machinery.PathFinder.find_spec(name, [entry])
        # has_location: not a namespace portion (a regular package anywhere on the path beats those).
        if spec is not None and spec.has_location and not _same_file(spec.origin, here):
            return spec
    return None


def redirect(name: str) -> None:
    """Replace sys.modules[name] (the top-level `models` or `kernels` whose __init__ is running) as above."""
    other = _installed_elsewhere(name, sys.modules[name].__file__)
    if other is not None:
        module = importlib.util.module_from_spec(other)
        sys.modules[name] = module
        other.loader.exec_module(module)
        return
    sys.modules[name] = importlib.import_module(f"tpzoo.{name}")
    if not any(isinstance(f, _Alias) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _Alias(name, f"tpzoo.{name}"))
