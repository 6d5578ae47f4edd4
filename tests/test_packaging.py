"""A plain (non-editable) wheel must carry every subpackage: models/ and kernels/ install as tpzoo.models and
tpzoo.kernels through package-dir, and a package missing from pyproject's list is silently dropped from a wheel
while an editable install hides the mistake."""
import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _source_packages():
    found = []
    for top, prefix in (("tpzoo", "tpzoo"), ("models", "tpzoo.models"), ("kernels", "tpzoo.kernels")):
        for init in sorted((ROOT / top).rglob("__init__.py")):
            rel = init.parent.relative_to(ROOT / top)
            found.append(".".join([prefix, *rel.parts]) if rel.parts else prefix)
    return found


def test_wheel_contains_and_imports_every_package(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "wheel"), str(ROOT)], check=True, cwd=tmp_path)
    (wheel,) = (tmp_path / "wheel").glob("tpzoo-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = _source_packages()
    missing = [p for p in packages if p.replace(".", "/") + "/__init__.py" not in names]
    assert not missing, f"subpackages missing from the wheel (add them to pyproject's packages): {missing}"
    assert "tpzoo/models/__init__.py" in names and "tpzoo/kernels/__init__.py" in names

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                    str(wheel)], check=True)
    code = "import importlib\nfor p in %r:\n    m = importlib.import_module(p)\n    assert %r in m.__file__, m.__file__\n" % (
        packages, str(target))
    env = {**os.environ, "PYTHONPATH": str(target)}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path, env=env)
