"""The job manifest (``version = 1`` TOML): parsed with tomllib and validated at load.

A manifest names long-running commands that a supervisord owned by ``ds-trhash jobs`` keeps
alive. Everything is checked before anything is written or started, and every error names the
manifest file, the job and the key, with the allowed values. Two rules protect secrets:
``environment`` refuses names that look like credentials (the value is never echoed), and a
job receives such a variable only by naming it in ``inherit_environment``, so its value stays
in the environment of ``jobs up`` and never reaches a file.
"""
from __future__ import annotations

import fnmatch
import math
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Literal, NoReturn, TypeVar, overload

from ds_trhash.errors import UserError
from ds_trhash.outputs import OutputPathError, check_dir_target
from ds_trhash.safe_names import UnsafeNameError, bare_name

T = TypeVar("T")


MANIFEST_VERSION = 1
RESTART_POLICIES = ("on-failure", "always", "never")
KINDS = ("training", "command")
SECRET_PATTERNS = ("*TOKEN*", "*PASSWORD*", "*SECRET*", "*API_KEY*", "*PRIVATE_KEY*")
TOP_KEYS = ("version", "jobs_dir", "directory", "jobs")
JOB_KEYS = ("name", "argv", "directory", "environment", "inherit_environment", "restart", "log", "after", "kind",
            "stop_wait_seconds", "start_seconds", "start_retries")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# the trainer's entry point: a job that runs it continues its run after every restart
TRAIN_ENTRY = PurePosixPath("launch/train.py")
# a training rank asked to stop finishes its step and writes a checkpoint first
STOP_WAIT_SECONDS = {"training": 600, "command": 30}


class ManifestError(UserError, ValueError):
    """The manifest cannot be used as written; the message names file, job, key and the fix."""


@dataclass(frozen=True)
class Job:
    name: str
    argv: tuple[str, ...]
    directory: Path
    environment: tuple[tuple[str, str], ...]  # sorted (name, value)
    inherit_environment: tuple[str, ...]
    restart: str
    log: Path | None  # None: <jobs directory>/logs/<name>.log
    after: tuple[str, ...]
    kind: str
    stop_wait_seconds: int
    start_seconds: int
    start_retries: int


@dataclass(frozen=True)
class Manifest:
    path: Path
    jobs_dir: Path
    jobs: tuple[Job, ...]

    def job(self, name: str) -> Job:
        return next(j for j in self.jobs if j.name == name)


def looks_secret(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name.upper(), pattern) for pattern in SECRET_PATTERNS)


# Values that are credentials whatever the variable is called: the published prefixes of access
# tokens (Hugging Face, GitHub, GitLab, Slack, OpenAI-style, AWS key ids, PyPI, npm) ...
TOKEN_RE = re.compile(r"(?<![A-Za-z0-9])(hf_[A-Za-z0-9]{16,}|api_org_[A-Za-z0-9]{16,}|gh[pousr]_[A-Za-z0-9]{20,}"
                      r"|github_pat_[A-Za-z0-9_]{20,}|glpat-[A-Za-z0-9_-]{16,}|xox[abposr]-[A-Za-z0-9-]{10,}"
                      r"|sk-[A-Za-z0-9_-]{20,}|AKIA[0-9A-Z]{16}|pypi-[A-Za-z0-9_-]{16,}|npm_[A-Za-z0-9]{20,})")
# ... and long random-looking words: 32+ characters of a token alphabet with more than 4.2 bits of
# entropy per character (a hex digest, at most 4.0, and ordinary words and paths stay below it).
WORD_RE = re.compile(r"[A-Za-z0-9_+=.-]{32,}")
MIN_ENTROPY_BITS = 4.2


def _entropy_bits(word: str) -> float:
    counts = [word.count(c) for c in set(word)]
    return -sum(n / len(word) * math.log2(n / len(word)) for n in counts)


def looks_like_token(text: str) -> bool:
    """Whether ``text`` holds an access token or another credential-like random string."""
    if TOKEN_RE.search(text):
        return True
    return any(_entropy_bits(w) > MIN_ENTROPY_BITS and re.search(r"\d", w) and re.search(r"[A-Za-z]", w)
               for w in WORD_RE.findall(text))


def is_training_argv(argv: tuple[str, ...]) -> bool:
    """Whether the command runs the trainer (directly or through the deepspeed launcher)."""
    return any(PurePosixPath(a).parts[-2:] == TRAIN_ENTRY.parts for a in argv)


def _check_text(where: str, text: str, *, echo: bool = True) -> None:
    """supervisord's INI format cannot carry line breaks or NUL, and it rewrites ``%(here)s``
    even when escaped; refuse those instead of starting a different command."""
    bad = next((c for c in ("\n", "\r", "\x00") if c in text), None)
    shown = f" ({text!r})" if echo else " (value not shown)"
    if bad is not None:
        raise ManifestError(f"{where}{shown} contains {bad!r}; supervisord's configuration cannot carry "
                            "line breaks or NUL characters")
    if "%(here)s" in text:
        raise ManifestError(f"{where}{shown} contains '%(here)s', which supervisord substitutes; "
                            "write the path out instead")


class _Reader:
    """Typed access to one table with errors that say where."""

    def __init__(self, file: Path, where: str, table: dict[str, Any], allowed: tuple[str, ...]):
        self.file, self.where, self.table = file, where, table
        unknown = sorted(set(table) - set(allowed))
        if unknown:
            self.fail(unknown[0], f"unknown key; allowed keys: {', '.join(allowed)}")

    def fail(self, key: str, message: str) -> NoReturn:
        raise ManifestError(f"{self.file}: {self.where}key {key!r}: {message}")

    @overload
    def get(self, key: str, kind: type[T], *, required: Literal[True]) -> T: ...
    @overload
    def get(self, key: str, kind: type[T], default: T) -> T: ...
    @overload
    def get(self, key: str, kind: type[T]) -> T | None: ...
    def get(self, key: str, kind: type[T], default: T | None = None, required: bool = False) -> T | None:
        if key not in self.table:
            if required:
                self.fail(key, "is required")
            return default
        value = self.table[key]
        if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
            self.fail(key, f"must be a {kind.__name__}, got {type(value).__name__}")
        return value

    @overload
    def path(self, key: str, base: Path, default: Path) -> Path: ...
    @overload
    def path(self, key: str, base: Path, default: None) -> Path | None: ...
    def path(self, key: str, base: Path, default: Path | None) -> Path | None:
        text = self.get(key, str)
        if text is None:
            return default
        _check_text(f"{self.file}: {self.where}key {key!r}", text)
        return (base / text).resolve() if text else self.fail(key, "must not be empty")

    def seconds(self, key: str, default: int) -> int:
        value = self.get(key, int, default)
        if value < 0:
            self.fail(key, f"must be >= 0, got {value}")
        return value


def _string_list(r: _Reader, key: str) -> tuple[str, ...]:
    items = r.get(key, list, [])
    for i, item in enumerate(items):
        if not isinstance(item, str):
            r.fail(key, f"element {i} must be a string, got {type(item).__name__}")
    return tuple(items)


def _argv(r: _Reader) -> tuple[str, ...]:
    if isinstance(r.table.get("argv"), str):
        r.fail("argv", 'must be a list of strings, never a shell string: write argv = ["prog", "arg", ...]')
    argv = _string_list(r, "argv")
    if not argv:
        r.fail("argv", "must name a program: a non-empty list of strings")
    if not argv[0] or "=" in argv[0]:
        r.fail("argv", f"the program {argv[0]!r} must be a non-empty path without '='")
    for i, arg in enumerate(argv):
        if looks_like_token(arg):  # checked first: the messages of _check_text echo the element
            raise ManifestError(f"{r.file}: {r.where}key 'argv' element {i} (value not shown) looks like an access "
                                "token or another secret; pass it through inherit_environment instead of argv")
        _check_text(f"{r.file}: {r.where}key 'argv' element {i}", arg)
    return argv


def _environment(r: _Reader, kind: str) -> tuple[tuple[str, str], ...]:
    table = r.get("environment", dict, {})
    out = []
    for name, value in table.items():
        if not ENV_NAME_RE.match(name):
            r.fail("environment", f"variable name {name!r} must match [A-Za-z_][A-Za-z0-9_]*")
        if looks_secret(name):
            r.fail("environment", f"{name} looks like a secret (names matching {', '.join(SECRET_PATTERNS)} are "
                                  "refused; its value is not shown). Never write secrets into a manifest: set "
                                  f'{name} in the environment of `ds-trhash jobs up` and add inherit_environment '
                                  f'= ["{name}"] to this job')
        if not isinstance(value, str):
            r.fail("environment", f"{name} must be a string (quote it in the TOML), got {type(value).__name__}")
        where = f"{r.file}: {r.where}key 'environment' variable {name}"
        _check_text(where, value, echo=False)
        if looks_like_token(value):
            raise ManifestError(f"{where} (value not shown) looks like an access token or another secret; never "
                                "write secrets into a manifest: set it in the environment of `ds-trhash jobs up` "
                                f'under its usual name and add inherit_environment = ["<NAME>"] to this job')
        quotes = {'"', "'"}
        if (value[:1] in quotes or value[-1:] in quotes) or quotes <= set(value):
            raise ManifestError(f"{where} (value not shown): supervisord strips quote characters at either end of "
                                "an environment value and cannot hold both quote kinds in one value")
        if re.search(r"\s[;#]", value):
            raise ManifestError(f"{where} (value not shown): a ';' or '#' after whitespace starts a comment in "
                                "supervisord's configuration and would cut the value")
        if name == "RESUME" and kind == "training":
            r.fail("environment", "a training job always runs with RESUME=auto (continue the newest complete "
                                  "checkpoint, or start fresh when there is none); remove RESUME")
        out.append((name, value))
    return tuple(sorted(out))


def _job(file: Path, index: int, table: object, here: Path, base_dir: Path) -> Job:
    """One [[jobs]] table; relative paths are relative to the manifest's folder ``here``."""
    if not isinstance(table, dict):
        raise ManifestError(f"{file}: jobs[{index}] must be a table ([[jobs]]), got {type(table).__name__}")
    name = table.get("name")
    where = f"job {name!r}: " if isinstance(name, str) and name else f"jobs[{index}]: "
    r = _Reader(file, where, table, JOB_KEYS)
    name = r.get("name", str, required=True)
    if not NAME_RE.match(name):  # the pattern first: its message names the allowed characters
        r.fail("name", f"{name!r} must be 1-64 of [A-Za-z0-9_.-], starting with a letter or digit")
    try:  # the name becomes <jobs_dir>/logs/<name>.log: a bare name (docs/contracts.md §2d)
        bare_name(name, str(file), f"{where}name")
    except UnsafeNameError as exc:
        raise ManifestError(str(exc)) from None
    argv = _argv(r)
    kind = r.get("kind", str, "training" if is_training_argv(argv) else "command")
    if kind not in KINDS:
        r.fail("kind", f"{kind!r} is not allowed; allowed: {', '.join(KINDS)}")
    restart = r.get("restart", str, "on-failure")
    if restart not in RESTART_POLICIES:
        r.fail("restart", f"{restart!r} is not allowed; allowed: {', '.join(RESTART_POLICIES)}")
    inherit = _string_list(r, "inherit_environment")
    for var in inherit:
        if not ENV_NAME_RE.match(var):
            r.fail("inherit_environment", f"{var!r} is not an environment variable name")
    environment = _environment(r, kind)
    clash = sorted(set(inherit) & {k for k, _ in environment})
    if clash:
        r.fail("inherit_environment", f"{clash[0]} is also set in environment; keep one of them")
    after = _string_list(r, "after")
    directory = r.path("directory", here, base_dir)
    if not directory.is_dir():  # supervisord would only report a failed spawn, again and again
        r.fail("directory", f"{directory} does not exist or is not a directory; create it or fix the path "
                            "(relative paths are taken from the manifest's folder)")
    return Job(name=name, argv=argv, directory=directory, environment=environment,
               inherit_environment=tuple(sorted(set(inherit))), restart=restart,
               log=r.path("log", here, None), after=after, kind=kind,
               stop_wait_seconds=r.seconds("stop_wait_seconds", STOP_WAIT_SECONDS[kind]),
               # 0: a job that ends quickly has ended, not failed to start (supervisord would rerun it)
               start_seconds=r.seconds("start_seconds", 0),
               start_retries=r.seconds("start_retries", 3))


def _check_order(file: Path, jobs: list[Job]) -> None:
    """``after`` names existing jobs that can finish, and the order has no cycle."""
    by_name = {j.name: j for j in jobs}
    for job in jobs:
        for dep in job.after:
            if dep not in by_name:
                raise ManifestError(f"{file}: job {job.name!r}: key 'after': no job is named {dep!r}; "
                                    f"jobs: {', '.join(by_name)}")
            if by_name[dep].restart == "always":
                raise ManifestError(f"{file}: job {job.name!r}: key 'after': {dep!r} has restart = \"always\" and "
                                    "never finishes; 'after' waits for a job to exit with status 0")
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(name: str, path: list[str]) -> None:
        if state.get(name) == 2:
            return
        if state.get(name) == 1:
            cycle = path[path.index(name):] + [name]
            raise ManifestError(f"{file}: job {name!r}: key 'after': the order has a cycle: {' -> '.join(cycle)}")
        state[name] = 1
        for dep in by_name[name].after:
            visit(dep, path + [name])
        state[name] = 2

    for job in jobs:
        visit(job.name, [])


def load_manifest(path: str | Path) -> Manifest:
    file = Path(path)
    try:
        raw = tomllib.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ManifestError(f"{file}: no such manifest file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ManifestError(f"{file}: cannot read the manifest: {err}") from None
    except tomllib.TOMLDecodeError as err:
        raise ManifestError(f"{file}: not valid TOML: {err}") from None
    r = _Reader(file, "", raw, TOP_KEYS)
    version = r.get("version", int, required=True)
    if version != MANIFEST_VERSION:
        r.fail("version", f"{version} is not supported; allowed: {MANIFEST_VERSION}")
    here = file.resolve().parent
    base_dir = r.path("directory", here, here)
    jobs_dir = r.path("jobs_dir", here, here / f"{file.stem}.jobs")
    try:  # the folder `jobs render` / `jobs up` write: the one output check, naming the key
        check_dir_target("jobs_dir", jobs_dir)
    except OutputPathError as exc:
        r.fail("jobs_dir", exc.message_lines()[0].removeprefix("jobs_dir "))
    tables = r.get("jobs", list, required=True)
    if not tables:
        r.fail("jobs", "holds no job; add at least one [[jobs]] table")
    jobs = [_job(file, i, t, here, base_dir) for i, t in enumerate(tables)]
    seen: set[str] = set()
    for job in jobs:
        if job.name in seen:
            raise ManifestError(f"{file}: job {job.name!r}: key 'name': two jobs share this name")
        seen.add(job.name)
    _check_order(file, jobs)
    return Manifest(path=file.resolve(), jobs_dir=jobs_dir, jobs=tuple(jobs))
