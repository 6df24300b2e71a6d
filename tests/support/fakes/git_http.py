"""A smart-HTTP git server: `git http-backend` behind a small threaded HTTPS
server on 127.0.0.1 that demands `token` by Basic auth (any user name).

It records every request (method, path, query, headers, body size) so tests
can prove where the token travelled: `saw_token_outside_authorization()`
is True if the token showed up anywhere but the Authorization header.
Push is enabled (REMOTE_USER is set for authenticated requests).

`fail_next(status, times)` answers the next `times` requests with `status`
(an HTTP error page) instead of serving them. `hold(predicate)` makes every
request for which `predicate(method, path)` is true wait, AFTER git served it
(a push has updated the ref), until `release()`: `held` is set meanwhile, so
a test can kill the client mid-call knowing the side effect has happened.
"""

from __future__ import annotations

import base64
import http.server
import os
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

# git run by the tests: an environment of its own (no user config, no inherited variables)
CLEAN_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "GIT_CONFIG_NOSYSTEM": "1",
              "GIT_CONFIG_GLOBAL": "/dev/null", "HOME": "/nonexistent"}


@dataclass
class SeenRequest:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    authorized: bool


@dataclass
class GitHttpServer:
    root: Path                         # folder of bare repositories
    token: str
    ssl_context: object | None = None
    requests: list[SeenRequest] = field(default_factory=list)
    auth_headers: list[str] = field(default_factory=list)
    port: int = 0
    delay_s: float = 0.0               # hold each request this long (lets a /proc poller see git)
    failures: list[int] = field(default_factory=list)
    held: threading.Event = field(default_factory=threading.Event)
    _hold: object | None = None
    _release: threading.Event = field(default_factory=threading.Event)

    def fail_next(self, status: int, times: int = 1) -> None:
        self.failures.extend([status] * times)

    def hold(self, predicate) -> None:
        self.held.clear()
        self._release.clear()
        self._hold = predicate

    def release(self) -> None:
        self._hold = None
        self._release.set()

    def url(self, repo: str) -> str:
        scheme = "https" if self.ssl_context else "http"
        return f"{scheme}://127.0.0.1:{self.port}/{repo}"

    def start(self) -> GitHttpServer:
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            self.rfile.readline()
                            break
                        out.append(self.rfile.read(size))
                        self.rfile.readline()
                    return b"".join(out)
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def _handle(self):
                body = self._body()
                if owner.delay_s:
                    time.sleep(owner.delay_s)
                auth = self.headers.get("Authorization", "")
                ok = False
                if auth.startswith("Basic "):
                    owner.auth_headers.append(auth)
                    try:
                        _user, _, pw = base64.b64decode(auth[6:]).decode().partition(":")
                        ok = pw == owner.token
                    except ValueError:
                        ok = False
                hdrs = {k: v for k, v in self.headers.items() if k.lower() != "authorization"}
                owner.requests.append(SeenRequest(self.command, self.path, hdrs, body, ok))
                if owner.failures:
                    status = owner.failures.pop(0)
                    msg = f"error {status}\n".encode()
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                if not ok:
                    msg = b"authentication required\n"
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", 'Basic realm="afe-test"')
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                path, _, query = self.path.partition("?")
                env = dict(CLEAN_ENV, GIT_PROJECT_ROOT=str(owner.root), GIT_HTTP_EXPORT_ALL="1",
                           REQUEST_METHOD=self.command, PATH_INFO=path, QUERY_STRING=query,
                           CONTENT_TYPE=self.headers.get("Content-Type", ""),
                           CONTENT_LENGTH=str(len(body)), REMOTE_USER="afe-test", REMOTE_ADDR="127.0.0.1")
                if self.headers.get("Content-Encoding"):
                    env["HTTP_CONTENT_ENCODING"] = self.headers["Content-Encoding"]
                if self.headers.get("Git-Protocol"):
                    env["GIT_PROTOCOL"] = self.headers["Git-Protocol"]
                proc = subprocess.run(["git", "http-backend"], input=body, capture_output=True, env=env, check=False)
                head, _, payload = proc.stdout.partition(b"\r\n\r\n")
                if not _:
                    head, _, payload = proc.stdout.partition(b"\n\n")
                status = 200
                headers = []
                for line in head.decode("latin-1").splitlines():
                    k, _, v = line.partition(":")
                    if k.lower() == "status":
                        status = int(v.strip().split()[0])
                    elif k:
                        headers.append((k, v.strip()))
                hold = owner._hold
                if hold is not None and hold(self.command, path):
                    owner.held.set()
                    owner._release.wait(120)
                self.send_response(status)
                for k, v in headers:
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = _handle
            do_POST = _handle

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        if self.ssl_context is not None:
            self._server.socket = self.ssl_context.wrap_socket(self._server.socket, server_side=True)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> GitHttpServer:  # noqa: PYI034
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def saw_token_outside_authorization(self) -> bool:
        needle = self.token.encode()
        b64 = base64.b64encode(self.token.encode())
        for r in self.requests:
            text = (r.method + r.path + repr(r.headers)).encode()
            if needle in text or needle in r.body or b64 in text:
                return True
        return False

    def token_in_authorization(self) -> bool:
        for a in self.auth_headers:
            try:
                if base64.b64decode(a[6:]).decode().partition(":")[2] == self.token:
                    return True
            except ValueError:
                continue
        return False


def make_bare_repo(root: Path, name: str, files: dict[str, str], branch: str = "main") -> Path:
    """A bare repository `root/name` with one commit holding `files` on `branch`."""
    env = dict(CLEAN_ENV, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t", HOME=str(root))
    src = root / (name + ".src")
    subprocess.run(["git", "init", "-q", "-b", branch, str(src)], check=True, env=env)
    for rel, text in files.items():
        p = src / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    subprocess.run(["git", "-C", str(src), "add", "-A"], check=True, env=env)
    subprocess.run(["git", "-C", str(src), "commit", "-qm", "initial"], check=True, env=env)
    bare = root / name
    subprocess.run(["git", "clone", "-q", "--bare", str(src), str(bare)], check=True, env=env)
    subprocess.run(["rm", "-rf", "--", str(src)], check=True)
    os.chmod(bare, 0o755)
    return bare
