"""The composition of a launch, and the import rule that keeps it the only place that composes.

Training never imports eval or release (not even inside a function); eval and release reach
checkpoints through ds_trhash.checkpoints; model, data and the checkpoint package never import
training, eval or release; kernels import nothing of ours; no module import cycle. See
docs/architecture.md.
"""
import ast
from pathlib import Path

from ds_trhash.eval.callbacks import HeldoutCallback, PiqaCallback
from ds_trhash.run import StageEndCallback, launch_parts
from ds_trhash.training.callbacks import (
    CheckpointCallback,
    FaultCallback,
    MetricsCallback,
    MicroBatchCallback,
    NonFiniteGuard,
    ProfileCallback,
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
    # release's rooms: hf <- export <- lifecycle, record <- hub; generate and commands on top
    "release/hf": ("ds_trhash.release", "ds_trhash.training", "ds_trhash.eval", "ds_trhash.checkpoints"),
    "release/export": ("ds_trhash.release.hub", "ds_trhash.release.lifecycle", "ds_trhash.release.record",
                       "ds_trhash.release.generate", "ds_trhash.release.commands"),
    "release/lifecycle": ("ds_trhash.release.hub", "ds_trhash.release.record", "ds_trhash.release.generate",
                          "ds_trhash.release.commands"),
    "release/record": ("ds_trhash.release.hub", "ds_trhash.release.lifecycle", "ds_trhash.release.generate",
                       "ds_trhash.release.commands"),
    "release/hub": ("ds_trhash.release.record", "ds_trhash.release.generate", "ds_trhash.release.commands"),
    "kernels": ("ds_trhash.",),
    "io.py": ("ds_trhash.",),
    "argtypes.py": ("ds_trhash.",),
    "batch_layout.py": ("ds_trhash.",),
    "deepspeed_command.py": ("ds_trhash.",),
    "engine_api.py": ("ds_trhash.",),  # the DeepSpeed engine as a Protocol: any module may name it
    "outputs.py": ("ds_trhash.training", "ds_trhash.data", "ds_trhash.model", "ds_trhash.checkpoints",
                   "ds_trhash.eval", "ds_trhash.release", "ds_trhash.report", "ds_trhash.ops", "ds_trhash.io"),
    # gloo's interface toward the master: errors only (engine.init_distributed and the summary use it)
    "network.py": ("ds_trhash.training", "ds_trhash.data", "ds_trhash.model", "ds_trhash.checkpoints",
                   "ds_trhash.eval", "ds_trhash.release", "ds_trhash.report", "ds_trhash.ops", "ds_trhash.io",
                   "ds_trhash.ranks", "ds_trhash.prelaunch", "ds_trhash.run", "ds_trhash.cli", "ds_trhash.kernels",
                   "ds_trhash.config_fields"),
    # what every component's config section is made of: below every package, beside errors.py
    "config_fields.py": ("ds_trhash.training", "ds_trhash.data", "ds_trhash.model", "ds_trhash.checkpoints",
                         "ds_trhash.eval", "ds_trhash.release", "ds_trhash.report", "ds_trhash.ops", "ds_trhash.io",
                         "ds_trhash.prelaunch", "ds_trhash.run", "ds_trhash.cli", "ds_trhash.kernels"),
    "prelaunch": ("ds_trhash.cli", "ds_trhash.run", "ds_trhash.ops", "ds_trhash.report", "ds_trhash.training.trainer"),
    # the launch plan and the run's records sit below the trainer: both it and preflight import them
    "training/preparation": ("ds_trhash.training.trainer", "ds_trhash.training.entrypoint",
                             "ds_trhash.training.loop", "ds_trhash.prelaunch"),
    "training/records": ("ds_trhash.training.trainer", "ds_trhash.training.entrypoint", "ds_trhash.training.loop",
                         "ds_trhash.training.preparation", "ds_trhash.training.callbacks"),
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
    banned, own = FORBIDDEN[part], "ds_trhash." + part.removesuffix(".py").replace("/", ".")
    return [f"{path.relative_to(REPO)} imports {name}" for name in _imports(path, text)
            if (name.startswith(banned) and not (name == own or name.startswith(own + ".")))
            or (name == "ds_trhash" and part in ("kernels", "io.py", "argtypes.py", "batch_layout.py", "engine_api.py"))]


def test_launch_calls_the_parts_in_order():
    # the end of a completed stage (final/, stage_complete.json, cleanup) runs after every checkpoint and best/
    # the non-finite guard first: its check and its before_save come before anything could save a diverged step
    assert launch_parts() == [NonFiniteGuard, StopCallback, FaultCallback, HeldoutCallback, PiqaCallback,
                              MetricsCallback, MicroBatchCallback, ProgressCallback, CheckpointCallback, SelectionCallback, ProfileCallback,
                              StageEndCallback]


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
    assert _broken("release/export", PKG / "release" / "export" / "writer.py", "from ..hub import sync\n") == [
        "ds_trhash/release/export/writer.py imports ds_trhash.release.hub",
        "ds_trhash/release/export/writer.py imports ds_trhash.release.hub.sync"]
    hf_model = PKG / "release" / "hf" / "modeling_tr_hash_moe.py"
    assert not _broken("release/hf", hf_model, "from .configuration_tr_hash_moe import X\n")


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


# Cycles tolerated for a while, each named with the change that removes it: none today (the
# release/hub* cycle went with the one Hub client). An entry must still exist to stay listed.
ALLOWED_CYCLES: dict[str, frozenset[str]] = {}


def _module_name(path: Path) -> str:
    package = _module_of(path)
    return ".".join(package if path.name == "__init__.py" else [*package, path.stem])


def _import_graph(texts: dict[Path, str] | None = None) -> dict[str, set[str]]:
    """module -> the package modules it imports (``texts``: sources that replace files' own).

    Every import statement counts, inside functions and ``TYPE_CHECKING`` blocks too, and so do
    the packages an import runs on the way (``a.b.c`` runs ``a.b``'s ``__init__``), except the
    module's own packages, which are already running when it is imported."""
    texts = texts or {}
    paths = sorted(PKG.rglob("*.py")) + sorted(SOURCES["kernels"].rglob("*.py"))
    names = {path: _module_name(path) for path in paths}
    known = set(names.values())
    graph = {}
    for path, me in names.items():
        edges = set()
        for name in _imports(path, texts.get(path)):
            parts = name.split(".")
            for i in range(2, len(parts) + 1):
                target = ".".join(parts[:i])
                if target in known and target != me and not me.startswith(target + "."):
                    edges.add(target)
        graph[me] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(frozenset(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_no_module_import_cycle():
    """A cycle makes import order matter and hides which module owns what: none is allowed,
    but for the named temporary entries (each must still exist, so a fixed one is removed here)."""
    graph = _import_graph()
    cycles = _cycles(graph)
    strays = [sorted(c) for c in cycles if not any(c <= allowed for allowed in ALLOWED_CYCLES.values())]
    assert not strays, "\n".join(" <-> ".join(c) + ": " + "; ".join(
        f"{m} imports {sorted(graph[m] & c)}" for m in sorted(c)) for c in map(set, strays))
    stale = [name for name, allowed in ALLOWED_CYCLES.items() if not any(c & allowed for c in cycles)]
    assert not stale, f"these cycles are gone: remove their ALLOWED_CYCLES entries: {stale}"


def test_the_cycle_check_sees_function_level_and_relative_imports():
    base = PKG / "training" / "callbacks" / "base.py"
    in_function = {base: "def hook():\n    from ..loop import train\n"}
    assert any({"ds_trhash.training.callbacks.base", "ds_trhash.training.loop"} <= c
               for c in _cycles(_import_graph(in_function)))
    # importing a module runs its package's __init__: checkpoint_plan -> base runs the callbacks
    # package, which imports checkpointing, which imports checkpoint_plan
    plan = PKG / "training" / "checkpoint_plan.py"
    via_package = {plan: "if False:\n    import ds_trhash.training.callbacks.base\n"}
    assert any({"ds_trhash.training.callbacks", "ds_trhash.training.checkpoint_plan"} <= c
               for c in _cycles(_import_graph(via_package)))
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]


def test_training_reaches_the_data_through_its_public_names():
    """The training -> data seam is one room's public face: ``ds_trhash.data.stage`` (its
    ``__all__``: open a stage's data, read it) and the config's ``data:`` section
    (``ds_trhash.data.config``); never a module of another room."""
    import ds_trhash.data.stage as stage

    public = {f"ds_trhash.data.stage.{name}" for name in stage.__all__} | {"ds_trhash.data.stage"}
    allowed = ("ds_trhash.data.config",)
    stray = [f"{path.relative_to(REPO)} imports {name}" for path in _files("training") for name in _imports(path)
             if name.startswith("ds_trhash.data") and name not in public and not name.startswith(allowed)]
    assert not stray, "\n".join(stray)
    # the checker itself: a room's module is caught
    assert [n for n in _imports(PKG / "training" / "loop.py", "from ds_trhash.data.stream.store import X\n")
            if n.startswith("ds_trhash.data") and n not in public]
