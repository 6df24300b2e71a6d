"""The sandbox broker: the only process that talks to Docker (R4-R12, R17-R19).

- `main`       composition root (`python -m services.sandbox.main`)
- `broker`     builds the core and the gRPC server (also used in-process by tests)
- `servicer`   thin gRPC servicer over the core
- `sandboxes`  lifecycle: create (idempotent) / destroy / list / reconcile / freeze
- `hardening`  the container settings of sandboxes and proxies, in one place
- `egress`     allowlist validation and the squid configuration
- `execs`      Exec (streamed, timeout, output cap) and interactive Process
- `dockerapi`  the few streaming Docker Engine API calls (hijacked exec)
- `paths`      R17-R19 path rules and the dir-fd walk
- `files`      host-side file tools on a ticket's workspace
- the local images (debootstrap base, sandbox, proxy) are built by services/common/host/images.py
"""
