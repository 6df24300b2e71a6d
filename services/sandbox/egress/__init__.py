"""A sandbox's way out (R10-R12, R44): the allowlist, the proxy and its rules, the per-
ticket CA, the judge of requests, and egress over a Unix socket."""
