"""pyproject's dependencies are exactly what the package imports: every third-party module that tpzoo/, models/
or kernels/ imports (at the top, inside functions, or by a literal importlib.import_module) is declared, required
in `dependencies` or optional in an extra other than dev, and every declared one is imported."""
import ast
import functools
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
OWN = {"tpzoo", "models", "kernels"}
# Modules that need a distribution of their own though they live inside another one's package, and import names
# whose distribution is named otherwise and may not be installed here (an optional extra).
SUBMODULE_DISTS = {"torch.utils.tensorboard": "tensorboard", "fla": "flash-linear-attention"}


def canonical(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()  # PEP 503


@functools.cache
def _providers() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def candidates(module: str) -> set[str]:
    """Distributions that may provide an import: the import name itself, and the installed distributions that
    provide it (yaml -> PyYAML; triton may come as pytorch-triton)."""
    if module in SUBMODULE_DISTS:
        return {canonical(SUBMODULE_DISTS[module])}
    top = module.split(".")[0]
    return {canonical(d) for d in [top, *_providers().get(top, [])]}


def _literal_import_module(call: ast.Call) -> bool:
    """importlib.import_module("literal"); computed names (dispatch.py's f"{__package__}.{name}") are our own."""
    name = getattr(call.func, "attr", getattr(call.func, "id", None))
    return name == "import_module" and bool(call.args) and isinstance(call.args[0], ast.Constant) \
        and isinstance(call.args[0].value, str)


def imported_modules(path: Path) -> set[str]:
    """Absolute module names imported by one file, wherever the import statement is."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Call) and _literal_import_module(node):
            found.add(node.args[0].value)
    return found


def third_party_imports(roots) -> dict[str, list[str]]:
    """{top-level module (or a SUBMODULE_DISTS key): [files importing it]} over every .py file under `roots`."""
    out: dict[str, set[str]] = {}
    for root in roots:
        for path in Path(root).rglob("*.py"):
            for module in imported_modules(path):
                top = module.split(".")[0]
                if top in OWN or top in sys.stdlib_module_names:
                    continue
                key = module if module in SUBMODULE_DISTS else top
                out.setdefault(key, set()).add(str(path.relative_to(Path(root).parent)))
    return {module: sorted(files) for module, files in out.items()}


def declared() -> tuple[set[str], set[str]]:
    """(required, optional) distribution names from pyproject.toml; dev (test tooling) is neither."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(reqs):
        return {canonical(re.match(r"[A-Za-z0-9._-]+", r).group()) for r in reqs}

    extras = project.get("optional-dependencies", {})
    optional = set().union(*(names(reqs) for extra, reqs in extras.items() if extra != "dev")) - {"tpzoo"}
    return names(project["dependencies"]), optional


def test_imports_match_declared_dependencies():
    required, optional = declared()
    used, undeclared = set(), {}
    for module, files in third_party_imports([ROOT / "tpzoo", ROOT / "models", ROOT / "kernels"]).items():
        hit = candidates(module) & (required | optional)
        if hit:
            used |= hit
        else:
            undeclared[module] = files
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"
    unused = (required | optional) - used
    assert not unused, f"declared in pyproject.toml but never imported by the package: {sorted(unused)}"
    assert not required & optional, f"both required and optional: {sorted(required & optional)}"
    assert "triton" in optional, "Triton must stay optional: the package runs on CPU without it"


def test_scanner_sees_lazy_dynamic_and_submodule_imports(tmp_path):
    pkg = tmp_path / "tpzoo"
    pkg.mkdir()
    (pkg / "a.py").write_text(
        "import os, json\nfrom . import b\nfrom tpzoo import c\n"
        "def f():\n    import yaml\n    from torch.utils.tensorboard import SummaryWriter\n"
        "    import importlib\n    return importlib.import_module('numpy.linalg')\n")
    found = third_party_imports([pkg])
    assert found == {"yaml": ["tpzoo/a.py"], "torch.utils.tensorboard": ["tpzoo/a.py"], "numpy": ["tpzoo/a.py"]}
    assert "pyyaml" in candidates("yaml") and candidates("torch.utils.tensorboard") == {"tensorboard"}
