"""Commands in a sandbox: the Commands stream, exec runs, and the command supervisor that
runs inside each sandbox."""
