"""Templates are shared with the manifest loader (which checks them when the
config loads): see services/common/config/templates.py."""

from services.common.config.templates import (
    MAX_ARG_BYTES,
    REFERENCE_HELP,
    check,
    references,
    render,
    render_command,
)

__all__ = ["MAX_ARG_BYTES", "REFERENCE_HELP", "check", "references", "render", "render_command"]
