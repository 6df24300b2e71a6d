"""`afe images build [--force]`: build the local images (Debian base from
debootstrap when missing, then the sandbox and egress proxy images)."""

from __future__ import annotations

import argparse
import sys

from services.common.errors import AfeError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("images", help="build the sandbox and proxy images",
                       description="Manage the local container images afe runs.")
    isub = p.add_subparsers(dest="images_cmd", metavar="CMD")
    b = isub.add_parser("build", help="build missing images (no registry needed)",
                        description="Build afe/base:bookworm (debootstrap + docker import) when missing, then "
                        "afe/sandbox:latest and afe/proxy:latest. With a registry, set "
                        "AFE_BASE_IMAGE=debian:bookworm-slim to skip debootstrap.")
    b.add_argument("--force", action="store_true", help="rebuild the sandbox and proxy images")
    b.set_defaults(func=run)
    p.set_defaults(func=lambda a: (p.print_help(sys.stderr), 2)[1])


def run(args: argparse.Namespace) -> int:
    from services.sandbox.images import ensure_images

    try:
        built = ensure_images(progress=lambda m: print(m, flush=True), force=args.force)
    except AfeError as exc:
        print(f"afe images build: {exc}", file=sys.stderr)
        return 1
    if not built:
        print("images already present (use --force to rebuild)")
    return 0
