#!/usr/bin/env bash
# Make gVisor's runtime `runsc` available to the Docker engine, for the
# sandboxes whose Workspace asks for `sandbox.runtime: gvisor` and for the
# tests of that runtime. Only what is missing is done, so a second run
# changes nothing:
#   - runsc is installed (Debian's package) when /usr/bin/runsc is absent;
#   - a `runsc` entry is merged into dockerd's daemon.json, keeping every
#     other key (the file is made when absent, rewritten only when it lacks
#     that entry);
#   - a running dockerd is told to reload its configuration (SIGHUP: its
#     containers keep running and its pid stays the same), and the script
#     waits until `docker info` lists the runtime.
#
#   scripts/ensure_runsc.sh                  a dockerd is running
#   scripts/ensure_runsc.sh --before-start   no dockerd yet: write the config it will read
#
# The runtime arguments: this runsc cannot give a sandbox a network of its
# own here (it refuses to run in the host's network namespace), and afe's
# sandboxes have none anyway (egress goes through a Unix socket, which
# --host-uds=open lets the sandbox open).
#
# Environment (defaults in brackets): AFE_DOCKER_DAEMON_JSON
# [/etc/docker/daemon.json], AFE_DOCKERD_PIDFILE [/var/run/docker.pid],
# AFE_DOCKERD_LOG [/tmp/ci-dockerd.log, shown when the runtime never
# appears], AFE_RUNSC_WAIT_S [30]; DOCKER_HOST picks the engine as usual.
set -euo pipefail

DAEMON_JSON=${AFE_DOCKER_DAEMON_JSON:-/etc/docker/daemon.json}
PIDFILE=${AFE_DOCKERD_PIDFILE:-/var/run/docker.pid}
DOCKERD_LOG=${AFE_DOCKERD_LOG:-/tmp/ci-dockerd.log}
WAIT_S=${AFE_RUNSC_WAIT_S:-30}
RUNSC=/usr/bin/runsc

log() { echo "[runsc $(date -u +%H:%M:%S)] $*"; }
fail() { log "FAILED: $*"; exit 1; }

SUDO=""
if [ "$(id -u)" != "0" ] && command -v sudo >/dev/null 2>&1; then SUDO="sudo"; fi

before_start=0
case "${1:-}" in
    "") ;;
    --before-start) before_start=1 ;;
    *) fail "unknown argument ${1}; use no argument (dockerd running) or --before-start" ;;
esac

engine_has_runsc() {
    docker info --format '{{json .Runtimes}}' 2>/dev/null \
        | python3 -c 'import json, sys; sys.exit(0 if "runsc" in json.load(sys.stdin) else 1)' 2>/dev/null
}

install_runsc() {
    [ -x "$RUNSC" ] && return 0
    command -v apt-get >/dev/null 2>&1 || fail "no $RUNSC and no apt-get: install gVisor's runsc by hand (https://gvisor.dev/docs/user_guide/install/)"
    log "installing runsc (gVisor)"
    # Unreachable third-party sources must not stop us: Debian's own are enough.
    $SUDO apt-get update || true
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y --no-install-recommends runsc
    [ -x "$RUNSC" ] || fail "the runsc package did not install $RUNSC"
}

# Prints "changed" when the file was (re)written, "unchanged" when it already held the entry.
merge_daemon_json() {
    $SUDO mkdir -p "$(dirname "$DAEMON_JSON")"
    $SUDO python3 - "$DAEMON_JSON" "$RUNSC" <<'EOF'
import json, os, sys
path, runsc = sys.argv[1], sys.argv[2]
entry = {"path": runsc, "runtimeArgs": ["--network=none", "--host-uds=open"]}
try:
    with open(path) as f:
        text = f.read()
except FileNotFoundError:
    text = ""
try:
    config = json.loads(text) if text.strip() else {}
except ValueError as exc:
    sys.exit(f"{path} is not valid JSON ({exc}); fix it by hand, dockerd reads it too")
if not isinstance(config, dict) or not isinstance(config.get("runtimes", {}), dict):
    sys.exit(f"{path}: expected a JSON object whose \"runtimes\" is an object; fix it by hand")
if config.get("runtimes", {}).get("runsc") == entry:
    print("unchanged")
    sys.exit(0)
config.setdefault("runtimes", {})["runsc"] = entry
tmp = path + ".afe-tmp"
with open(tmp, "w") as f:
    json.dump(config, f, indent=2)
    f.write("\n")
if os.path.exists(path):
    os.chmod(tmp, os.stat(path).st_mode & 0o7777)
os.replace(tmp, path)
print("changed")
EOF
}

if [ "$before_start" = 1 ]; then
    install_runsc
    result=$(merge_daemon_json) || fail "could not register runsc in $DAEMON_JSON"
    log "daemon.json $DAEMON_JSON: $result (runsc registered for the dockerd about to start)"
    exit 0
fi

docker info >/dev/null 2>&1 || fail "no Docker engine answers; start dockerd first, or run with --before-start before starting it"
if engine_has_runsc; then
    log "the engine already has the runtime runsc; nothing to do"
    exit 0
fi
install_runsc
result=$(merge_daemon_json) || fail "could not register runsc in $DAEMON_JSON"
log "daemon.json $DAEMON_JSON: $result"
pid=$(cat "$PIDFILE" 2>/dev/null || true)
if [ -z "$pid" ]; then
    # No pidfile: the one dockerd of this machine, never a guess among several.
    pids=$(pidof dockerd || true)
    [ "$(echo "$pids" | wc -w)" = 1 ] && pid=$pids
fi
if [ -z "$pid" ] || ! kill -0 "$pid" 2>/dev/null; then
    fail "no running dockerd found through $PIDFILE (or a single pidof dockerd); set AFE_DOCKERD_PIDFILE, or reload it by hand (systemctl reload docker)"
fi
log "reloading dockerd (pid $pid, SIGHUP)"
$SUDO kill -HUP "$pid"
for _ in $(seq 1 "$WAIT_S"); do
    if engine_has_runsc; then
        log "the engine lists the runtime runsc"
        exit 0
    fi
    sleep 1
done
log "the engine did not list runsc within ${WAIT_S} s after the reload; last lines of $DOCKERD_LOG:"
tail -n 30 "$DOCKERD_LOG" 2>/dev/null || log "(no log at $DOCKERD_LOG; with systemd: journalctl -u docker)"
exit 1
