#!/usr/bin/env bash
# Build the local Debian base image that the sandbox and proxy images start
# from, without any container registry: debootstrap a minimal bookworm root
# filesystem from the machine's Debian mirror and `docker import` it.
#
# Usage: build-base.sh [IMAGE]   (default afe/base:bookworm)
# A user with a registry can skip this: set AFE_BASE_IMAGE=debian:bookworm-slim
# (the Dockerfiles install what they need on top).
set -euo pipefail
image="${1:-afe/base:bookworm}"
if docker image inspect "$image" >/dev/null 2>&1; then
  echo "base image $image already present"
  exit 0
fi
command -v debootstrap >/dev/null || {
  echo "debootstrap is missing: apt-get install -y debootstrap" >&2; exit 1; }

mirror="${AFE_DEBIAN_MIRROR:-}"
if [ -z "$mirror" ]; then
  mirror=$( (grep -hsE '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}';
             grep -hsE '^deb ' /etc/apt/sources.list | awk '{print $2}') \
           | grep -E '/debian/?$' | head -n1) || true
fi
mirror="${mirror:-http://deb.debian.org/debian}"

root=$(mktemp -d /var/tmp/afe-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
echo "debootstrap bookworm from $mirror (about a minute)..."
debootstrap --variant=minbase \
  --include=bash,coreutils,git,python3,python3-venv,python3-pytest,ca-certificates,squid-openssl,openssl,procps,iproute2 \
  bookworm "$root" "$mirror" >"$root.log" 2>&1 || { tail -n 30 "$root.log" >&2; exit 1; }
rm -f "$root.log"
# Trim what a container never uses.
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/usr/share/doc/* \
       "$root"/usr/share/man/* "$root"/usr/share/locale/*
tar -C "$root" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  - "$image" >/dev/null
echo "built $image"
