"""A local stand-in for the Hugging Face Hub: serves directories as model
repos over HTTP, with Range support, an emulated bandwidth and latency, and
injectable faults.

It answers the few endpoints ``huggingface_hub`` uses to download and
upload (repo info, tree listing, ``resolve`` with HEAD and ranged GET,
create repo, pre-upload and commit of regular files), so tests and
``bench fetch`` point ``huggingface_hub``'s endpoint at it instead of the
network. It is not a Hub: no LFS, no auth, no history beyond one commit.
"""

import base64
import hashlib
import json
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple
from urllib.parse import unquote, urlparse

CHUNK = 64 << 10


@dataclass
class Request:
    """One GET or HEAD of a repo file, as the fault hooks and tests see it."""

    method: str
    repo: str
    path: str
    range: Optional[Tuple[int, int]]  # inclusive byte range, when asked


# A fault hook returns None (serve normally) or one of: "drop" (send the
# headers and half the body, then close), "full" (answer 200 with the whole
# file, ignoring Range), "corrupt" (flip one byte of the body), "hang" (never
# answer), or an HTTP status code (or a (status, headers) pair) to answer
# with instead.
Fault = Callable[[Request], Optional[object]]


@dataclass
class Repo:
    root: Path
    sha: str


@dataclass
class HubState:
    repos: Dict[str, Repo] = field(default_factory=dict)
    upload_root: Optional[Path] = None
    bandwidth: Optional[float] = None  # bytes per second of the link, None = as fast as possible
    latency: float = 0.0  # seconds before each response
    faults: List[Fault] = field(default_factory=list)
    log: List[Request] = field(default_factory=list)
    bytes_sent: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    hang: threading.Event = field(default_factory=threading.Event)
    link_free_at: float = 0.0  # when the emulated link has sent what it was given
    stopped: bool = False

    def pace(self, nbytes: int) -> None:
        """Hold a sender until the shared link has carried ``nbytes`` more:
        parallel responses share the bandwidth, as on one network link."""
        if not self.bandwidth:
            return
        with self.lock:
            start = max(time.perf_counter(), self.link_free_at)
            self.link_free_at = start + nbytes / self.bandwidth
            done = self.link_free_at
        wait = done - time.perf_counter()
        if wait > 0:
            time.sleep(wait)


def _tree_sha(root: Path) -> str:
    h = hashlib.sha1()
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        st = f.stat()
        h.update(f"{f.relative_to(root)}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


def _files(root: Path) -> List[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and ".cache" not in p.parts)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    state: HubState

    def log_message(self, *args):  # quiet
        pass

    # -- routing ---------------------------------------------------------
    def do_HEAD(self):
        self._route("HEAD")

    def do_GET(self):
        self._route("GET")

    def do_POST(self):
        self._route("POST")

    def _route(self, method: str):
        if self.state.stopped:
            # A kept-alive connection outlives shutdown(): answer nothing.
            self.close_connection = True
            return
        url = urlparse(self.path)
        path = unquote(url.path)
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
        if m and method == "GET":
            return self._repo_info(m.group(1), m.group(2))
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(/.*)?", path)
        if m and method == "GET":
            return self._tree(m.group(1), m.group(2))
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if m and method in ("GET", "HEAD"):
            return self._resolve(method, m.group(1), m.group(2), m.group(3))
        if path == "/api/repos/create" and method == "POST":
            return self._create()
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/preupload/([^/]+)", path)
        if m and method == "POST":
            return self._preupload()
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/commit/([^/]+)", path)
        if m and method == "POST":
            return self._commit(m.group(1))
        self._json(404, {"error": f"not found: {path}"}, {"X-Error-Code": "EntryNotFound"})

    # -- responses -------------------------------------------------------
    def _json(self, status: int, obj, headers: Optional[dict] = None):
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _repo(self, repo_id: str, revision: Optional[str]) -> Optional[Repo]:
        """The repo, if it exists and ``revision`` is main or its commit."""
        repo = self.state.repos.get(repo_id)
        if repo is None:
            self._json(404, {"error": "Repository not found"},
                       {"X-Error-Code": "RepoNotFound"})
        elif revision not in (None, "main", repo.sha):
            self._json(404, {"error": f"Invalid rev id: {revision}"},
                       {"X-Error-Code": "RevisionNotFound"})
            return None
        return repo

    def _repo_info(self, repo_id: str, revision: Optional[str]):
        repo = self._repo(repo_id, revision)
        if repo is None:
            return
        siblings = [{"rfilename": str(f.relative_to(repo.root))} for f in _files(repo.root)]
        self._json(200, {"id": repo_id, "modelId": repo_id, "sha": repo.sha,
                         "siblings": siblings, "private": False})

    def _tree(self, repo_id: str, revision: str):
        repo = self._repo(repo_id, revision)
        if repo is None:
            return
        entries = []
        for f in _files(repo.root):
            rel = str(f.relative_to(repo.root))
            entries.append({"type": "file", "path": rel, "size": f.stat().st_size,
                            "oid": hashlib.sha1(rel.encode()).hexdigest()})
        self._json(200, entries)

    def _resolve(self, method: str, repo_id: str, revision: str, rel: str):
        repo = self._repo(repo_id, revision)
        if repo is None:
            return
        f = repo.root / rel
        if not f.is_file() or ".." in Path(rel).parts:
            return self._json(404, {"error": "Entry not found"},
                              {"X-Error-Code": "EntryNotFound"})
        size = f.stat().st_size
        byte_range = _parse_range(self.headers.get("Range"), size)
        request = Request(method, repo_id, rel, byte_range)
        with self.state.lock:
            self.state.log.append(request)
        fault = None
        for hook in list(self.state.faults):
            fault = hook(request)
            if fault is not None:
                break
        if self.state.latency:
            time.sleep(self.state.latency)
        if fault == "hang":
            self.state.hang.wait()
            self.close_connection = True
            return
        if isinstance(fault, int):
            return self._json(fault, {"error": f"injected {fault}"})
        if isinstance(fault, tuple):  # (status, headers)
            return self._json(fault[0], {"error": f"injected {fault[0]}"}, fault[1])
        etag = f'"{hashlib.sha1(f"{repo.sha}/{rel}".encode()).hexdigest()}"'
        start, end, status = 0, size - 1, 200
        if byte_range is not None and byte_range[0] >= size and fault != "full":
            return self._json(416, {"error": "Requested range not satisfiable"},
                              {"Content-Range": f"bytes */{size}"})
        if byte_range is not None and fault != "full":
            start, end = byte_range
            status = 206
        self.send_response(status)
        self.send_header("ETag", etag)
        self.send_header("X-Repo-Commit", repo.sha)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(end - start + 1))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        if method == "HEAD":
            return
        self._send_file(f, start, end - start + 1, fault)

    def _send_file(self, f: Path, start: int, length: int, fault):
        limit = length // 2 if fault == "drop" else length
        sent = 0
        with open(f, "rb") as fh:
            fh.seek(start)
            while sent < limit:
                chunk = bytearray(fh.read(min(CHUNK, limit - sent)))
                if fault == "corrupt" and sent == 0 and chunk:
                    chunk[len(chunk) // 2] ^= 0xFF
                self.state.pace(len(chunk))
                try:
                    self.wfile.write(chunk)
                except (BrokenPipeError, ConnectionResetError):
                    return
                sent += len(chunk)
        with self.state.lock:
            self.state.bytes_sent += sent
        if fault == "drop":
            self.close_connection = True
            self.wfile.flush()

    # -- uploads (regular files only: the payload is in the commit) ------
    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n)

    def _create(self):
        body = json.loads(self._body() or b"{}")
        name = body.get("name")
        org = body.get("organization")
        repo_id = f"{org}/{name}" if org else name
        if "/" not in repo_id:
            repo_id = f"user/{repo_id}"
        self._ensure_repo(repo_id)
        self._json(200, {"url": f"{self._origin()}/{repo_id}", "name": repo_id})

    def _ensure_repo(self, repo_id: str) -> Repo:
        repo = self.state.repos.get(repo_id)
        if repo is None:
            if self.state.upload_root is None:
                raise RuntimeError("uploads need HubServer(upload_root=...)")
            root = self.state.upload_root / repo_id.replace("/", "--")
            root.mkdir(parents=True, exist_ok=True)
            repo = self.state.repos[repo_id] = Repo(root, _tree_sha(root))
        return repo

    def _preupload(self):
        body = json.loads(self._body() or b"{}")
        files = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
                  "oid": None} for f in body.get("files", [])]
        self._json(200, {"files": files, "commitOid": None})

    def _commit(self, repo_id: str):
        repo = self._ensure_repo(repo_id)
        for line in self._body().splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            if item.get("key") == "file":
                value = item["value"]
                dst = repo.root / value["path"]
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.write_bytes(base64.b64decode(value["content"]))
            elif item.get("key") == "deletedFile":
                (repo.root / item["value"]["path"]).unlink(missing_ok=True)
        repo.sha = _tree_sha(repo.root)
        self._json(200, {"commitOid": repo.sha,
                         "commitUrl": f"{self._origin()}/{repo_id}/commit/{repo.sha}",
                         "success": True})

    def _origin(self) -> str:
        return f"http://{self.headers.get('Host')}"


def _parse_range(header: Optional[str], size: int) -> Optional[Tuple[int, int]]:
    m = re.fullmatch(r"bytes=(\d+)-(\d*)", (header or "").strip())
    if not m:
        return None
    start = int(m.group(1))
    end = int(m.group(2)) if m.group(2) else size - 1
    return start, min(end, size - 1)


class _QuietServer(ThreadingHTTPServer):
    """A client that closes its connection early (a fetch cancelled, a
    process stopped) is no error of the server's: no traceback for it."""

    daemon_threads = True

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


class HubServer:
    """Serve ``{repo_id: directory}`` as Hub model repos on 127.0.0.1.

    Use as a context manager; ``url`` is the endpoint to give
    ``huggingface_hub`` (``endpoint=`` or ``HF_ENDPOINT``).
    """

    def __init__(self, repos: Optional[Dict[str, Path]] = None, *,
                 bandwidth: Optional[float] = None, latency: float = 0.0,
                 upload_root: Optional[Path] = None):
        self.state = HubState(bandwidth=bandwidth, latency=latency,
                              upload_root=Path(upload_root) if upload_root else None)
        for repo_id, root in (repos or {}).items():
            self.add(repo_id, root)
        handler = type("Handler", (_Handler,), {"state": self.state})
        self._httpd = _QuietServer(("127.0.0.1", 0), handler)
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def add(self, repo_id: str, root: Path) -> None:
        root = Path(root)
        self.state.repos[repo_id] = Repo(root, _tree_sha(root))

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def log(self) -> List[Request]:
        return self.state.log

    @property
    def faults(self) -> List[Fault]:
        return self.state.faults

    def ranged(self, suffix: str = ".blob") -> List[Request]:
        """The GETs of expert blobs (``experts/*{suffix}``): record fetches.
        Dense records (``spine/``) are downloaded whole with the spine."""
        return [r for r in self.log if r.method == "GET" and r.path.endswith(suffix)
                and r.path.startswith("experts/")]

    def start(self) -> "HubServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self.state.stopped = True
        self.state.hang.set()
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def main(argv=None) -> int:
    """Serve directories as Hub repos until interrupted (``bench fetch``
    runs it in its own process, so serving takes no time from a case)."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m mlx_streaming.testing.hubserver")
    p.add_argument("--repo", action="append", required=True, metavar="ORG/NAME=DIR")
    p.add_argument("--bandwidth-mbps", type=float, default=None, help="MB/s of the link")
    p.add_argument("--latency-ms", type=float, default=0.0, help="before each answer")
    args = p.parse_args(argv)
    repos = dict(r.split("=", 1) for r in args.repo)
    server = HubServer({k: Path(v) for k, v in repos.items()},
                       bandwidth=args.bandwidth_mbps * 1e6 if args.bandwidth_mbps else None,
                       latency=args.latency_ms / 1e3)
    server.start()
    print(server.url, flush=True)
    try:
        sys.stdin.read()  # serve until the parent closes our stdin (or kills us)
    except KeyboardInterrupt:
        pass
    server.stop()
    return 0


if __name__ == "__main__":
    from ..cli import leave

    leave(main())
