"""Triton kernels for TR-HASH, installed as ``ds_trhash.kernels``.

Importing this package does not import triton: callers import its modules by name
(``from ds_trhash.kernels.routed_experts import routed_experts_triton``) where they need them, so a
test can set ``TRITON_INTERPRET`` before triton is imported.

The folder sits at the repository root, and from there (``python -m ...``, ``python -c``) Python
finds it as a top-level ``kernels`` before anything installed, which would hide the ``kernels``
package on PyPI (recent transformers import it). Imported under that name, this file hands the
name to the installed package; with none installed it stays an empty package, as before (transformers
5.24 imports ``kernels`` to ask its version when ``find_spec`` finds one, and takes none as absent).
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

__all__: list[str] = []

_TOP_LEVEL = "kernels"


def _without_this_folder() -> list[str]:
    """sys.path less the entries that find this folder as a top-level package (the root, ``''``)."""
    root = Path(__file__).resolve().parent.parent
    return [entry for entry in sys.path if Path(entry or ".").resolve() != root]


def _hand_over_to_installed() -> None:
    """Replace this module in ``sys.modules`` with the installed ``kernels``, if any: the import
    statement returns what ``sys.modules`` holds once the module has run."""
    spec = importlib.machinery.PathFinder.find_spec(_TOP_LEVEL, _without_this_folder())
    if spec is None or spec.loader is None:
        return
    installed = importlib.util.module_from_spec(spec)
    sys.modules[_TOP_LEVEL] = installed
    spec.loader.exec_module(installed)


if __name__ == _TOP_LEVEL:
    _hand_over_to_installed()
