"""`afe images build [--force] [--agent NAME] [--config DIR]`: build the local
images (Debian base from debootstrap when missing, then the sandbox and
egress proxy images), an agent preset's image (services/common/config/presets.py),
and the config folder's project images (DIR/images/NAME/Dockerfile, FROM
afe/sandbox, tagged afe/project-NAME:latest; `afe init` writes one)."""

from __future__ import annotations

import argparse
import sys

from services.common.errors import AfeError


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("images", help="build the sandbox and proxy images",
                       description="Manage the local container images afe runs.")
    isub = p.add_subparsers(dest="images_cmd", metavar="CMD")
    b = isub.add_parser("build", help="build missing images (no registry needed)",
                        description="Build afe/base:bookworm (debootstrap + docker import) when missing, then "
                        "afe/sandbox:latest and afe/proxy:latest. With a registry, set "
                        "AFE_BASE_IMAGE=debian:bookworm-slim to skip debootstrap.")
    b.add_argument("--force", action="store_true", help="rebuild the sandbox and proxy images (with --agent: "
                   "that agent's image)")
    b.add_argument("--agent", action="append", default=[], metavar="NAME",
                   help="build an agent preset's image (claude-code, codex, gemini, opencode; docs/AGENTS.md) "
                   "from its pinned npm packages; repeatable")
    b.add_argument("--config", default=None, metavar="DIR",
                   help="also build the project images in DIR/images/NAME/Dockerfile as afe/project-NAME:latest "
                   "(default: ./afe.d when it exists)")
    b.set_defaults(func=run)

    def usage(args: argparse.Namespace) -> int:
        p.print_help(sys.stderr)
        return 2
    p.set_defaults(func=usage)


def run(args: argparse.Namespace) -> int:
    from services.common.host.images import build_agent_image, ensure_images

    def progress(m: str) -> None:
        print(m, flush=True)

    if args.agent:
        try:
            for name in args.agent:
                if not build_agent_image(name, progress=progress, force=args.force):
                    print(f"agent image for {name} is up to date (use --force to rebuild)")
        except AfeError as exc:
            print(f"afe images build: {exc}", file=sys.stderr)
            return 1
        return 0
    try:
        built = ensure_images(progress=progress, force=args.force)
    except AfeError as exc:
        print(f"afe images build: {exc}", file=sys.stderr)
        return 1
    from pathlib import Path

    from services.common.host.images import build_project_images

    config = Path(args.config) if getattr(args, "config", None) else (Path("afe.d") if Path("afe.d").is_dir()
                                                                     else None)
    if config is not None:
        try:
            built += build_project_images(config, progress=progress, force=args.force)
        except AfeError as exc:
            print(f"afe images build: {exc}", file=sys.stderr)
            return 1
    if not built:
        print("images already present (use --force to rebuild)")
    return 0
