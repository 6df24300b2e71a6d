"""The credential broker: the only process holding git, forge and model
secrets (docs/ARCHITECTURE.md; rules R1-R3, R13-R16, R27-R30).

Modules at the top (the process itself):
  main.py        composition root (process conventions, secrets from the env)
  compose.py     builds the core (shared with tests/support/credential_broker.py)
  app.py         the core, servicer and server wired into one app
  servicer.py    thin gRPC servicer over broker.py
  broker.py      the core: lookups by manifest name, the R16 merge gate
  httpclient.py  retries, Retry-After, redacted errors for the HTTP APIs

Rooms (each package's docstring says what it holds):
  git/           what a failed fetch or push means, and the mirrors (host git itself, its
                 runner and askpass helper, is services/common/host/)
  workspaces/    a ticket's workspace: prepare, snapshot, commit, continuation
  forges/        the forge interface (forges/base.py), GitHub's REST, a local bare repo
  relay/         the key-free model relay (R32)
  mcptools/      MCP tools through the broker (R43)
  verification/  the clean-room verification's harness and checkout (R41)
  records/       the signing key and the run records it signs (R42)
  fencing/       the fences checked before a side effect (R37, R45)
  models/        openai, anthropic, replay providers
"""
