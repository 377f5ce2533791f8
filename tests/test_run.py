"""The composition of a launch, and the import rule that keeps it the only place that composes.

Training never imports eval or release (not even inside a function); eval and release reach
checkpoints through ds_trhash.checkpoints; model, data and the checkpoint package never import
training, eval or release; kernels import nothing of ours. See docs/architecture.md.
"""
import ast
from pathlib import Path

from ds_trhash.eval.callbacks import HeldoutCallback, PiqaCallback
from ds_trhash.run import StageEndCallback, launch_parts
from ds_trhash.training.callbacks import (
    CheckpointCallback,
    FaultCallback,
    MetricsCallback,
    ProgressCallback,
    SelectionCallback,
    StopCallback,
)

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "ds_trhash"
# where each part's files live: the top-level kernels/ folder is installed as ds_trhash.kernels (setup.py)
SOURCES = {"kernels": REPO / "kernels"}
FORBIDDEN = {
    "training": ("ds_trhash.eval", "ds_trhash.release", "ds_trhash.run", "ds_trhash.demo", "ds_trhash.cli"),
    "eval": ("ds_trhash.release", "ds_trhash.run"),
    "checkpoints": ("ds_trhash.training", "ds_trhash.eval", "ds_trhash.release", "ds_trhash.data"),
    "model": ("ds_trhash.training", "ds_trhash.eval", "ds_trhash.release", "ds_trhash.checkpoints", "ds_trhash.data"),
    "data": ("ds_trhash.training", "ds_trhash.eval", "ds_trhash.release", "ds_trhash.checkpoints"),
    "ops": ("ds_trhash.training", "ds_trhash.eval", "ds_trhash.release", "ds_trhash.report", "ds_trhash.checkpoints",
            "ds_trhash.data", "ds_trhash.model", "ds_trhash.run"),
    "report": ("ds_trhash.eval", "ds_trhash.run", "ds_trhash.ops"),
    "release": ("ds_trhash.report", "ds_trhash.ops", "ds_trhash.run", "ds_trhash.training"),  # selection: checkpoints
    "kernels": ("ds_trhash.",),
    "io.py": ("ds_trhash.",),
    "argtypes.py": ("ds_trhash.",),
    "outputs.py": ("ds_trhash.training", "ds_trhash.data", "ds_trhash.model", "ds_trhash.checkpoints",
                   "ds_trhash.eval", "ds_trhash.release", "ds_trhash.report", "ds_trhash.ops", "ds_trhash.io"),
    "prelaunch": ("ds_trhash.cli", "ds_trhash.run", "ds_trhash.ops", "ds_trhash.report", "ds_trhash.training.trainer"),
    # the launch plan and the run's records sit below the trainer: both it and preflight import them
    "training/launch": ("ds_trhash.training.trainer", "ds_trhash.training.launcher", "ds_trhash.training.loop",
                        "ds_trhash.prelaunch"),
    "training/records": ("ds_trhash.training.trainer", "ds_trhash.training.launcher", "ds_trhash.training.loop",
                         "ds_trhash.training.launch", "ds_trhash.training.callbacks"),
}


def _module_of(path: Path) -> list[str]:
    """The dotted package holding ``path`` (``ds_trhash.kernels`` for the top-level kernels/)."""
    for part, root in SOURCES.items():
        if path.is_relative_to(root):
            return ["ds_trhash", part, *path.relative_to(root).parent.parts]
    return ["ds_trhash", *path.relative_to(PKG).parent.parts]


def _imports(path: Path, text: str | None = None):
    """Every module ``path`` imports (``text``: its source, default the file's), relative imports
    resolved against its package."""
    source = path.read_text(encoding="utf-8") if text is None else text
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = _module_of(path)
                module = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                module = node.module
            yield module
            yield from (f"{module}.{a.name}" for a in node.names)


def _files(part: str) -> list[Path]:
    return [PKG / part] if part.endswith(".py") else sorted(SOURCES.get(part, PKG / part).rglob("*.py"))


def _broken(part: str, path: Path, text: str | None = None) -> list[str]:
    banned, own = FORBIDDEN[part], f"ds_trhash.{part.removesuffix('.py')}"
    return [f"{path.relative_to(REPO)} imports {name}" for name in _imports(path, text)
            if (name.startswith(banned) and not (name == own or name.startswith(own + ".")))
            or (name == "ds_trhash" and part in ("kernels", "io.py", "argtypes.py"))]


def test_launch_calls_the_parts_in_order():
    # the end of a completed stage (final/, stage_complete.json, cleanup) runs after every checkpoint and best/
    assert launch_parts() == [StopCallback, FaultCallback, HeldoutCallback, PiqaCallback, MetricsCallback,
                              ProgressCallback, CheckpointCallback, SelectionCallback, StageEndCallback]


def test_no_package_imports_above_itself():
    broken = [line for part in FORBIDDEN for path in _files(part) for line in _broken(part, path)]
    assert not broken, "\n".join(broken)


def test_the_import_rule_checks_every_part_and_relative_imports():
    """The checker itself: a part without files would pass vacuously (kernels/ lives outside
    ds_trhash/), and a relative import is an import like any other."""
    assert all(_files(part) for part in FORBIDDEN), [part for part in FORBIDDEN if not _files(part)]
    assert _broken("data", PKG / "data" / "plans" / "plan.py", "from ...training import loop\n") == [
        "ds_trhash/data/plans/plan.py imports ds_trhash.training", "ds_trhash/data/plans/plan.py imports ds_trhash.training.loop"]
    assert _broken("kernels", REPO / "kernels" / "routed_experts.py", "from ds_trhash.model import experts\n")
    assert _broken("kernels", REPO / "kernels" / "routed_experts.py", "from . import routed_experts\n") == []
    assert not _broken("model", PKG / "model" / "backend.py", "from .experts import EXPERT_BACKENDS\n")


def test_eval_and_release_read_checkpoints_only_through_the_package():
    """No torch.load, no DeepSpeed checkpoint reader outside ds_trhash.checkpoints; eval takes from
    training only the callback interface."""
    for part in ("eval", "release"):
        for path in sorted((PKG / part).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            assert "torch.load(" not in text and "zero_to_fp32" not in text and "deepspeed.checkpoint" not in text, path
            if part == "eval":
                training = [n for n in _imports(path) if n.startswith("ds_trhash.training")]
                assert all(n.startswith("ds_trhash.training.callbacks.base") for n in training), (path, training)


def test_prelaunch_imports_no_private_name():
    """preflight and smoke use the trainer's checks through their public names only."""
    private = []
    for path in sorted((PKG / "prelaunch").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ds_trhash"):
                private += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert not private, private
