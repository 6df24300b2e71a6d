"""Checks of the deployment files' process separation, used by test_deploy.py
(kept apart so the positive-control tests can run them on mutated copies)."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SYSTEMD = ROOT / "deploy" / "systemd"
COMPOSE = ROOT / "deploy" / "compose" / "compose.yaml"
SERVICES = ("sandbox", "credentials", "scheduler", "gateway")
MODULES = {"sandbox": "services.sandbox.main", "credentials": "services.credentials.main",
           "scheduler": "services.scheduler.main", "gateway": "gateway.main"}
# who may connect to whose socket (DESIGN section 1)
CALLERS = {"sandbox": {"scheduler"}, "credentials": {"scheduler"}, "scheduler": {"gateway"}}
HARDENING = {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
             "PrivateDevices": "yes", "RestrictNamespaces": "yes", "UMask": "0077",
             "ProtectKernelTunables": "yes", "LockPersonality": "yes", "RestrictSUIDSGID": "yes"}


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    out: dict[str, dict[str, list[str]]] = {}
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            out.setdefault(section, {})
            continue
        key, _, value = line.partition("=")
        out.setdefault(section, {}).setdefault(key.strip(), []).append(value.strip())
    return out


def load_units() -> dict[str, dict]:
    return {svc: parse_unit((SYSTEMD / f"afe-{svc}.service").read_text()) for svc in SERVICES}


def parse_sysusers(text: str) -> dict[str, set[str]]:
    """group -> members (m lines, plus users whose primary group it is)."""
    members: dict[str, set[str]] = {}
    for line in text.splitlines():
        parts = line.split()
        if not parts or parts[0].startswith("#"):
            continue
        if parts[0] == "m":
            members.setdefault(parts[2], set()).add(parts[1])
        elif parts[0] == "u" and ":" in parts[2]:
            members.setdefault(parts[2].split(":", 1)[1], set()).add(parts[1])
    return members


def one(unit: dict, key: str) -> str | None:
    values = unit.get("Service", {}).get(key, [])
    return values[-1] if values else None


def words(unit: dict, key: str) -> list[str]:
    return [w for v in unit.get("Service", {}).get(key, []) for w in v.split()]


def unit_problems(units: dict[str, dict], sysusers: dict[str, set[str]]) -> list[str]:
    problems: list[str] = []
    users = [one(u, "User") for u in units.values()]
    if len(set(users)) != len(users) or None in users or "root" in users:
        problems.append(f"each unit needs its own non-root User=: {users}")
    for svc, unit in units.items():
        envs = unit.get("Service", {}).get("EnvironmentFile", [])
        if envs != [f"/etc/afe/{svc}.env"]:
            problems.append(f"{svc}: EnvironmentFile must be only /etc/afe/{svc}.env, got {envs}")
        for key, want in HARDENING.items():
            if one(unit, key) != want:
                problems.append(f"{svc}: {key} must be {want}, got {one(unit, key)}")
        if "CapabilityBoundingSet" not in unit.get("Service", {}):
            problems.append(f"{svc}: CapabilityBoundingSet= missing")
        if not set(words(unit, "RestrictAddressFamilies")) <= {"AF_UNIX", "AF_INET", "AF_INET6"}:
            problems.append(f"{svc}: RestrictAddressFamilies too wide")
        exec_start = one(unit, "ExecStart") or ""
        if f"-m {MODULES[svc]} " not in exec_start:
            problems.append(f"{svc}: ExecStart does not run {MODULES[svc]}")
        if "--ops-host 127.0.0.1" not in exec_start:
            problems.append(f"{svc}: ops endpoints must bind 127.0.0.1 (R23)")
        if "--link-fd 0" not in exec_start or one(unit, "StandardInput") != f"file:/etc/afe/links/{svc}.json":
            problems.append(f"{svc}: link secrets must come on fd 0 from /etc/afe/links/{svc}.json")
        docker = "docker" in words(unit, "SupplementaryGroups") or "docker" in (one(unit, "Group") or "")
        if svc == "sandbox":
            if not docker:
                problems.append("sandbox: needs the docker group")
        else:
            if docker:
                problems.append(f"{svc}: must not be in the docker group")
            hidden = {p.lstrip("-") for p in words(unit, "InaccessiblePaths")}
            if not {"/run/docker.sock", "/var/run/docker.sock"} <= hidden:
                problems.append(f"{svc}: docker.sock must be in InaccessiblePaths")
        # sockets: the server's primary group is the clients group, whose
        # only members are the intended callers
        if svc in CALLERS:
            group = f"afe-{svc}-clients"
            if one(unit, "Group") != group or one(unit, "Environment") is None \
                    or "AFE_SOCKET_MODE=0660" not in " ".join(unit["Service"].get("Environment", [])):
                problems.append(f"{svc}: socket must be 0660 with primary Group={group}")
            want = {f"afe-{c}" for c in CALLERS[svc]} | {f"afe-{svc}"}
            if sysusers.get(group, set()) != want:
                problems.append(f"{svc}: members of {group} must be {sorted(want)}, got "
                                f"{sorted(sysusers.get(group, set()))}")
        for other, callers in CALLERS.items():
            group = f"afe-{other}-clients"
            if other != svc and (group in words(unit, "SupplementaryGroups")) != (svc in callers):
                problems.append(f"{svc}: membership of {group} does not match who may call {other}")
    return problems


def _mounts(service: dict) -> list[str]:
    return [v if isinstance(v, str) else json.dumps(v) for v in service.get("volumes", [])]


def compose_problems(doc: dict) -> list[str]:
    from services.common.secrecy.redact import secret_kind

    problems: list[str] = []
    services = doc.get("services", {})
    if set(services) != set(SERVICES):
        problems.append(f"compose must run exactly {SERVICES}, got {sorted(services)}")
        return problems
    users = [s.get("user") for s in services.values()]
    if len(set(users)) != 4 or any(u is None or u.split(":")[0] in ("0", "root") for u in users):
        problems.append(f"each container needs its own non-root user: {users}")
    gid_of = {name: s["user"].split(":")[1] for name, s in services.items()}
    for name, s in services.items():
        if "docker.sock" in json.dumps(s) and name != "sandbox":
            problems.append(f"{name}: sees the Docker socket")
        if name == "sandbox" and not any("/var/run/docker.sock" in m for m in _mounts(s)):
            problems.append("sandbox: needs the Docker socket")
        if s.get("env_file") != [f"env/{name}.env"]:
            problems.append(f"{name}: env_file must be only env/{name}.env")
        for key, value in (s.get("environment") or {}).items():
            if key != "AFE_SOCKET_MODE" or secret_kind(str(value)):
                problems.append(f"{name}: environment {key} belongs in its env_file")
        if s.get("secrets") != [f"{name}_links"]:
            problems.append(f"{name}: must get only its own link secret")
        if s.get("read_only") is not True or s.get("cap_drop") != ["ALL"] \
                or "no-new-privileges:true" not in (s.get("security_opt") or []):
            problems.append(f"{name}: needs read_only, cap_drop ALL and no-new-privileges")
        if "privileged" in s or "pid" in s or s.get("network_mode") == "host":
            problems.append(f"{name}: privileged / host namespaces are not allowed")
        if s.get("ports") and name != "gateway":
            problems.append(f"{name}: only the gateway publishes a port")
        for p in s.get("ports") or []:
            if not str(p).startswith("127.0.0.1:"):
                problems.append(f"{name}: publish on 127.0.0.1 behind a TLS proxy, got {p}")
        entry = " ".join(s.get("entrypoint") or [])
        if "--ops-host 127.0.0.1" not in entry or f"-m {MODULES[name]} " not in entry:
            problems.append(f"{name}: entrypoint must run {MODULES[name]} with ops on 127.0.0.1")
        groups = {str(g) for g in s.get("group_add") or []}
        for server, callers in CALLERS.items():
            if server != name and (gid_of[server] in groups) != (name in callers):
                problems.append(f"{name}: group_add of {server}'s socket group does not match who may call it")
    return problems


def analyze_security(path: Path) -> float:
    import subprocess

    out = subprocess.run(["systemd-analyze", "security", "--offline=yes", str(path)],
                         capture_output=True, text=True, timeout=60, check=False).stdout
    m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", out)
    assert m, out[-500:]
    return float(m.group(1))
