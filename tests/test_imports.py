"""Every module imports on its own, as the first tpzoo import of a fresh interpreter: no import cycle that only a
lazy import or a lucky import order closes (`python -c "import tpzoo.models.inputs"` must work as well as
`import tpzoo`).

One subprocess does it for all modules: between two imports it drops every tpzoo module from sys.modules (torch and
transformers stay loaded: they are not ours). Importing a module first runs its package's __init__, so a module
that __init__ already imports is that package's import; only the others are imported one by one."""
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"tpzoo": "tpzoo", "models": "tpzoo.models", "kernels": "tpzoo.kernels"}  # pyproject's package-dir
NOT_IMPORTED = {"tpzoo.__main__"}  # runs the command line


def _packages() -> dict[str, list[str]]:
    """{package: its modules} of the three source folders, from the files (nothing imported)."""
    out = {}
    for folder, package in FOLDERS.items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            rel = init.parent.relative_to(ROOT / folder).parts
            name = ".".join((package, *rel))
            out[name] = sorted(f"{name}.{f.stem}" for f in init.parent.glob("*.py")
                               if f.name != "__init__.py" and f"{name}.{f.stem}" not in NOT_IMPORTED)
    return out


def test_every_module_imports_alone():
    packages = _packages()
    assert {"tpzoo.models.inputs", "tpzoo.models.kinds.attention", "tpzoo.plan.costs"} <= {
        m for mods in packages.values() for m in mods}
    code = textwrap.dedent(f"""
        import importlib, sys, traceback
        import torch, transformers  # noqa: F401 (kept loaded: only tpzoo's modules are imported afresh)

        def first(name):
            for key in [k for k in sys.modules if k == "tpzoo" or k.startswith("tpzoo.")]:
                del sys.modules[key]
            try:
                importlib.import_module(name)
            except Exception:
                failed.append(name + ": " + traceback.format_exc().strip().splitlines()[-1])

        failed, imported = [], 0
        for package, modules in {packages!r}.items():
            first(package)
            by_init = set(sys.modules)
            for module in [m for m in modules if m not in by_init]:
                first(module)
                imported += 1
        print(imported)
        assert not failed, "\\n".join(failed)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd="/")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert int(proc.stdout.split()[-1]) > 10  # modules no package imports (commands, ...) were imported alone
