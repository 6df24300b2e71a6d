"""The credential broker: the only process holding git, forge and model
secrets (DESIGN §5; rules R1-R3, R13-R16, R27-R30).

Modules, one concept each:
  main.py        composition root (process conventions, secrets from the env)
  compose.py     builds the core (shared with tests/support/credential_broker.py)
  servicer.py    thin gRPC servicer over broker.py
  broker.py      the core: lookups by manifest name, the R16 merge gate
  gitcmd.py      every host git process: clean env, -c hardening, argv only
  askpass.py     the GIT_ASKPASS helper answering only the expected origin
  workspaces.py  mirror cache, prepare (spare checkouts, scratch .git), commit,
                 diff, push, release
  continuation.py  where a retried ticket resumes (kept state), update-branch
  snapshot.py    walking the sandbox-written workspace with dir fds + O_NOFOLLOW
  forges.py      the forge interface; github.py (REST), localforge.py (bare repo)
  httpclient.py  retries, Retry-After, redacted errors for the HTTP APIs
  models/        openai, anthropic, replay providers
"""
