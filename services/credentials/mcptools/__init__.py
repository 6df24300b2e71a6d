"""MCP tools through the broker (R43): the filter of what passes, the relay agents use and
the tools of model nodes. The MCP client of the configured servers is shared with `afe check`:
services/common/mcpclient.py."""
