"""The type checker's settings, and what it cannot see (docs/architecture.md, "Types").

mypy (mypy.ini, run by `make typecheck` and `make test`) refuses a function without types; these
checks keep its settings from being loosened, and count what mypy accepts but the house does not:
a bare ``Any`` without its reason, more than ``MAX_BARE_ANY`` of them, a module ``__getattr__``
that hides its names' types.
"""
import ast
import configparser
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = [*sorted((REPO / "ds_trhash").rglob("*.py")), *sorted((REPO / "kernels").rglob("*.py"))]
MAX_BARE_ANY = 10


def test_the_checker_refuses_untyped_functions_over_the_whole_package():
    settings = configparser.ConfigParser()
    settings.read(REPO / "mypy.ini")
    main = settings["mypy"]
    assert main.getboolean("disallow_untyped_defs") and main.getboolean("disallow_incomplete_defs")
    assert main["files"].split(",") == ["ds_trhash"] and main["mypy_path"] == "build/typecheck"
    # no section turns a check off for our own modules (only third-party imports are let through)
    loosened = [name for name in settings.sections() if name != "mypy" and "ds_trhash" in name]
    assert not loosened, f"mypy.ini relaxes checks for our modules: {loosened}"
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    assert "ln -sfn ../../../kernels build/typecheck/ds_trhash/kernels" in makefile  # kernels/ checked as installed
    assert "$(MAKE) -s typecheck" in makefile.split("\ntest:")[1].split("\n\n")[0]  # `make test` runs it


def test_no_module_imports_one_of_transformers_own_models():
    """mypy.ini skips ``transformers.models.*`` (types it would never check here): an import from
    there would be unchecked, so there is none."""
    found = []
    for path in sorted([*(REPO / "ds_trhash").rglob("*.py"), *(REPO / "kernels").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(REPO)}: {n}" for n in names if n.startswith("transformers.models")]
    assert not found, found
    settings = configparser.ConfigParser()
    settings.read(REPO / "mypy.ini")
    assert settings["mypy-transformers.models.*"]["follow_imports"] == "skip"


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.arg]:
    a = node.args
    params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *([a.vararg] if a.vararg else []), *([a.kwarg] if a.kwarg else [])]
    return params[1:] if params and params[0].arg in ("self", "cls") else params


def _triton_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(ast.unparse(d) == "triton.jit" for d in node.decorator_list)


def _untyped(path: Path, text: str | None = None) -> list[str]:
    """"file:line name" of every parameter without an annotation (self and cls left out), but a
    Triton kernel's: Triton reads a kernel's annotations as its types (kernels/routed_experts.py,
    TRITON_PARAMETERS), so those defs tell the checker to let them be."""
    tree = ast.parse(path.read_text(encoding="utf-8") if text is None else text)
    return [f"{path.relative_to(REPO)}:{p.lineno} {p.arg}" for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _triton_kernel(node)
            for p in _parameters(node) if p.annotation is None]


def _is_any(annotation: ast.expr | None) -> bool:
    return (isinstance(annotation, ast.Name) and annotation.id == "Any") or (
        isinstance(annotation, ast.Attribute) and annotation.attr == "Any") or (
        isinstance(annotation, ast.Constant) and annotation.value == "Any")


def _bare_any(path: Path, text: str | None = None) -> list[tuple[str, bool]]:
    """("file:line", said why) of every annotation that is ``Any`` itself (a parameter, a return,
    a variable; ``dict[str, Any]`` is not bare); the reason is a comment on its line saying
    ``Any: why``."""
    source = path.read_text(encoding="utf-8") if text is None else text
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        annotations = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            annotations = [p.annotation for p in _parameters(node)] + [node.returns]
        elif isinstance(node, ast.AnnAssign):
            annotations = [node.annotation]
        for annotation in annotations:
            if annotation is not None and _is_any(annotation):
                line = lines[annotation.lineno - 1]
                found.append((f"{path.relative_to(REPO)}:{annotation.lineno}", "# Any:" in line))
    return found


def test_no_parameter_is_untyped():
    """mypy refuses an untyped def already; this holds where the checker is told to let a def be
    (``type: ignore``): only a Triton kernel may be, and says so on its line."""
    untyped = [where for path in SOURCES for where in _untyped(path)]
    assert not untyped, untyped
    kernels = REPO / "kernels" / "routed_experts.py"
    lines = kernels.read_text(encoding="utf-8").splitlines()
    jit = [n for n in ast.walk(ast.parse("\n".join(lines))) if isinstance(n, ast.FunctionDef) and _triton_kernel(n)]
    assert jit and all("type: ignore[no-untyped-def]  # TRITON_PARAMETERS" in lines[n.lineno - 1] for n in jit)
    ignored = [f"{path.relative_to(REPO)}:{i}" for path in SOURCES
               for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
               if "ignore[no-untyped-def]" in line and "TRITON_PARAMETERS" not in line]
    assert not ignored, ignored


def test_bare_any_is_rare_and_says_why():
    found = [item for path in SOURCES for item in _bare_any(path)]
    silent = [where for where, said in found if not said]
    assert not silent, f"say why on the line (`# Any: ...`), or give these a real type: {silent}"
    assert len(found) <= MAX_BARE_ANY, f"{len(found)} bare Any (at most {MAX_BARE_ANY}): {[w for w, _ in found]}"


def test_the_counts_see_what_they_count():
    path = REPO / "ds_trhash" / "io.py"
    assert _untyped(path, "def f(a, b: int, *c, **d) -> None: ...\n") == [
        "ds_trhash/io.py:1 a", "ds_trhash/io.py:1 c", "ds_trhash/io.py:1 d"]
    assert _untyped(path, "class C:\n    def m(self, x: int) -> None: ...\n") == []
    assert _untyped(path, "@triton.jit\ndef k(x_ptr, N: tl.constexpr): ...\n") == []
    text = "def f(a: Any) -> Any:  # Any: a reason\n    x: Any = 1\n    y: dict[str, Any] = {}\n"
    assert _bare_any(path, text) == [("ds_trhash/io.py:1", True), ("ds_trhash/io.py:1", True),
                                     ("ds_trhash/io.py:2", False)]


def test_module_getattr_names_its_types():
    """A package that loads a name on first use (PEP 562, to defer a heavy import) declares the
    name's type for the checker in a ``TYPE_CHECKING`` block and annotates ``__getattr__``; else
    every use of the name is ``Any`` to the checker and invisible to import analysis."""
    hidden = []
    for path in SOURCES:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        getattrs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "__getattr__"]
        declared = any(isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test) for n in tree.body)
        if getattrs and (not declared or getattrs[0].returns is None or _is_any(getattrs[0].returns)):
            hidden.append(str(path.relative_to(REPO)))
    assert not hidden, hidden
