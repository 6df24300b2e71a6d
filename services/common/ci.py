"""What counts as failing CI on GitHub (docs/GITHUB.md, "Failing CI"): one
vocabulary for the scheduler, which reads webhooks (github/ci.py), and the
credential broker, which reads a commit's checks (services/credentials/forges/github_checks.py).
`cancelled` is not a failure: a person or a newer push stopped the run."""

FAILING_RUN = ("failure", "timed_out", "action_required")    # a check run's conclusion
FAILING_SUITE = ("failure", "timed_out")                     # a check suite's conclusion
FAILING_STATUS = ("failure", "error")                        # a commit status's state
