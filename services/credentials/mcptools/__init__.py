"""MCP tools through the broker (R43): the MCP client of the configured servers, the filter
of what passes, the relay agents use and the tools of model nodes."""
