"""models/ and kernels/ install as tpzoo.models and tpzoo.kernels through package-dir. A plain (non-editable) wheel
must carry every subpackage: one missing from pyproject's list is silently dropped from a wheel while an editable
install hides the mistake. And Python started in the checkout root, where the folders are also top-level `models`
and `kernels`, must see one copy of each (tpzoo/_toplevel.py), and transformers must not take kernels/ for Hugging
Face's `kernels` package."""
import os
import subprocess
import sys
import textwrap
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


def _run_in_root(*code: str, **env) -> None:
    """`python -c CODE` in the checkout root, so its folders are importable as top-level packages."""
    code = "\n".join(textwrap.dedent(c) for c in code)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# Every models.* / kernels.* in sys.modules is the tpzoo module of that name: no second copy of any class.
NO_COPIES = """
    copies = [k for k in sys.modules if k.split(".")[0] in ("models", "kernels")
              and sys.modules[k] is not sys.modules.get("tpzoo." + k)]
    assert not copies, copies
"""


def test_toplevel_models_and_kernels_are_the_tpzoo_modules():
    _run_in_root("""
        import sys
        import models.zoo                      # a submodule first: its parent runs first
        import kernels
        import tpzoo.models, tpzoo.kernels
        assert models is tpzoo.models and kernels is tpzoo.kernels
        assert models.__name__ == "tpzoo.models" and models.zoo.__spec__.name == "tpzoo.models.zoo"
        from models import ModelConfig
        import models.config, models.families.gpt2, kernels.dispatch
        from kernels.reference import rms_norm
        assert ModelConfig is tpzoo.models.ModelConfig is models.config.ModelConfig
        assert kernels.dispatch is tpzoo.kernels.dispatch and rms_norm is tpzoo.kernels.reference.rms_norm
        assert models.get_config("gpt2") == tpzoo.models.get_config("gpt2")
    """, NO_COPIES)
    _run_in_root("""
        import sys
        import tpzoo.models, tpzoo.kernels    # the other order
        import models, kernels.ops
        assert models is tpzoo.models and kernels.ops is tpzoo.kernels.ops
    """, NO_COPIES)


def test_transformers_does_not_take_kernels_folder_for_hf_kernels(tmp_path):
    model_dir = tmp_path / "tiny-llama"
    _run_in_root(f"""
        import sys, torch, transformers
        from transformers.utils import is_kernels_available
        assert not is_kernels_available()
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2)
        LlamaForCausalLM(cfg).save_pretrained({str(model_dir)!r})
        model = LlamaForCausalLM.from_pretrained({str(model_dir)!r})
        assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 64)
        assert sys.modules.get("kernels") in (None, sys.modules.get("tpzoo.kernels"))
    """, NO_COPIES)


def test_installed_kernels_package_wins_over_the_folder(tmp_path):
    """With Hugging Face's `kernels` installed, `import kernels` in the checkout root gets it, not our folder
    (a stand-in here: a package and its dist-info on PYTHONPATH)."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text(
        "__version__ = '0.18.5'\ndef get_kernel(repo):\n    return repo\n")
    (tmp_path / "kernels-0.18.5.dist-info").mkdir()
    (tmp_path / "kernels-0.18.5.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: kernels\nVersion: 0.18.5\n")
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    _run_in_root("""
        import sys
        from transformers.utils import is_kernels_available
        assert is_kernels_available()
        from kernels import get_kernel
        import kernels, models, tpzoo.kernels
        assert kernels.__version__ == "0.18.5" and get_kernel("x") == "x" and kernels is not tpzoo.kernels
        assert models is sys.modules["tpzoo.models"]
    """, PYTHONPATH=path)
