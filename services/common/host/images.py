"""The local images: a Debian base made with debootstrap (no registry
needed), the default sandbox image and the egress proxy image, all built
from `deploy/images/`; and, on request, the agent preset images
(`deploy/images/agents/NAME/`, `build_agent_image`).

`ensure_images()` builds whatever is missing or stale and stays quiet when
all three are present and current; `force=True` rebuilds the sandbox and
proxy images (the base is only rebuilt when it is missing: it is the slow,
network-bound step). The sandbox and proxy images carry a label hashing
their inputs (`image_digest`: their folder's files and the base image's id),
so a changed Dockerfile or source is rebuilt once and then kept.

The sandbox image holds a small C library (`sandbox/statx-compat.c`, compiled
on this machine into the build's context, preloaded into every program of
the image) that makes `ls -l` and `stat` work under gVisor.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

from services.common.config.model import DEFAULT_PROXY_IMAGE, DEFAULT_SANDBOX_IMAGE
from services.common.config.presets import PRESETS, Preset
from services.common.errors import FailedPrecondition, InvalidArgument, Unavailable
from services.common.secrecy.childenv import (
    DEFAULT_PATH,
    DOCKER_CLI_NAMES,
    PROXY_NAMES,
    docker_cli_env,
    tool_env,
)

log = logging.getLogger(__name__)

BASE_IMAGE = os.environ.get("AFE_BASE_IMAGE", "afe/base:bookworm")
IMAGES_DIR = Path(__file__).resolve().parents[3] / "deploy" / "images"
SANDBOX_IMAGE = DEFAULT_SANDBOX_IMAGE
PROXY_IMAGE = DEFAULT_PROXY_IMAGE

Progress = Callable[[str], None]

# build-base.sh runs debootstrap (apt over HTTP: the operator's proxies and
# mirror) and `docker import` (the docker CLI's settings); nothing else (R33).
BASE_BUILD_NAMES = (*DOCKER_CLI_NAMES, *PROXY_NAMES, "AFE_DEBIAN_MIRROR")


def _present(image: str) -> bool:
    r = subprocess.run(["docker", "image", "inspect", image], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=False, env=docker_cli_env())
    return r.returncode == 0


def _run(argv: list[str], what: str, progress: Progress, env: dict[str, str]) -> None:
    progress(f"{what}...")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    tail: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip()
        tail = [*tail, line][-30:]
        if line.startswith(("Step ", "#", "built ", "debootstrap", "base image")):
            progress("  " + line)
    if proc.wait() != 0:
        raise FailedPrecondition(f"{what} failed (exit {proc.returncode}); last output:\n" + "\n".join(tail))


def docker_host(environ: Mapping[str, str] | None = None) -> str:
    """The engine address the docker CLI and docker-py use: DOCKER_HOST, else the default socket."""
    src = os.environ if environ is None else environ
    return src.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


def check_engine(environ: Mapping[str, str] | None = None) -> None:
    """Raise Unavailable, naming the address tried, when the Docker engine does not answer."""
    try:
        r = subprocess.run(["docker", "version", "--format", "{{.Server.Version}}"], capture_output=True,
                           text=True, check=False, env=docker_cli_env(environ), timeout=60)
    except FileNotFoundError:
        raise Unavailable("the docker command is not installed; install the Docker CLI (docker.io or "
                          "docker-ce-cli) and retry") from None
    except subprocess.TimeoutExpired:
        r = subprocess.CompletedProcess([], 1, "", "no answer in 60 s")
    if r.returncode != 0:
        why = next((ln.strip() for ln in reversed(r.stderr.splitlines()) if ln.strip()), "")[:300]
        raise Unavailable(f"the Docker engine at {docker_host(environ)} is not reachable"
                          + (f" ({why})" if why else "")
                          + ": start it, or set DOCKER_HOST to its address, and retry")


# The label of a local image (sandbox, proxy) that hashes its inputs (`image_digest`).
IMAGE_DIGEST_LABEL = "afe.image.digest"
# sandbox/: the gVisor statx library's source, and what it is compiled to in the build context.
STATX_SOURCE = "statx-compat.c"
STATX_LIBRARY = "afe-statx.so"
# The host's C compiler reads nothing but PATH and its own settings (R33).
CC_NAMES = ("CC",)


def image_digest(folder: Path, base_id: str) -> str:
    """A hash of every input of a local image: the files of its folder
    (Dockerfile, sources) and the base image's id."""
    h = hashlib.sha256(base_id.encode() + b"\0")
    for f in sorted(p for p in folder.iterdir() if p.is_file()):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:32]


def c_compiler() -> str | None:
    """This machine's C compiler (CC, else gcc or cc on PATH), or None."""
    env = tool_env(CC_NAMES)
    return env.get("CC") or shutil.which("gcc", path=env["PATH"]) or shutil.which("cc", path=env["PATH"])


def _compile_statx(source: Path, out: Path, progress: Progress) -> None:
    """The gVisor statx library (statx-compat.c), built with this machine's C compiler. Without
    one the image is built without it (an empty file: the Dockerfile preloads nothing), so afe
    still starts on a machine with only Python, git and Docker; gVisor sandboxes then lack
    `ls -l` and `stat`, which the message says and `make images` mends once a compiler is there."""
    cc = c_compiler()
    if not cc:
        progress(f"warning: no C compiler on this machine: {SANDBOX_IMAGE} is built without {source.name}, so "
                 "`ls -l` and `stat` fail in gVisor sandboxes (runtime: gvisor; runc is not affected). Install "
                 "one (Debian/Ubuntu: `apt-get install gcc libc6-dev`) or name it in CC, then run `make images`")
        out.write_bytes(b"")
        return
    _run([cc, "-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-s", "-o", str(out), str(source)],
         f"compiling {source.name} with {cc}", progress, tool_env(CC_NAMES))


def _build_local(image: str, folder: Path, base: str, digest: str, progress: Progress) -> None:
    """`docker build` of a folder of deploy/images, from a copy of it (plus the
    compiled statx library when the folder has its source)."""
    with tempfile.TemporaryDirectory(prefix=f"afe-image-{folder.name}-") as tmp:
        ctx = Path(tmp)
        for f in folder.iterdir():
            if f.is_file():
                shutil.copy2(f, ctx / f.name)
        if (folder / STATX_SOURCE).is_file():
            _compile_statx(folder / STATX_SOURCE, ctx / STATX_LIBRARY, progress)
        _run(["docker", "build", "--build-arg", f"BASE={base}", "--label", f"{IMAGE_DIGEST_LABEL}={digest}",
              "-t", image, str(ctx)], f"building {image}", progress, docker_cli_env())


def ensure_images(progress: Progress = print, force: bool = False,
                  sandbox_image: str = SANDBOX_IMAGE, proxy_image: str = PROXY_IMAGE) -> list[str]:
    """Build missing or stale images (all of them with force, except an existing base).

    Returns the names of the images that were built.
    """
    check_engine()
    built: list[str] = []
    base = BASE_IMAGE
    if not _present(base):
        if base != "afe/base:bookworm":
            _run(["docker", "pull", base], f"pulling {base}", progress, docker_cli_env())
        else:
            _run(["bash", str(IMAGES_DIR / "build-base.sh"), base],
                 f"building {base} with debootstrap (a few minutes)", progress, tool_env(BASE_BUILD_NAMES))
        built.append(base)
    base_id = _image_id(base)
    if base_id is None:
        raise FailedPrecondition(f"the base image {base} is missing after it was built; run `afe images build` "
                                 "again")
    for image, folder in ((sandbox_image, "sandbox"), (proxy_image, "proxy")):
        digest = image_digest(IMAGES_DIR / folder, base_id)
        if (IMAGES_DIR / folder / STATX_SOURCE).is_file() and not c_compiler():
            digest += "-nocc"       # built without the statx library: built again once a compiler is there
        if force or _image_label(image, IMAGE_DIGEST_LABEL) != digest:
            _build_local(image, IMAGES_DIR / folder, base, digest, progress)
            built.append(image)
    if built:
        progress("images ready: " + ", ".join(built))
    return built


# -- project images (`afe images build` with a config folder, docs/GUIDE.md) ------

PROJECT_PREFIX = "afe/project-"
_PROJECT_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")


def project_images(config_dir: Path) -> list[tuple[str, Path]]:
    """(image, folder) of every `CONFIG/images/NAME/Dockerfile`: image afe/project-NAME:latest."""
    root = config_dir / "images"
    if not root.is_dir():
        return []
    out = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and (p / "Dockerfile").is_file()):
        if not _PROJECT_NAME.match(folder.name):
            raise InvalidArgument(f"{folder}: a project image folder is named with lowercase letters, digits "
                                  "and '-'; rename it")
        out.append((f"{PROJECT_PREFIX}{folder.name}:latest", folder))
    return out


def build_project_images(config_dir: Path, progress: Progress = print, force: bool = False) -> list[str]:
    """Build each project image (FROM afe/sandbox) that is missing, or all with force."""
    built = []
    for image, folder in project_images(config_dir):
        if force or not _present(image):
            _run(["docker", "build", "-t", image, str(folder)], f"building {image} from {folder}", progress,
                 docker_cli_env())
            built.append(image)
    return built


def image_present(image: str) -> bool:
    return _present(image)


# -- agent preset images (`afe images build --agent NAME`, docs/AGENTS.md) ------

AGENT_DIGEST_LABEL = "afe.agent.digest"


def _image_id(image: str) -> str | None:
    r = subprocess.run(["docker", "image", "inspect", "--format", "{{.Id}}", image], capture_output=True,
                       text=True, check=False, env=docker_cli_env())
    return r.stdout.strip() if r.returncode == 0 else None


def _image_label(image: str, label: str) -> str | None:
    r = subprocess.run(["docker", "image", "inspect", "--format", f'{{{{index .Config.Labels "{label}"}}}}',
                        image], capture_output=True, text=True, check=False, env=docker_cli_env())
    return r.stdout.strip() if r.returncode == 0 else None


def agent_image_digest(preset: Preset, base: str = SANDBOX_IMAGE) -> str:
    """A hash of every input of a preset's image: the files of its build
    folder (Dockerfile, package.json, package-lock.json, config) and the
    base image's id. Raises FailedPrecondition when the base is missing."""
    base_id = _image_id(base)
    if base_id is None:
        raise FailedPrecondition(f"the base image {base} is missing; run `afe images build` first")
    h = hashlib.sha256(base_id.encode() + b"\0")
    for f in sorted(p for p in preset.context_dir.iterdir() if p.is_file()):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:32]


def agent_image_state(preset: Preset, base: str = SANDBOX_IMAGE) -> str:
    """"ready", "missing", or "stale" (built from other inputs than today's)."""
    label = _image_label(preset.image, AGENT_DIGEST_LABEL)
    if label is None:
        return "missing"
    try:
        return "ready" if label == agent_image_digest(preset, base) else "stale"
    except FailedPrecondition:
        return "stale"


# What the host's npm reads besides PATH HOME LANG TZ (R33): the operator's
# proxies, CA bundle and registry (also from ~/.npmrc, under HOME).
NPM_NAMES = (*PROXY_NAMES, "NODE_EXTRA_CA_CERTS", "NPM_CONFIG_REGISTRY", "npm_config_registry",
             "NPM_CONFIG_CAFILE", "npm_config_cafile", "XDG_CACHE_HOME")


def npm_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """npm's download cache for the agent images (kept between builds)."""
    src = os.environ if environ is None else environ
    base = src.get("XDG_CACHE_HOME") or os.path.join(src.get("HOME") or "/root", ".cache")
    return Path(base) / "afe" / "npm"


def _npm_ci(preset: Preset, ctx: Path, progress: Progress) -> None:
    """`npm ci` of the preset's lock into `ctx` on this machine: exact
    versions and integrity hashes from the lock, no install scripts."""
    npm = shutil.which("npm", path=os.environ.get("PATH") or DEFAULT_PATH)
    if npm is None:
        raise FailedPrecondition("building an agent image needs npm on this machine (it installs the pinned "
                                 "packages): install it, e.g. `apt-get install nodejs npm`, and retry")
    env = tool_env(NPM_NAMES)
    if os.environ.get("AFE_CA_FILE") and "NODE_EXTRA_CA_CERTS" not in env:
        env["NODE_EXTRA_CA_CERTS"] = os.environ["AFE_CA_FILE"]   # the operator's CA (a mirror, a proxy)
    env.update(npm_config_update_notifier="false", npm_config_fund="false", npm_config_audit="false")
    cache = npm_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    _run([npm, "ci", "--ignore-scripts", "--omit=dev", "--no-audit", "--no-fund", "--prefer-offline",
          "--cache", str(cache), "--prefix", str(ctx)],
         f"npm ci {preset.package}@{preset.version} (cache {cache})", progress, env)


def build_agent_image(name: str, progress: Progress = print, force: bool = False,
                      base: str = SANDBOX_IMAGE) -> bool:
    """Build preset `name`'s image unless it is there with today's inputs (or
    with `force`). The npm packages are installed on this machine from the
    committed lock (npm's cache keeps them between builds); the image build
    itself runs without network. Returns True when it built."""
    preset = PRESETS.get(name)
    if preset is None:
        raise InvalidArgument(f"no agent preset named {name!r}; presets: {', '.join(PRESETS)}")
    check_engine()
    if _image_id(base) is None:
        ensure_images(progress)
    digest = agent_image_digest(preset, base)
    if not force and _image_label(preset.image, AGENT_DIGEST_LABEL) == digest:
        return False
    with tempfile.TemporaryDirectory(prefix=f"afe-agent-{preset.name}-") as tmp:
        ctx = Path(tmp)
        for f in preset.context_dir.iterdir():
            if f.is_file():
                shutil.copy2(f, ctx / f.name)
        _npm_ci(preset, ctx, progress)
        _run(["docker", "build", "--network", "none", "--build-arg", f"BASE={base}",
              "--label", f"{AGENT_DIGEST_LABEL}={digest}", "--label", f"afe.agent.preset={preset.name}",
              "-t", preset.image, str(ctx)],
             f"building {preset.image} ({preset.package} {preset.version})", progress, docker_cli_env())
    progress(f"image ready: {preset.image}")
    return True
