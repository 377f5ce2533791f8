"""A stand-in Hugging Face Hub on loopback, for driving the real ``huggingface_hub`` client.

It implements exactly the HTTP endpoints that ``HfApi`` (huggingface_hub 2.x) calls for what
``ds-trhash sync`` does, with the payloads the client sends and parses:

- ``POST /api/repos/create`` (JSON ``{name, organization, type, visibility}``): 200 with ``url``,
  409 when the repository exists (``create_repo(exist_ok=True)`` accepts that).
- ``GET /api/{type}s/{repo}/revision/{rev}``: repository info with the head commit (``repo_info``;
  ``create_commit`` calls it when every addition is already on the Hub).
- ``POST /api/{type}s/{repo}/paths-info/{rev}`` (form ``paths=...``) and
  ``GET /api/{type}s/{repo}/tree/{rev}[/{path}]?recursive=``: one entry per file with its ``size``,
  its git blob id ``oid`` and, for LFS files, ``lfs: {oid: sha256, size, pointerSize}`` (the ``oid``
  of an LFS file is then the blob id of its pointer file, as on the Hub).
- ``POST /api/{type}s/{repo}/preupload/{rev}``: ``uploadMode`` "lfs" for the suffixes the Hub's
  default ``.gitattributes`` tracks (and files over 10 MiB), else "regular"; ``oid`` of the file
  already at that path (sha256 for LFS, blob id otherwise), so unchanged files are skipped.
- ``POST /{prefix}{repo}.git/info/lfs/objects/batch`` (basic transfer): an ``upload`` and a
  ``verify`` action per object the store lacks, no actions for objects it holds; then
  ``PUT /lfs-upload/{oid}?sig=`` (a pre-signed URL; the body must hash to ``oid``) and ``POST /lfs-verify/{oid}``.
- ``POST /api/{type}s/{repo}/commit/{rev}`` (ndjson): ``header``, ``file`` (base64), ``lfsFile``
  (must reference an uploaded object), ``deletedFile`` and ``deletedFolder``; applied atomically.

Every request must carry ``Authorization: Bearer <token>`` (else 401), so a test also proves the
token reached the client from the environment; the 401 message echoes the header received (as some
proxies do), so a test can check that what the user sees is scrubbed. The client uploads large files through Xet when
``hf_xet`` is importable; Xet's content-addressed protocol lives inside the ``hf_xet`` extension and
is not emulated here, so tests set ``HF_HUB_DISABLE_XET`` and the client uses the LFS protocol.

Faults a test can arm: ``drop`` (endpoint name -> which of its requests, counted from 1, to drop:
the server reads half the body and closes the socket without answering) and ``corrupt`` (repository paths whose
committed bytes get their first byte flipped, so the Hub's reported hashes differ); ``hold``
(endpoint name -> event: such a request, once it arrived (``arrived[name]`` is set), waits up to
60 s for the event, so a test can act while a client is mid-request).

The server handles requests in a loop bounded by ``deadline_s`` and stops by itself then, or when
the ``with`` block exits; handler sockets time out after a few seconds.
"""
from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt", ".npy", ".pkl", ".h5", ".msgpack", ".onnx")
LFS_THRESHOLD = 10 * 1024 * 1024
_REPO = r"(?P<type>model|dataset)s/(?P<repo>[^/]+/[^/]+)"


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


@dataclass(frozen=True)
class StoredFile:
    """A file's bytes, hashed once, as the Hub records them at upload (hashing them again at
    every GET and listing cost the loopback Hub about 0.4 ms per 512 KiB, on the cores the
    benchmarks measure)."""

    data: bytes
    lfs: bool

    @functools.cached_property
    def _digests(self) -> dict[str, Any]:
        if not self.lfs:
            return {"oid": git_blob_id(self.data)}
        sha = hashlib.sha256(self.data).hexdigest()
        pointer = lfs_pointer(sha, len(self.data))
        return {"oid": git_blob_id(pointer), "lfs": {"oid": sha, "size": len(self.data), "pointerSize": len(pointer)}}

    def entry(self, path: str) -> dict[str, Any]:
        digests = self._digests
        doc: dict[str, Any] = {"type": "file", "path": path, "size": len(self.data), "oid": digests["oid"]}
        if self.lfs:
            doc["lfs"] = dict(digests["lfs"])
        return doc

    def upload_oid(self) -> str:
        return self._digests["lfs"]["oid"] if self.lfs else self._digests["oid"]


@dataclass
class Repo:
    repo_id: str
    repo_type: str
    private: bool
    files: dict[str, StoredFile] = field(default_factory=dict)
    commits: list[dict[str, Any]] = field(default_factory=list)
    history: dict[str, dict[str, StoredFile]] = field(default_factory=dict)  # commit -> files at it
    pinned_head: str | None = None  # a view of the repository at one past commit

    @property
    def head(self) -> str:
        if self.pinned_head is not None:
            return self.pinned_head
        return hashlib.sha1(json.dumps([c["oid"] for c in self.commits]).encode()).hexdigest()


class HubServer:
    """``with HubServer(token) as hub:`` serves on ``hub.url`` until the block exits."""

    def __init__(self, token: str, *, deadline_s: float = 120.0):
        self.token = token
        self.deadline_s = deadline_s
        self.repos: dict[tuple[str, str], Repo] = {}
        self.lfs_store: dict[str, bytes] = {}
        self.requests: list[str] = []  # endpoint names, in arrival order
        self.counts: dict[str, int] = {}  # requests per endpoint name
        self.drop: dict[str, set[int]] = {}
        self.corrupt: set[str] = set()
        self.hold: dict[str, threading.Event] = {}
        self.arrived: dict[str, threading.Event] = {}
        self.file_faults: dict[str, list[str]] = {}  # resolve path -> faults, one per request (see DatasetFaults)
        self.stall_s = 30.0  # how long a "stall" fault keeps the connection silent
        # an outage: until ``outage_until`` (time.monotonic()), every request is answered with
        # ``outage_status`` and these headers (e.g. Retry-After, or the rate-limit headers of a 429)
        self.outage_until = 0.0
        self.outage_status = 503
        self.outage_headers: dict[str, str] = {}
        self.outage_answers = 0  # requests answered by the outage
        self.served: dict[str, int] = {}  # resolve path -> complete GETs answered
        self.observers: list[Any] = []  # callables(endpoint) run on every request (e.g. "is the local dir intact?")
        self.lock = threading.Lock()
        self._stop = threading.Event()
        handler = type("Handler", (_Handler,), {"hub": self})
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._httpd.daemon_threads = True
        self._httpd.timeout = 0.2
        self._thread = threading.Thread(target=self._serve, name="hub-server", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def _serve(self) -> None:
        end = time.monotonic() + self.deadline_s
        while not self._stop.is_set() and time.monotonic() < end:
            self._httpd.handle_request()
        self._httpd.server_close()

    def __enter__(self) -> "HubServer":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def sign(self, oid: str) -> str:
        return hmac.new(self.token.encode(), oid.encode(), hashlib.sha256).hexdigest()

    def repo(self, repo_id: str, repo_type: str = "model") -> Repo:
        return self.repos[(repo_type, repo_id)]

    def file(self, repo_id: str, path: str) -> bytes:
        return self.repo(repo_id).files[path].data


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, **extra: Any):
        super().__init__(message)
        self.status, self.message, self.code, self.extra = status, message, code, extra


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer
    protocol_version = "HTTP/1.0"  # one request per connection: nothing lingers after a test
    timeout = 5.0

    def log_message(self, format: str, *args: Any) -> None:  # quiet test output
        pass

    # ------------------------------------------------------------------ plumbing

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        path, query = unquote(url.path), parse_qs(url.query)
        try:
            name, handler, match = self._route(method, path)
            with self.hub.lock:
                self.hub.requests.append(name)
                for observe in self.hub.observers:
                    observe(name)
                self.hub.counts[name] = self.hub.counts.get(name, 0) + 1
                drop = self.hub.counts[name] in self.hub.drop.get(name, ())
                outage = time.monotonic() < self.hub.outage_until
                self.hub.outage_answers += outage
            if drop:
                self._drop()
                return
            if outage:
                raise _HTTPError(self.hub.outage_status, "the Hub is down for maintenance", **{"_headers": dict(
                    self.hub.outage_headers)})
            gate = self.hub.hold.get(name)
            if gate is not None:  # keep the client waiting (mid-request) until the test opens the gate
                self.hub.arrived.setdefault(name, threading.Event()).set()
                gate.wait(timeout=60)
            if name == "lfs_upload":  # a pre-signed URL, as the Hub hands out: the PUT carries no token
                if query.get("sig", [""])[0] != self.hub.sign(match.group("oid")):
                    raise _HTTPError(403, "bad upload signature")
            elif self.headers.get("Authorization") != f"Bearer {self.hub.token}":
                got = self.headers.get("Authorization")
                raise _HTTPError(401, f"Invalid credentials in Authorization header {got!r}")
            body = self._body()
            status, doc, headers = handler(match, query, body)
            if isinstance(doc, _Raw):
                self._send_raw(status, doc, headers)
                return
        except _HTTPError as err:
            extra = {k: v for k, v in err.extra.items() if k != "_headers"}
            status, doc, headers = err.status, {"error": err.message, **extra}, {"X-Error-Message": err.message}
            headers.update(err.extra.get("_headers", {}))
            if err.code:
                headers["X-Error-Code"] = err.code
        payload = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(payload)

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _drop(self) -> None:
        """Read half the request body, then close the socket without a response."""
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length // 2)
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self._dispatch("PUT")

    def _route(self, method: str, path: str) -> tuple[str, Any, re.Match]:
        routes = [
            ("POST", r"/api/repos/create", "create_repo", self._create_repo),
            ("GET", rf"/api/{_REPO}/revision/(?P<rev>[^/]+)", "repo_info", self._repo_info),
            ("POST", rf"/api/{_REPO}/paths-info/(?P<rev>[^/]+)", "paths_info", self._paths_info),
            ("GET", rf"/api/{_REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?", "tree", self._tree),
            ("POST", rf"/api/{_REPO}/preupload/(?P<rev>[^/]+)", "preupload", self._preupload),
            ("POST", rf"/api/{_REPO}/commit/(?P<rev>[^/]+)", "commit", self._commit),
            ("POST", r"/(?P<prefix>datasets/)?(?P<repo>[^/]+/[^/]+)\.git/info/lfs/objects/batch", "lfs_batch",
             self._lfs_batch),
            ("PUT", r"/lfs-upload/(?P<oid>[0-9a-f]{64})", "lfs_upload", self._lfs_upload),
            ("GET", r"/(?P<type>dataset)s/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)", "resolve",
             self._resolve_file),
            ("POST", r"/lfs-verify/(?P<oid>[0-9a-f]{64})", "lfs_verify", self._lfs_verify),
        ]
        for want, pattern, name, handler in routes:
            match = re.fullmatch(pattern, path)
            if match and want == method:
                return name, handler, match
        raise _HTTPError(404, f"no such endpoint: {method} {path}")

    def _repo(self, match: re.Match) -> Repo:
        repo_type = match.group("type") if "type" in match.re.groupindex else "model"
        repo = self.hub.repos.get((repo_type, match.group("repo")))
        if repo is None:
            raise _HTTPError(404, f"Repository {match.group('repo')} not found", "RepoNotFound")
        rev = match.groupdict().get("rev") or "main"
        if rev in ("main", repo.head):
            return repo
        if rev in repo.history:  # a past commit: the files as they were then
            return Repo(repo.repo_id, repo.repo_type, repo.private, dict(repo.history[rev]), repo.commits,
                        pinned_head=rev)
        raise _HTTPError(404, f"Revision {rev} not found", "RevisionNotFound")

    # ------------------------------------------------------------------ endpoints

    def _create_repo(self, match: re.Match, query: dict, body: bytes):
        doc = json.loads(body)
        repo_id = f"{doc['organization']}/{doc['name']}" if doc.get("organization") else f"user/{doc['name']}"
        key = (doc.get("type") or "model", repo_id)
        with self.hub.lock:
            if key in self.hub.repos:
                raise _HTTPError(409, "You already created this model repo", url=f"{self.hub.url}/{repo_id}")
            self.hub.repos[key] = Repo(repo_id, key[0], private=doc.get("visibility") == "private")
        return 200, {"url": f"{self.hub.url}/{repo_id}", "name": repo_id}, {}

    def _repo_info(self, match: re.Match, query: dict, body: bytes):
        repo = self._repo(match)
        with self.hub.lock:
            siblings = [{"rfilename": p} for p in sorted(repo.files)]
            return 200, {"id": repo.repo_id, "sha": repo.head, "private": repo.private, "siblings": siblings}, {}

    def _paths_info(self, match: re.Match, query: dict, body: bytes):
        repo = self._repo(match)
        wanted = parse_qs(body.decode()).get("paths", [])
        with self.hub.lock:
            out = [repo.files[p].entry(p) for p in wanted if p in repo.files]
            folders = {p for p in wanted if p not in repo.files and any(f.startswith(p + "/") for f in repo.files)}
        out += [{"type": "directory", "path": p, "oid": git_blob_id(p.encode())} for p in sorted(folders)]
        return 200, out, {}

    def _tree(self, match: re.Match, query: dict, body: bytes):
        repo = self._repo(match)
        prefix = (match.group("path") or "").strip("/")
        recursive = query.get("recursive", ["False"])[0].lower() == "true"
        with self.hub.lock:
            names = sorted(p for p in repo.files if not prefix or p.startswith(prefix + "/"))
            if prefix and not names:
                raise _HTTPError(404, f"{prefix} does not exist on main", "EntryNotFound")
            out, seen = [], set()
            for name in names:
                rest = name[len(prefix) + 1:] if prefix else name
                if recursive or "/" not in rest:
                    out.append(repo.files[name].entry(name))
                else:
                    folder = (prefix + "/" if prefix else "") + rest.split("/", 1)[0]
                    if folder not in seen:
                        seen.add(folder)
                        out.append({"type": "directory", "path": folder, "oid": git_blob_id(folder.encode())})
        return 200, out, {}

    def _preupload(self, match: re.Match, query: dict, body: bytes):
        repo = self._repo(match)
        files = []
        for item in json.loads(body)["files"]:
            lfs = item["path"].endswith(LFS_SUFFIXES) or item["size"] > LFS_THRESHOLD
            stored = repo.files.get(item["path"])
            files.append({"path": item["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False,
                          "oid": stored.upload_oid() if stored is not None and stored.lfs == lfs else None})
        return 200, {"files": files, "commitOid": repo.head}, {}

    def _lfs_batch(self, match: re.Match, query: dict, body: bytes):
        doc = json.loads(body)
        repo_type = "dataset" if match.group("prefix") else "model"
        if (repo_type, match.group("repo")) not in self.hub.repos:
            raise _HTTPError(404, "Repository not found", "RepoNotFound")
        if doc.get("operation") != "upload" or "basic" not in doc.get("transfers", []):
            raise _HTTPError(400, "only the basic upload transfer is implemented")
        objects = []
        for obj in doc["objects"]:
            entry: dict[str, Any] = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
            if obj["oid"] not in self.hub.lfs_store:
                entry["actions"] = {"upload": {"href": f"{self.hub.url}/lfs-upload/{obj['oid']}?sig={self.hub.sign(obj['oid'])}"},
                                    "verify": {"href": f"{self.hub.url}/lfs-verify/{obj['oid']}"}}
            objects.append(entry)
        return 200, {"transfer": "basic", "objects": objects}, {}

    def _lfs_upload(self, match: re.Match, query: dict, body: bytes):
        oid = match.group("oid")
        if hashlib.sha256(body).hexdigest() != oid:
            raise _HTTPError(400, f"uploaded content does not hash to {oid}")
        with self.hub.lock:
            self.hub.lfs_store[oid] = body
        return 200, {}, {}

    def _lfs_verify(self, match: re.Match, query: dict, body: bytes):
        doc = json.loads(body)
        stored = self.hub.lfs_store.get(match.group("oid"))
        if stored is None or len(stored) != doc.get("size"):
            raise _HTTPError(404, f"object {match.group('oid')} was not uploaded")
        return 200, {}, {}

    def _commit(self, match: re.Match, query: dict, body: bytes):
        repo = self._repo(match)
        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header" or not lines[0]["value"].get("summary"):
            raise _HTTPError(400, "a commit starts with a header line carrying a summary")
        with self.hub.lock:
            files = dict(repo.files)
            for line in lines[1:]:
                key, value = line["key"], line["value"]
                path = value["path"]
                if key == "file":
                    files[path] = StoredFile(base64.b64decode(value["content"]), lfs=False)
                elif key == "lfsFile":
                    data = self.hub.lfs_store.get(value["oid"])
                    if data is None:
                        raise _HTTPError(422, f"LFS object {value['oid']} for {path} was never uploaded")
                    files[path] = StoredFile(data, lfs=True)
                elif key == "deletedFile":
                    if files.pop(path, None) is None:
                        raise _HTTPError(404, f"{path} does not exist", "EntryNotFound")
                elif key == "deletedFolder":
                    doomed = [p for p in files if p.startswith(path.rstrip("/") + "/")]
                    for p in doomed:
                        del files[p]
                else:
                    raise _HTTPError(400, f"unknown commit operation {key!r}")
                if path in self.hub.corrupt and path in files and files[path].data:
                    data = bytearray(files[path].data)
                    data[0] ^= 1
                    files[path] = StoredFile(bytes(data), files[path].lfs)
            repo.files = files
            repo.commits.append({"summary": lines[0]["value"]["summary"], "operations": lines[1:],
                                 "oid": hashlib.sha1(body).hexdigest()})
            oid = repo.head
            repo.history[oid] = dict(files)
        return 200, {"commitUrl": f"{self.hub.url}/{repo.repo_id}/commit/{oid}", "commitOid": oid,
                     "pullRequestUrl": None}, {}


# ---------------------------------------------------------------------- dataset downloads
# Kept apart from the upload endpoints above: what the shard store's downloads need.


@dataclass
class _Raw:
    """A file body (not JSON), sent from ``start`` with the faults armed for its path."""

    data: bytes
    start: int
    path: str
    fault: str | None


def _resolve_file(self: _Handler, match: re.Match, query: dict, body: bytes):
    """``GET /datasets/{repo}/resolve/{rev}/{path}``: the file at that revision, with the headers
    the client reads (X-Repo-Commit, ETag, X-Linked-Etag / X-Linked-Size for LFS files,
    Content-Length, Accept-Ranges) and ``Range: bytes=N-`` answered with 206."""
    repo = self._repo(match)
    path = match.group("path")
    stored = repo.files.get(path)
    if stored is None:
        raise _HTTPError(404, f"{path} does not exist at {match.group('rev')}", "EntryNotFound")
    with self.hub.lock:
        faults = self.hub.file_faults.get(path) or []
        fault = faults.pop(0) if faults else None
    if fault == "503":
        raise _HTTPError(503, "Service temporarily unavailable")
    if fault == "429":
        raise _HTTPError(429, "Too many requests")
    start = 0
    wanted = self.headers.get("Range", "")
    if wanted.startswith("bytes=") and wanted.endswith("-"):
        start = min(int(wanted[6:-1]), len(stored.data))
    entry = stored.entry(path)
    headers = {"X-Repo-Commit": repo.head, "ETag": f'"{entry["oid"]}"', "Accept-Ranges": "bytes"}
    if stored.lfs:
        headers.update({"X-Linked-Etag": f'"{entry["lfs"]["oid"]}"', "X-Linked-Size": str(len(stored.data))})
    if start:
        headers["Content-Range"] = f"bytes {start}-{len(stored.data) - 1}/{len(stored.data)}"
    return (206 if start else 200), _Raw(stored.data, start, path, fault), headers


def _send_raw(self: _Handler, status: int, raw: _Raw, headers: dict) -> None:
    """The body with its fault: ``drop`` closes the socket halfway, ``stall`` goes silent halfway
    for ``hub.stall_s``, ``corrupt`` flips one byte; otherwise the whole body."""
    data = memoryview(raw.data)[raw.start:]  # sent as it is stored: no copy per GET
    if raw.fault == "corrupt" and data:
        damaged = bytearray(data)
        damaged[len(damaged) // 2] ^= 0xFF
        data = memoryview(damaged)
    self.send_response(status)
    self.send_header("Content-Type", "application/octet-stream")
    self.send_header("Content-Length", str(len(data)))
    for key, value in headers.items():
        self.send_header(key, value)
    self.end_headers()
    half = len(data) // 2
    try:
        if raw.fault == "drop":
            self.wfile.write(data[:half])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if raw.fault == "stall":
            self.wfile.write(data[:half])
            self.wfile.flush()
            self.hub._stop.wait(self.hub.stall_s)
        self.wfile.write(data[half:] if raw.fault == "stall" else data)
    except OSError:
        return  # the client gave up on a stalled transfer
    if raw.fault == "stall":
        return  # the client had given up on it by now: not a download it used
    with self.hub.lock:
        self.hub.served[raw.path] = self.hub.served.get(raw.path, 0) + 1


_Handler._resolve_file = _resolve_file
_Handler._send_raw = _send_raw


def seed_dataset(hub: HubServer, repo_id: str, files: dict[str, bytes]) -> str:
    """Create (or move ``main`` of) a dataset repository holding ``files`` (``.bin`` as LFS); the
    new commit, kept in the history so the former ones stay readable. ``None`` values delete."""
    with hub.lock:
        repo = hub.repos.setdefault(("dataset", repo_id), Repo(repo_id, "dataset", private=False))
        now = dict(repo.files)
        for path, data in files.items():
            if data is None:
                now.pop(path, None)
            else:
                now[path] = StoredFile(data, lfs=path.endswith(LFS_SUFFIXES) or len(data) > LFS_THRESHOLD)
        repo.files = now
        repo.commits.append({"summary": "seed", "operations": sorted(files),
                             "oid": hashlib.sha1(f"{len(repo.commits)}{sorted(files)}".encode()).hexdigest()})
        repo.history[repo.head] = dict(now)
        return repo.head
