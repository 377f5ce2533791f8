"""`data publish DIR hf://datasets/OWNER/REPO`: put a corpus on the Hub and prove it arrived whole.

What is sent: every file under DIR, at the same path in the repository, except hidden entries
(work directories and locks of `data tokenize`) and `<source>.part-I-of-K` directories. That
covers our layout (``<source>/manifest.json`` + shards) and the release's
(``mixture_manifest.json``, ``corpora/<source>/manifest.json`` + shards): a manifest is any
``manifest.json`` with a ``shards`` list of ``{file, bytes, sha256}``.

How: ``HfApi.upload_folder`` (repository type ``dataset``; the pinned client, huggingface_hub 2.4,
has no ``upload_large_folder`` any more: ``upload_folder`` took over its resumable, multi-commit
upload). With ``hf_xet`` the client streams
the folder in several commits and a re-run skips what is committed and deduplicates what was
uploaded; over the LFS protocol (``HF_HUB_DISABLE_XET=1``) it makes one commit, and a re-run
after an interruption sends no LFS object the Hub already holds (its batch endpoint asks only
for the missing ones). Either way, running the same command again resumes.

Then every shard of every manifest is checked on the Hub (``list_repo_tree``): present, its size
equal to the manifest's ``bytes``, its LFS SHA-256 equal to the manifest's ``sha256``; and each
manifest's own bytes (git blob id). The verified head commit is printed, for a plan's ``revision``.

The token is ``HF_TOKEN`` from the environment (``ds_trhash.hub_access``, the project's one Hub policy);
it is never written, and scrubbed from every message.
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from ds_trhash import hub_access
from ds_trhash.errors import UserError
from ds_trhash.io import read_json_object, sha256_file

from ds_trhash.data.build.parts import REPORT_FILE

if TYPE_CHECKING:
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

TARGET_PREFIX = "hf://datasets/"
_PART_DIR = re.compile(r".+\.part-\d+-of-\d+$")
MANIFEST_NAME = "manifest.json"

T = TypeVar("T")


class PublishError(UserError, OSError):
    """A corpus that cannot be published as given, or a publish that did not verify."""

    def __init__(self, message: str) -> None:
        super().__init__(hub_access.redact(" ".join(str(message).split())))


def parse_target(target: str) -> str:
    repo = target[len(TARGET_PREFIX):] if target.startswith(TARGET_PREFIX) else ""
    problem = hub_access.repo_id_problem(repo) if repo else "no repository named"
    if problem:
        raise PublishError(f"{target!r} is not hf://datasets/OWNER/REPO ({problem}); name the dataset repository to "
                           "publish to")
    return repo


def _published(root: Path, path: Path) -> bool:
    parts = path.relative_to(root).parts
    return not any(p.startswith(".") for p in parts) and not any(_PART_DIR.match(p) for p in parts[:-1])


def corpus_files(root: Path) -> list[str]:
    """The repository paths ``publish`` sends, sorted."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and _published(root, p))


def corpus_manifests(root: Path) -> dict[str, dict]:
    """Every shard manifest under ``root`` by its repository path, each shard checked locally by size."""
    found = {}
    for path in corpus_files(root):
        if Path(path).name != MANIFEST_NAME:
            continue
        doc = read_json_object(root / path, PublishError)
        shards = doc.get("shards")
        if not isinstance(shards, list) or not all(isinstance(s, dict) and {"file", "bytes", "sha256"} <= set(s)
                                                    for s in shards):
            raise PublishError(f"{root / path} has no `shards` list of {{file, bytes, sha256}}; it is not a shard manifest")
        for shard in shards:
            local = (root / path).parent / shard["file"]
            if not local.is_file() or local.stat().st_size != shard["bytes"]:
                size = local.stat().st_size if local.is_file() else "missing"
                raise PublishError(f"{local} is {size} bytes locally, its manifest says {shard['bytes']}; "
                                   "nothing was sent. Re-create the source with `data tokenize`")
        found[path] = doc
    if not found:
        raise PublishError(f"{root} holds no {MANIFEST_NAME} with shards (neither <source>/ nor corpora/<source>/)")
    return found


def _git_blob_id(path: Path) -> str:
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _hub(what: str, call: Callable[..., T], *args: object, **kwargs: object) -> T:
    """One client call; any failure (refusal, network) becomes one scrubbed line."""
    try:
        return call(*args, **kwargs)
    except Exception as exc:  # the client raises HTTP, connection and validation errors alike
        raise hub_access.failure(exc, what, PublishError, transient_hint="run the same command again to resume") from None


def _mismatch(path: str, entry: RepoFile | None, size: int, sha256: str | None, blob_id: str | None) -> str | None:
    """Why the remote ``entry`` is not the expected file, or None when it is."""
    if entry is None:
        return f"{path}: absent"
    remote_sha = entry.lfs.sha256 if entry.lfs is not None else None
    if entry.size != size or (sha256 is not None and remote_sha != sha256) or (
            sha256 is None and entry.blob_id != blob_id):
        return f"{path}: remote {entry.size} bytes sha256 {remote_sha}, expected {size} bytes sha256 {sha256 or '-'}"
    return None


def verify_remote(api: HfApi, repo_id: str, root: Path, manifests: dict[str, dict], files: list[str]) -> int:
    """Check every published file on the Hub: shards against their manifests (size, LFS SHA-256), the
    other files against their local bytes. Returns the number of shards checked."""
    from huggingface_hub.hf_api import RepoFile  # lazy, as the client itself

    listing = _hub(f"listing {repo_id}", lambda: list(api.list_repo_tree(repo_id, recursive=True, expand=True,
                                                                         repo_type="dataset")))
    remote = {entry.path: entry for entry in listing if isinstance(entry, RepoFile)}  # files (folders have no size)
    shards = {(Path(path).parent / shard["file"]).as_posix(): shard for path, doc in manifests.items()
              for shard in doc["shards"]}
    problems = []
    for path in files:
        entry = remote.get(path)
        if path in shards:
            problem = _mismatch(path, entry, shards[path]["bytes"], shards[path]["sha256"], None)
        elif entry is not None and entry.lfs is not None:
            problem = _mismatch(path, entry, (root / path).stat().st_size, sha256_file(root / path), None)
        else:
            problem = _mismatch(path, entry, (root / path).stat().st_size, None, _git_blob_id(root / path))
        if problem:
            problems.append(problem)
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise PublishError(f"{repo_id} does not hold the corpus as its manifests describe: {shown}; "
                           "run the same command again to re-send")
    return len(shards)


def publish_corpus(root: Path, target: str, log: Callable[[str], None] = print) -> str:
    """Upload ``root`` to the dataset repository ``target``, verify it, return the verified commit."""
    repo_id = parse_target(target)
    root = Path(root)
    if not root.is_dir():
        raise PublishError(f"corpus directory {root} does not exist")
    manifests = corpus_manifests(root)
    files = corpus_files(root)
    api = hub_access.make_api(PublishError, require_token=True, what="`data publish`")
    _hub(f"creating {repo_id}", api.create_repo, repo_id, repo_type="dataset", exist_ok=True)
    ignore = [".*", "**/.*", "*.part-*-of-*/**", "**/*.part-*-of-*/**"]
    _hub(f"uploading {len(files)} files to {repo_id}", api.upload_folder, repo_id=repo_id, repo_type="dataset",
         folder_path=str(root), ignore_patterns=ignore,
         commit_message=f"Publish corpus: {len(manifests)} sources, {len(files)} files")
    head = _hub(f"reading the head of {repo_id}", api.repo_info, repo_id, repo_type="dataset",
                revision="main").sha
    shards = verify_remote(api, repo_id, root, manifests, files)
    reports = sum(1 for f in files if Path(f).name == REPORT_FILE)
    log(f"{TARGET_PREFIX}{repo_id}: {len(manifests)} manifests, {shards} shards verified (size and SHA-256)"
        + (f", {reports} tokenize reports" if reports else ""))
    log(f"commit {head}")
    return str(head)
