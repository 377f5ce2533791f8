"""The repository's kernels/ folder does not hide an installed ``kernels`` package from commands run
at the repository root (``python -m``, ``python -c``), where Python finds the folder first."""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run_at_root(code: str, site: Path | None = None, module: str | None = None) -> str:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if site is not None:
        env["PYTHONPATH"] = str(site)  # after the root ('') on sys.path, as site-packages are
    command = [sys.executable, "-m", module] if module else [sys.executable, "-c", code]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _stand_in(tmp_path: Path) -> Path:
    """A site folder holding a ``kernels`` package, as PyPI's would be installed, and a command that
    imports a name from it the way transformers does."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("from .props import CUDAProperties\n")
    (tmp_path / "kernels" / "props.py").write_text("CUDAProperties = 'installed'\n")
    (tmp_path / "uses_kernels.py").write_text("from kernels import CUDAProperties\nprint(CUDAProperties)\n")
    return tmp_path


def test_an_installed_kernels_package_wins_at_the_root(tmp_path):
    site = _stand_in(tmp_path)
    assert _run_at_root("", site, module="uses_kernels") == "installed"
    found = _run_at_root("import kernels, sys; print(kernels.__file__, sys.modules['kernels'] is kernels)", site)
    assert found == f"{site / 'kernels' / '__init__.py'} True"


def test_our_kernels_stay_ds_trhash_kernels_beside_the_installed_one(tmp_path):
    site = _stand_in(tmp_path)
    code = ("import kernels, ds_trhash.kernels.routed_experts as rk; "
            "print(kernels.CUDAProperties, rk.__name__, rk.__file__)")
    assert _run_at_root(code, site) == f"installed ds_trhash.kernels.routed_experts {REPO / 'kernels' / 'routed_experts.py'}"


def test_without_an_installed_one_transformers_finds_no_kernels_package():
    """transformers imports ``kernels`` to ask its version once ``find_spec`` finds one: the folder
    must neither break that nor pass for the package."""
    code = ("from transformers.utils.import_utils import is_kernels_available; import kernels; "
            "print(is_kernels_available(), hasattr(kernels, 'CUDAProperties'))")
    assert _run_at_root(code) == "False False"
