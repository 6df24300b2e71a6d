"""A package registry and git host over HTTPS, standing in for
registry.npmjs.org, pypi.org and a git forge in the egress rules tests (R44).

It runs in a container on the egress proxies' outside network (the proxy
resolves its names there), from the sandbox image, with this file mounted:

    python3 package_host.py CERT KEY [PORT]

and speaks, on every name it is reached by:

- the npm registry API: GET /<name> (the packument; `@scope%2fname` too),
  GET /<name>/-/<file>.tgz, PUT /<name> (`npm publish`: the version lands);
- the PyPI simple API (PEP 503): GET /simple/<name>/, GET /packages/<file>;
- an upload store: PUT or POST /upload/<path> keeps the body at the path's
  normal form (escapes decoded, dot segments resolved, as many servers do),
  GET /upload/<path> gives it back (404 when nothing landed);
- git smart HTTP (`git http-backend`, push enabled): GET .../info/refs,
  POST .../git-upload-pack, POST .../git-receive-pack, repositories in
  /tmp/git.

Seeded with npm package `demo-pkg` 1.0.0, the wheel `demo_pkg-1.0` and the
bare repository `demo.git`. Every request is printed on stdout as one JSON
line ({"method", "path", "host", "bytes"}) before it is answered, so a test
can tell what reached the origin. Standard library and git only.
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import io
import json
import os
import posixpath
import ssl
import subprocess
import sys
import tarfile
import threading
import urllib.parse
import zipfile

GIT_ROOT = "/tmp/git"
GIT_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null",
           "HOME": "/tmp"}
LOCK = threading.Lock()
NPM: dict[str, dict[str, bytes]] = {}        # name -> version -> tarball
UPLOADS: dict[str, bytes] = {}
FILES: dict[str, bytes] = {}                 # /packages/<file> -> bytes


def npm_tarball(name: str, version: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for rel, text in (("package/package.json", json.dumps({"name": name, "version": version,
                                                                "main": "index.js"})),
                          ("package/index.js", f"module.exports = {json.dumps(name + '@' + version)};\n")):
            data = text.encode()
            info = tarfile.TarInfo(rel)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def wheel(dist: str, version: str) -> tuple[str, bytes]:
    name = f"{dist}-{version}-py3-none-any.whl"
    files = {f"{dist}/__init__.py": b"VALUE = 1\n",
             f"{dist}-{version}.dist-info/METADATA": (
                 f"Metadata-Version: 2.1\nName: {dist.replace('_', '-')}\nVersion: {version}\n").encode(),
             f"{dist}-{version}.dist-info/WHEEL": (
                 b"Wheel-Version: 1.0\nGenerator: afe-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")}
    record = "".join(f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b'=').decode()},"
                     f"{len(d)}\n" for p, d in files.items()) + f"{dist}-{version}.dist-info/RECORD,,\n"
    files[f"{dist}-{version}.dist-info/RECORD"] = record.encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for p, d in files.items():
            z.writestr(p, d)
    return name, buf.getvalue()


def seed() -> None:
    NPM["demo-pkg"] = {"1.0.0": npm_tarball("demo-pkg", "1.0.0")}
    name, data = wheel("demo_pkg", "1.0")
    FILES[name] = data
    src = "/tmp/demo-src"
    env = dict(GIT_ENV, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t")
    subprocess.run(["git", "init", "-q", "-b", "main", src], check=True, env=env)
    with open(f"{src}/README", "w") as f:
        f.write("demo\n")
    subprocess.run(["git", "-C", src, "add", "-A"], check=True, env=env)
    subprocess.run(["git", "-C", src, "commit", "-qm", "initial"], check=True, env=env)
    os.makedirs(GIT_ROOT, exist_ok=True)
    subprocess.run(["git", "clone", "-q", "--bare", src, f"{GIT_ROOT}/demo.git"], check=True, env=env)


def packument(host: str, name: str) -> dict:
    versions = {}
    for v, tgz in NPM[name].items():
        file = f"{name.rsplit('/', 1)[-1]}-{v}.tgz"
        versions[v] = {"name": name, "version": v, "dist": {
            "tarball": f"https://{host}/{name}/-/{file}", "shasum": hashlib.sha1(tgz).hexdigest(),
            "integrity": "sha512-" + base64.b64encode(hashlib.sha512(tgz).digest()).decode()}}
    latest = max(NPM[name], key=lambda v: tuple(int(x) for x in v.split(".")))
    return {"_id": name, "name": name, "dist-tags": {"latest": latest}, "versions": versions}


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def log_message(self, *args) -> None:  # the JSON lines are the log
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

    def _send(self, status: int, data: bytes = b"", ctype: str = "text/plain", headers: tuple = ()) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        for k, v in headers:
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _json(self, status: int, obj: object) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json")

    def handle_any(self) -> None:
        body = self._body()
        host = (self.headers.get("Host") or "").split(":")[0]
        print(json.dumps({"method": self.command, "path": self.path, "host": host, "bytes": len(body)}),
              flush=True)
        raw, _, query = self.path.partition("?")
        path = urllib.parse.unquote(raw)
        if path.startswith("/settle/"):                 # the test's own marker (egress_hosts.py)
            return self._send(200)
        if raw.endswith(("/info/refs", "/git-upload-pack", "/git-receive-pack")):
            return self._git(raw, query, body)
        if path.startswith("/simple/"):
            return self._simple(host, path)
        if path.startswith("/packages/"):
            data = FILES.get(path[len("/packages/"):])
            return self._send(200, data, "application/octet-stream") if data else self._send(404, b"no file\n")
        if path.startswith("/upload/"):
            key = posixpath.normpath(path)
            if self.command in ("PUT", "POST"):
                with LOCK:
                    UPLOADS[key] = body
                return self._json(201, {"ok": True, "stored": key})
            data = UPLOADS.get(key)
            return self._send(200, data) if data is not None else self._send(404, b"nothing uploaded\n")
        if path.startswith("/-/"):
            return self._json(404, {"error": "not here"})
        return self._npm(host, path, body)

    def _npm(self, host: str, path: str, body: bytes) -> None:
        name, sep, file = path.lstrip("/").partition("/-/")
        if self.command in ("GET", "HEAD"):
            if name not in NPM:
                return self._json(404, {"error": "not found"})
            if sep:
                version = file.removesuffix(".tgz").rsplit("-", 1)[-1]
                tgz = NPM[name].get(version)
                return self._send(200, tgz, "application/octet-stream") if tgz else self._json(404, {})
            return self._json(200, packument(host, name))
        if self.command == "PUT" and not sep:             # npm publish
            try:
                doc = json.loads(body)
                for att in doc["_attachments"].values():
                    tgz = base64.b64decode(att["data"])
                version = next(iter(doc["versions"]))
            except (ValueError, KeyError, StopIteration):
                return self._json(400, {"error": "not a publish document"})
            with LOCK:
                NPM.setdefault(name, {})[version] = tgz
            return self._json(201, {"ok": True, "id": name})
        return self._json(405, {"error": "method not allowed"})

    def _simple(self, host: str, path: str) -> None:
        project = path[len("/simple/"):].strip("/")
        links = [f'<a href="/packages/{f}#sha256={hashlib.sha256(d).hexdigest()}">{f}</a>'
                 for f, d in sorted(FILES.items()) if f.split("-")[0].replace("_", "-") == project]
        if not links:
            return self._send(404, b"no project\n")
        page = f"<!DOCTYPE html><html><body>{''.join(links)}</body></html>\n".encode()
        return self._send(200, page, "text/html")

    def _git(self, raw: str, query: str, body: bytes) -> None:
        env = dict(GIT_ENV, GIT_PROJECT_ROOT=GIT_ROOT, GIT_HTTP_EXPORT_ALL="1", REQUEST_METHOD=self.command,
                   PATH_INFO=urllib.parse.unquote(raw), QUERY_STRING=query,
                   CONTENT_TYPE=self.headers.get("Content-Type", ""), CONTENT_LENGTH=str(len(body)),
                   REMOTE_USER="tester", REMOTE_ADDR="127.0.0.1")
        if self.headers.get("Content-Encoding"):
            env["HTTP_CONTENT_ENCODING"] = self.headers["Content-Encoding"]
        if self.headers.get("Git-Protocol"):
            env["GIT_PROTOCOL"] = self.headers["Git-Protocol"]
        proc = subprocess.run(["git", "http-backend"], input=body, capture_output=True, env=env, check=False)
        head, sep, payload = proc.stdout.partition(b"\r\n\r\n")
        if not sep:
            head, _, payload = proc.stdout.partition(b"\n\n")
        status, headers = 200, []
        for line in head.decode("latin-1").splitlines():
            k, _, v = line.partition(":")
            if k.lower() == "status":
                status = int(v.strip().split()[0])
            elif k and k.lower() != "content-length":
                headers.append((k, v.strip()))
        self.send_response(status)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = handle_any


def main(argv: list[str]) -> None:
    cert, key = argv[1], argv[2]
    port = int(argv[3]) if len(argv) > 3 else 443
    seed()
    server = http.server.ThreadingHTTPServer(("0.0.0.0", port), Handler)
    server.daemon_threads = True
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    print(json.dumps({"ready": port}), flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv)
